"""`specdec bench-aiperf`: an independent cross-check of our benchmark numbers. NVIDIA's
aiperf (genai-perf's successor, its own venv: it pins its own dependencies) drives the
OpenAI front end while `specdec-client bench` drives the ensemble over gRPC, on one server,
with the same ShareGPT prompts, max_tokens (ignore_eos) and concurrencies, for the
baseline and one method -> results/aiperf/ (comparison.json, comparison.md, both tools' raw
output). Nothing here is asserted.

What each tool counts (so differences can be read): aiperf counts output tokens by
re-tokenizing the streamed text with the target's tokenizer and measures from its own HTTP
client (SSE through the front end); our client counts the tokens the server reports and
measures gRPC streams to the ensemble. Both report TTFT, ITL and inter-chunk latency
percentiles and output tokens per second over the run, compared like with like: ITL per
token ((E2E - TTFT) / (output tokens - 1) per request; aiperf's inter_token_latency) and
inter-chunk latency per streamed chunk (pooled gaps; aiperf's inter_chunk_latency, left
empty when its export lacks it). A speculative chunk carries several tokens, so only ITL
is a per-token latency.

So that a difference can be explained and not only shown, every run also records what the
server itself saw (its loop's mean step time and emitted tokens per second, from its own
Prometheus counters, scraped before and after) and how many CPU cores each party used
(server, load generator, OpenAI front end; from psutil), in comparison.json and a second
table of comparison.md.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import psutil

from specdec.bench.bench_openai import PROMPT_TOKENS, served_with_openai
from specdec_client.envinfo import provenance, write_result

BASE_MODEL_ID = "smollm2-135m-instruct"
FIELDS = ("output_tok_s", "ttft_p50_ms", "itl_p50_ms", "inter_chunk_latency_p50_ms")


def aiperf_point(report: dict[str, Any]) -> dict[str, float | None]:
    """The fields we compare, from aiperf's profile_export_aiperf.json."""
    chunks = report.get("inter_chunk_latency")
    return {"output_tok_s": report["output_token_throughput"]["avg"], "ttft_p50_ms": report["time_to_first_token"]["p50"],
            "itl_p50_ms": report["inter_token_latency"]["p50"],
            "inter_chunk_latency_p50_ms": chunks["p50"] if chunks else None, "requests": report["request_count"]["avg"]}


def client_point(run: dict[str, Any]) -> dict[str, float | None]:
    """The same fields from one run of specdec-client bench's summary.json (schema 2: itl_ms per token)."""
    return {"output_tok_s": run["output_tok_s"], "ttft_p50_ms": run["ttft_ms"]["p50"], "itl_p50_ms": run["itl_ms"]["p50"],
            "inter_chunk_latency_p50_ms": run["inter_chunk_latency_ms"]["p50"], "requests": run["requests"]}


def compare(client: dict[str, dict], aiperf: dict[str, dict]) -> list[dict[str, Any]]:
    """One row per (mode, concurrency): both tools' numbers, aiperf / client per field, and
    each tool's speedup of the method over the baseline at that concurrency."""
    rows = []
    for key in sorted(client, key=lambda k: (client[k]["concurrency"], k)):
        ours, theirs = client[key], aiperf.get(key)
        if theirs is None:
            continue
        row = {"mode": ours["mode"], "concurrency": ours["concurrency"], "client": ours["point"], "aiperf": theirs,
               "aiperf_over_client": {f: theirs[f] / ours["point"][f] for f in FIELDS
                                      if ours["point"][f] and theirs[f] is not None}}
        rows.append(row)
    for row in rows:
        base = next((r for r in rows if r["concurrency"] == row["concurrency"] and r["mode"] == "baseline"), None)
        if base is not None:
            row["speedup"] = {tool: row[tool]["output_tok_s"] / base[tool]["output_tok_s"] for tool in ("client", "aiperf")}
    return rows


