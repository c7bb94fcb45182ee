"""Per-sequence state: the drafter side's view (SequenceState) and the request loop's
(RequestState: stop conditions, draft budget, text, stats). Shared by the in-process
engine and the Triton models so both apply exactly the same rules."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Generic, Hashable, TypeVar

import torch

from .config import SamplingParams
from .detok import IncrementalDetokenizer
from .errors import UnknownSequenceError
from .metrics import SpecStats
from .request import draft_budget, room_left

T = TypeVar("T")

FINISH_EOS = "eos"
FINISH_LENGTH = "length"
FINISH_STOP = "stop"
FINISH_CANCELLED = "cancelled"


@dataclass
class SequenceState:
    """What a drafter sees of one sequence."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    method: str
    generator: torch.Generator
    output_ids: list[int] = field(default_factory=list)
    # Drafter-owned state (e.g. the EAGLE head's cache slot).
    drafter_state: dict[str, Any] = field(default_factory=dict)
    last_used: float = 0.0

    @property
    def root_token(self) -> int:
        """The last emitted token: it is fed first in the next step (its KV is not cached yet)."""
        return self.output_ids[-1]

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids


@dataclass
class RequestState:
    """The request loop's state: what has been emitted and when to stop."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    method: str
    num_draft_tokens: int  # draft budget per step; 0 = plain decoding (the baseline)
    max_seq_len: int
    eos_token_ids: frozenset[int]
    detok: IncrementalDetokenizer | None = None
    output_ids: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)  # of output_ids, with return_log_probs
    stats: SpecStats = field(default_factory=SpecStats)
    finished: bool = False
    finish_reason: str | None = None

    @property
    def speculative(self) -> bool:
        return self.num_draft_tokens > 0

    @property
    def room(self) -> int:
        """Tokens this request may still emit (max_tokens and the context both bound it)."""
        return room_left(self.params.max_tokens, self.max_seq_len, len(self.prompt_ids), len(self.output_ids))

    def draft_budget(self, requested: int | None = None) -> int:
        """Draft no more than could be emitted, leaving room for the bonus token."""
        wanted = self.num_draft_tokens if requested is None else requested
        return draft_budget(wanted, self.params.max_tokens, self.max_seq_len, len(self.prompt_ids), len(self.output_ids))

    def accept(self, tokens: list[int], log_probs: list[float] | None = None) -> tuple[list[int], str]:
        """Apply EOS / stop strings / max_tokens / context to newly emitted tokens, one token
        at a time in the order plain decoding meets them, so a step's accepted run is cut
        exactly where the baseline stops (and the log probs of the tokens kept are kept).
        Returns (tokens kept, final text delta); sets finished/finish_reason."""
        kept: list[int] = []
        reason, room = None, self.room
        for tok in tokens:
            if tok in self.eos_token_ids and not self.params.ignore_eos:
                reason = FINISH_EOS  # the end token is not output
                break
            kept.append(tok)
            if self.detok is not None and self.detok.add(tok):
                reason = FINISH_STOP
                break
            if len(kept) >= room:
                reason = FINISH_LENGTH
                break
        self.output_ids.extend(kept)
        if log_probs is not None:
            self.log_probs.extend(log_probs[: len(kept)])
        text = ""
        if self.detok is not None:
            text = self.detok.release()
            if reason in (FINISH_EOS, FINISH_LENGTH):
                text += self.detok.flush()
        if reason is not None:
            self.finish(reason)
        return kept, text

    def finish(self, reason: str) -> None:
        self.finished, self.finish_reason = True, reason


class KeyedSequences(Generic[T]):
    """Per-sequence records keyed by sequence id, with an idle timeout: the shared shape of
    the verifier's and the drafters' state (each may live in its own Triton process)."""

    where = "this model"

    def __init__(self) -> None:
        self._seqs: dict[Hashable, T] = {}

    @property
    def active(self) -> int:
        return len(self._seqs)

    def __contains__(self, seq_id: Hashable) -> bool:
        return seq_id in self._seqs

    def _get(self, seq_id: Hashable) -> T:
        seq = self._seqs.get(seq_id)
        if seq is None:
            raise UnknownSequenceError("sequence_id", f"no sequence {seq_id!r} on the {self.where}")
        return seq

    def release(self, seq_id: Hashable) -> None:
        raise NotImplementedError

    def idle(self, max_idle_s: float) -> list[Hashable]:
        """Sequences nobody has touched for max_idle_s (a client that vanished)."""
        cutoff = time.monotonic() - max_idle_s
        return [k for k, s in self._seqs.items() if s.last_used < cutoff]

    def release_idle(self, max_idle_s: float) -> list[Hashable]:
        """Free the idle sequences."""
        stale = self.idle(max_idle_s)
        for seq_id in stale:
            self.release(seq_id)
        return stale
