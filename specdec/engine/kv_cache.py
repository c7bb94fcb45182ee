"""Slot KV cache, preallocated once from max_batch_size x max_seq_len.

A sequence owns one slot. Its cached prefix occupies columns [0, length). A forward pass
writes the K/V of its n new tokens (a draft tree or chain, or a prompt) at columns
[length, length + n) -- "the newest positions" -- without changing `length`. `commit`
then keeps the chosen subset of them (e.g. the accepted root-to-leaf path) as the
contiguous continuation of the prefix; everything else is simply overwritten later.
"""
from __future__ import annotations

import logging
from typing import Sequence

import torch

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
    ):
        self.max_seq_len = max_seq_len
        # Slack so a step's newest positions (tree or prompt chunk) fit behind a full prefix.
        self.capacity = max_seq_len + max_new_per_step
        shape = (num_layers, max_slots, num_kv_heads, self.capacity, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # [L, slots, kvh, cap, hd]
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.lengths = [0] * max_slots
        self._free = list(range(max_slots))
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

    def allocate(self) -> int:
        """Take the lowest free slot (keeps active slots compact, so batches are often a view)."""
        if not self._free:
            raise CapacityError(f"no free KV-cache slot: all {self.max_slots} slots (max_batch_size) are in use")
        slot = min(self._free)
        self._free.remove(slot)
        self.lengths[slot] = 0
        return slot

    def release(self, slot: int) -> None:
        if slot in self._free or not 0 <= slot < self.max_slots:
            raise UnknownSequenceError("slot", f"slot {slot} is not allocated")
        self.lengths[slot] = 0
        self._free.append(slot)

    def is_allocated(self, slot: int) -> bool:
        return 0 <= slot < self.max_slots and slot not in self._free

    def commit(self, slot: int, kept: Sequence[int]) -> None:
        """Keep the newest positions `kept` (indices into the last written block, in
        root-to-leaf order) as the continuation of the prefix."""
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

    def truncate(self, slot: int, length: int) -> None:
        """Drop committed positions past `length` (used when a drafter must rewind)."""
        self.lengths[slot] = min(self.lengths[slot], length)
