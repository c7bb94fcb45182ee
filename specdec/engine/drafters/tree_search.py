"""EAGLE-2 dynamic draft trees (arXiv 2406.16858; SafeAILab/EAGLE `topK_genrate`), for any
model-based drafter that can give next-token log-probabilities at a set of tree nodes.

Root = top-k of the first draft distribution. At each depth, one batched draft pass over
the frontier (every row's frontier nodes at once), top-k children per node, score =
cumulative log-prob, keep the global top-k as the next frontier. Finally keep each row's
`budget` best nodes of all depths: a parent always outscores its children (log-probs are
<= 0) and ties go to the shallower node, so the kept set is a tree. Children are chosen
deterministically (top-k), so verification uses the one-hot rule: lossless under sampling.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import Tensor

from specdec.engine.models.llama import ForwardBatch
from specdec.engine.tree import DETERMINISTIC, IID_SAMPLED, ROOT, DraftTree


@dataclass
class Candidate:
    token: int  # target vocabulary
    parent: int  # candidate index, or ROOT
    score: float  # cumulative log-prob
    depth: int  # 1 for children of the root


@dataclass
class Expansion:
    """One row's frontier, expanded in one draft pass."""

    nodes: list[int]  # candidate indices being expanded
    tokens: list[int]  # their tokens (target vocabulary)
    parents: list[int]  # their parents' candidate indices (ROOT at the first level)
    level: int  # 0-based depth of these nodes (their position past the committed prefix)
    offset: int  # draft columns written by earlier levels of this row
    mask: Tensor  # [n, offset + n] bool: column c (earlier levels, then these) is an ancestor-or-self


# Given one Expansion per row, the next-token log-probs at each expanded node: [B, N, V].
ExpandFn = Callable[[list[Expansion]], Tensor]


def dynamic_trees(
    root_logp: Tensor,  # [B, V] first draft distribution per row (log-probs)
    expand: ExpandFn,
    top_k: int,
    max_depth: int,
    budgets: Sequence[int],
    to_target: Callable[[int], int] = int,  # drafter vocabulary id -> target id
    keep_drafting: Callable[[int, Sequence[float]], bool] | None = None,
) -> list[DraftTree]:
    B = root_logp.shape[0]
    top_k = min(top_k, root_logp.shape[-1])  # a draft vocabulary smaller than top-k
    cands: list[list[Candidate]] = [[] for _ in range(B)]
    top = root_logp.topk(top_k, dim=-1)
    for b in range(B):
        cands[b] = [Candidate(to_target(d), ROOT, s, 1) for s, d in zip(top.values[b].tolist(), top.indices[b].tolist())]
    frontier = [list(range(len(c))) for c in cands]
    written: list[list[int]] = [[] for _ in range(B)]  # candidate index of each written draft column
    for level in range(min(max_depth, max(budgets)) - 1):  # a node at depth d needs a budget >= d
        if keep_drafting is not None:
            best = [math.exp(max(cands[b][c].score for c in frontier[b])) for b in range(B)]
            if not keep_drafting(level + 1, best):
                break
        rows = [_expansion(cands[b], frontier[b], written[b], level) for b in range(B)]
        child_logp = expand(rows)  # [B, N, V]
        for b in range(B):
            written[b] += frontier[b]
            new = []
            for j, c in enumerate(frontier[b]):
                vals, idx = child_logp[b, j].topk(top_k)
                new += [Candidate(to_target(d), c, cands[b][c].score + v, level + 2) for v, d in zip(vals.tolist(), idx.tolist())]
            start = len(cands[b])
            cands[b] += new
            frontier[b] = [start + i for i in sorted(range(len(new)), key=lambda i: -new[i].score)[:top_k]]
    return [rerank(cands[b], budgets[b]) for b in range(B)]


