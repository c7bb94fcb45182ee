"""The serving loop's backend in process: the hooks of specdec.serving.loop over a Speculator (and,
for a drafter served apart, a DraftService), the role TensorRT-LLM's MockDecoder plays for
its BLS. Tests drive run_loop (tests/support/loop_driver.py) with it."""
from __future__ import annotations

from typing import Hashable, Sequence

from torch import Tensor

from specdec.config import SamplingParams
from specdec.engine.drafters.service import DraftService
from specdec.engine.sequences import SequenceRecord
from specdec.serving.loop import LoopBackend
from specdec.engine.speculator import Speculator, StartItem, StepItem, StepResult
from specdec.engine.tree import DraftTree


class InProcessBackend(LoopBackend):
    def __init__(self, speculator: Speculator, seq_id: Hashable, drafts: DraftService | None = None):
        self.speculator, self.seq_id, self.drafts = speculator, seq_id, drafts

    async def start_target(self, prompt_ids: Sequence[int], params: SamplingParams, method: str, num_draft_tokens: int,
                           want_hidden: bool) -> StepResult:
        return self.speculator.prefill([StartItem(self.seq_id, prompt_ids, params, method, num_draft_tokens, want_hidden)])[0]

    async def verify(self, tree: DraftTree | None, want_hidden: bool) -> StepResult:
        return self.speculator.step([StepItem(self.seq_id, tree, want_hidden)])[0]

    async def start_drafter(self, prompt_ids: Sequence[int], first_token: int, params: SamplingParams, method: str,
                            hidden: Tensor | None, num_draft_tokens: int) -> DraftTree:
        self.drafts.start(SequenceRecord(self.seq_id, list(prompt_ids), params, method, output_ids=[first_token]), hidden)
        return self.drafts.propose([(self.seq_id, num_draft_tokens)])[0]

    async def draft(self, last: StepResult, num_draft_tokens: int) -> DraftTree:
        self.drafts.advance(self.seq_id, last.emitted, last.accepted, last.hidden)
        return self.drafts.propose([(self.seq_id, num_draft_tokens)])[0]

    async def release(self, target_started: bool, drafter_started: bool) -> None:
        if target_started:
            self.speculator.release(self.seq_id)
        if drafter_started:
            self.drafts.release(self.seq_id)
