"""Requests through the in-process engine in a closed loop: the one driver every in-process
benchmark uses (bench-engine, bench-formats, bench-draft, bench-drafters, bench-load, and
gpu_check on a lent GPU, where nothing of the client package is installed: this module
imports only the engine).
"""
from __future__ import annotations

import itertools
import statistics
import time
from typing import Iterator

import torch

from specdec.config import SamplingParams
from specdec.serving.spec_engine import SpecEngine


def padded(counts: list[int]) -> Iterator[int]:
    """Counts per draft position, then zeros (positions no earlier run reached)."""
    return itertools.chain(counts, itertools.repeat(0))


def run_requests(engine: SpecEngine, prompts: list[list[int]], params: SamplingParams, method: str, k: int | None,
                 concurrency: int, token_ids: dict[str, list[int]] | None = None, limit_s: float | None = None) -> dict:
    """Closed loop at `concurrency` (k None: the method's configured budget); returns
    aggregate and per-user throughput and acceptance. `token_ids`, if given, receives each
    request's token ids (by request id); past `limit_s` it raises (a stuck engine must not
    hold a short GPU lease; the caller builds a fresh one)."""
    todo = list(enumerate(prompts))
    added, first, last, count = {}, {}, {}, {}
    stats_before = engine.stats.as_dict()
    drafted_before = list(engine.stats.drafted_per_position)
    accepted_before = list(engine.stats.accepted_per_position)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    while todo or engine.has_work():
        if limit_s is not None and time.perf_counter() - t0 > limit_s:
            raise TimeoutError(f"{method} at c={concurrency}: not done after {limit_s:.0f} s")
        while todo and len(engine.sequences) < concurrency:
            i, p = todo.pop(0)
            engine.add_request(str(i), p, params, method, k)
            added[str(i)] = time.perf_counter()
        for out in engine.step():
            now = time.perf_counter()
            if out.new_token_ids:
                first.setdefault(out.request_id, now)
                last[out.request_id] = now
                count[out.request_id] = count.get(out.request_id, 0) + len(out.new_token_ids)
                if token_ids is not None:
                    token_ids.setdefault(out.request_id, []).extend(out.new_token_ids)
    wall = time.perf_counter() - t0
    per_user = [(count[r] - 1) / (last[r] - first[r]) for r in count if count[r] > 1 and last[r] > first[r]]
    after = engine.stats
    steps = after.steps - stats_before["steps"]
    drafted = after.draft_tokens - stats_before["draft_tokens"]
    return {
        "output_tok_s": sum(count.values()) / wall,
        "per_user_tok_s": statistics.mean(per_user) if per_user else 0.0,
        "mean_acceptance_length": (after.emitted_tokens - stats_before["emitted_tokens"]) / steps if steps else 0.0,
        "acceptance_rate": (after.accepted_tokens - stats_before["accepted_tokens"]) / drafted if drafted else 0.0,
        "per_position_acceptance": [  # this run only (the engine's counters are running totals)
            (a - a0) / max(1, n - n0)
            for n, a, n0, a0 in zip(after.drafted_per_position, after.accepted_per_position, padded(drafted_before), padded(accepted_before))
        ],
        "tokens": sum(count.values()),
        # From joining the engine (a free sequence slot) to the first token, as a client would see it.
        "ttft_p50_ms": 1e3 * statistics.median(first[r] - added[r] for r in first) if first else 0.0,
        # Per sequence step (a verification of one sequence; at c=1 an engine step): drafting and verifying time.
        "draft_ms_per_seq_step": 1e3 * (after.draft_seconds - stats_before["draft_seconds"]) / steps if steps else 0.0,
        "verify_ms_per_seq_step": 1e3 * (after.verify_seconds - stats_before["verify_seconds"]) / steps if steps else 0.0,
    }