def sampled_trees(
    root_q: Sequence[Tensor],  # per row: [V] q at the root (target vocabulary, processed like the target)
    expand: ExpandFn,  # the draft logits at each expanded node: [B, N, Vd]
    to_q: Callable[[int, Tensor], Tensor],  # (row, [Vd] draft logits) -> [V] q
    draw: Callable[[int, Tensor], int],  # (row, q) -> a token drawn from q with the row's generator
    top_k: int,
    max_depth: int,
    budgets: Sequence[int],
    mass: float,
    keep_drafting: Callable[[int, Sequence[float]], bool] | None = None,
) -> list[DraftTree]:
    """Dynamic trees under sampling, lossless with the i.i.d. rule (SpecInfer's recursive
    rejection): every node is a fresh draw from q at its parent, and every decision about
    the shape (draw another sibling, grow this node, stop at the budget) is made from
    what was drawn *before*, never from the draw it keeps or drops. Recursive rejection
    stays exact when the number of drafts is such a stopping rule; keeping the best of a
    pool of draws (EAGLE-2's rerank) would not be.

    Level by level: each frontier node draws up to top_k children, stopping after a
    duplicate (kept: its rejection step is part of the rule; never grown, it is never
    accepted) or once its distinct children cover `mass` of q; the next frontier is the
    level's top_k non-duplicate nodes by path probability. Node indices follow draw order,
    so a prefix (the budget's truncation) is a stopping rule too."""
    B = len(root_q)
    cands: list[list[Candidate]] = [[] for _ in range(B)]
    rows: list[list[Tensor]] = [[] for _ in range(B)]  # q at each node's parent
    frontier: list[list[tuple[int, Tensor]]] = [[(ROOT, root_q[b])] for b in range(B)]
    written: list[list[int]] = [[] for _ in range(B)]
    for level in range(max_depth):
        grown: list[list[int]] = []
        for b in range(B):
            new: list[int] = []
            for node, q in frontier[b]:
                base = 0.0 if node == ROOT else cands[b][node].score
                seen, covered = set(), 0.0
                for _ in range(top_k):
                    if len(cands[b]) >= budgets[b]:
                        break
                    token = draw(b, q)
                    prob = float(q[token])
                    cands[b].append(Candidate(token, node, base + math.log(prob), level + 1))
                    rows[b].append(q)
                    if token in seen:  # a duplicate: rejected for sure, and ends this node's draws
                        break
                    new.append(len(cands[b]) - 1)
                    seen.add(token)
                    covered += prob
                    if covered >= mass:
                        break
            grown.append(sorted(new, key=lambda c: -cands[b][c].score)[:top_k] if len(cands[b]) < budgets[b] else [])
        if level + 1 == max_depth or not any(grown):
            break
        if keep_drafting is not None:  # decided from the levels drawn so far: a stopping rule too
            best = [math.exp(max(cands[b][c].score for c in grown[b])) if grown[b] else 0.0 for b in range(B)]
            if not keep_drafting(level + 1, best):
                break
        batch = [_expansion(cands[b], grown[b], written[b], level) for b in range(B)]
        logits = expand(batch)  # [B, N, Vd]
        for b in range(B):
            written[b] += grown[b]
            frontier[b] = [(c, to_q(b, logits[b, j])) for j, c in enumerate(grown[b])]
    trees = []
    for b in range(B):
        if not cands[b]:
            trees.append(DraftTree())
            continue
        conf = [math.exp(c.score - (0.0 if c.parent == ROOT else cands[b][c.parent].score)) for c in cands[b]]
        trees.append(DraftTree([c.token for c in cands[b]], [c.parent for c in cands[b]], torch.stack(rows[b]), IID_SAMPLED, conf))
    return trees


def _expansion(cands: list[Candidate], frontier: list[int], written: list[int], level: int) -> Expansion:
    cols = written + frontier
    mask = torch.zeros(len(frontier), len(cols), dtype=torch.bool)
    for j, c in enumerate(frontier):
        ancestors = _ancestors(cands, c)
        for col, cand in enumerate(cols):
            mask[j, col] = cand in ancestors
    return Expansion(list(frontier), [cands[c].token for c in frontier], [cands[c].parent for c in frontier], level,
                     len(written), mask)


def _ancestors(cands: list[Candidate], c: int) -> set[int]:
    """Ancestor-or-self candidate indices."""
    out = set()
    while c != ROOT:
        out.add(c)
        c = cands[c].parent
    return out


def rerank(cands: list[Candidate], budget: int) -> DraftTree:
    """The `budget` best candidates, in topological order; each node's confidence is its
    draft probability given its parent."""
    best = sorted(range(len(cands)), key=lambda i: (-cands[i].score, cands[i].depth, i))[:budget]
    keep = sorted(best, key=lambda i: (cands[i].depth, i))
    index = {c: n for n, c in enumerate(keep)}
    tokens = [cands[c].token for c in keep]
    parents = [ROOT if cands[c].parent == ROOT else index[cands[c].parent] for c in keep]
    confidence = [math.exp(cands[c].score - (0.0 if cands[c].parent == ROOT else cands[cands[c].parent].score)) for c in keep]
    return DraftTree(tokens, parents, None, DETERMINISTIC, confidence)


def draft_pass_batch(prefix_lens: Sequence[int], slots: Sequence[int], tokens: list[list[int]], offsets: list[int],
                     depths: list[list[int]], masks: list[Tensor], device: torch.device | str) -> ForwardBatch:
    """One draft pass over uncommitted draft nodes of a slot cache. Node j of row b is
    written at cache column prefix + offsets[b] + j, at RoPE position prefix + depth, and
    attends to the committed prefix plus the columns masks[b][j] marks among the drafted
    ones (earlier passes' columns, then this pass's)."""
    B, N = len(tokens), max(len(t) for t in tokens)
    prefix = torch.tensor(list(prefix_lens))
    C = int(prefix.max()) + max(offsets) + N
    tok = torch.zeros(B, N, dtype=torch.long)
    pos = torch.zeros(B, N, dtype=torch.long)
    write = torch.zeros(B, N, dtype=torch.long)
    allow = torch.zeros(B, N, C, dtype=torch.bool)
    for b in range(B):
        n, p, o = len(tokens[b]), int(prefix[b]), offsets[b]
        tok[b, :n] = torch.tensor(tokens[b])
        pos[b, :n] = p + torch.tensor(depths[b])
        write[b] = p + o + torch.arange(N)
        allow[b, :, :p] = True
        allow[b, :n, p : p + o + n] = masks[b]
        allow[b, n:, p + o + n : p + o + N] = torch.eye(N - n, dtype=torch.bool)  # padding: itself
    slots = list(slots)
    contiguous = all(x == slots[0] + i for i, x in enumerate(slots))
    # Assembled on the CPU, moved to the drafter's cache device in one go.
    tok, pos, slot_ids, write, allow = (t.to(device) for t in (tok, pos, torch.tensor(slots), write, allow))
    return ForwardBatch(tok, pos, slot_ids, write, allow[:, None], [len(t) for t in tokens], slots[0] if contiguous else None)
