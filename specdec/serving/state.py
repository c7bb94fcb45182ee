"""A request's state in the loop (RequestState: what was emitted, when to stop, text,
stats). Shared by the in-process engine and the Triton loop so both apply exactly the same
rules."""
from __future__ import annotations

from dataclasses import dataclass, field

from specdec.config import SamplingParams
from specdec.engine.logits_processing import TokenLogProbs
from specdec.serving.detok import IncrementalDetokenizer
from specdec.serving.stats import SpecStats
from specdec.engine.sequences import room_left

FINISH_EOS = "eos"
FINISH_LENGTH = "length"
FINISH_STOP = "stop"
FINISH_CANCELLED = "cancelled"


@dataclass
class RequestState:
    """The request loop's state: what has been emitted and when to stop."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    method: str
    num_draft_tokens: int  # the most per step (the verifier decides each step's); 0 = plain decoding (the baseline)
    max_seq_len: int
    eos_token_ids: frozenset[int]
    detok: IncrementalDetokenizer | None = None
    output_ids: list[int] = field(default_factory=list)
    log_probs: TokenLogProbs = field(default_factory=TokenLogProbs)  # of output_ids, with return_log_probs / top_logprobs
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

    def accept(self, tokens: list[int], log_probs: TokenLogProbs | None = None) -> tuple[list[int], str]:
        """Apply EOS / stop strings / max_tokens / context to newly emitted tokens, one token
        at a time in the order plain decoding meets them, so a step's accepted run is cut
        exactly where the baseline stops (and the log probs of the tokens kept are kept).
        Returns (tokens kept, final text delta); sets finished/finish_reason."""
        kept: list[int] = []
        reason, room = None, self.room
        for tok in tokens:
            # a grammar's end ends the request even with ignore_eos (nothing may follow it)
            if tok in self.eos_token_ids and (not self.params.ignore_eos or self.params.guided):
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