def _cell(value: float | None, digits: int) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def markdown(rows: list[dict[str, Any]], requests: int, max_tokens: int) -> str:
    """ITL is per token in both tools, inter-chunk latency per streamed chunk in both."""
    columns = (("output_tok_s", "tok/s", 1), ("ttft_p50_ms", "TTFT p50", 0), ("itl_p50_ms", "ITL p50", 1),
               ("inter_chunk_latency_p50_ms", "inter-chunk p50", 1))
    head = " | ".join(f"{name} client | aiperf | ratio" for _, name, _ in columns)
    lines = [f"# aiperf vs specdec-client bench ({requests} ShareGPT prompts per point, {max_tokens} tokens, greedy, ignore_eos)",
             "", f"| mode | c | {head} | speedup client | speedup aiperf |", "|" + "---|" * (4 + 3 * len(columns))]
    for r in rows:
        c, a, q, s = r["client"], r["aiperf"], r["aiperf_over_client"], r.get("speedup", {})
        cells = " | ".join(f"{_cell(c[f], d)} | {_cell(a[f], d)} | {_cell(q.get(f), 2)}" for f, _, d in columns)
        lines.append(f"| {r['mode']} | {r['concurrency']} | {cells} | {s.get('client', 1):.2f}x | {s.get('aiperf', 1):.2f}x |")
    return "\n".join(lines) + "\n"


def runs_markdown(runs: list[dict[str, Any]]) -> str:
    """What the server saw during each tool's run, and who used the CPU (averaged over the
    tool's whole run: start-up and warm-up included; the client's run holds both modes)."""
    groups = ["server", "specdec-client", "aiperf", "openai front end"]
    lines = ["## What the server saw, and who used the CPU", "",
             "| tool | c | method (server label) | server steps | server step ms | tokens emitted | "
             + " | ".join(f"cores: {g}" for g in groups) + " | run s |", "|" + "---|" * (7 + len(groups))]
    for run in runs:
        cores = " | ".join(f"{run['cores'].get(g, 0.0):.2f}" for g in groups)
        for method, view in sorted(run["server"].items()) or [("–", None)]:
            server = (f"{view['steps']:.0f} | {view['step_ms']:.1f} | {view['emitted']:.0f}" if view else "– | – | –")
            lines.append(f"| {run['tool']} | {run['concurrency']} | {method} | {server} | {cores} | {run['wall_s']:.0f} |")
    return "\n".join(lines) + "\n"


def _cmdline(pid: int) -> str | None:
    try:
        return " ".join(psutil.Process(pid).cmdline())
    except psutil.Error:
        return None


def _deprioritise(pattern: str, seen: set[int]) -> None:
    """Renice (19) the processes whose command line starts with `pattern`."""
    for pid in psutil.pids():
        if pid in seen:
            continue
        cmdline = _cmdline(pid)
        if cmdline is not None and cmdline.startswith(pattern):
            try:
                psutil.Process(pid).nice(19)
                seen.add(pid)
            except psutil.Error:
                pass


# Who used the CPU during a run, by command line (the OpenAI front end runs in this process).
# First match wins: our client's command line names results/aiperf/ (its --out).
CPU_GROUPS = {"server": ("tritonserver", "triton_python_backend_stub"), "specdec-client": ("specdec-client",),
              "aiperf": ("aiperf",)}


def _stat(pid: int) -> tuple[float, float] | None:
    """(start time, user + system CPU seconds) of one process; not its reaped children's
    time: those were sampled as processes of their own and would count twice."""
    try:
        proc = psutil.Process(pid)
        with proc.oneshot():
            times = proc.cpu_times()
            return proc.create_time(), times.user + times.system
    except psutil.Error:
        return None


def _group_of(pid: int, own_cmdline: str | None) -> str | None | bool:
    """The party a process belongs to, None for none, False for not yet known: a child
    between fork and exec still shows this process's command line (which names aiperf)."""
    if pid == os.getpid():
        return "openai front end"
    cmdline = _cmdline(pid)
    if cmdline is None or cmdline == own_cmdline:
        return False
    return next((group for group, marks in CPU_GROUPS.items() if any(m in cmdline for m in marks)), None)


