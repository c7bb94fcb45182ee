"""Headless Locust runs for the Makefile: one run per decoding mode (the baseline and each
method), same scenario, same server; CSV + HTML per run in --out; stops by itself.

    python -m loadtest.run --scenario concurrency_1 --duration 60s --start-server
    python -m loadtest.run --scenario production --users 16 --duration 120s --url localhost:8001
    python -m loadtest.run ... -- --master --expect-workers 2      (extra args go to locust)
"""
from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
from pathlib import Path
from typing import Iterator, Sequence

from loadtest import scenarios
from specdec_client.envinfo import provenance, write_result
from specdec_client.locust_stats import mode_figures

LOCUSTFILE = Path(__file__).resolve().parent / "locustfile.py"
REPO_ROOT = LOCUSTFILE.parent.parent
DEFAULT_OUT = Path("results/loadtest")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m loadtest.run", description=__doc__.split("\n\n")[0])
    p.add_argument("--scenario", choices=scenarios.SCENARIOS, default="concurrency_1")
    p.add_argument("--duration", default="60s", help="per mode, Locust syntax (90s, 2m)")
    p.add_argument("--users", type=int, default=scenarios.DEFAULT_PRODUCTION_USERS, help="production: peak users")
    p.add_argument("--ramp-steps", type=int, default=scenarios.DEFAULT_RAMP_STEPS)
    p.add_argument("--methods", default="ngram", help="comma-separated methods (':k' = draft tokens), e.g. ngram,ngram-tree:6")
    p.add_argument("--no-baseline", action="store_true", help="skip the baseline run (num_draft_tokens=0)")
    p.add_argument("--url", help="host:port (default localhost:8001 grpc / localhost:8000 http)")
    p.add_argument("--protocol", choices=("grpc", "http"), default="grpc")
    p.add_argument("--model", default="ensemble")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--no-ignore-eos", action="store_true", help="let requests stop at EOS")
    p.add_argument("--dataset", default="sharegpt", choices=("sharegpt", "synthetic", "jsonl"))
    p.add_argument("--dataset-path", default="")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stop-timeout", default="60s", help="let in-flight requests finish when users stop")
    p.add_argument("--start-server", action="store_true", help="start the project's Triton server on free ports")
    p.add_argument("--server-settings", type=Path, help="with --start-server: a specdec.json for it")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("locust_args", nargs="*", help="after --: extra arguments for locust")
    return p


def modes(args) -> list[tuple[str, str, str]]:
    """(name, SPECDEC_METHOD, SPECDEC_NUM_DRAFT_TOKENS) per run."""
    from specdec_client.bench import parse_modes

    out = []
    for mode in parse_modes(args.methods.split(",")):
        if mode.is_baseline and args.no_baseline:
            continue
        k = "" if mode.num_draft_tokens is None else str(mode.num_draft_tokens)
        out.append((mode.name.replace(":", "-k"), mode.method or "", k))
    return out


@contextlib.contextmanager
def target(args) -> Iterator[str]:
    """host:port of the server under test (started here with --start-server)."""
    if not args.start_server:
        yield args.url or f"localhost:{8001 if args.protocol == 'grpc' else 8000}"
        return
    from specdec_client.local_server import local_server

    args.out.mkdir(parents=True, exist_ok=True)
    print(f"starting tritonserver (log {args.out / 'triton.log'}) ...", flush=True)
    with local_server(args.out / "triton.log", args.server_settings) as ep:
        yield ep.grpc if args.protocol == "grpc" else ep.http


def locust_command(args, url: str, mode: tuple[str, str, str]) -> tuple[list[str], dict[str, str]]:
    name, method, k = mode
    prefix = args.out / f"{args.scenario}_{name}"
    cmd = [
        sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless", "--only-summary",
        # The shape ends the test after --specdec-duration and lets in-flight requests finish
        # (--stop-timeout); Locust's own -t would kill them at the deadline instead.
        "--specdec-duration", args.duration, "--stop-timeout", args.stop_timeout,
        "--csv", str(prefix), "--csv-full-history", "--html", f"{prefix}.html",  # history: a row per entry
        "--specdec-scenario", args.scenario, "--specdec-url", url, "--specdec-protocol", args.protocol,
        "--specdec-model", args.model, "--specdec-users", str(args.users), "--specdec-ramp-steps", str(args.ramp_steps),
        "--specdec-max-tokens", str(args.max_tokens), "--specdec-temperature", str(args.temperature),
        "--specdec-ignore-eos", "false" if args.no_ignore_eos else "true",
        "--specdec-dataset", args.dataset, "--specdec-num-prompts", str(args.num_prompts), "--specdec-seed", str(args.seed),
        "--specdec-method", method, "--specdec-num-draft-tokens", k, *args.locust_args,
    ]
    if args.dataset_path:
        cmd += ["--specdec-dataset-path", args.dataset_path]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    return cmd, env


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    scenarios.parse_duration(args.duration)  # fail early on a bad duration
    runs = modes(args)
    args.out.mkdir(parents=True, exist_ok=True)
    started = provenance()
    worst = 0
    with target(args) as url:
        for mode in runs:
            cmd, env = locust_command(args, url, mode)
            print(f"== {args.scenario} / {mode[0]}: locust for {args.duration} against {url}", flush=True)
            worst = max(worst, subprocess.run(cmd, env=env, check=False).returncode)
    print(f"wrote {args.out}/{args.scenario}_<mode>_stats.csv and .html for modes: {', '.join(m[0] for m in runs)}")
    table = side_by_side(args.out, args.scenario, [m[0] for m in runs])
    (args.out / f"{args.scenario}_side_by_side.md").write_text(table + "\n")
    # Locust's CSV and HTML carry no provenance: this record beside them does.
    write_result(args.out / f"{args.scenario}_run.json", {"scenario": args.scenario, "duration": args.duration,
                                                          "modes": [m[0] for m in runs], "exit_code": worst,
                                                          "files": sorted(p.name for p in args.out.glob(f"{args.scenario}_*")
                                                                          if p.suffix != ".json")}, started)
    print(table)
    return worst


def side_by_side(out: Path, scenario: str, names: Sequence[str]) -> str:
    """Every mode of one runner call in one table, each against the baseline's row: request
    count, failures, output tok/s (requests/s x mean output tokens), TTFT, TPOT and E2E p50
    (Locust rounds them: 1 ms below 100 ms, 10 ms to 1 s)."""
    rows, base = [], None
    header = ("| mode | requests | failures | output tok/s | TTFT p50 ms | TPOT p50 ms | E2E p50 ms | tok/s / baseline "
              "| TPOT p50 / baseline |")
    for name in names:
        figures = mode_figures(out, scenario, name)
        if figures is None:
            continue
        base = base or (figures if name == "baseline" else None)
        ratio = ((f"{figures.output_tok_s / base.output_tok_s:.2f}" if base and base.output_tok_s else ""),
                 (f"{figures.tpot_p50_ms / base.tpot_p50_ms:.2f}" if base and base.tpot_p50_ms else ""))
        rows.append(f"| {name} | {figures.requests} | {figures.failures} | {figures.output_tok_s:.1f} | "
                    f"{figures.ttft_p50_ms:.0f} | {figures.tpot_p50_ms:.0f} | {figures.e2e_p50_ms:.0f} | {ratio[0]} | {ratio[1]} |")
    return "\n".join([f"{scenario}: every mode against the baseline (same server, same prompts)", "", header,
                      "|" + "---|" * 9, *rows])


if __name__ == "__main__":
    sys.exit(main())
