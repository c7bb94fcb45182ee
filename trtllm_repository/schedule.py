"""draft_len_schedule in both meanings, translated (pure; tested both ways on the CPU).

Ours (specdec.config.SpeculativeConfig): {bound: n} caps a step at n draft tokens when the
batch size is <= bound (the smallest such bound wins); above every bound, 0.
TensorRT-LLM's (DecodingBaseConfig.draft_len_schedule, PyTorch backend): {threshold: n}
drafts n tokens when the batch size is >= threshold (the largest such threshold wins); it
must contain threshold 1, schedule[1] must equal max_draft_len and no n may exceed it.

  ours {2: 5, 4: 1}, max_draft_len 5   <->   TensorRT-LLM {1: 5, 3: 1, 5: 0}
"""
from __future__ import annotations

from typing import Mapping

from specdec.errors import ConfigError

FIELD = "draft_len_schedule"


def ours_draft_len(schedule: Mapping[int, int], max_draft_len: int, batch_size: int) -> int:
    """Draft tokens per step at this batch size under our meaning (as SpeculativeConfig.scheduled_draft_tokens)."""
    caps = [n for bound, n in sorted(schedule.items()) if batch_size <= bound]
    return min(max_draft_len, caps[0]) if caps else 0


def trtllm_draft_len(schedule: Mapping[int, int], batch_size: int) -> int:
    """Draft tokens per step at this batch size under TensorRT-LLM's meaning."""
    return [n for threshold, n in sorted(schedule.items()) if threshold <= batch_size][-1]


def check_trtllm_schedule(schedule: Mapping[int, int], max_draft_len: int) -> None:
    """TensorRT-LLM's own rules for the field, so a file it would refuse is refused here first."""
    if 1 not in schedule:
        raise ConfigError(FIELD, f"TensorRT-LLM's schedule must contain batch size 1, got {dict(schedule)}")
    if schedule[1] != max_draft_len:
        raise ConfigError(FIELD, f"TensorRT-LLM needs schedule[1] == max_draft_len ({max_draft_len}), got {schedule[1]}")
    for threshold, n in schedule.items():
        if threshold < 1 or not 0 <= n <= max_draft_len:
            raise ConfigError(FIELD, f"entries must be batch size >= 1 -> 0..max_draft_len ({max_draft_len}), got {threshold}: {n}")


def to_trtllm(schedule: Mapping[int, int], max_draft_len: int) -> dict[int, int]:
    """Our schedule -> TensorRT-LLM's, drafting the same at every batch size. Refused (naming
    the field) when batch size 1 would draft less than max_draft_len: TensorRT-LLM cannot
    say that (lower max_draft_len instead)."""
    first = min(schedule[min(schedule)], max_draft_len)
    if first != max_draft_len:
        raise ConfigError(FIELD, f"drafts {first} at batch size 1, below max_draft_len ({max_draft_len}); TensorRT-LLM "
                                 f"drafts max_draft_len there: set max_draft_len to {first}")
    out: dict[int, int] = {}
    start = 1
    for bound, n in sorted(schedule.items()):
        n = min(n, max_draft_len)
        if start <= bound and (not out or out[max(out)] != n):  # a new step in the staircase
            out[start] = n
        start = max(start, bound + 1)
    if out[max(out)] != 0:
        out[start] = 0  # above our largest bound nothing is drafted
    check_trtllm_schedule(out, max_draft_len)
    return out


def from_trtllm(schedule: Mapping[int, int], max_draft_len: int, max_batch_size: int) -> dict[int, int]:
    """TensorRT-LLM's schedule -> ours, drafting the same at every batch size up to
    max_batch_size (ours has no open-ended last step; no batch is larger)."""
    schedule = {int(k): int(v) for k, v in schedule.items()}  # YAML / JSON may give string keys
    check_trtllm_schedule(schedule, max_draft_len)
    thresholds = sorted(schedule)
    out = {nxt - 1: schedule[this] for this, nxt in zip(thresholds, thresholds[1:])}
    last = thresholds[-1]
    if schedule[last] and last <= max_batch_size:
        out[max_batch_size] = schedule[last]
    return {bound: n for bound, n in out.items() if bound >= 1}