@contextmanager
def cpu_use(every_s: float = 0.25) -> Iterator[dict[str, float]]:
    """Cores each group used over the block (CPU seconds / wall seconds), sampled every
    `every_s` so that processes which exit before the end (aiperf's) are counted too, up to
    their last `every_s`; filled in on exit. This process (the front end) includes the
    sampler itself."""
    first: dict[tuple[int, float], float] = {}  # keyed by (pid, start time): pids get reused
    last: dict[tuple[int, float], tuple[str, float]] = {}
    groups: dict[tuple[int, float], str | None] = {}  # each process's command line is read once
    own_cmdline = _cmdline(os.getpid())
    stop = threading.Event()

    def sample(initial: bool = False) -> None:
        for pid in psutil.pids():
            stat = _stat(pid)
            if stat is None:
                continue
            key, seconds = (pid, stat[0]), stat[1]
            if key not in groups:
                group = _group_of(pid, own_cmdline)
                if group is False:
                    continue
                groups[key] = group
            if groups[key] is None:
                continue
            first.setdefault(key, seconds if initial else 0.0)
            last[key] = (groups[key], seconds)

    def loop() -> None:
        while not stop.wait(every_s):
            sample()

    result: dict[str, float] = {}
    sample(initial=True)
    start = time.perf_counter()
    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        yield result
    finally:
        stop.set()
        thread.join()
        sample()
        wall = time.perf_counter() - start
        for key, (group, seconds) in last.items():
            result[group] = result.get(group, 0.0) + (seconds - first[key]) / wall
        result["wall_s"] = wall


def server_view(before, after) -> dict[str, dict[str, float]]:
    """Per method label, what the serving loop measured between two scrapes (warm-up
    requests included): its steps, mean step time (ms) and tokens emitted."""
    from specdec_client import server_metrics
    import specdec_wire as P

    diff = server_metrics.delta(before, after)
    steps = server_metrics.by_label(diff, P.VERIFICATION_STEPS_TOTAL, "method")
    seconds = server_metrics.by_label(diff, P.STEP_SECONDS_TOTAL, "method")
    emitted = server_metrics.by_label(diff, P.EMITTED_TOKENS_TOTAL, "method")
    return {m: {"steps": n, "step_ms": 1000 * seconds.get(m, 0.0) / n, "emitted": emitted.get(m, 0.0)}
            for m, n in steps.items() if n}


@contextmanager
def observed(metrics_url: str, runs: list[dict[str, Any]], **label: Any) -> Iterator[None]:
    """Record one run's CPU use and the server's own view of it into `runs`."""
    from specdec_client import server_metrics

    before = server_metrics.scrape(metrics_url)
    with cpu_use() as cores:
        yield
    view = server_view(before, server_metrics.scrape(metrics_url))
    runs.append({**label, "wall_s": cores.pop("wall_s"), "cores": cores, "server": view})


def stamp_folders(root: Path, record: dict[str, Any], started: dict[str, Any]) -> None:
    """aiperf's exports carry no commit, tree state or machine: a stamped record in every
    folder of its artifact tree says which run of ours wrote them (results/ provenance)."""
    for folder in [root, *sorted(p for p in root.rglob("*") if p.is_dir())]:
        write_result(folder / "specdec_run.json", record, started)


def run_aiperf(command: list[str], renice: bool) -> None:
    """aiperf's timing manager busy-waits on a core (measured here: 97% of a vCPU for the
    whole run). On a machine with few cores that halves the server's: with `renice` it runs
    at nice 19, so it only takes what the server leaves (the workers that time the chunks
    keep their priority)."""
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL)
    seen: set[int] = set()
    while proc.poll() is None:
        if renice:
            _deprioritise("aiperf timing_manager", seen)
        time.sleep(0.5)
    if proc.returncode:
        raise subprocess.CalledProcessError(proc.returncode, command)


