"""Per-sequence state shared by the engine and the drafters."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from .config import SamplingParams
from .detok import IncrementalDetokenizer
from .metrics import SpecStats

FINISH_EOS = "eos"
FINISH_LENGTH = "length"
FINISH_STOP = "stop"
FINISH_CANCELLED = "cancelled"


@dataclass
class SequenceState:
    request_id: str
    slot: int
    prompt_ids: list[int]
    params: SamplingParams
    method: str
    num_draft_tokens: int  # draft budget per step; 0 = plain decoding (the baseline)
    generator: torch.Generator
    detok: IncrementalDetokenizer | None
    output_ids: list[int] = field(default_factory=list)
    stats: SpecStats = field(default_factory=SpecStats)
    finished: bool = False
    finish_reason: str | None = None
    # Drafter-owned state (e.g. the EAGLE head's cache slot), keyed by drafter name.
    drafter_state: dict[str, Any] = field(default_factory=dict)
    arrival_time: float = 0.0
    first_token_time: float | None = None

    @property
    def root_token(self) -> int:
        """The last emitted token: it is fed first in the next step (its KV is not cached yet)."""
        return self.output_ids[-1]

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def speculative(self) -> bool:
        return self.num_draft_tokens > 0
