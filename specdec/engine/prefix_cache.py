"""Prefix caching over the slot KV cache: which slot already holds the KV of a prompt's
longest prefix.

Each slot's committed token ids are indexed by chained block hashes (vLLM's automatic
prefix caching, TensorRT-LLM's enable_kv_cache_reuse): block k's key hashes block k's
tokens with block k-1's key, so one key names the whole prefix up to it, and a lookup walks
the prompt's blocks until a key is missing, then extends token by token inside the next
block. The chain starts from the request's cache_salt: requests with different salts never
share a key, so never share KV.

A finished sequence's slot keeps its content while free ("retained"); allocation takes an
empty slot first, then the least recently used retained one, so the cache lives inside the
KV memory the server already owns and evicts by LRU. A hit on a free slot adopts it (no
copy); a hit on a slot in use (a running sequence with the same system prompt) copies the
prefix's columns into the new slot.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

DEFAULT_BLOCK_TOKENS = 16


@dataclass
class PrefixMatch:
    slot: int  # holds the prefix's KV
    tokens: int  # how many leading tokens it holds


@dataclass
class PrefixCacheCounters:
    """Token-level, as vLLM counts them (prefix_cache_queries / prefix_cache_hits)."""

    requests: int = 0
    hit_requests: int = 0  # requests that reused at least one token
    queried_tokens: int = 0  # prompt tokens looked up
    reused_tokens: int = 0  # of those, taken from the cache (the rest were computed)

    @property
    def hit_rate(self) -> float:
        return self.reused_tokens / self.queried_tokens if self.queried_tokens else 0.0

    def as_dict(self) -> dict:
        return {"requests": self.requests, "hit_requests": self.hit_requests, "queried_tokens": self.queried_tokens,
                "reused_tokens": self.reused_tokens, "computed_tokens": self.queried_tokens - self.reused_tokens,
                "hit_rate": round(self.hit_rate, 4)}


class PrefixIndex:
    """Per slot: its committed token ids, its salt, the chained key of each full block, and
    when it was last used; and, over all slots, which slots hold each key."""

    def __init__(self, max_slots: int, block_tokens: int = DEFAULT_BLOCK_TOKENS):
        if block_tokens < 1:
            raise ValueError("block_tokens must be >= 1")
        self.block = block_tokens
        self.tokens: list[list[int]] = [[] for _ in range(max_slots)]
        self.keys: list[list[int]] = [[] for _ in range(max_slots)]
        self.salts: list[str | None] = [None] * max_slots
        self.last_used = [0.0] * max_slots
        self._slots_by_key: dict[int, set[int]] = {}
        self.counters = PrefixCacheCounters()

    def _root(self, salt: str | None) -> int:
        return hash(("specdec-prefix", salt))

    def holds(self, slot: int) -> int:
        """Tokens of reusable content in the slot."""
        return len(self.tokens[slot])

    # ---- a slot's content -----------------------------------------------------------------
    def reset(self, slot: int, salt: str | None) -> None:
        """The slot starts a new sequence from nothing (its old content is evicted)."""
        self.truncate(slot, 0)
        self.salts[slot] = salt
        self.last_used[slot] = time.monotonic()

    def truncate(self, slot: int, length: int) -> None:
        """Keep only the first `length` tokens (a rewind, or an adopted slot's matched part)."""
        if length >= len(self.tokens[slot]):
            return
        keep_blocks = length // self.block
        for key in self.keys[slot][keep_blocks:]:
            holders = self._slots_by_key.get(key)
            if holders is not None:
                holders.discard(slot)
                if not holders:
                    del self._slots_by_key[key]
        del self.keys[slot][keep_blocks:]
        del self.tokens[slot][length:]

    def extend(self, slot: int, tokens: Sequence[int]) -> None:
        """Tokens whose KV was just committed after the slot's content; index new full blocks."""
        ids = self.tokens[slot]
        ids.extend(int(t) for t in tokens)
        keys = self.keys[slot]
        while (len(keys) + 1) * self.block <= len(ids):
            start = len(keys) * self.block
            key = hash((keys[-1] if keys else self._root(self.salts[slot]), tuple(ids[start : start + self.block])))
            keys.append(key)
            self._slots_by_key.setdefault(key, set()).add(slot)
        self.last_used[slot] = time.monotonic()

    # ---- lookup -------------------------------------------------------------------------------
    def match(self, tokens: Sequence[int], salt: str | None, limit: int) -> PrefixMatch | None:
        """The slot holding the longest prefix of `tokens` (at most `limit`) under `salt`."""
        if limit <= 0:
            return None
        candidates: set[int] | None = None
        key = self._root(salt)
        blocks = 0
        while (blocks + 1) * self.block <= limit:
            start = blocks * self.block
            key = hash((key, tuple(tokens[start : start + self.block])))
            holders = self._slots_by_key.get(key)
            if not holders:
                break
            candidates, blocks = holders, blocks + 1
        if candidates is None:  # no full block: a slot of the same salt may share a shorter prefix
            candidates = {s for s, ids in enumerate(self.tokens) if ids and self.salts[s] == salt}
        best: PrefixMatch | None = None
        start = blocks * self.block
        for slot in sorted(candidates):
            ids = self.tokens[slot]
            if self.salts[slot] != salt or ids[:start] != list(tokens[:start]):  # a hash collision never reuses
                continue
            n, end = start, min(limit, len(ids))
            while n < end and ids[n] == tokens[n]:
                n += 1
            if n > 0 and (best is None or n > best.tokens):
                best = PrefixMatch(slot, n)
        return best

    def record(self, queried: int, reused: int) -> None:
        c = self.counters
        c.requests += 1
        c.hit_requests += reused > 0
        c.queried_tokens += queried
        c.reused_tokens += reused
