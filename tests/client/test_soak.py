"""The soak's own checks (loadtest/soak.py): a malformed request counts as refused only when
its error names the field, and the report carries the server's peak resident memory. The
pure parts against fake clients and a fake clock; the malformed cases against the real server."""
from __future__ import annotations

import asyncio
import sys
from argparse import Namespace
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # `loadtest` is a folder of the repository, not an installed package

from loadtest import soak  # noqa: E402

from specdec_client import GenerateRequest  # noqa: E402


def field_of(request: GenerateRequest) -> str | None:
    """The field a MALFORMED case breaks in `request` (None: a well-formed request)."""
    for _, fields, field in soak.MALFORMED:
        if all(getattr(request, name) == value for name, value in fields.items()):
            return field
    return None


class FakeClient:
    """Serves well-formed requests; answers malformed ones as `answer` says: "named" (an
    error naming the field), "vague" (an error naming nothing) or "served" (no error)."""

    def __init__(self, answer: str):
        self.answer = answer

    async def generate(self, request):
        field = field_of(request)
        if field is not None and self.answer == "named":
            raise ValueError(f"{field}: out of range")
        if field is not None and self.answer == "vague":
            raise RuntimeError("bad request")

    async def stream(self, request):
        yield "chunk"


class TickingClock:
    """time.monotonic() that advances one second per call: user() runs a fixed number of requests."""

    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        self.now += 1.0
        return self.now


def run_user(answer: str, monkeypatch) -> dict:
    monkeypatch.setattr(soak, "time", TickingClock())
    run = soak.Soak(None, ["Say hi."], ["baseline", "ngram"], Namespace(seed=0, max_tokens=8))
    run._new_minute()
    asyncio.run(run.user(FakeClient(answer), deadline=400.0))
    return run._current


@pytest.mark.parametrize("answer, counter", [("named", None), ("vague", "malformed_field_not_named"),
                                             ("served", "malformed_not_refused")])
def test_a_malformed_request_counts_as_refused_only_when_its_error_names_the_field(monkeypatch, answer, counter):
    bucket = run_user(answer, monkeypatch)
    assert bucket["malformed"] >= len(soak.MALFORMED)  # every case came up at least once
    assert bucket["failures"] == 0 and bucket["normal"] > 0 and bucket["cancelled"] > 0
    for name in ("malformed_not_refused", "malformed_field_not_named"):
        assert bucket[name] == (bucket["malformed"] if name == counter else 0), (name, bucket)


def test_refusal_problem_names_what_is_wrong():
    assert soak.refusal_problem("top_p > 1", "top_p", ValueError("top_p: must be in (0, 1]")) is None
    assert soak.refusal_problem("top_p > 1", "top_p", None) == "not refused: top_p > 1"
    assert "without naming top_p" in soak.refusal_problem("top_p > 1", "top_p", RuntimeError("bad request"))


def test_the_report_carries_the_peak_rss_between_minute_samples(monkeypatch):
    """A spike seen by the every-second watcher, not by the per-minute samples, is the peak."""
    readings = iter([100, 900, 200, 300] + [300] * 10)
    run = soak.Soak(None, ["Say hi."], ["baseline"], Namespace(seed=0, max_tokens=8))
    run.rss = soak.PeakRss(lambda: next(readings) * 2**20)
    monkeypatch.setattr(run, "_active", lambda: 0.0)
    run._new_minute()
    run.minutes.append(run._summarise(run._current))  # samples 100
    assert run.rss.sample() == 900 * 2**20 and run.rss.sample() == 200 * 2**20  # the watcher's samples
    run._new_minute()
    run.minutes.append(run._summarise(run._current))  # samples 300
    report = run._report()
    assert [m["rss_mib"] for m in report["minutes"]] == [100, 300]
    assert report["rss_peak_mib"] == 900 and report["malformed_field_not_named"] == 0


def test_rss_counts_live_processes_and_skips_gone_ones():
    import os
    import subprocess

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # reaped: its pid names no process now
    mine = soak.rss_bytes([os.getpid()])
    assert mine > 10 * 2**20  # this interpreter with pytest loaded
    assert soak.rss_bytes([os.getpid(), gone.pid]) == pytest.approx(mine, rel=0.1)


def test_the_watcher_samples_until_cancelled():
    seen = []

    async def go():
        peak = soak.PeakRss(lambda: seen.append(len(seen)) or len(seen) * 2**20)
        task = asyncio.create_task(peak.watch(every_s=0.0))
        while len(seen) < 5:
            await asyncio.sleep(0)
        task.cancel()
        return peak.peak

    assert asyncio.run(go()) >= 5 * 2**20


@pytest.mark.server
def test_the_soaks_malformed_requests_are_refused_by_the_server_naming_the_field(triton_server):
    """Through the ensemble over HTTP, as the soak sends them (its default protocol)."""
    from specdec_client import AsyncSpecDecClient

    async def answers():
        out = []
        async with AsyncSpecDecClient(triton_server.endpoints.http, "http", timeout_s=120) as client:
            for what, fields, field in soak.MALFORMED:
                error = None
                try:
                    await client.generate(GenerateRequest(**{"prompt": "Say hi.", "max_tokens": 8, **fields}))
                except Exception as exc:  # noqa: BLE001 - what is being checked
                    error = exc
                out.append(soak.refusal_problem(what, field, error))
        return out

    assert asyncio.run(answers()) == [None] * len(soak.MALFORMED)
