"""Independent draft model: a separate small causal LM with the target's tokenizer proposes
a chain (NVIDIA's Triton tutorial, TensorRT-LLM's Draft_Target) or an EAGLE-2 dynamic tree
(the shared tree search) that the target verifies.

Per sequence the draft keeps a KV-cache slot. Tokens it has not seen yet wait as `pending`
(the prompt and first token at the start; later what verification emitted); the next
propose runs every sequence's pending tokens in one pass and drafts from the last one's
logits. Draft passes write their nodes past the committed prefix; when verification keeps
some of them, their columns are committed in place (no second pass over accepted tokens),
so the draft only catches up on the bonus token.

Checkpoints: any HF-style directory our decoder reads (config.json + safetensors, sharded
or not) or a .gguf file. Two optional extensions (config.json "specdec" block) let a small
trained draft ship without the target's large matrices: "shares_target_embedding" (the
input embedding is the target's, read at load) and a reduced output vocabulary (an
`lm_head` over draft_vocab_size rows and `d2t`, EAGLE-3's draft -> target id offsets).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch
from torch import Tensor

from specdec.config import METHOD_DRAFT_MODEL, ModelConfig, SpeculativeConfig
from specdec.errors import ConfigError, ModelLoadError
from specdec.engine.models.eagle3_head import draft_weights
from specdec.engine.models.llama import Transformer, build_batch
from specdec.engine.models.loading import check_same_tokenizer, load_safetensors_dir, prepare_gguf, transformer_from_state
from specdec.engine.sampling import logits_to_probs, sample
from specdec.engine.sequences import SequenceState
from specdec.engine.tree import DraftTree
from specdec.engine.drafters.base import KeepDrafting, SlotCacheDrafter
from specdec.config import REPO_ROOT
from specdec.engine.drafters.registry import BuildContext, DrafterKind, register, resolve_path
from specdec.engine.drafters.tree_search import Expansion, draft_pass_batch, dynamic_trees

DEFAULT_DRAFT = REPO_ROOT / "models" / "draft-smollm2-135m"
EMBEDDING = "model.embed_tokens.weight"
# Pending tokens up to this many share one padded catch-up pass; a longer run (a prompt)
# gets a pass of its own so that one long prompt does not pad every row of the batch.
SHARED_CATCH_UP = 8


@dataclass
class _DraftState:
    slot: int
    pending: list[int]  # tokens not in the draft's cache yet; the last one's logits start the next draft
    # Columns (past the committed prefix) that the last propose wrote, by the draft path
    # (tokens from the root) of the node written there.
    written: dict[tuple[int, ...], int] = field(default_factory=dict)
    last_logits: Tensor | None = None  # [Vd] after the last committed token


class DraftModelDrafter(SlotCacheDrafter):
    name = "draft_model"

    def __init__(self, model: Transformer, draft_to_target: Tensor | None, target_vocab: int, config: SpeculativeConfig,
                 max_batch_size: int, max_seq_len: int, prefix_block_tokens: int | None = None):
        """prefix_block_tokens: prefix caching of the draft's own KV (the engine's setting):
        a prompt the target finds cached starts the draft from its cached prefix too."""
        self.model = model
        self.config = config
        self.target_vocab = target_vocab
        self.draft_to_target = draft_to_target  # [Vd] target ids, or None: the same vocabulary
        width = config.dynamic_tree_max_topK if config.use_dynamic_tree else 1
        self.cache = model.new_cache(max_batch_size, max_seq_len, SHARED_CATCH_UP + width * config.max_draft_len,
                                     prefix_block_tokens)

    # ---- sequence life cycle --------------------------------------------------------------
    def on_prefill(self, seq: SequenceState, hidden: Tensor | None) -> None:
        tokens = list(seq.prompt_ids) + [seq.output_ids[0]]
        salt = seq.params.cache_salt
        # the last token is always run: its logits start the first draft
        slot = self.cache.claim(tokens, salt, self.cache.lookup(tokens, salt, len(tokens) - 1))
        seq.drafter_state[self.name] = _DraftState(slot, tokens[self.cache.lengths[slot]:])

    def on_verified(self, seq: SequenceState, emitted: list[int], accepted: int, hidden: Tensor | None) -> None:
        state: _DraftState = seq.drafter_state[self.name]
        kept = []
        for k in range(1, accepted + 1):  # accepted draft tokens whose KV the draft already wrote
            column = state.written.get(tuple(emitted[:k]))
            if column is None:
                break
            kept.append(column)
        self.cache.commit(state.slot, kept, emitted[: len(kept)])
        state.written = {}
        state.pending += emitted[len(kept):]

    # ---- drafting ---------------------------------------------------------------------------
    def propose(self, seqs: Sequence[SequenceState], budgets: Sequence[int], keep_drafting: KeepDrafting | None = None) -> list[DraftTree]:
        states = [s.drafter_state[self.name] for s in seqs]
        self._catch_up(states)
        trees = [DraftTree() for _ in seqs]
        active = [i for i, b in enumerate(budgets) if b > 0]
        if active:
            draft = self._dynamic_trees if self.config.use_dynamic_tree else self._chains
            for i, tree in zip(active, draft([seqs[i] for i in active], [states[i] for i in active], [budgets[i] for i in active], keep_drafting)):
                trees[i] = tree
        return trees

    def _catch_up(self, states: list[_DraftState]) -> None:
        """Run the pending tokens into the cache and keep the last logits (short runs
        together in one ragged pass, long ones alone)."""
        todo = [s for s in states if s.pending]
        groups = [[s for s in todo if len(s.pending) <= SHARED_CATCH_UP]] + [[s] for s in todo if len(s.pending) > SHARED_CATCH_UP]
        for group in filter(None, groups):
            batch = build_batch([s.slot for s in group], [self.cache.lengths[s.slot] for s in group], [s.pending for s in group],
                                device=self.cache.k.device)
            logits = self.model(batch, self.cache, last_only=True).logits[:, 0]
            for b, s in enumerate(group):
                self.cache.commit(s.slot, range(len(s.pending)), s.pending)
                s.last_logits, s.pending = logits[b], []

    def _pass(self, states: list[_DraftState], tokens: list[list[int]], offsets: list[int], depths: list[list[int]],
              masks: list[Tensor]) -> Tensor:
        """One draft pass over uncommitted nodes; their logits [B, N, Vd]."""
        batch = draft_pass_batch([self.cache.lengths[s.slot] for s in states], [s.slot for s in states], tokens, offsets, depths, masks,
                                 self.cache.k.device)
        return self.model(batch, self.cache).logits

    def _to_target(self, draft_id: int) -> int:
        return draft_id if self.draft_to_target is None else int(self.draft_to_target[draft_id])

    def _target_logits(self, draft_logits: Tensor) -> Tensor:
        """Draft logits over the target's vocabulary (-inf where the draft cannot propose)."""
        if self.draft_to_target is None:
            return draft_logits[..., : self.target_vocab]
        out = draft_logits.new_full((*draft_logits.shape[:-1], self.target_vocab), float("-inf"))
        out[..., self.draft_to_target] = draft_logits
        return out

    def _chains(self, seqs, states, budgets, keep_drafting: KeepDrafting | None = None) -> list[DraftTree]:
        """Linear drafts: argmax (greedy) or sampled from the draft's processed distribution
        (the same temperature / top-k / top-p as the target), which sampled verification
        needs (min(1, p/q))."""
        planned = keep_drafting is not None
        tokens: list[list[int]] = [[] for _ in seqs]
        probs: list[list[Tensor]] = [[] for _ in seqs]
        confidence: list[list[float]] = [[] for _ in seqs]
        path = [1.0] * len(seqs)
        logits = {b: s.last_logits for b, s in enumerate(states)}
        for depth in range(max(budgets)):
            for b, seq in enumerate(seqs):
                if b in logits and depth < budgets[b]:
                    token, q, conf = self._pick(seq, logits[b], planned)
                    tokens[b].append(token)
                    if q is not None:
                        probs[b].append(q)
                    if planned:
                        confidence[b].append(conf)
                        path[b] *= conf
            rows = [b for b in range(len(seqs)) if depth + 1 < budgets[b]]  # rows that draft a further token
            if not rows or (planned and not keep_drafting(depth + 1, [path[b] if b in rows else 0.0 for b in range(len(seqs))])):
                break
            for b in rows:  # the node written at column `depth` is the path so far
                states[b].written[tuple(tokens[b])] = depth
            out = self._pass([states[b] for b in rows], [[tokens[b][-1]] for b in rows], [depth] * len(rows), [[depth]] * len(rows),
                             [torch.ones(1, depth + 1, dtype=torch.bool)] * len(rows))
            logits = {b: out[j, 0] for j, b in enumerate(rows)}
        return [DraftTree.chain(t, torch.stack(p) if p else None, c if planned else None) for t, p, c in zip(tokens, probs, confidence)]

    def _pick(self, seq: SequenceState, draft_logits: Tensor, planned: bool) -> tuple[int, Tensor | None, float]:
        if seq.params.greedy:
            d = int(draft_logits.argmax())
            conf = float(torch.softmax(draft_logits.float(), -1)[d]) if planned else 1.0
            return self._to_target(d), None, conf
        q = logits_to_probs(self._target_logits(draft_logits.float()), seq.params)
        token = sample(q, seq.generator)
        return token, q, float(q[token])

    def _dynamic_trees(self, seqs, states, budgets, keep_drafting: KeepDrafting | None = None) -> list[DraftTree]:
        """EAGLE-2 dynamic trees through the shared tree search, one batched draft pass per
        depth. Deterministic (top-k) children: lossless under sampling too (one-hot rule)."""
        paths: list[dict[int, tuple[int, ...]]] = [{} for _ in states]  # candidate -> its draft path

        def expand(rows: list[Expansion]) -> Tensor:
            for b, r in enumerate(rows):
                for j, (node, token, parent) in enumerate(zip(r.nodes, r.tokens, r.parents)):
                    paths[b][node] = paths[b].get(parent, ()) + (token,)
                    states[b].written[paths[b][node]] = r.offset + j
            logits = self._pass(states, [r.tokens for r in rows], [r.offset for r in rows],
                                [[r.level] * len(r.nodes) for r in rows], [r.mask for r in rows])
            return torch.log_softmax(logits.float(), -1)

        root_logp = torch.log_softmax(torch.stack([s.last_logits for s in states]).float(), -1)
        cfg = self.config
        return dynamic_trees(root_logp, expand, cfg.dynamic_tree_max_topK, cfg.max_draft_len, budgets, self._to_target, keep_drafting)


