"""Speculation metrics, defined once and shared by the engine, the server and the benchmarks.

acceptance rate         = accepted draft tokens / drafted tokens
mean acceptance length  = emitted tokens / target verification steps (bonus or recovered
                          token included, so plain decoding = 1.0)
per-position acceptance = P(the draft's position d is accepted | a draft reached depth d)
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecStats:
    steps: int = 0  # target verification steps (plain decoding steps included)
    drafts: int = 0  # steps that carried a non-empty draft
    draft_tokens: int = 0
    accepted_tokens: int = 0
    forced_accepted_tokens: int = 0  # of accepted_tokens, those a grammar forced (drafted without the drafter)
    cached_prompt_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    emitted_tokens: int = 0
    drafted_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0

    def record_step(self, draft_depth: int, draft_tokens: int, num_accepted: int, num_emitted: int,
                    forced_accepted: int = 0) -> None:
        self.steps += 1
        self.forced_accepted_tokens += forced_accepted
        self.emitted_tokens += num_emitted
        if draft_tokens:
            self.drafts += 1
            self.draft_tokens += draft_tokens
            self.accepted_tokens += num_accepted
        grow = draft_depth - len(self.drafted_per_position)
        if grow > 0:
            self.drafted_per_position += [0] * grow
            self.accepted_per_position += [0] * grow
        for d in range(draft_depth):
            self.drafted_per_position[d] += 1
        for d in range(num_accepted):
            self.accepted_per_position[d] += 1

    def merge(self, other: "SpecStats") -> None:
        for name in ("steps", "drafts", "draft_tokens", "accepted_tokens", "forced_accepted_tokens", "emitted_tokens", "draft_seconds", "verify_seconds",
                     "cached_prompt_tokens"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for d, (n, a) in enumerate(zip(other.drafted_per_position, other.accepted_per_position)):
            if d >= len(self.drafted_per_position):
                self.drafted_per_position.append(0)
                self.accepted_per_position.append(0)
            self.drafted_per_position[d] += n
            self.accepted_per_position[d] += a

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        return self.emitted_tokens / self.steps if self.steps else 0.0

    @property
    def per_position_acceptance(self) -> list[float]:
        return [a / n if n else 0.0 for a, n in zip(self.accepted_per_position, self.drafted_per_position)]

    def as_dict(self) -> dict:
        return {
            "steps": self.steps,
            "drafts": self.drafts,
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            "forced_accepted_tokens": self.forced_accepted_tokens,
            "emitted_tokens": self.emitted_tokens,
            "cached_prompt_tokens": self.cached_prompt_tokens,
            "acceptance_rate": self.acceptance_rate,
            "mean_acceptance_length": self.mean_acceptance_length,
            "per_position_acceptance": self.per_position_acceptance,
            "draft_seconds": self.draft_seconds,
            "verify_seconds": self.verify_seconds,
        }
