"""Service metrics of a benchmark, as pure functions over request timestamp traces.

Definitions (DESIGN.md, "Vocabulary and metric definitions"); all times in seconds here,
the summary converts to milliseconds:

- TTFT = first text chunk time - request send time.
- ITL (inter-token latency) = (E2E - TTFT) / (output tokens - 1), per request: aiperf's
  inter_token_latency, the same quantity as TPOT (both names are reported). Its
  distribution is over requests, so it compares like with like across modes.
- inter-chunk latency = gaps between successive text chunks, pooled over all requests of
  a run (aiperf's inter_chunk_latency). A speculative step streams accepted + bonus tokens
  in one chunk, so chunk gaps grow with the acceptance length and are not a per-token
  latency: never compare them with another mode's ITL.
- per-user throughput = output tokens / (E2E - TTFT), per request.
  A request with <= 1 output token (or E2E == TTFT) has neither ITL/TPOT nor per-user
  throughput: the quantity is undefined, so it is left out of those distributions (it
  still counts in `requests`, TTFT, E2E and the aggregate throughput).
- aggregate throughput = all output tokens / benchmark wall time of the run.
- mean acceptance length = tokens emitted per target verification step, bonus or
  recovered token included (plain decoding = 1.0). The first output token comes from
  the prefill, not from a verification step, so per run it is
  sum(output_tokens - 1) / sum(verification_steps), pooled over requests (a token-weighted
  mean, not a mean of per-request ratios); undefined when no step ran.
- acceptance rate = accepted draft tokens / draft tokens (undefined with no drafts).
- per-position acceptance = P(position i of a draft is accepted) = accepted_i / drafted_i.

Distributions are reported as mean, p50, p90, p99; percentiles interpolate linearly
between closest ranks (numpy's default "linear" method).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

import numpy as np

PERCENTILES = (50, 90, 99)


@dataclass(frozen=True)
class Trace:
    """One request as the client saw it (perf_counter seconds) plus the server's counters."""

    send: float
    chunks: Sequence[float]  # arrival time of each chunk that carried text
    end: float
    output_tokens: int
    verification_steps: int = 0
    accepted: int = 0  # accepted draft tokens
    drafted: int = 0  # draft tokens
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass(frozen=True)
class Stats:
    mean: float | None
    p50: float | None
    p90: float | None
    p99: float | None

    def as_dict(self, scale: float = 1.0) -> dict[str, float | None]:
        return {k: (None if v is None else v * scale) for k, v in
                (("mean", self.mean), ("p50", self.p50), ("p90", self.p90), ("p99", self.p99))}


# ---- per request -------------------------------------------------------------------------
def ttft(t: Trace) -> float | None:
    return t.chunks[0] - t.send if t.chunks else None


def e2e(t: Trace) -> float:
    return t.end - t.send


def inter_chunk_latencies(t: Trace) -> list[float]:
    """Gaps between successive text chunks; a chunk may carry several tokens."""
    return [b - a for a, b in zip(t.chunks, t.chunks[1:])]


def _decode_time(t: Trace) -> float | None:
    first = ttft(t)
    if first is None or t.output_tokens <= 1:
        return None
    span = e2e(t) - first
    return span if span > 0 else None


def itl(t: Trace) -> float | None:
    """Inter-token latency: (E2E - TTFT) / (output tokens - 1), per token of this request."""
    span = _decode_time(t)
    return None if span is None else span / (t.output_tokens - 1)


tpot = itl  # time per output token: the same quantity under its other usual name


def per_user_tok_s(t: Trace) -> float | None:
    span = _decode_time(t)
    return None if span is None else t.output_tokens / span


