"""The drafter interface: propose one draft tree per sequence (batched), learn what was kept."""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable, Sequence

from torch import Tensor

from specdec.config import SpeculativeConfig
from specdec.engine.kv_cache import KVCache
from specdec.engine.sequences import SequenceState
from specdec.engine.tree import DraftTree


# Asked before each further draft pass: (depth drafted so far, per row the drafter's
# confidence in its best path) -> run the pass? (confidence-cut drafting; planner.DraftCut)
KeepDrafting = Callable[[int, Sequence[float]], bool]


class Drafter(ABC):
    name: str = "drafter"
    # Target layers whose hidden states the drafter needs (EAGLE-3); empty for most.
    tap_layers: tuple[int, ...] = ()
    config: SpeculativeConfig | None = None  # its method's settings (load controls, adaptive) when served

    @abstractmethod
    def propose(self, seqs: Sequence[SequenceState], budgets: Sequence[int],
                keep_drafting: KeepDrafting | None = None) -> list[DraftTree]:
        """One tree per sequence with at most budgets[i] nodes (all >= 1), proposed after
        seq.root_token. Sequences skipped in a step (budget 0) are not passed: their
        on_verified updates accumulate until the next propose. A drafter that drafts in
        passes asks keep_drafting (when given) before each pass after the first, and states
        each node's confidence (DraftTree.confidence) when it has probabilities."""

    def on_prefill(self, seq: SequenceState, hidden: Tensor | None) -> None:
        """After the prompt is in the target cache. hidden: [prompt_len, taps*H] or None."""

    def on_verified(self, seq: SequenceState, emitted: list[int], accepted: int, hidden: Tensor | None) -> None:
        """After verification; seq.output_ids already ends with `emitted` (the `accepted`
        draft tokens, then the bonus/recovered token). hidden: [1 + accepted, taps*H] for
        the previous root and the accepted tokens (the positions whose KV was committed)."""

    def on_finish(self, seq: SequenceState) -> None:
        """Free per-sequence resources (finished, cancelled or failed)."""


class SlotCacheDrafter(Drafter):
    """A model-based drafter with its own slot KV cache: each sequence's state (in
    seq.drafter_state[name]) holds one slot, freed when the sequence ends."""

    cache: KVCache

    def on_finish(self, seq: SequenceState) -> None:
        state = seq.drafter_state.pop(self.name, None)
        if state is not None:
            self.cache.release(state.slot)