# ---- loading ----------------------------------------------------------------------------------
def draft_dir(spec: SpeculativeConfig) -> Path:
    path = resolve_path(spec.speculative_model, DEFAULT_DRAFT)
    if path.suffix == ".gguf":
        return prepare_gguf(path)
    if not (path / "config.json").is_file():
        raise ConfigError("speculative_model", f"no draft model at {path} (an HF-style directory with config.json, or a .gguf file)")
    return path


def load_draft(path: Path, ctx: BuildContext, dtype: str) -> tuple[Transformer, Tensor | None]:
    """The draft decoder (and its draft -> target id map when its output vocabulary is
    reduced), checked against the target."""
    raw = json.loads((path / "config.json").read_text())
    try:
        cfg = ModelConfig.from_hf_dict(raw)
    except ConfigError as exc:
        raise ConfigError("speculative_model", f"{path}: {exc}") from exc
    ext = raw.get("specdec", {})
    target = ctx.target_cfg
    state = load_safetensors_dir(path)
    d2t = state.pop("d2t", None)
    draft_to_target = None if d2t is None else torch.arange(len(d2t)) + d2t.long()
    if EMBEDDING not in state and ext.get("shares_target_embedding"):
        if cfg.hidden_size != target.hidden_size or cfg.vocab_size != target.vocab_size:
            raise ConfigError("speculative_model", f"{path}: shares the target's embedding but its hidden/vocab sizes "
                                                   f"{cfg.hidden_size}/{cfg.vocab_size} differ from the target's {target.hidden_size}/{target.vocab_size}")
        state[EMBEDDING] = ctx.embedding().weight
    check_compatible(path, cfg, ctx, draft_to_target)
    if cfg.max_position_embeddings < ctx.engine.max_seq_len:
        raise ConfigError("speculative_model", f"{path}: the draft's context (max_position_embeddings="
                                               f"{cfg.max_position_embeddings}) is shorter than engine.max_seq_len={ctx.engine.max_seq_len}")
    try:
        model = transformer_from_state(cfg, state, "float32" if dtype == "int8" else dtype, ctx.engine.device, path,
                                       None if d2t is None else len(d2t))
    except ModelLoadError as exc:
        raise ConfigError("speculative_model", str(exc)) from exc
    if dtype == "int8":  # its linears on the int8 kernels, as an EAGLE-3 head's (draft_weights)
        model = draft_weights(model, dtype)
    return model, draft_to_target


def check_compatible(path: Path, cfg: ModelConfig, ctx: BuildContext, draft_to_target: Tensor | None) -> None:
    """ModelConfig.check_draft_pairing, and when both directories carry a tokenizer, the same
    tokens and special tokens (check_same_tokenizer)."""
    ctx.target_cfg.check_draft_pairing(cfg, str(path))
    if draft_to_target is not None and (int(draft_to_target.min()) < 0 or int(draft_to_target.max()) >= ctx.target_cfg.vocab_size):
        raise ConfigError("speculative_model", f"{path}: d2t maps outside the target's vocabulary of {ctx.target_cfg.vocab_size}")
    check_same_tokenizer(path, ctx.target_dir)


def _build(spec: SpeculativeConfig, ctx: BuildContext) -> DraftModelDrafter:
    model, draft_to_target = load_draft(draft_dir(spec), ctx, spec.draft_dtype or ctx.engine.draft_dtype)
    return DraftModelDrafter(model, draft_to_target, ctx.target_cfg.vocab_size, spec, ctx.engine.max_batch_size, ctx.engine.max_seq_len,
                             ctx.engine.prefix_cache_block)


register(DrafterKind(methods=(METHOD_DRAFT_MODEL,), build=_build))