@dataclass(frozen=True)
class Slo:
    """A service-level objective per request: TTFT and TPOT limits (None: no limit). A
    request meets it when it succeeded and is within every limit given (a one-token answer
    has no TPOT and is judged by its TTFT alone)."""

    ttft_s: float | None = None
    tpot_s: float | None = None

    def met(self, t: Trace) -> bool:
        if not t.ok:
            return False
        first, per_token = ttft(t), tpot(t)
        if self.ttft_s is not None and (first is None or first > self.ttft_s):
            return False
        return self.tpot_s is None or per_token is None or per_token <= self.tpot_s


def goodput(traces: Sequence[Trace], wall_s: float, slo: Slo) -> dict[str, float]:
    """DistServe's goodput: requests (and their output tokens) per second that met the SLO,
    and the fraction of requests that met it (attainment)."""
    good = [t for t in traces if slo.met(t)]
    return {"requests_per_s": len(good) / wall_s if wall_s > 0 else 0.0,
            "output_tok_s": sum(t.output_tokens for t in good) / wall_s if wall_s > 0 else 0.0,
            "attainment": len(good) / len(traces) if traces else 0.0}


# ---- distributions -----------------------------------------------------------------------
def percentile(values: Sequence[float], q: float) -> float:
    """q-th percentile (0..100), linear interpolation between closest ranks."""
    if not values:
        raise ValueError("percentile of an empty sequence")
    if not 0 <= q <= 100:
        raise ValueError(f"q must be in [0, 100], got {q}")
    return float(np.percentile(values, q))  # numpy's default method is this interpolation


def summarize(values: Iterable[float | None]) -> Stats:
    """mean/p50/p90/p99 of the defined values; all None when there are none."""
    data = [v for v in values if v is not None]
    if not data:
        return Stats(None, None, None, None)
    return Stats(sum(data) / len(data), *(percentile(data, q) for q in PERCENTILES))


# ---- per run -----------------------------------------------------------------------------
def acceptance_length(output_tokens: int, verification_steps: int) -> float | None:
    """Tokens per verification step; the first token is the prefill's (see module doc)."""
    if verification_steps <= 0:
        return None
    return (output_tokens - 1) / verification_steps


def pooled_acceptance_length(traces: Iterable[Trace]) -> float | None:
    done = [t for t in traces if t.ok and t.output_tokens > 0]
    steps = sum(t.verification_steps for t in done)
    if steps <= 0:
        return None
    return sum(t.output_tokens - 1 for t in done) / steps


def acceptance_rate(accepted: int, drafted: int) -> float | None:
    return accepted / drafted if drafted > 0 else None


def aggregate_tok_s(traces: Iterable[Trace], wall_s: float) -> float | None:
    if wall_s <= 0:
        return None
    return sum(t.output_tokens for t in traces if t.ok) / wall_s


@dataclass(frozen=True)
class RunMetrics:
    requests: int
    failures: int
    output_tokens: int
    wall_s: float
    ttft: Stats
    itl: Stats  # per request, per token
    tpot: Stats  # the same values as itl
    inter_chunk_latency: Stats  # pooled chunk gaps
    e2e: Stats
    per_user_tok_s: Stats
    output_tok_s: float | None
    requests_per_s: float | None
    mean_acceptance_length: float | None
    acceptance_rate: float | None


def run_metrics(traces: Sequence[Trace], wall_s: float) -> RunMetrics:
    """All metrics of one (mode, load) run; latency metrics over successful requests."""
    ok = [t for t in traces if t.ok]
    return RunMetrics(
        requests=len(traces),
        failures=len(traces) - len(ok),
        output_tokens=sum(t.output_tokens for t in ok),
        wall_s=wall_s,
        ttft=summarize(ttft(t) for t in ok),
        itl=summarize(itl(t) for t in ok),
        tpot=summarize(tpot(t) for t in ok),
        inter_chunk_latency=summarize(gap for t in ok for gap in inter_chunk_latencies(t)),
        e2e=summarize(e2e(t) for t in ok),
        per_user_tok_s=summarize(per_user_tok_s(t) for t in ok),
        output_tok_s=aggregate_tok_s(ok, wall_s),
        requests_per_s=len(ok) / wall_s if wall_s > 0 else None,
        mean_acceptance_length=pooled_acceptance_length(ok),
        acceptance_rate=acceptance_rate(sum(t.accepted for t in ok), sum(t.drafted for t in ok)),
    )


