"""The timings one streamed request records in Locust's statistics besides the request
itself, as a pure function (no Locust import, unit-tested). Definitions: DESIGN.md,
"Vocabulary and metric definitions", and specdec_client.metrics.

| Type          | value, ms                                         | samples                          |
|---------------|---------------------------------------------------|----------------------------------|
| `TTFT`        | first text chunk - send                           | one per request                  |
| `ITL`         | (E2E - TTFT) / (output tokens - 1), per token     | one per request with >= 2 tokens |
| `TPOT`        | the same value as ITL, under its other name       | one per request with >= 2 tokens |
| `inter-chunk` | gap between successive streamed chunks            | one per gap, pooled              |

A speculative step streams 1 + accepted tokens in one chunk, so inter-chunk latency is not
a per-token latency; ITL is. None of these are requests: the locustfile logs them into
entries of their own, outside Locust's Aggregated row.
"""
from __future__ import annotations

from dataclasses import dataclass

from specdec_client import metrics as M

TTFT, ITL, TPOT, INTER_CHUNK = "TTFT", "ITL", "TPOT", "inter-chunk"
TIMING_TYPES = (TTFT, ITL, TPOT, INTER_CHUNK)
MS = 1000.0


@dataclass(frozen=True)
class Sample:
    type: str  # the Locust entry's Type column; its Name is the mode
    ms: float
    length: int  # the Response Length column: output tokens for ITL and TPOT, else 0


def samples(trace: M.Trace) -> list[Sample]:
    """The timing samples of one successful request."""
    out = []
    first = M.ttft(trace)
    if first is not None:
        out.append(Sample(TTFT, first * MS, 0))
    per_token = M.itl(trace)
    if per_token is not None:
        out += [Sample(ITL, per_token * MS, trace.output_tokens), Sample(TPOT, per_token * MS, trace.output_tokens)]
    out += [Sample(INTER_CHUNK, gap * MS, 0) for gap in M.inter_chunk_latencies(trace)]
    return out
