"""Test-only drafters: scripted trees around a known greedy continuation, and a bigram
draft model with real draft probabilities for the statistical losslessness tests."""
from __future__ import annotations

import random
from typing import Sequence

import torch

from specdec.config import SpeculativeConfig
from specdec.engine.drafters.base import Drafter
from specdec.engine.sampling import logits_to_probs, sample
from specdec.engine.sequences import SequenceState
from specdec.engine.tree import DETERMINISTIC, IID_SAMPLED, ROOT, DraftTree


class ScriptedDrafter(Drafter):
    """Proposes the reference greedy continuation with random corruptions plus random
    sibling branches, so verification exercises accepts, rejections and deep paths."""

    name = "scripted"

    def __init__(self, reference: dict[tuple[int, ...], list[int]], vocab: int, tree: bool, seed: int = 0,
                 adaptive: bool = False):
        self.reference, self.vocab, self.tree = reference, vocab, tree
        self.rng = random.Random(seed)
        self.config = SpeculativeConfig(adaptive=True) if adaptive else None

    def propose(self, seqs: Sequence[SequenceState], budgets: Sequence[int], keep_drafting=None) -> list[DraftTree]:
        return [self._one(s, b) for s, b in zip(seqs, budgets)]

    def _one(self, seq: SequenceState, budget: int) -> DraftTree:
        ref = self.reference[tuple(seq.prompt_ids)]
        done = len(seq.output_ids)
        truth = ref[done : done + budget]
        tokens, parents = [], []
        parent = ROOT
        for tok in truth:
            if len(tokens) >= budget:
                break
            if self.tree and len(tokens) + 1 < budget and self.rng.random() < 0.5:
                tokens.append(self.rng.randrange(self.vocab))  # a wrong sibling first
                parents.append(parent)
            if self.rng.random() < 0.15:
                tok = self.rng.randrange(self.vocab)  # corrupt the true path
            tokens.append(tok)
            parents.append(parent)
            parent = len(tokens) - 1
        return DraftTree(tokens[:budget], parents[:budget])


class BigramDrafter(Drafter):
    """q(x | last token) = processed softmax(table[last]). Chains or trees, i.i.d. sampled
    with draft probabilities or deterministic (argmax / top-k: one-hot)."""

    name = "bigram"

    def __init__(self, table: torch.Tensor, iid: bool, branches: int, depth: int, adaptive: bool = False,
                 merge: bool = False):
        """merge: also merge a lookup-style continuation (the prompt's first tokens) into
        each deterministic tree, as hybrid_ngram does."""
        self.table, self.iid, self.branches, self.depth, self.merge = table, iid, branches, depth, merge
        self.config = SpeculativeConfig(adaptive=True) if adaptive else None
        self.proposed = 0  # nodes drafted (the planner may verify fewer)

    def propose(self, seqs: Sequence[SequenceState], budgets: Sequence[int], keep_drafting=None) -> list[DraftTree]:
        trees = [self._one(s, b, keep_drafting) for s, b in zip(seqs, budgets)]
        self.proposed += sum(len(t) for t in trees)
        return trees

    def _one(self, seq: SequenceState, budget: int, keep_drafting=None) -> DraftTree:
        tokens, parents, probs, confidence = [], [], [], []
        frontier = [(ROOT, seq.root_token, 1.0)]
        for level in range(self.depth):
            if level and keep_drafting is not None and not keep_drafting(level, [max(f[2] for f in frontier)]):
                break
            nxt = []
            for parent, last, path in frontier:
                q = logits_to_probs(self.table[last], seq.params)
                if self.iid:
                    kids = [sample(q, seq.generator) for _ in range(self.branches)]  # i.i.d. draws
                else:
                    kids = torch.topk(q, self.branches).indices.tolist()
                for tok in kids:
                    if len(tokens) >= budget:
                        break
                    tokens.append(int(tok))
                    parents.append(parent)
                    probs.append(q)
                    confidence.append(float(q[tok]))
                    nxt.append((len(tokens) - 1, int(tok), path * float(q[tok])))
            frontier = nxt
        if not tokens:
            return DraftTree()
        tree = DraftTree(
            tokens, parents, torch.stack(probs) if self.iid else None, IID_SAMPLED if self.iid else DETERMINISTIC, confidence
        )
        if self.merge and not self.iid:
            tree = tree.merged(list(seq.prompt_ids[: max(1, budget - len(tree))]))
        return tree


def argmax_path(tree: DraftTree, target_probs: torch.Tensor) -> tuple[list[int], int]:
    """The lossy shortcut the acceptance tests' negative controls take (test_acceptance_by_argmax_is_caught): follow the draft while
    its token is the target's argmax. Returns (the nodes kept, the row to sample the next token from)."""
    row, path = 0, []
    kids = tree.children()
    while kids[row]:
        best = int(target_probs[row].argmax())
        match = next((c for c in kids[row] if tree.tokens[c] == best), None)
        if match is None:
            break
        path.append(match)
        row = match + 1
    return path, row