# ---- per-position acceptance (from the server's Prometheus counters) ---------------------
@dataclass(frozen=True)
class PositionAcceptance:
    position: int
    drafted: int
    accepted: int

    @property
    def acceptance(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None


def per_position(drafted: Mapping[int, float], accepted: Mapping[int, float]) -> list[PositionAcceptance]:
    """Join per-position counter deltas (position -> count) into a sorted list."""
    rows = [PositionAcceptance(p, int(round(drafted.get(p, 0))), int(round(accepted.get(p, 0))))
            for p in sorted(set(drafted) | set(accepted))]
    return [r for r in rows if r.drafted or r.accepted]  # series of other runs: no change here


# ---- speculative mode vs the matched baseline --------------------------------------------
def ratio(value: float | None, base: float | None) -> float | None:
    """value / base; None when either is missing or the base is 0."""
    if value is None or base is None or base == 0:
        return None
    return value / base


@dataclass(frozen=True)
class Speedup:
    output_tok_s_ratio: float | None  # > 1: more aggregate throughput
    per_user_tok_s_ratio: float | None  # ratio of the means; > 1: faster per user
    ttft_p50_ratio: float | None  # < 1: faster first token
    itl_p50_ratio: float | None  # < 1: less time per output token
    tpot_p50_ratio: float | None  # the same as itl_p50_ratio
    inter_chunk_latency_p50_ratio: float | None  # > 1 is expected when chunks carry more tokens
    e2e_p50_ratio: float | None  # < 1: requests finish sooner


def speedup(spec: RunMetrics, base: RunMetrics) -> Speedup:
    return Speedup(
        output_tok_s_ratio=ratio(spec.output_tok_s, base.output_tok_s),
        per_user_tok_s_ratio=ratio(spec.per_user_tok_s.mean, base.per_user_tok_s.mean),
        ttft_p50_ratio=ratio(spec.ttft.p50, base.ttft.p50),
        itl_p50_ratio=ratio(spec.itl.p50, base.itl.p50),
        tpot_p50_ratio=ratio(spec.tpot.p50, base.tpot.p50),
        inter_chunk_latency_p50_ratio=ratio(spec.inter_chunk_latency.p50, base.inter_chunk_latency.p50),
        e2e_p50_ratio=ratio(spec.e2e.p50, base.e2e.p50),
    )


# The verdict's metric: closed loop (the load is a number of users) -> aggregate output
# throughput; open loop (the load is a fixed arrival rate, so throughput follows the
# offered load) -> how much sooner requests finish (baseline E2E p50 / speculative).
CLOSED_LOOP_METRIC, OPEN_LOOP_METRIC = "output_tok_s", "e2e_p50"


def gain(spec: RunMetrics, base: RunMetrics, open_loop: bool) -> float | None:
    """> 1 favours speculation, on the verdict's metric for this kind of load."""
    if open_loop:
        return ratio(base.e2e.p50, spec.e2e.p50)
    return ratio(spec.output_tok_s, base.output_tok_s)


PAYS, COSTS, UNCLEAR = "pays", "costs", "no clear difference"


def verdict(overall: float | None, block_gains: Sequence[float] = (), margin: float = 0.05) -> str:
    """pays / costs when the gain is outside 1 +- margin and every paired block agrees on
    the sign; otherwise no clear difference (noise)."""
    if overall is None:
        return UNCLEAR
    if overall >= 1 + margin and all(b > 1 for b in block_gains):
        return PAYS
    if overall <= 1 - margin and all(b < 1 for b in block_gains):
        return COSTS
    return UNCLEAR
