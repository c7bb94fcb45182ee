"""summary.json: the benchmark's stable result document (schema: summary.schema.json,
described in client/README.md), built from the raw per-request records."""
from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Sequence

from specdec_client import metrics as M
from specdec_client import server_metrics
from specdec_client.bench import BenchResult, BlockResult, LoadPoint, Mode, RequestRecord

SCHEMA_VERSION = 2  # 2: itl_ms is per token (was chunk gaps, now inter_chunk_latency_ms)
MS = 1000.0


@dataclass
class Run:
    """All blocks of one (mode, load point), merged."""

    mode: Mode
    load: LoadPoint
    blocks: list[BlockResult]

    @property
    def wall_s(self) -> float:
        return sum(b.wall_s for b in self.blocks)

    def metrics(self) -> M.RunMetrics:
        return M.run_metrics([r.trace() for b in self.blocks for r in b.records], self.wall_s)

    def per_position(self) -> list[M.PositionAcceptance] | None:
        if self.mode.is_baseline:
            return []
        if any(b.metrics_delta is None for b in self.blocks):
            return None
        drafted: dict[int, float] = defaultdict(float)
        accepted: dict[int, float] = defaultdict(float)
        for b in self.blocks:
            d, a = server_metrics.per_position_counts(b.metrics_delta, self.mode.metrics_method)
            for p, v in d.items():
                drafted[p] += v
            for p, v in a.items():
                accepted[p] += v
        return M.per_position(drafted, accepted)


def group_runs(result: BenchResult) -> list[Run]:
    runs: dict[tuple[str, LoadPoint], Run] = {}
    for load in result.config.loads:
        for mode in result.config.modes:
            runs[(mode.name, load)] = Run(mode, load, [])
    for block in result.blocks:
        runs[(block.plan.mode.name, block.plan.load)].blocks.append(block)
    return [run for run in runs.values() if run.blocks]


def run_entry(run: Run, slo: M.Slo | None = None) -> dict[str, Any]:
    m = run.metrics()
    positions = run.per_position()
    traces = [r.trace() for b in run.blocks for r in b.records]
    return {
        "goodput": None if slo is None else M.goodput(traces, run.wall_s, slo),
        "mode": run.mode.name, "method": run.mode.method, "num_draft_tokens": run.mode.num_draft_tokens,
        "concurrency": run.load.concurrency, "request_rate": run.load.request_rate, "load": run.load.label,
        "requests": m.requests, "failures": m.failures, "output_tokens": m.output_tokens, "wall_s": m.wall_s,
        "ttft_ms": m.ttft.as_dict(MS), "itl_ms": m.itl.as_dict(MS), "tpot_ms": m.tpot.as_dict(MS),
        "inter_chunk_latency_ms": m.inter_chunk_latency.as_dict(MS),
        "e2e_ms": m.e2e.as_dict(MS), "per_user_tok_s": m.per_user_tok_s.as_dict(),
        "output_tok_s": m.output_tok_s, "requests_per_s": m.requests_per_s,
        "mean_acceptance_length": m.mean_acceptance_length, "acceptance_rate": m.acceptance_rate,
        "accepted_tokens": sum(r.accepted for b in run.blocks for r in b.records),
        "forced_accepted_tokens": sum(r.forced for b in run.blocks for r in b.records),
        "structured": _structured(run),
        "cached_prompt_tokens": sum(r.cached_tokens for b in run.blocks for r in b.records),
        "by_turn": _by_turn(run),
        "per_position_acceptance": None if positions is None else [
            {"position": p.position, "drafted": p.drafted, "accepted": p.accepted, "acceptance": p.acceptance}
            for p in positions
        ],
    }


def _by_turn(run: Run) -> list[dict[str, Any]] | None:
    """Conversations: per turn index, TTFT, TPOT, per-user speed and prompt tokens reused."""
    records = [r for b in run.blocks for r in b.records]
    turns = sorted({r.turn for r in records})
    if turns == [0]:
        return None
    out = []
    for turn in turns:
        mine = [r for r in records if r.turn == turn]
        m = M.run_metrics([r.trace() for r in mine], run.wall_s)
        ok = [r for r in mine if r.error is None]
        out.append({"turn": turn, "requests": m.requests, "failures": m.failures, "ttft_ms": m.ttft.as_dict(MS),
                    "tpot_ms": m.tpot.as_dict(MS), "per_user_tok_s": m.per_user_tok_s.as_dict(),
                    "mean_acceptance_length": m.mean_acceptance_length,
                    "cached_prompt_tokens_mean": sum(r.cached_tokens for r in ok) / len(ok) if ok else 0.0})
    return out


def _structured(run: Run) -> dict[str, int] | None:
    """Requests with a guide (structured output) and how many outputs satisfied it."""
    checked = [r.valid for b in run.blocks for r in b.records if r.valid is not None]
    return {"checked": len(checked), "valid": sum(checked)} if checked else None


def _block_gains(spec: Run, base: Run) -> list[float]:
    """The verdict's gain per paired block (same prompts, same repeat)."""
    base_by_key = {(b.plan.repeat, b.plan.block): b for b in base.blocks}
    open_loop = spec.load.request_rate is not None
    gains = []
    for b in spec.blocks:
        other = base_by_key.get((b.plan.repeat, b.plan.block))
        if other is None:
            continue
        g = M.gain(_block_metrics(b), _block_metrics(other), open_loop)
        if g is not None:
            gains.append(g)
    return gains


