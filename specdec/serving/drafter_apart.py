"""The loop's side of a drafter served apart (the `drafter` model): started on a sequence's
first step, handed what the verifier kept (merged over steps that drafted nothing), kept
alive. The verifier's scheduler holds one per such sequence; run_loop (tests/support/loop_driver.py)
holds one per request.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Sequence

import torch

from specdec.engine.speculator import StepResult
from specdec.engine.tree import DraftTree
from specdec.serving.state import RequestState

if TYPE_CHECKING:
    from specdec.serving.loop import LoopBackend


def merge_replies(replies: Sequence[StepResult]) -> StepResult:
    """Consecutive verifier replies as one: the drafter only needs the committed tokens in
    order and the hidden taps of their positions."""
    if len(replies) == 1:
        return replies[0]
    hidden = [r.hidden for r in replies if r.hidden is not None]
    return StepResult(
        [t for r in replies for t in r.emitted], sum(r.accepted for r in replies),
        hidden=torch.cat(hidden) if len(hidden) == len(replies) else None, num_draft_tokens=replies[-1].num_draft_tokens,
    )


class DrafterApart:
    """The loop's side of a drafter served apart: start it on the first step, hand it what
    the verifier kept (merged over steps that drafted nothing), keep it alive."""

    def __init__(self, backend: "LoopBackend", req: RequestState, keepalive_s: float):
        self.backend, self.req, self.keepalive_s = backend, req, keepalive_s
        self.started = False
        self.unsent: list[StepResult] = []  # verifier replies the drafter has not seen yet
        self.last_call = time.monotonic()

    async def tree(self, reply: StepResult) -> DraftTree:
        """The next tree, of at most the verifier's decided reply.num_draft_tokens."""
        req, tree, n = self.req, None, reply.num_draft_tokens
        if not self.started:
            tree = await self.backend.start_drafter(req.prompt_ids, reply.emitted[0], req.params, req.method, reply.hidden, n)
            self.started = True
            self.last_call = time.monotonic()
        else:
            self.unsent.append(reply)
            if n > 0 or time.monotonic() - self.last_call > self.keepalive_s:
                tree = await self.backend.draft(merge_replies(self.unsent), n)
                self.unsent = []
                self.last_call = time.monotonic()
        return tree or DraftTree()
