"""Verification of a draft tree against the target: greedy and lossless sampling.

Walk from the root. At a node with target distribution p and children c_1..c_m:
  greedy: follow the child equal to argmax p, else emit argmax p and stop.
  sampled, deterministic children (one-hot q): accept c_k with prob p(c_k); on rejection
      set p(c_k) = 0 and renormalise; try the next sibling.
  sampled, i.i.d. children drawn from q (SpecInfer, arXiv 2305.09781): accept c_k with
      prob min(1, p(c_k)/q(c_k)); on rejection p <- norm(max(p - q, 0)).
If every child is rejected, emit a *recovered* token sampled from the residual p. If an
accepted node is a leaf, emit a *bonus* token sampled from p at that node. Either way the
emitted token stream is distributed exactly as sampling from the target (Leviathan et al.
2023; Chen et al. 2023). The chain is the one-child case.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from specdec.engine.sampling import sample, uniform
from specdec.engine.tree import IID_SAMPLED, DraftTree

# Residual mass below this is treated as empty (p == q up to rounding); fall back to p.
_RESIDUAL_EPS = 1e-12


@dataclass
class VerifyResult:
    accepted_nodes: list[int]  # node indices of the accepted root-to-leaf path
    accepted_tokens: list[int]
    next_token: int  # the bonus token (path ran to a leaf) or the recovered token
    next_is_bonus: bool

    @property
    def emitted(self) -> list[int]:
        return self.accepted_tokens + [self.next_token]


def verify_greedy(tree: DraftTree, target_logits: Tensor) -> VerifyResult:
    """target_logits: [n+1, V]; row 0 is the root, row i+1 is node i."""
    # max's indices: the first maximal value, as argmax's, at a third of its time on a few 49k-wide
    # rows on CPU (261 against 89 us for 7 rows here), every verified step
    argmax = target_logits.max(-1).indices.tolist()  # [n+1]
    children = tree.children()
    row, path = 0, []
    while True:
        want = argmax[row]
        match = next((c for c in children[row] if tree.tokens[c] == want), None)
        if match is None:
            return VerifyResult(path, [tree.tokens[i] for i in path], want, not children[row])
        path.append(match)
        row = match + 1


def verify_sampled(tree: DraftTree, target_probs: Tensor, generator: torch.Generator) -> VerifyResult:
    """target_probs: [n+1, V] processed target distributions (same processing as q)."""
    children = tree.children()
    iid = tree.scheme == IID_SAMPLED
    row, path = 0, []
    while True:
        kids = children[row]
        if not kids:  # leaf (or empty tree): bonus token from the target
            return VerifyResult(path, [tree.tokens[i] for i in path], sample(target_probs[row], generator), True)
        p = target_probs[row].clone()
        accepted = None
        for child in kids:
            x = tree.tokens[child]
            q = tree.draft_probs[child] if iid else None
            if iid:
                if uniform(generator) * float(q[x]) < float(p[x]):  # u < p/q without dividing by 0
                    accepted = child
                    break
            elif uniform(generator) < float(p[x]):
                accepted = child
                break
            p = residual_after_rejection(p, x, q)
        if accepted is None:
            return VerifyResult(path, [tree.tokens[i] for i in path], sample(p, generator), False)
        path.append(accepted)
        row = accepted + 1


def residual_after_rejection(p: Tensor, x: int, q: Tensor | None) -> Tensor:
    """The distribution to go on with after draft x was rejected at a node with (the
    residual of) target distribution p: norm(max(p - q, 0)) for a draw from q, p with x
    zeroed and renormalised for a one-hot draft. p is the caller's own copy (changed in place)."""
    if q is not None:
        residual = (p - q).clamp_(min=0.0)
    else:
        residual = p
        residual[x] = 0.0
    mass = float(residual.sum())
    return residual / mass if mass > _RESIDUAL_EPS else p
