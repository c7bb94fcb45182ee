"""Slot KV cache, preallocated once from max_batch_size x max_seq_len.

A sequence owns one slot. Its cached prefix occupies columns [0, length). A forward pass
writes the K/V of its n new tokens (a draft tree or chain, or a prompt) at columns
[length, length + n) -- "the newest positions" -- without changing `length`. `commit`
then keeps the chosen subset of them (e.g. the accepted root-to-leaf path) as the
contiguous continuation of the prefix; everything else is simply overwritten later.

With prefix caching (specdec/engine/prefix_cache.py) a released slot keeps its content
until it is needed again, and `claim` starts a sequence on the slot (or a copy of the slot)
that already holds its prompt's longest cached prefix.
"""
from __future__ import annotations

import logging
import time
from typing import Sequence

import torch

from specdec.engine.prefix_cache import PrefixIndex, PrefixMatch
from specdec.errors import CapacityError, UnknownSequenceError

log = logging.getLogger(__name__)


class KVCache:
    def __init__(
        self,
        num_layers: int,
        max_slots: int,
        num_kv_heads: int,
        max_seq_len: int,
        head_dim: int,
        max_new_per_step: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        prefix_block_tokens: int | None = None,
    ):
        """prefix_block_tokens: index committed tokens for prefix caching in blocks of this
        many tokens (None: no prefix caching; commit's `tokens` are then not needed)."""
        self.max_seq_len = max_seq_len
        # Slack so a step's newest positions (tree or prompt chunk) fit behind a full prefix.
        self.capacity = max_seq_len + max_new_per_step
        shape = (num_layers, max_slots, num_kv_heads, self.capacity, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # [L, slots, kvh, cap, hd]
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.lengths = [0] * max_slots
        self._free = list(range(max_slots))
        self.prefix = PrefixIndex(max_slots, prefix_block_tokens) if prefix_block_tokens else None
        log.info(
            "KV cache: %d slots x %d positions x %d layers = %.1f MiB",
            max_slots, self.capacity, num_layers, self.nbytes / 2**20,
        )

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2

    @property
    def max_slots(self) -> int:
        return self.k.shape[1]

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, salt: str | None = None, keep: int | None = None) -> int:
        """Take the lowest free slot (keeps active slots compact, so batches are often a view);
        with prefix caching the lowest empty one, else the least recently used retained one
        (not `keep` while another is free)."""
        if not self._free:
            raise CapacityError(f"no free KV-cache slot: all {self.max_slots} slots (max_batch_size) are in use")
        if self.prefix is None:
            slot = min(self._free)
        else:
            slot = min(self._free, key=lambda s: (s == keep, self.prefix.holds(s) > 0, self.prefix.last_used[s], s))
            self.prefix.reset(slot, salt)
        self._free.remove(slot)
        self.lengths[slot] = 0
        return slot

    def lookup(self, tokens: Sequence[int], salt: str | None, limit: int) -> PrefixMatch | None:
        """The slot holding the longest cached prefix of `tokens` (at most `limit`) under `salt`."""
        return self.prefix.match(tokens, salt, limit) if self.prefix is not None else None

    def claim(self, tokens: Sequence[int], salt: str | None, found: PrefixMatch | None) -> int:
        """A slot for a sequence whose first tokens are `tokens`, holding the KV of `found`
        (from lookup; None: an empty slot); its length is then found.tokens. A free slot that
        holds it and no more is adopted; one that holds more (a longer conversation, kept for
        its own next turn) is copied from while another slot is free, as is one in use."""
        if found is None or found.tokens == 0:
            return self.allocate(salt)
        if found.slot in self._free and (found.tokens >= self.prefix.holds(found.slot) or len(self._free) == 1):
            self._free.remove(found.slot)
            slot = found.slot
            self.prefix.truncate(slot, found.tokens)
        else:
            slot = self.allocate(salt, keep=found.slot)
            self.copy_prefix(found, slot)
            self.prefix.extend(slot, tokens[: found.tokens])
        self.lengths[slot] = found.tokens
        return slot

    def copy_prefix(self, source: PrefixMatch, slot: int) -> None:
        n = source.tokens
        self.k[:, slot, :, :n] = self.k[:, source.slot, :, :n]
        self.v[:, slot, :, :n] = self.v[:, source.slot, :, :n]

    def release(self, slot: int) -> None:
        if slot in self._free or not 0 <= slot < self.max_slots:
            raise UnknownSequenceError("slot", f"slot {slot} is not allocated")
        self.lengths[slot] = 0
        self._free.append(slot)
        if self.prefix is not None:
            self.prefix.last_used[slot] = time.monotonic()  # its content is retained (LRU)

    def is_allocated(self, slot: int) -> bool:
        return 0 <= slot < self.max_slots and slot not in self._free

    def commit(self, slot: int, kept: Sequence[int], tokens: Sequence[int] | None = None) -> None:
        """Keep the newest positions `kept` (indices into the last written block, in
        root-to-leaf order) as the continuation of the prefix. tokens: their ids (with prefix
        caching; without them the slot's content stops being reusable here)."""
        start = self.lengths[slot]
        m = len(kept)
        if m == 0:
            return
        if start + m > self.max_seq_len:
            raise CapacityError(f"slot {slot}: sequence would exceed max_seq_len={self.max_seq_len}")
        if list(kept) != list(range(m)):  # a chain prefix is already in place
            src = torch.tensor([start + i for i in kept], device=self.k.device)
            self.k[:, slot, :, start : start + m] = self.k[:, slot, :, :].index_select(2, src)
            self.v[:, slot, :, start : start + m] = self.v[:, slot, :, :].index_select(2, src)
        self.lengths[slot] = start + m
        if self.prefix is not None and tokens is not None and self.prefix.holds(slot) == start:
            self.prefix.extend(slot, tokens)

    def truncate(self, slot: int, length: int) -> None:
        """Drop committed positions past `length` (used when a drafter must rewind)."""
        self.lengths[slot] = min(self.lengths[slot], length)
        if self.prefix is not None:
            self.prefix.truncate(slot, length)
