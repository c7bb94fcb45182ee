"""A per-request speculative loop over LoopBackend hooks, for tests: it drives the same
DrafterApart and InProcessBackend the served engine loop uses, one request at a time (the
served path batches every sequence in specdec/serving/engine_loop.py instead). It owns the
request-level rules (stop conditions, text, stats) through RequestState and always releases
what it started, whatever happens (finish, error, cancellation)."""
from __future__ import annotations

import time
from typing import AsyncIterator, Callable

from specdec.serving.drafter_apart import DrafterApart
from specdec.serving.loop import LoopBackend, LoopUpdate
from specdec.serving.state import FINISH_CANCELLED, RequestState


def _kept(log_probs: list[float] | None, tokens: list[int]) -> list[float] | None:
    return None if log_probs is None else log_probs[: len(tokens)]


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
