"""Medusa for TensorRT-LLM: our `medusa` settings as MedusaDecodingConfig, and back (pure).

TensorRT-LLM verifies a *static* Medusa tree, `medusa_choices`: each node is the path of
top-k positions that leads to it ([0] = head 1's argmax, [0, 1] = head 2's second guess
under it). Ours drafts a chain of the heads' argmaxes or, with use_dynamic_tree, the best
nodes of the heads' top-k product tree by path probability, chosen anew every step. The
static tree that stands for our settings (`derive_choices`):

  every node of the top-k product tree (each position < dynamic_tree_max_topK, depth <=
  max_draft_len), ordered by the sum of its positions (0 = every head's argmax), ties
  shallower first, then lexicographically; the first max_total_draft_tokens are kept.

A node's prefix sorts before it (no larger sum, shallower), so the kept nodes are a tree;
the sum-0 chain comes first, so it is max_draft_len deep. A chain is the case topK = 1:
[[0], [0, 0], [0, 0, 0], ...]. The order stands in for path probability with ranks only:
without calibration data (Medusa's mc_sim trees are fitted to measured head accuracies)
a lower rank is the better guess.

TensorRT-LLM's meaning of the fields (1.2.x, TensorRT engine backend; checked against
NVIDIA/TensorRT-LLM tensorrt_llm/llmapi/llm_args.py of the 1.2 line, see the comment above
llm_api.TENSORRT_BACKEND, and tensorrt_llm/runtime/medusa_utils.py at 249d93d551e8): max_draft_len
is the number of draft tokens a step, i.e. the tree's node count (TrtLlmArgs copies it into
build_config.max_draft_len, the engine's Medusa token budget; MedusaDecodingConfig sets
max_total_draft_tokens = max_draft_len; the 63-node mc_sim_7b_63 tree of upstream's examples
goes with max_draft_len 63), and a path may be at most num_medusa_heads deep
(medusa_utils.choices_2_paths keeps one level count per head).
"""
from __future__ import annotations

from typing import Any, Iterator, Sequence

from specdec.config import METHOD_MEDUSA, SpeculativeConfig
from specdec.errors import ConfigError


def _paths(total: int, depth: int, topk: int) -> Iterator[tuple[int, ...]]:
    """Every path of exactly `depth` positions in [0, topk) whose positions sum to `total`,
    in lexicographic order."""
    if depth == 0:
        if total == 0:
            yield ()
        return
    for first in range(min(total, topk - 1) + 1):
        for rest in _paths(total - first, depth - 1, topk):
            yield (first, *rest)


def derive_choices(spec: SpeculativeConfig) -> list[list[int]]:
    """medusa_choices for our settings (module docstring: the rule)."""
    if spec.method != METHOD_MEDUSA:
        raise ConfigError("method", f"medusa_choices are derived for method {METHOD_MEDUSA!r}, got {spec.method!r}")
    topk = spec.dynamic_tree_max_topK if spec.use_dynamic_tree else 1
    depth, budget = spec.max_draft_len, int(spec.max_total_draft_tokens)
    out: list[list[int]] = []
    total = 0
    while len(out) < budget:  # budget <= topk * depth nodes exist (SpeculativeConfig checks it)
        for level in range(1, depth + 1):
            for path in _paths(total, level, topk):
                out.append(list(path))
                if len(out) == budget:
                    return out
        total += 1
    return out


def check_choices(choices: Any, num_heads: int | None, field: str = "speculative_config.medusa_choices") -> list[list[int]]:
    """A medusa_choices value TensorRT-LLM would build a tree from: non-empty paths of
    positions >= 0, no duplicates, every prefix present, at most num_heads deep."""
    if not isinstance(choices, Sequence) or isinstance(choices, str) or not choices:
        raise ConfigError(field, f"must be a non-empty list of paths, got {choices!r}")
    seen: set[tuple[int, ...]] = set()
    for path in choices:
        if (not isinstance(path, Sequence) or isinstance(path, str) or not path
                or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in path)):
            raise ConfigError(field, f"every path is a non-empty list of top-k positions >= 0, got {path!r}")
        if tuple(path) in seen:
            raise ConfigError(field, f"path {list(path)} is listed twice")
        seen.add(tuple(path))
    for path in seen:
        if len(path) > 1 and path[:-1] not in seen:
            raise ConfigError(field, f"path {list(path)} has no parent {list(path[:-1])}: list every node of the tree")
    depth = max(len(p) for p in seen)
    if num_heads is not None and depth > num_heads:
        raise ConfigError(field, f"paths {depth} deep need {depth} Medusa heads; num_medusa_heads is {num_heads}")
    return [list(p) for p in choices]

