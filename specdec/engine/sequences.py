"""Per-sequence bookkeeping the engine's parts share: one record per sequence, what a drafter sees of it,
records keyed by sequence id with an idle timeout, and how many tokens a sequence may still
emit (so no part drafts more than could be kept)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Generic, Hashable, Sequence, TypeVar

import torch

import specdec_wire as P
from specdec.config import METHOD_NONE, SamplingParams
from specdec.errors import InvalidRequestError, UnknownSequenceError

T = TypeVar("T")


def room_left(max_tokens: int, max_seq_len: int, prompt_len: int, generated: int) -> int:
    """Tokens a sequence may still emit: max_tokens and the context both bound it."""
    return min(max_tokens - generated, max_seq_len - prompt_len - generated)


def draft_budget(wanted: int, max_tokens: int, max_seq_len: int, prompt_len: int, generated: int) -> int:
    """Draft no more than could be emitted, leaving room for the bonus token."""
    return max(0, min(wanted, room_left(max_tokens, max_seq_len, prompt_len, generated) - 1))



def check_token_ids(name: str, ids: Sequence[int], vocab_size: int) -> None:
    if ids and not (0 <= min(ids) and max(ids) < vocab_size):
        raise InvalidRequestError(name, f"token ids must be in [0, {vocab_size}), got {sorted(set(ids))[:8]}")



def check_prompt_ids(prompt_ids: Sequence[int], max_seq_len: int, vocab_size: int | None = None, name: str = P.TEXT_INPUT) -> None:
    """A tokenized prompt must fit the context (leaving room for one token) and the vocabulary.
    name: the input the prompt came in (text_input, tokenized; or input_ids as sent)."""
    if not prompt_ids:
        raise InvalidRequestError(name, "the prompt is empty")
    if len(prompt_ids) >= max_seq_len:
        raise InvalidRequestError(name, f"the prompt has {len(prompt_ids)} tokens; the context holds {max_seq_len} (max_seq_len)")
    if vocab_size is not None and (min(prompt_ids) < 0 or max(prompt_ids) >= vocab_size):
        raise InvalidRequestError(P.INPUT_IDS, f"token ids must be in [0, {vocab_size})")


@dataclass
class SequenceRecord:
    """One sequence as the engine's parts in one process share it (the speculator, the target
    pass, the drafters beside the target): what it asked for and every token it has emitted.
    The parts hold this record, not copies of it; its tokens are appended in one place, the
    target pass, as it commits them (TargetPass: _TargetSequence.emitted). A drafter's service
    appends them itself only where it is served apart, with no target beside it."""

    seq_id: Hashable
    prompt_ids: list[int]
    params: SamplingParams
    method: str = METHOD_NONE  # none: plain decoding (the baseline)
    num_draft_tokens: int = 0  # the request's most per step
    output_ids: list[int] = field(default_factory=list)

    @property
    def root_token(self) -> int:
        """The last emitted token: it is fed first in the next step (its KV is not cached yet)."""
        return self.output_ids[-1]

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids


@dataclass
class SequenceState:
    """What a drafter sees of one sequence: the shared record, and the drafter's own state."""

    record: SequenceRecord
    generator: torch.Generator | None
    # Drafter-owned state (e.g. the EAGLE head's cache slot).
    drafter_state: dict[str, Any] = field(default_factory=dict)
    last_used: float = 0.0
    # Whether the service appends the tokens it is told of (served apart) or the record's
    # owner beside it already has (the target pass).
    appends_tokens: bool = True

    @property
    def request_id(self) -> str:
        return str(self.record.seq_id)

    @property
    def prompt_ids(self) -> list[int]:
        return self.record.prompt_ids

    @property
    def output_ids(self) -> list[int]:
        return self.record.output_ids

    @property
    def params(self) -> SamplingParams:
        return self.record.params

    @property
    def method(self) -> str:
        return self.record.method

    @property
    def root_token(self) -> int:
        return self.record.root_token

    @property
    def all_ids(self) -> list[int]:
        return self.record.all_ids


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
