"""Suffix decoding across requests (SuffixDecoding, Oliaro et al. 2024; Arctic Inference's
`suffix` method): draft from what followed the same context in earlier requests' prompts
and outputs, and in this request's own history.

Per cache_salt scope, a corpus of finished requests (prompt + output), bounded all together:
at most `suffix_corpus_tokens` tokens over every scope (a scope's oldest documents dropped
first once it alone holds them all; otherwise the least recently used scopes go) and at
most `suffix_scopes` scopes. Each
step, the longest suffix of the sequence's context (at most suffix_max_match tokens) that
occurs in the corpus or earlier in its own history is matched; the continuations of its
most recent occurrences are merged into a trie that counts how often each continuation
token followed, and the tree drafted is the `budget` nodes of highest frequency-weighted
path probability (the product of count(child) / count(parent) along the path), each at
least suffix_min_token_prob given its parent. Drafts are deterministic (one-hot rule), so
verification is lossless as for n-gram lookup; the per-node probability is the planner's
confidence (adaptive under load like the other methods).

Unlike a suffix tree, matching scans a numpy array of the scope's tokens (a vectorised
compare per matched position): no per-token Python objects, memory bounded by the token
count, and a lookup over a million tokens costs about a millisecond here.
"""
from __future__ import annotations

import heapq
from collections import OrderedDict, deque
from typing import Sequence

import numpy as np

from specdec.config import METHOD_SUFFIX, SpeculativeConfig
from specdec.engine.drafters.base import Drafter
from specdec.engine.drafters.registry import DrafterKind, register
from specdec.engine.sequences import SequenceState
from specdec.engine.tree import ROOT, DraftTree

SEPARATOR = -1  # between documents: no match or continuation crosses it
MAX_OCCURRENCES = 64  # most recent occurrences whose continuations are counted


class SuffixCorpus:
    """One scope's earlier token sequences, oldest first, in one array with separators,
    holding at most max_tokens entries, separators included.

    The array lives in a buffer with room behind it: adding a document writes after the last
    one and dropping the oldest moves the start, so neither copies the scope (this runs on
    the scheduler's thread for every finished request). The buffer is compacted or grown,
    copying what is held, only when its end is reached with less than half of it held: at
    most one copy of a token per token added."""

    INITIAL_CAPACITY = 1024

    def __init__(self, max_tokens: int):
        if max_tokens < 3:  # a separator, one token, a separator
            raise ValueError(f"max_tokens must be >= 3, got {max_tokens}")
        self.max_tokens = max_tokens
        self.lengths: deque[int] = deque()  # of its documents, oldest first
        self._buffer = np.full(min(self.INITIAL_CAPACITY, 2 * max_tokens), SEPARATOR, dtype=np.int32)
        self._start, self._end = 0, 1  # tokens = buffer[start:end], which starts with a separator

    @property
    def tokens(self) -> np.ndarray:
        """The documents, each followed by a separator, behind a leading one (a view)."""
        return self._buffer[self._start : self._end]

    def add(self, ids: Sequence[int]) -> None:
        if not ids:
            return
        ids = np.asarray(list(ids)[-(self.max_tokens - 2) :], dtype=np.int32)  # room for its separators
        need = len(ids) + 1
        while self._end - self._start + need > self.max_tokens:  # the oldest documents make room
            self._start += self.lengths.popleft() + 1
        if self._end + need > len(self._buffer):
            self._make_room(need)
        self._buffer[self._end : self._end + len(ids)] = ids
        self._buffer[self._end + len(ids)] = SEPARATOR
        self._end += need
        self.lengths.append(len(ids))

    def _make_room(self, need: int) -> None:
        held = self.tokens
        size = len(held) + need
        capacity = len(self._buffer)
        if size > capacity // 2:  # grow (doubling, up to twice the bound)
            capacity = min(max(2 * size, 2 * capacity), 2 * self.max_tokens)
        buffer = np.full(capacity, SEPARATOR, dtype=np.int32)
        buffer[: len(held)] = held
        self._buffer, self._start, self._end = buffer, 0, len(held)


class SuffixCorpora:
    """Corpora by cache_salt (requests see only their own scope's), bounded in tokens over
    all scopes and in scopes; shared by every drafter that drafts from it (suffix, and the
    EAGLE-3 hybrid)."""

    def __init__(self, max_tokens: int, max_scopes: int):
        self.max_tokens = max_tokens
        self.max_scopes = max_scopes
        self._scopes: OrderedDict[str | None, SuffixCorpus] = OrderedDict()
        self._tokens = 0

    def get(self, salt: str | None) -> SuffixCorpus | None:
        corpus = self._scopes.get(salt)
        if corpus is not None:
            self._scopes.move_to_end(salt)
        return corpus

    def add(self, salt: str | None, ids: Sequence[int]) -> None:
        corpus = self.get(salt)
        before = 0 if corpus is None else len(corpus.tokens)
        if corpus is None:
            corpus = self._scopes[salt] = SuffixCorpus(self.max_tokens)
        corpus.add(ids)
        self._tokens += len(corpus.tokens) - before
        while len(self._scopes) > 1 and (self._tokens > self.max_tokens or len(self._scopes) > self.max_scopes):
            _, dropped = self._scopes.popitem(last=False)  # the least recently used (never this one: it was just used)
            self._tokens -= len(dropped.tokens)

    @property
    def scopes(self) -> int:
        return len(self._scopes)

    @property
    def tokens(self) -> int:
        """Tokens held over every scope (separators included)."""
        return self._tokens


