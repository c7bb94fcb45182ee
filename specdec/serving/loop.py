"""One sequence's view of the verifier and of a drafter served apart (LoopBackend), and the
update a round gives its request (LoopUpdate, what the loop model streams).

The verifier's engine loop (specdec/serving/engine_loop.py) batches every sequence and asks a
drafter served apart through DrafterApart (specdec/serving/drafter_apart.py) over a
LoopBackend; `specdec.serving.inprocess.InProcessBackend` implements the hooks over a
Speculator in process. The draft budget is the verifier's: it decides it every step
(specdec.engine.speculator) and says it in its reply.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import AsyncIterator, Callable, Sequence

from torch import Tensor

from specdec.config import SamplingParams
from specdec.engine.speculator import StepResult
from specdec.engine.logits_processing import TokenLogProbs
from specdec.engine.tree import DraftTree


@dataclass
class LoopUpdate:
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None
    verified: bool = False  # False for the prefill's first token
    draft_depth: int = 0  # of the tree verified in this step (0 for plain decoding)
    draft_tokens: int = 0
    accepted: int = 0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    step_seconds: float = 0.0  # wall time of the step as the loop saw it (calls included)
    log_probs: TokenLogProbs | None = None  # of token_ids, when the request asked for them
    error: str | None = None  # the sequence ended with this error after token_ids (the verifier's message)


async def coalesced(updates: AsyncIterator[LoopUpdate], ready: Callable[[], bool]) -> AsyncIterator[list[LoopUpdate]]:
    """A sequence's updates in runs, each heard as one response: the rounds already waiting
    (`ready`) when one arrives go with it, so a response path that fell behind the scheduler
    catches up with one send instead of one per round. The last round ends its run; an error
    comes after the run it interrupted."""
    held: list[LoopUpdate] = []
    try:
        async for update in updates:
            held.append(update)
            if update.finished or not ready():
                run, held = held, []
                yield run
    except Exception:
        if held:
            yield held
        raise


class LoopBackend(ABC):
    """One sequence's view of the verifier (which hosts the co-located drafters) and, for a
    drafter served apart, of the drafter."""

    @abstractmethod
    async def start_target(
        self, prompt_ids: Sequence[int], params: SamplingParams, method: str, num_draft_tokens: int, want_hidden: bool,
    ) -> StepResult:
        """Prefill (num_draft_tokens: the request's most per step); with a co-located
        `method` the verifier also drafts the first tree."""

    @abstractmethod
    async def verify(self, tree: DraftTree | None, want_hidden: bool) -> StepResult:
        """One step: verify `tree` (None: the tree the verifier's co-located drafter made last
        step), then decide the next budget and let that drafter draft the next tree."""

    async def start_drafter(
        self, prompt_ids: Sequence[int], first_token: int, params: SamplingParams, method: str,
        hidden: Tensor | None, num_draft_tokens: int,
    ) -> DraftTree:
        raise NotImplementedError("this backend has no drafter served apart")

    async def draft(self, last: StepResult, num_draft_tokens: int) -> DraftTree:
        raise NotImplementedError("this backend has no drafter served apart")

    @abstractmethod
    async def release(self, target_started: bool, drafter_started: bool) -> None: ...