def run(args, started: dict[str, Any]) -> dict[str, Any]:
    from specdec_client.datasets import load_sharegpt, load_token_counter

    from specdec.config import default_model_dir
    from specdec.config import SERVED_SETTINGS

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    requests = max(args.prompts, 2 * max(args.concurrency))  # every load: both tools, the same requests, >= 2 waves
    prompts = load_sharegpt(requests, 0, load_token_counter(), *PROMPT_TOKENS).prompts
    dataset = out / "prompts.jsonl"
    dataset.write_text("".join(json.dumps({"text": p.text}) + "\n" for p in prompts))
    client_out = out / "client"
    aiperf: dict[str, dict] = {}
    runs: list[dict[str, Any]] = []
    client: dict[str, dict] = {}
    settings_file = None
    if args.verifier_threads is not None:
        # The same server with fewer compute threads: with aiperf's own processes on the same
        # cores, two OpenMP threads that each wait for the other at every barrier are
        # oversubscribed; one thread is not (see run_aiperf's docstring and the README).
        settings = json.loads(SERVED_SETTINGS.read_text())
        settings["threads"]["verifier"] = args.verifier_threads
        settings_file = out / "server-settings.json"
        settings_file.write_text(json.dumps(settings, indent=2))
    with served_with_openai(out, BASE_MODEL_ID, settings_file) as (server, port):
        metrics_url = server.endpoints.metrics_url
        for c in args.concurrency:
            # Ours first at each concurrency (the baseline and the method interleaved in blocks), then aiperf's.
            with observed(metrics_url, runs, tool="specdec-client", concurrency=c, modes=["baseline", args.method]):
                subprocess.run([
                    str(Path(sys.executable).with_name("specdec-client")), "bench", "--url", server.endpoints.grpc,
                    "--methods", args.method, "--concurrency", str(c), "--num-prompts", str(requests),
                    "--max-tokens", str(args.max_tokens),
                    "--min-input-tokens", str(PROMPT_TOKENS[0]), "--max-input-tokens", str(PROMPT_TOKENS[1]),
                    "--ignore-eos", "--no-metrics", "--no-progress", "--out", str(client_out / f"c{c}"),
                ], check=True)
            summary = json.loads((client_out / f"c{c}" / "summary.json").read_text())
            client.update({f"{r['mode']}@{r['concurrency']}": {"mode": r["mode"], "concurrency": r["concurrency"],
                                                                 "point": client_point(r)} for r in summary["runs"]})
            for mode, model in (("baseline", f"{BASE_MODEL_ID}:none"), (args.method, f"{BASE_MODEL_ID}:{args.method}")):
                artifacts = out / "aiperf" / f"{mode}-c{c}"
                with observed(metrics_url, runs, tool="aiperf", concurrency=c, modes=[mode]):
                    run_aiperf([
                        args.aiperf, "profile", "--model", model, "--url", f"http://127.0.0.1:{port}", "--endpoint-type", "chat",
                        "--streaming", "--input-file", str(dataset), "--custom-dataset-type", "single_turn",
                        "--dataset-sampling-strategy", "sequential", "--tokenizer", str(default_model_dir()),
                        "--extra-inputs", f"max_tokens:{args.max_tokens}", "--extra-inputs", "ignore_eos:true",
                        "--extra-inputs", "temperature:0", "--concurrency", str(c), "--request-count", str(requests),
                        "--warmup-request-count", "2", "--workers-max", "1", "--record-processor-service-count", "1",
                        # Nothing else competes for the 2 cores: no GPU telemetry or server-metrics pollers.
                        "--ui-type", "none", "--no-gpu-telemetry", "--no-server-metrics", "--artifact-dir", str(artifacts),
                    ], renice=args.renice_timing_manager)
                stamp_folders(artifacts, {"tool": "aiperf", "mode": mode, "model": model, "concurrency": c}, started)
                aiperf[f"{mode}@{c}"] = aiperf_point(json.loads((artifacts / "profile_export_aiperf.json").read_text()))
    rows = compare(client, aiperf)
    (out / "comparison.md").write_text(markdown(rows, requests, args.max_tokens) + "\n" + runs_markdown(runs))
    return {"requests_per_point": requests, "max_tokens": args.max_tokens, "method": args.method, "concurrency": args.concurrency,
            "aiperf_timing_manager_reniced": args.renice_timing_manager,
            "verifier_threads": args.verifier_threads, "rows": rows, "runs": runs}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="specdec bench-aiperf", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--aiperf", default="tmp/aiperf-venv/bin/aiperf", help="the aiperf executable (make bench-aiperf installs it)")
    p.add_argument("--prompts", type=int, default=16, help="requests per (mode, c): at least 2 x the largest c")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--method", default="eagle3-hybrid")
    p.add_argument("--concurrency", type=lambda text: [int(c) for c in text.split(",")], default=[1, 8])
    p.add_argument("--out", default="results/aiperf")
    p.add_argument("--verifier-threads", type=int, help="serve with this many verifier (target) threads instead of "
                   "the repository's setting")
    p.add_argument("--renice-timing-manager", action=argparse.BooleanOptionalAction, default=True,
                   help="run aiperf's busy-waiting timing manager at nice 19 (see run_aiperf)")
    args = p.parse_args(argv)
    started = provenance()
    result = run(args, started)
    write_result(Path(args.out) / "comparison.json", result, started)
    print((Path(args.out) / "comparison.md").read_text())
    return 0
