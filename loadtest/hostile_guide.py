"""`make bench-hostile`: does a hostile guide stall the other streams? (issue 43)

A plain greedy control stream decodes through the ensemble while hostile guided requests
arrive one after another: a JSON schema with 400 fields, a deeply nested 27 KB schema, a
regex slow to compile, and a guide past the size limit. The control's gaps between streamed
chunks are recorded: the longest gap is compared with the median gap of the same stream
(the issue's bar: at most 3x), and with a control run alone measured in the same run. Each
hostile request's outcome is recorded too: served, or refused naming the field, and how
long that took (the refusal must come within engine.guide_compile_timeout_s).
"""
from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from pathlib import Path

from specdec_client import GenerateRequest, SpecDecClient
from specdec_client.envinfo import provenance, write_result

CONTROL = GenerateRequest("Write a long story about a lighthouse keeper and the sea.", max_tokens=1000, temperature=0.0,
                          ignore_eos=True, method=None, num_draft_tokens=0)


def hostile_guides() -> dict[str, tuple[str, str]]:
    wide = {"type": "object", "properties": {f"field_{i}": {"type": "string"} for i in range(400)},
            "required": [f"field_{i}" for i in range(400)]}
    nested: dict = {"type": "string"}
    while len(json.dumps(nested)) < 27_000:  # each level doubles it: 27 to 54 KB, 11 levels deep
        nested = {"type": "object", "properties": {"a": nested, "b": {"type": "array", "items": nested}}, "required": ["a"]}
    return {
        "no_guide": (None, None),  # what any request joining costs the control (its prefill)
        "wide_schema_400_fields": ("json_schema", json.dumps(wide)),
        "nested_schema": ("json_schema", json.dumps(nested)),
        "slow_regex": ("regex", "[a-z]{0,4000}(x|y){0,3000}"),
        "over_the_size_limit": ("regex", "a" * (70 * 1024)),
    }


def control_gaps(url: str, results: list[float], arrivals: list[float] | None = None) -> None:
    with SpecDecClient(url) as client:
        last = None
        for chunk in client.stream(CONTROL):
            if last is not None:
                results.append(chunk.time - last)
                if arrivals is not None:
                    arrivals.append(chunk.time)
            last = chunk.time


def summary(gaps: list[float]) -> dict:
    median = statistics.median(gaps)
    return {"chunks": len(gaps) + 1, "median_gap_ms": round(1000 * median, 1), "max_gap_ms": round(1000 * max(gaps), 1),
            "max_over_median": round(max(gaps) / median, 2)}


def run(url: str) -> dict:
    alone: list[float] = []
    control_gaps(url, alone)
    report = {"control_alone": summary(alone), "hostile": {}}
    gaps: list[float] = []
    arrivals: list[float] = []
    origin = time.perf_counter()
    control = threading.Thread(target=control_gaps, args=(url, gaps, arrivals))
    control.start()
    time.sleep(1.0)  # the control is decoding
    with SpecDecClient(url) as client:
        for name, (guide_type, guide) in hostile_guides().items():
            if not control.is_alive():
                break
            time.sleep(0.5)  # apart, so each gap can be told to its request
            t0 = time.perf_counter()
            try:
                text = client.generate(GenerateRequest("Fill in the form.", max_tokens=24, guide_type=guide_type, guide=guide,
                                                       method=None, num_draft_tokens=0)).text
                outcome = {"served": True, "tokens_text_chars": len(text)}
            except Exception as exc:  # noqa: BLE001 - a refusal is an outcome
                outcome = {"served": False, "error": str(exc)[-200:]}
            outcome.update(seconds=round(time.perf_counter() - t0, 2), guide_bytes=len((guide or "").encode()),
                           sent_at_s=round(t0 - origin, 3))
            report["hostile"][name] = outcome
    control.join()
    report["control_with_hostile_guides"] = summary(gaps)
    # the bar, read where it applies: the gaps that ended while a hostile request was in flight
    windows = [(h["sent_at_s"], h["sent_at_s"] + h["seconds"]) for h in report["hostile"].values()]
    in_flight = [g for g, at in zip(gaps, arrivals) if any(a <= at - origin <= b for a, b in windows)]
    if in_flight:
        worst = max(in_flight)
        median = statistics.median(gaps)
        report["control_while_hostile_in_flight"] = {
            "gaps": len(in_flight), "max_gap_ms": round(1000 * worst, 1), "max_over_stream_median": round(worst / median, 2)}
    # the longest gaps, each with when its chunk arrived (the hostile requests' sent_at_s clock)
    report["control_with_hostile_guides"]["longest_gaps"] = [
        {"gap_ms": round(1000 * gaps[i], 1), "arrived_at_s": round(arrivals[i] - origin, 3)}
        for i in sorted(range(len(gaps)), key=lambda i: -gaps[i])[:6]]
    return report


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.hostile_guide", description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default=None, help="a running server's gRPC url (default: start one)")
    p.add_argument("--out", type=Path, default=Path("results/hostile_guide.json"))
    args = p.parse_args(argv)
    started = provenance()
    server = None
    url = args.url
    if url is None:
        from specdec.launcher import DEFAULT_MODEL_REPOSITORY, TritonServer, free_ports

        http, grpc, metrics = free_ports(3)
        server = TritonServer(log_path=args.out.with_suffix(".log"))
        server.start(DEFAULT_MODEL_REPOSITORY, http_port=http, grpc_port=grpc, metrics_port=metrics)
        server.wait_ready(timeout=600)
        url = server.endpoints.grpc
    try:
        with SpecDecClient(url) as client:  # warm: the first request builds the grammar tables
            client.generate(GenerateRequest("Hi", max_tokens=4, guide_type="json", method=None, num_draft_tokens=0))
        report = run(url)
    finally:
        if server is not None:
            server.stop()
    write_result(args.out, report, started, indent=1)
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
