"""Locust scenarios: the stage plans (pure), then a short headless run against the real
server through the Makefile's runner (Locust runs in a subprocess: it monkey-patches
the standard library with gevent, which must not happen inside pytest)."""
from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # `loadtest` is a folder of the repository, not an installed package

from loadtest import run, scenarios, timings  # noqa: E402
from specdec_client import metrics as M  # noqa: E402


def test_concurrency_1_is_one_user_until_the_end():
    stages = scenarios.plan("concurrency_1", 30)
    assert scenarios.tick(stages, 0) == (1, 1.0) and scenarios.tick(stages, 29.9) == (1, 1.0)
    assert scenarios.tick(stages, 30) is None


def test_production_ramps_up_holds_and_ramps_down():
    stages = scenarios.plan("production", 80, users=16, ramp_steps=4)
    users = [scenarios.tick(stages, t)[0] for t in range(0, 80, 5)]
    assert users == [4, 8, 12, 16, 16, 16, 16, 16, 16, 16, 16, 16, 12, 12, 8, 4]
    assert scenarios.tick(stages, 80) is None
    assert [s.users for s in scenarios.plan("production", 8, users=2)] == [1, 2, 2, 1]
    assert [s.users for s in scenarios.plan("production", 8, users=1)] == [1, 1]


def test_scenario_options_are_checked():
    with pytest.raises(ValueError, match="scenario"):
        scenarios.plan("spike", 10)
    with pytest.raises(ValueError, match="duration"):
        scenarios.parse_duration("ten minutes")
    assert scenarios.parse_duration("1m30s") == 90 and scenarios.parse_duration("45") == 45


def test_modes_name_the_stats_entries():
    assert scenarios.mode("ngram", "") == ("ngram", "ngram", None)
    assert scenarios.mode("ngram", "0") == ("baseline", "ngram", 0)
    assert scenarios.mode("", "4") == ("default:4", None, 4)
    with pytest.raises(ValueError, match="num_draft_tokens"):
        scenarios.mode("ngram", "-1")


def test_timings_are_per_token_itl_and_pooled_chunk_gaps():
    """Chunks carrying 1, 3 and 1 tokens: one TTFT, one ITL (= TPOT) per token of the
    request, and one inter-chunk sample per gap."""
    trace = M.Trace(send=0.0, chunks=[0.2, 0.3, 0.5], end=0.5, output_tokens=5)
    got = [(s.type, round(s.ms, 6), s.length) for s in timings.samples(trace)]
    assert got == [("TTFT", 200.0, 0), ("ITL", 75.0, 5), ("TPOT", 75.0, 5), ("inter-chunk", 100.0, 0),
                   ("inter-chunk", 200.0, 0)]
    one = M.Trace(send=0.0, chunks=[0.2], end=0.2, output_tokens=1)
    assert [s.type for s in timings.samples(one)] == ["TTFT"]  # no ITL with one token, no gap with one chunk


