"""Draft trees. A linear chain is the special case where every node has one child.

Node indices are 0..n-1 in topological order (a parent always precedes its children);
parent ROOT (-1) means the node continues the root, i.e. the sequence's last emitted token
(whose KV is not cached yet). The verifier feeds [root] + nodes, so input row i+1 is node i.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

ROOT = -1

# How the children of a node were chosen, which decides the lossless acceptance rule:
#   DETERMINISTIC: distinct tokens picked without target randomness (n-gram, argmax, top-k):
#       try each with probability p(x), zeroing x in p after a rejection (one-hot drafts).
#   IID_SAMPLED: each child drawn independently from q at its parent (SpecInfer):
#       accept with min(1, p(x)/q(x)); after a rejection p <- norm(max(p - q, 0)).
DETERMINISTIC = "deterministic"
IID_SAMPLED = "iid_sampled"


@dataclass
class DraftTree:
    tokens: list[int] = field(default_factory=list)  # [n] draft token per node
    parents: list[int] = field(default_factory=list)  # [n] parent node index or ROOT
    # [n, V] q at each node's parent (the distribution the node was drawn from); IID only.
    draft_probs: Tensor | None = None
    scheme: str = DETERMINISTIC
    # [n] the drafter's probability of each node given its parent (None: not stated, e.g.
    # n-gram). Only planning reads it (which nodes to verify); acceptance never does.
    confidence: list[float] | None = None
    # The first `forced` nodes are a chain the request's grammar forces (drafted without the
    # drafter, specdec/engine/grammar.py); acceptance metrics count them apart.
    forced: int = 0

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.parents):
            raise ValueError("tokens and parents must have the same length")
        for i, p in enumerate(self.parents):
            if not ROOT <= p < i:
                raise ValueError(f"node {i}: parent {p} must be ROOT or an earlier node")
        if self.scheme == IID_SAMPLED and self.draft_probs is None and self.tokens:
            raise ValueError("an IID-sampled tree needs draft_probs")
        if self.confidence is not None and len(self.confidence) != len(self.tokens):
            raise ValueError("confidence must have one entry per node")

    @staticmethod
    def chain(tokens: list[int], draft_probs: Tensor | None = None, confidence: list[float] | None = None) -> "DraftTree":
        scheme = IID_SAMPLED if draft_probs is not None else DETERMINISTIC
        return DraftTree(list(tokens), list(range(-1, len(tokens) - 1)), draft_probs, scheme, confidence)

    @staticmethod
    def from_arrays(tokens, parents, draft_probs: Tensor | None = None) -> "DraftTree":
        """From the wire format between the Triton models: token and parent lists, and the
        [n, V] draft probabilities when the children were sampled (else deterministic)."""
        tokens, parents = [int(t) for t in tokens], [int(p) for p in parents]
        if not tokens:
            return DraftTree()
        scheme = IID_SAMPLED if draft_probs is not None else DETERMINISTIC
        return DraftTree(tokens, parents, draft_probs, scheme)

    def __len__(self) -> int:
        return len(self.tokens)

    def depths(self) -> list[int]:
        """Depth of each node: 1 for children of the root."""
        out: list[int] = []
        for p in self.parents:
            out.append(1 if p == ROOT else out[p] + 1)
        return out

    def children(self) -> list[list[int]]:
        """children()[0] lists the root's children; children()[i + 1] those of node i."""
        kids: list[list[int]] = [[] for _ in range(len(self) + 1)]
        for i, p in enumerate(self.parents):
            kids[p + 1].append(i)
        return kids

    def is_chain(self) -> bool:
        return self.parents == list(range(-1, len(self) - 1))

    def truncated(self, max_nodes: int) -> "DraftTree":
        """The first max_nodes nodes (topological order keeps it a tree)."""
        if max_nodes >= len(self):
            return self
        return self.select(range(max(max_nodes, 0)))

    def select(self, nodes) -> "DraftTree":
        """The subtree of `nodes` (ascending; every kept node's parent kept too), re-indexed."""
        keep = list(nodes)
        if len(keep) == len(self):
            return self
        index = {old: new for new, old in enumerate(keep)}
        parents = []
        for old in keep:
            p = self.parents[old]
            if p != ROOT and p not in index:
                raise ValueError(f"node {old} kept without its parent {p}")
            parents.append(ROOT if p == ROOT else index[p])
        probs = None if self.draft_probs is None else self.draft_probs[keep]
        confidence = None if self.confidence is None else [self.confidence[i] for i in keep]
        forced = sum(1 for i in keep if i < self.forced)  # a chain from the root: kept as a prefix
        return DraftTree([self.tokens[i] for i in keep], parents, probs, self.scheme, confidence, forced)

    def with_forced_chain(self, chain: list[int]) -> "DraftTree":
        """A grammar's forced tokens as a chain from the root in front of this tree's nodes
        (nodes 0..len(chain)-1; a node of this tree on the same path is shared), confidence 1.
        Lossless as any merge is (see merged and _merged_sampled)."""
        if not chain:
            return self
        if self.scheme == IID_SAMPLED:
            merged = self._merged_sampled(chain, 1.0)
            merged.forced = len(chain)
            return merged
        tokens, parents, conf = list(chain), list(range(ROOT, len(chain) - 1)), [1.0] * len(chain)
        child = {(p, t): i for i, (p, t) in enumerate(zip(parents, tokens))}
        own = self.confidence if self.confidence is not None else [float("nan")] * len(self)
        mapped: list[int] = []  # this tree's node -> its node in the merged tree
        for tok, parent, c in zip(self.tokens, self.parents, own):
            at = ROOT if parent == ROOT else mapped[parent]
            node = child.get((at, tok))
            if node is None:  # not on the forced chain: the method's own node, its confidence kept
                node = child[(at, tok)] = len(tokens)
                tokens.append(tok)
                parents.append(at)
                conf.append(c)
            mapped.append(node)
        return DraftTree(tokens, parents, None, DETERMINISTIC, conf, len(chain))

    def merged(self, continuation: list[int], confidence: float = float("nan")) -> "DraftTree":
        """This tree plus a chain of tokens from the root, sharing any prefix it already has
        (one tree, one verification). New nodes get `confidence` (NaN: not stated, planned
        by position). Deterministic trees: every node's children stay distinct tokens, which
        the one-hot acceptance rule needs. I.i.d.-sampled trees: see _merged_sampled."""
        if self.scheme == IID_SAMPLED:
            return self._merged_sampled(continuation, confidence)
        tokens, parents = list(self.tokens), list(self.parents)
        conf = list(self.confidence) if self.confidence is not None else [float("nan")] * len(tokens)
        child = {(p, t): i for i, (p, t) in enumerate(zip(parents, tokens))}
        node = ROOT
        for tok in continuation:
            nxt = child.get((node, tok))
            if nxt is None:
                nxt = len(tokens)
                tokens.append(tok)
                parents.append(node)
                conf.append(confidence)
                child[(node, tok)] = nxt
            node = nxt
        return DraftTree(tokens, parents, None, DETERMINISTIC, conf)

    def _merged_sampled(self, continuation: list[int], confidence: float) -> "DraftTree":
        """A deterministic continuation joined to sampled draws, still lossless: a
        deterministic draft is an i.i.d. draft from the one-hot q, for which the SpecInfer
        rule (accept with min(1, p/q), residual max(p - q, 0)) is exactly the one-hot rule,
        and recursive rejection holds for drafts with different q as long as each is drawn
        independently of the others. The continuation's nodes come first so that each is
        tried before its sampled siblings. A sampled node equal to a continuation node at
        the same parent is tried after a rejection that zeroed its token, so it is never
        accepted, but its rejection still moves the residual (p <- norm(max(p - q, 0))) and
        the recovered token must come from that residual: dropping the step is lossy (p =
        (.2, .4, .4), q = (.5, .5, 0), continuation [0] would emit (.2, .6, .2)). So it stays
        as a leaf in its place among its siblings, and its sampled subtree, drawn for the
        same context, hangs below the continuation's node."""
        V = self.draft_probs.shape[-1]
        tokens, parents, rows = [], [], []
        child: dict[tuple[int, int], int] = {}
        node = ROOT
        for tok in continuation:
            child[(node, tok)] = len(tokens)
            tokens.append(tok)
            parents.append(node)
            rows.append(None)  # one-hot
            node = len(tokens) - 1
        mapped: list[int] = []
        for i, (tok, parent) in enumerate(zip(self.tokens, self.parents)):
            at = ROOT if parent == ROOT else mapped[parent]
            shared = child.get((at, tok))
            mapped.append(len(tokens) if shared is None else shared)
            tokens.append(tok)  # shared: the rejection step, a leaf
            parents.append(at)
            rows.append(i)
        probs = self.draft_probs.new_zeros(len(tokens), V)
        for n, (tok, row) in enumerate(zip(tokens, rows)):
            if row is None:
                probs[n, tok] = 1.0
            else:
                probs[n] = self.draft_probs[row]
        conf = None
        if self.confidence is not None:
            conf = [confidence if row is None else self.confidence[row] for row in rows]
        return DraftTree(tokens, parents, probs, IID_SAMPLED, conf)

    def input_rows(self, root_token: int) -> tuple[list[int], list[int], Tensor]:
        """What the decoder takes for [root] + nodes: tokens, depth offsets (root = 0) and
        the [n+1, n+1] ancestor-or-self mask."""
        n = len(self) + 1
        mask = torch.zeros(n, n, dtype=torch.bool)
        mask[:, 0] = True
        mask[0, 0] = True
        for i, p in enumerate(self.parents):
            row = i + 1
            mask[row] = mask[p + 1]
            mask[row, row] = True
        return [root_token] + self.tokens, [0] + self.depths(), mask

    def first_path(self) -> list[int]:
        """Tokens along each node's first child from the root (a drafter that lists the most
        probable child first: its best path)."""
        kids, node, out = self.children(), ROOT, []
        while kids[node + 1]:
            node = kids[node + 1][0]
            out.append(self.tokens[node])
        return out

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root's child down to `node`."""
        path = []
        while node != ROOT:
            path.append(node)
            node = self.parents[node]
        return path[::-1]
