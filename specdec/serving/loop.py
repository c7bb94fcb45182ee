"""The per-request speculative decoding loop, written against abstract async hooks.

`specdec.serving.inprocess.InProcessBackend` implements the hooks over a Speculator (tests,
and the in-process CLI). The Triton path no longer runs this loop per request: the verifier's
scheduler (specdec/serving/engine_loop.py) batches every sequence, and uses DrafterApart
(specdec/serving/drafter_apart.py) for drafters served apart. The loop owns the request-level
rules (stop conditions, text, stats) through RequestState, and always releases what it
started, whatever happens (finish, error, cancellation). The draft budget is not the loop's:
the verifier decides it every step (specdec.engine.speculator) and says it in its reply, which
the loop hands to a drafter served apart.
"""
from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import AsyncIterator, Callable, Sequence

from torch import Tensor

from specdec.config import SamplingParams
from specdec.serving.drafter_apart import DrafterApart
from specdec.serving.state import FINISH_CANCELLED, RequestState
from specdec.engine.speculator import StepResult
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
    log_probs: list[float] | None = None  # of token_ids, when the request asked for them
    error: str | None = None  # the sequence ended with this error after token_ids (the verifier's message)


def _kept(log_probs: list[float] | None, tokens: list[int]) -> list[float] | None:
    return None if log_probs is None else log_probs[: len(tokens)]


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


async def run_loop(
    req: RequestState,
    backend: LoopBackend,
    want_hidden: bool = False,
    is_cancelled: Callable[[], bool] = lambda: False,
    drafter_keepalive_s: float = 60.0,
    colocated: bool = True,
) -> AsyncIterator[LoopUpdate]:
    """Yield one update per verification step until the request finishes. With `colocated`
    (the drafter lives beside the target) each step is ONE call: verify, then draft the next
    tree. Otherwise the drafter served apart drafts first, as many tokens as the verifier's
    last reply allows; in a step whose budget is 0 it is not called, and what the verifier
    kept is handed to it, merged, at the next drafting step (or, without one for
    `drafter_keepalive_s`, with a budget of 0, so it never drops the sequence as idle).
    `want_hidden`: the drafter served apart needs the target's hidden taps."""
    separate = DrafterApart(backend, req, drafter_keepalive_s) if req.speculative and not colocated else None
    target_started = False
    try:
        hidden_apart = want_hidden and separate is not None
        reply = await backend.start_target(req.prompt_ids, req.params, req.method, req.num_draft_tokens, hidden_apart)
        target_started = True
        while not reply.emitted:  # a long prompt, or one that met running streams, is prefilled in chunks
            if is_cancelled():
                req.finish(FINISH_CANCELLED)
                yield LoopUpdate([], "", True, FINISH_CANCELLED)
                return
            reply = await backend.verify(None, hidden_apart)
        req.stats.cached_prompt_tokens = reply.cached_tokens
        tokens, text = req.accept(reply.emitted, reply.log_probs)
        yield LoopUpdate(tokens, text, req.finished, req.finish_reason, log_probs=_kept(reply.log_probs, tokens))
        while not req.finished:
            if is_cancelled():
                req.finish(FINISH_CANCELLED)
                yield LoopUpdate([], "", True, FINISH_CANCELLED)
                return
            t0 = time.perf_counter()
            if separate is None:
                reply = await backend.verify(None, False)
                draft_s = reply.draft_seconds
            else:
                tree = await separate.tree(reply)
                draft_s = time.perf_counter() - t0
                reply = await backend.verify(tree, want_hidden)
                reply.draft_depth, reply.draft_tokens = max(tree.depths(), default=0), len(tree)
            step_s = time.perf_counter() - t0
            req.stats.draft_seconds += draft_s
            req.stats.verify_seconds += reply.verify_seconds
            req.stats.record_step(reply.draft_depth, reply.draft_tokens, reply.accepted, len(reply.emitted), reply.forced_accepted)
            tokens, text = req.accept(reply.emitted, reply.log_probs)
            yield LoopUpdate(
                tokens, text, req.finished, req.finish_reason, True, reply.draft_depth, reply.draft_tokens,
                reply.accepted, draft_s, reply.verify_seconds, step_s, _kept(reply.log_probs, tokens),
            )
    finally:
        await backend.release(target_started, separate is not None and separate.started)