def _block_metrics(block: BlockResult) -> M.RunMetrics:
    return M.run_metrics([r.trace() for r in block.records], block.wall_s)


def speedup_entries(runs: list[Run]) -> list[dict[str, Any]]:
    base = {run.load: run for run in runs if run.mode.is_baseline}
    out = []
    for run in runs:
        if run.mode.is_baseline or run.load not in base:
            continue
        spec_m, base_m = run.metrics(), base[run.load].metrics()
        s = M.speedup(spec_m, base_m)
        open_loop = run.load.request_rate is not None
        overall, blocks = M.gain(spec_m, base_m, open_loop), _block_gains(run, base[run.load])
        out.append({
            "mode": run.mode.name, "concurrency": run.load.concurrency, "request_rate": run.load.request_rate,
            "load": run.load.label,
            "output_tok_s_ratio": s.output_tok_s_ratio, "per_user_tok_s_ratio": s.per_user_tok_s_ratio,
            "ttft_p50_ratio": s.ttft_p50_ratio, "itl_p50_ratio": s.itl_p50_ratio,
            "tpot_p50_ratio": s.tpot_p50_ratio, "e2e_p50_ratio": s.e2e_p50_ratio,
            "inter_chunk_latency_p50_ratio": s.inter_chunk_latency_p50_ratio,
            "verdict_metric": M.OPEN_LOOP_METRIC if open_loop else M.CLOSED_LOOP_METRIC,
            "verdict_gain": overall, "block_gains": blocks, "verdict": M.verdict(overall, blocks),
        })
    return out


def identical_outputs(records: Sequence[RequestRecord], reference: str, modes: Sequence[str]) -> dict[str, list[int]]:
    """Per mode: [compared, identical] outputs against `reference`'s for the same prompt, load
    point, repeat and turn (both successful)."""
    def key(r: RequestRecord) -> tuple:
        return r.concurrency, r.request_rate, r.repeat, r.prompt_index, r.turn

    base = {key(r): r.text for r in records if r.mode == reference and r.error is None}
    counts: dict[str, list[int]] = {m: [0, 0] for m in modes}
    for r in records:
        if r.mode in counts and r.error is None and key(r) in base:
            counts[r.mode][0] += 1
            counts[r.mode][1] += int(r.text == base[key(r)])
    return counts


def lossless(result: BenchResult) -> dict[str, Any]:
    """Greedy runs: each speculative output vs the baseline output of the same prompt,
    load point and repeat (both successful)."""
    if not result.config.greedy or not result.config.compare_outputs:  # sampled, or two different models
        return {"greedy": result.config.greedy, "compared": 0, "identical": 0, "by_mode": []}
    counts = identical_outputs(result.records, result.config.modes[0].name, [m.name for m in result.config.modes[1:]])
    by_mode = [{"mode": m, "compared": c, "identical": i} for m, (c, i) in counts.items()]
    return {"greedy": True, "compared": sum(c for c, _ in counts.values()),
            "identical": sum(i for _, i in counts.values()), "by_mode": by_mode}


def sustained_rates(entries: list[dict[str, Any]], attainment: float) -> list[dict[str, Any]]:
    """Per mode over the open-loop rates: the highest rate at which, and at every rate
    below it, at least `attainment` of the requests met the SLO (None: not even the lowest)."""
    out = []
    for mode in dict.fromkeys(e["mode"] for e in entries):
        rates = sorted((e["request_rate"], e["goodput"]["attainment"]) for e in entries
                       if e["mode"] == mode and e["request_rate"] is not None and e["goodput"] is not None)
        if not rates:
            continue
        sustained = None
        for rate, met in rates:
            if met < attainment:
                break
            sustained = rate
        out.append({"mode": mode, "sustained_rate": sustained, "rates": [r for r, _ in rates],
                    "attainment": [a for _, a in rates]})
    return out


def build_summary(result: BenchResult, env: dict[str, Any], dataset: dict[str, Any]) -> dict[str, Any]:
    runs = group_runs(result)
    slo = result.config.slo
    entries = [run_entry(run, slo) for run in runs]
    config = result.config.as_dict()
    config.update(dataset=dataset, started_unix=result.started_unix,
                  sampling={k: config[k] for k in ("temperature", "top_k", "top_p", "seed", "max_tokens", "ignore_eos", "stop")})
    env = dict(env, dataset=dataset, sampling=config["sampling"], metrics_scrape_error=result.metrics_error)
    return {
        "schema_version": SCHEMA_VERSION,
        "env": env,
        "config": config,
        "runs": entries,
        "speedup": speedup_entries(runs),
        "lossless": lossless(result),
        "slo": None if slo is None else {
            "ttft_ms": result.config.slo_ttft_ms, "tpot_ms": result.config.slo_tpot_ms,
            "attainment": result.config.slo_attainment,
            "sustained": sustained_rates(entries, result.config.slo_attainment)},
    }


# ---- files -------------------------------------------------------------------------------
def schema() -> dict[str, Any]:
    return json.loads(resources.files("specdec_client").joinpath("summary.schema.json").read_text())


def validate(summary: dict[str, Any]) -> None:
    """Raise jsonschema.ValidationError when `summary` does not match the schema."""
    import jsonschema

    jsonschema.validate(summary, schema())


def write_requests(result: BenchResult, path: Path) -> None:
    with path.open("w", encoding="utf-8") as fh:
        for record in result.records:
            fh.write(json.dumps(record.as_json(result.t0)) + "\n")


def read_requests(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def write_json(data: Any, path: Path) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=False, default=str) + "\n")