def test_aggregated_row_counts_real_requests_only(tmp_path):
    """Locust's Aggregated row (its CSV, and a master's total from a worker's report) counts
    one per request, failures included; the timings have rows of their own."""
    requests = 8  # 2 of them fail (every 4th)
    done = subprocess.run([sys.executable, str(REPO / "tests" / "support" / "locust_probe.py"), str(REPO), str(tmp_path), str(requests)],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    probe = json.loads(done.stdout.strip().splitlines()[-1])
    assert probe["sent"] == requests
    rows, ok = probe["stats_csv"], requests - 2
    assert rows["|Aggregated"] == requests == rows["gRPC|ngram"]
    assert rows["TTFT|ngram"] == rows["ITL|ngram"] == rows["TPOT|ngram"] == ok
    assert rows["inter-chunk|ngram"] == 2 * ok  # three chunks, two gaps per request
    assert probe["history_types"] == ["", "ITL", "TPOT", "TTFT", "gRPC", "inter-chunk"]  # full history: every entry
    assert probe["master_total"] == requests and probe["master_failures"] == 2
    assert probe["master_entries"] == {"gRPC|ngram": requests, "TTFT|ngram": ok, "ITL|ngram": ok, "TPOT|ngram": ok,
                                       "inter-chunk|ngram": 2 * ok}


def test_each_worker_gets_its_own_prompt_order():
    """Distributed workers must not all send prompt 0, then 1, ... at the same moments."""
    orders = [scenarios.prompt_order(64, seed=0, worker_index=i) for i in range(8)]
    assert all(sorted(order) == list(range(64)) for order in orders)  # the same prompts, each once
    assert len({tuple(order) for order in orders}) == 8
    assert len({order[0] for order in orders}) > 1  # not all start with the same prompt
    assert scenarios.prompt_order(64, seed=0, worker_index=3) == orders[3]  # reproducible
    assert scenarios.prompt_order(64, seed=1, worker_index=3) != orders[3]
    assert scenarios.prompt_order(5, seed=0, worker_index=None) == [0, 1, 2, 3, 4]  # standalone: the data set's order
    with pytest.raises(ValueError, match="worker_index"):
        scenarios.prompt_order(5, seed=0, worker_index=-1)
    with pytest.raises(ValueError, match="prompt count"):
        scenarios.prompt_order(0, seed=0, worker_index=0)


def test_locust_workers_send_prompts_in_different_orders(tmp_path):
    """A real Locust master and three workers (in a subprocess, over localhost): each worker,
    numbered by the master, orders the prompts its own way; the master keeps the file's order."""
    prompts = [f"prompt {i}" for i in range(32)]
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    done = subprocess.run([sys.executable, str(REPO / "tests" / "support" / "locust_workers_probe.py"), str(REPO), str(data), "3"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    probe = json.loads(done.stdout.strip().splitlines()[-1])
    assert sorted(probe["indexes"]) == [0, 1, 2]
    assert probe["standalone"] == prompts
    for order in probe["orders"]:
        assert sorted(order) == sorted(prompts) and order != prompts
    assert len({tuple(order) for order in probe["orders"]}) == 3


def test_runner_writes_the_full_stats_history():
    args = run.build_parser().parse_args(["--out", "results/x"])
    cmd, _ = run.locust_command(args, "localhost:8001", ("ngram", "ngram", ""))
    assert "--csv-full-history" in cmd and cmd[cmd.index("--csv") + 1] == str(Path("results/x") / "concurrency_1_ngram")


def stats_rows(path: Path) -> dict[tuple[str, str], dict]:
    with path.open() as fh:
        return {(row["Type"], row["Name"]): row for row in csv.DictReader(fh)}


@pytest.mark.server
def test_headless_locust_run_writes_request_and_ttft_rows(triton_server, tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": p}) for p in ("Count from one to ten.", "Name three colors.")) + "\n")
    out = tmp_path / "loadtest"
    cmd = [sys.executable, "-m", "loadtest.run", "--scenario", "production", "--users", "2", "--duration", "6s",
           "--url", triton_server.endpoints.grpc, "--methods", "ngram", "--no-baseline", "--max-tokens", "8",
           "--dataset", "jsonl", "--dataset-path", str(data), "--out", str(out)]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = stats_rows(out / "production_ngram_stats.csv")
    requests = int(rows[("gRPC", "ngram")]["Request Count"])
    assert requests >= 1 and int(rows[("", "Aggregated")]["Request Count"]) == requests
    assert int(rows[("gRPC", "ngram")]["Failure Count"]) == 0
    assert int(rows[("TTFT", "ngram")]["Request Count"]) == requests
    assert float(rows[("TTFT", "ngram")]["Median Response Time"]) > 0
    assert int(rows[("ITL", "ngram")]["Request Count"]) == requests  # 8 tokens each: one ITL per request
    assert ("TPOT", "ngram") in rows and ("inter-chunk", "ngram") in rows
    with (out / "production_ngram_stats_history.csv").open() as fh:
        assert {"gRPC", "TTFT", "ITL"} <= {row["Type"] for row in csv.DictReader(fh)}
    assert (out / "production_ngram.html").stat().st_size > 0


def test_the_runner_prints_every_mode_beside_the_baseline(tmp_path):
    """One runner call's modes in one table, each against the baseline's row."""
    fields = ["Type", "Name", "Request Count", "Failure Count", "Requests/s", "Average Content Size", "50%"]
    for mode, e2e, tpot, rate in (("baseline", 3000, 20, 4.0), ("ngram", 2000, 12, 6.0)):
        with (tmp_path / f"production_{mode}_stats.csv").open("w", newline="") as fh:
            writer = csv.DictWriter(fh, fields)
            writer.writeheader()
            for row_type, median in (("gRPC", e2e), ("TTFT", 100), ("TPOT", tpot)):
                writer.writerow({"Type": row_type, "Name": mode, "Request Count": 10, "Failure Count": 0,
                                 "Requests/s": rate, "Average Content Size": 64 if row_type == "gRPC" else 0, "50%": median})
    table = run.side_by_side(tmp_path, "production", ["baseline", "ngram", "missing"])
    rows = [line for line in table.splitlines() if line.startswith("| baseline") or line.startswith("| ngram")]
    assert rows[0] == "| baseline | 10 | 0 | 256.0 | 100 | 20 | 3000 | 1.00 | 1.00 |"
    assert rows[1] == "| ngram | 10 | 0 | 384.0 | 100 | 12 | 2000 | 1.50 | 0.60 |"
    assert "missing" not in table
