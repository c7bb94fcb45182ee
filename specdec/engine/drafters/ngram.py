"""N-gram prompt lookup (vLLM `prompt_lookup_min/max`, transformers `prompt_lookup_num_tokens`).

Match the last n tokens (n from prompt_lookup_max down to prompt_lookup_min) against the
prompt and output so far and propose what followed. With a tree config, the continuations
of several matches (most recent first) are merged into a trie of distinct branches.
Drafts are deterministic (no draft distribution), so verification uses the one-hot rule.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from specdec.config import METHOD_NGRAM, SpeculativeConfig
from specdec.engine.sequences import SequenceState
from specdec.engine.tree import ROOT, DraftTree
from specdec.engine.drafters.base import Drafter
from specdec.engine.drafters.registry import DrafterKind, register


def find_continuations(history: np.ndarray, n: int, length: int, max_matches: int) -> list[np.ndarray]:
    """Continuations (up to `length` tokens) after earlier occurrences of history's last
    n tokens, most recent occurrence first."""
    if len(history) <= n:
        return []
    suffix = history[-n:]
    body = history[:-1]  # an occurrence must end before the last token
    windows = np.lib.stride_tricks.sliding_window_view(body, n)  # [len-n, n]
    starts = np.flatnonzero((windows == suffix).all(axis=1))
    out = []
    for start in starts[::-1][:max_matches]:
        cont = history[start + n : start + n + length]
        if len(cont):
            out.append(cont)
    return out


class NgramDrafter(Drafter):
    name = "ngram"

    def __init__(self, config: SpeculativeConfig):
        self.config = config

    def propose(self, seqs: Sequence[SequenceState], budgets: Sequence[int], keep_drafting=None) -> list[DraftTree]:
        # Lookup costs nothing to extend: the planner trims what is verified instead.
        return [self._propose_one(seq, budget) for seq, budget in zip(seqs, budgets)]

    def _propose_one(self, seq: SequenceState, budget: int) -> DraftTree:
        if budget <= 0:
            return DraftTree()
        cfg = self.config
        history = np.asarray(seq.all_ids, dtype=np.int64)
        branches = cfg.dynamic_tree_max_topK if cfg.use_dynamic_tree else 1
        depth = min(budget, cfg.max_draft_len) if cfg.use_dynamic_tree else budget
        for n in range(cfg.prompt_lookup_max, cfg.prompt_lookup_min - 1, -1):
            conts = find_continuations(history, n, depth, max_matches=4 * branches)
            if conts:
                return build_trie(conts, budget, branches)
        return DraftTree()


def build_trie(continuations: list[np.ndarray], max_nodes: int, max_branches: int) -> DraftTree:
    """Merge continuations (most relevant first) into a tree of at most max_nodes nodes and
    at most max_branches distinct first tokens; shared prefixes are shared nodes."""
    tokens: list[int] = []
    parents: list[int] = []
    child_of: dict[tuple[int, int], int] = {}  # (parent, token) -> node
    root_children = 0
    for cont in continuations:
        parent = ROOT
        for tok in cont.tolist():
            node = child_of.get((parent, tok))
            if node is None:
                if len(tokens) >= max_nodes or (parent == ROOT and root_children >= max_branches):
                    break
                node = len(tokens)
                tokens.append(tok)
                parents.append(parent)
                child_of[(parent, tok)] = node
                root_children += parent == ROOT
            parent = node
        if len(tokens) >= max_nodes:
            break
    return DraftTree(tokens, parents)


register(DrafterKind(methods=(METHOD_NGRAM,), build=lambda spec, ctx: NgramDrafter(spec)))