def match_occurrences(haystack: np.ndarray, context: np.ndarray, max_match: int) -> tuple[int, np.ndarray]:
    """(L, positions): the longest L <= max_match such that context's last L tokens occur in
    haystack ending at each position (before haystack's last token), and those positions."""
    if len(context) == 0 or len(haystack) < 2:
        return 0, np.empty(0, dtype=np.int64)
    alive = np.flatnonzero(haystack[:-1] == context[-1])
    length = 1 if len(alive) else 0
    while len(alive) and length < min(max_match, len(context)):
        back = alive - length
        ok = back >= 0
        ok[ok] = haystack[back[ok]] == context[-1 - length]
        if not ok.any():
            break
        alive, length = alive[ok], length + 1
    return length, alive


def continuations(haystack: np.ndarray, ends: np.ndarray, depth: int) -> list[np.ndarray]:
    """What followed each match end (most recent first), up to `depth` tokens, cut at a separator."""
    out = []
    for end in ends[::-1][:MAX_OCCURRENCES]:
        cont = haystack[end + 1 : end + 1 + depth]
        stop = np.flatnonzero(cont == SEPARATOR)
        cont = cont[: stop[0]] if len(stop) else cont
        if len(cont):
            out.append(cont)
    return out


def frequency_tree(conts: list[np.ndarray], budget: int, min_prob: float) -> DraftTree:
    """The `budget` nodes of highest path probability in the trie of `conts`, each node's
    probability given its parent at least `min_prob`; confidence = that probability."""
    counts: list[int] = []
    tokens: list[int] = []
    parents: list[int] = []
    child: dict[tuple[int, int], int] = {}
    for cont in conts:
        node = ROOT
        for tok in cont.tolist():
            nxt = child.get((node, tok))
            if nxt is None:
                nxt = child[(node, tok)] = len(tokens)
                tokens.append(tok)
                parents.append(node)
                counts.append(0)
            counts[nxt] += 1
            node = nxt
    if not tokens:
        return DraftTree()
    total = len(conts)
    kids: dict[int, list[int]] = {}
    for i, p in enumerate(parents):
        kids.setdefault(p, []).append(i)
    # best-first over path probability (a child's is never above its parent's)
    frontier = [(-counts[i] / total, i) for i in kids.get(ROOT, [])]
    heapq.heapify(frontier)
    chosen: list[tuple[int, float]] = []  # (node, probability given its parent)
    while frontier and len(chosen) < budget:
        neg, node = heapq.heappop(frontier)
        parent_count = total if parents[node] == ROOT else counts[parents[node]]
        cond = counts[node] / parent_count
        if cond < min_prob:
            continue
        chosen.append((node, cond))
        for kid in kids.get(node, []):
            heapq.heappush(frontier, (neg * counts[kid] / counts[node], kid))
    index = {}
    out_tokens, out_parents, confidence = [], [], []
    for node, cond in chosen:  # popped parents first: topological
        index[node] = len(out_tokens)
        out_tokens.append(tokens[node])
        out_parents.append(ROOT if parents[node] == ROOT else index[parents[node]])
        confidence.append(cond)
    return DraftTree(out_tokens, out_parents, confidence=confidence)


class SuffixDrafter(Drafter):
    name = "suffix"

    def __init__(self, config: SpeculativeConfig, corpora: SuffixCorpora):
        self.config = config
        self.corpora = corpora

    def propose(self, seqs: Sequence[SequenceState], budgets: Sequence[int], keep_drafting=None) -> list[DraftTree]:
        return [suffix_tree(self.corpora, self.config, seq, budget) if budget > 0 else DraftTree()
                for seq, budget in zip(seqs, budgets)]

    def on_finish(self, seq: SequenceState) -> None:
        learn(self.corpora, seq)


def learn(corpora: SuffixCorpora, seq: SequenceState) -> None:
    """A finished (or cancelled) sequence's prompt and output join its scope's corpus."""
    corpora.add(seq.params.cache_salt, seq.all_ids)


def suffix_tree(corpora: SuffixCorpora, cfg: SpeculativeConfig, seq: SequenceState, budget: int) -> DraftTree:
    """The frequency-weighted draft for a sequence: the longest context suffix matched in its
    scope's corpus and in its own history (the longer match wins; equal: both count)."""
    history = np.asarray(seq.all_ids, dtype=np.int32)
    depth = min(budget, cfg.max_draft_len)
    found = []
    corpus = corpora.get(seq.params.cache_salt)
    if corpus is not None:
        found.append((*match_occurrences(corpus.tokens, history, cfg.suffix_max_match), corpus.tokens))
    found.append((*match_occurrences(history, history, cfg.suffix_max_match), history))
    best = max(length for length, _, _ in found)
    if best < cfg.prompt_lookup_min:
        return DraftTree()
    conts = [c for length, ends, hay in found if length == best for c in continuations(hay, ends, depth)]
    return frequency_tree(conts, budget, cfg.suffix_min_token_prob)


register(DrafterKind(methods=(METHOD_SUFFIX,), build=lambda spec, ctx: SuffixDrafter(spec, ctx.suffix_corpora(spec))))
