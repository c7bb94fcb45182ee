"""The per-request speculative decoding loop, written against abstract async hooks.

The Triton `speculative_loop` model implements the hooks with BLS calls to the `drafter`
and `verifier` models; tests implement them in process. The loop owns the request-level
rules (stop conditions, draft budget, text, stats) through RequestState, and always
releases what it started, whatever happens (finish, error, cancellation).
"""
from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import AsyncIterator, Callable, Sequence

import torch
from torch import Tensor

from .config import SamplingParams
from .sequence import FINISH_CANCELLED, RequestState
from .tree import DraftTree


@dataclass
class TargetReply:
    emitted: list[int]  # accepted draft tokens + the bonus/recovered token (prefill: the first token)
    accepted: int  # how many of `emitted` were draft tokens
    hidden: Tensor | None  # hidden taps of the committed positions, when asked for


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


def merge_replies(replies: Sequence[TargetReply]) -> TargetReply:
    """Consecutive verifier replies as one: the drafter only needs the committed tokens in
    order and the hidden taps of their positions."""
    if len(replies) == 1:
        return replies[0]
    hidden = [r.hidden for r in replies if r.hidden is not None]
    return TargetReply(
        [t for r in replies for t in r.emitted], sum(r.accepted for r in replies),
        torch.cat(hidden) if len(hidden) == len(replies) else None,
    )


class LoopBackend(ABC):
    """One sequence's view of the drafter and the verifier."""

    @abstractmethod
    async def start_target(self, prompt_ids: Sequence[int], params: SamplingParams, want_hidden: bool) -> TargetReply: ...

    @abstractmethod
    async def start_drafter(
        self, prompt_ids: Sequence[int], first_token: int, params: SamplingParams, method: str,
        hidden: Tensor | None, budget: int,
    ) -> DraftTree: ...

    @abstractmethod
    async def draft(self, last: TargetReply, budget: int) -> DraftTree: ...

    @abstractmethod
    async def verify(self, tree: DraftTree, want_hidden: bool) -> TargetReply: ...

    @abstractmethod
    async def release(self, target_started: bool, drafter_started: bool) -> None: ...


async def run_loop(
    req: RequestState,
    backend: LoopBackend,
    want_hidden: bool = False,
    is_cancelled: Callable[[], bool] = lambda: False,
    scheduled: Callable[[int], int] = lambda requested: requested,
    drafter_keepalive_s: float = 60.0,
) -> AsyncIterator[LoopUpdate]:
    """Yield one update per verification step until the request finishes. `scheduled` maps
    the request's draft budget to this step's (the method's load controls under the current
    load); in a step it makes 0 the drafter is not called, and what the verifier kept is
    handed to it, merged, at the next drafting step (or, without one for
    `drafter_keepalive_s`, with a budget of 0, so the drafter never drops the sequence as idle)."""
    target_started = drafter_started = False
    unsent: list[TargetReply] = []  # verifier replies the drafter has not seen yet
    last_drafter_call = time.monotonic()
    try:
        reply = await backend.start_target(req.prompt_ids, req.params, want_hidden)
        target_started = True
        tokens, text = req.accept(reply.emitted)
        yield LoopUpdate(tokens, text, req.finished, req.finish_reason)
        tree: DraftTree | None = None
        while not req.finished:
            if is_cancelled():
                req.finish(FINISH_CANCELLED)
                yield LoopUpdate([], "", True, FINISH_CANCELLED)
                return
            t0 = time.perf_counter()
            budget = scheduled(req.draft_budget()) if req.speculative else 0
            tree = None
            if req.speculative and not drafter_started:
                tree = await backend.start_drafter(
                    req.prompt_ids, reply.emitted[0], req.params, req.method, reply.hidden, budget
                )
                drafter_started = True
                last_drafter_call = time.monotonic()
            elif req.speculative:
                unsent.append(reply)
                if budget > 0 or time.monotonic() - last_drafter_call > drafter_keepalive_s:
                    tree = await backend.draft(merge_replies(unsent), budget)
                    unsent = []
                    last_drafter_call = time.monotonic()
            t1 = time.perf_counter()
            tree = (tree or DraftTree()).truncated(budget)
            reply = await backend.verify(tree, want_hidden)
            t2 = time.perf_counter()
            req.stats.draft_seconds += t1 - t0
            req.stats.verify_seconds += t2 - t1
            depth = max(tree.depths(), default=0)
            req.stats.record_step(depth, len(tree), reply.accepted, len(reply.emitted))
            tokens, text = req.accept(reply.emitted)
            yield LoopUpdate(
                tokens, text, req.finished, req.finish_reason, True, depth, len(tree), reply.accepted, t1 - t0, t2 - t1
            )
    finally:
        await backend.release(target_started, drafter_started)
