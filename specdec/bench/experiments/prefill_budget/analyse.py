"""The prefill budget's A/B (run.sh): per tree and workload, TTFT (the first wave of each
block apart), each stream's longest gap against its own median, and output tok/s, from the
client's requests.jsonl. Writes results/bench/prefill-budget/summary.json, or the folder given's
(with the provenance of the tree that analysed it; each run's summary.json records its own)."""
from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from specdec_client.envinfo import provenance, write_result
from specdec_client.metrics import percentile

ROOT = Path("results/bench/prefill-budget")


def stream_gaps(request: dict) -> tuple[float, float] | None:
    """(median gap, longest gap) between a stream's responses, in ms; None with too few."""
    gaps = [b - a for a, b in zip(request["chunks"], request["chunks"][1:])]
    return (statistics.median(gaps) * 1e3, max(gaps) * 1e3) if len(gaps) >= 4 else None


def analyse(run: Path) -> dict:
    requests = [json.loads(line) for line in (run / "requests.jsonl").read_text().splitlines() if line.strip()]
    summary = json.loads((run / "summary.json").read_text())
    out = {}
    for mode in dict.fromkeys(r["mode"] for r in requests):
        mine = [r for r in requests if r["mode"] == mode and not r.get("error")]
        ttft = [(r["chunks"][0] - r["send"]) * 1e3 for r in mine if r["chunks"]]
        first_wave = []
        concurrency = mine[0]["concurrency"]
        for block in {(r["repeat"], r["block"]) for r in mine}:
            wave = sorted((r for r in mine if (r["repeat"], r["block"]) == block), key=lambda r: r["send"])[:concurrency]
            first_wave += [(r["chunks"][0] - r["send"]) * 1e3 for r in wave if r["chunks"]]
        ratios = [longest / median for median, longest in filter(None, map(stream_gaps, mine)) if median > 0]
        run_summary = next(x for x in summary["runs"] if x["mode"] == mode)
        out[mode] = {
            "requests": len(mine), "concurrency": concurrency,
            "output_tok_s": run_summary["output_tok_s"],
            "ttft_p50_ms": statistics.median(ttft), "ttft_p90_ms": percentile(ttft, 90),
            "first_wave_ttft_p50_ms": statistics.median(first_wave) if first_wave else None,
            "itl_p50_ms": run_summary["itl_ms"]["p50"],
            "gap_over_median_p50": statistics.median(ratios) if ratios else None,
            "gap_over_median_max": max(ratios) if ratios else None,
            "streams_over_3x": sum(r > 3 for r in ratios), "streams": len(ratios),
        }
    return out


def main() -> None:
    started = provenance()
    root = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT
    runs = {}
    for run in sorted(p for p in root.iterdir() if (p / "requests.jsonl").exists()):
        runs[run.name] = analyse(run)
    write_result(str(root / "summary.json"), {"runs": runs, "command": "specdec/bench/experiments/prefill_budget/run.sh"}, started)
    for name, modes in runs.items():
        for mode, r in modes.items():
            print(f"{name:28s} {mode:14s} tok/s {r['output_tok_s']:6.1f}  TTFT p50 {r['ttft_p50_ms']:6.0f} first wave "
                  f"{r['first_wave_ttft_p50_ms'] or 0:6.0f}  gap/median p50 {r['gap_over_median_p50'] or 0:4.2f} max "
                  f"{r['gap_over_median_max'] or 0:5.2f}  over 3x {r['streams_over_3x']}/{r['streams']}")


if __name__ == "__main__":
    sys.exit(main())
