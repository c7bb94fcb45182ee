"""Where the served path's CPU goes (issue 60): a real Triton server under a closed loop of
gRPC streams, with every process's and thread's CPU time read from /proc before and after,
and optionally py-spy's sampled stacks of the engine's process.

    python -m specdec.bench.experiments.profiles.served_path --concurrency 1,16 \
        --out results/profiles/served_path.json [--py-spy tmp/served_path]

Reports, per concurrency: output tok/s, TTFT p50, and CPU milliseconds per output token of
the server (tritonserver: gRPC, routing), each stub process (named by its model) and the
benchmark client, split by thread name, so the share of a token spent outside the forward
is read off directly. Nothing is asserted.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import time
from pathlib import Path

import psutil

from specdec.config import ServingConfig, resolve_model_dir
from specdec.launcher import DEFAULT_MODEL_REPOSITORY, TritonServer, free_ports
from specdec.launcher.processes import descendants
from specdec.serving.runtime import load_tokenizer
from specdec.bench.bench_engine import env_record
from specdec.bench.bench_load import through_triton
from specdec.tools.sharegpt import sharegpt_prompts
from specdec_client.envinfo import write_result

TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def process_label(pid: int) -> str:
    """tritonserver, a stub by its model's name (its model.py path is in its command line), or the client."""
    if pid == os.getpid():
        return "client"
    cmd = psutil.Process(pid).cmdline()
    if cmd and "triton_python_backend_stub" in cmd[0]:
        return "stub:" + Path(cmd[1]).parent.parent.name
    return Path(cmd[0]).name if cmd else str(pid)


def thread_times(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) of each thread of pid, summed by thread name."""
    out: dict[str, float] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            name = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
            fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # a thread that ended meanwhile
            continue
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) * TICK_S
    return out


def snapshot(pids: list[int]) -> dict[str, dict[str, float]]:
    return {process_label(pid): thread_times(pid) for pid in pids}


def difference(after: dict, before: dict) -> dict[str, dict[str, float]]:
    return {proc: {name: t - before.get(proc, {}).get(name, 0.0) for name, t in threads.items()}
            for proc, threads in after.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--concurrency", default="1,16")
    p.add_argument("--method", default="none")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--prompts-at-1", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--model-repository", default=str(DEFAULT_MODEL_REPOSITORY))
    p.add_argument("--py-spy", default=None, help="a folder: py-spy's stacks of every stub (raw, one file per stub and level)")
    p.add_argument("--no-stream", action="store_true", help="one response per request (no per-token responses)")
    p.add_argument("--out", default="results/profiles/served_path.json")
    args = p.parse_args(argv)
    repo = Path(args.model_repository)
    settings = ServingConfig.from_file(repo / "specdec.json")
    tokenizer = load_tokenizer(resolve_model_dir(settings.model_dir))
    texts = sharegpt_prompts(args.num_prompts, seed=0, tokenizer=tokenizer, min_tokens=4, max_tokens=192)
    k = settings.default_draft_tokens(args.method) if args.method != "none" else 0
    result = {"env": env_record(settings.engine.dtype), "method": args.method, "max_tokens": args.max_tokens,
              "command": "python -m specdec.bench.experiments.profiles.served_path " + " ".join(argv or []), "points": []}
    http, grpc, metrics = free_ports(3)
    server = TritonServer()
    server.start(repo, http_port=http, grpc_port=grpc, metrics_port=metrics)
    try:
        server.wait_ready(timeout=600)
        through_triton(server.endpoints, texts[:2], "none", 0, 8, 2)  # warm-up
        pids = [server.pid, *descendants(server.pid), os.getpid()]
        for c in (int(x) for x in args.concurrency.split(",")):
            n = min(len(texts), args.prompts_at_1) if c == 1 else len(texts)
            spies = []
            if args.py_spy:
                Path(args.py_spy).mkdir(parents=True, exist_ok=True)
                for pid in pids[1:-1]:
                    label = process_label(pid).replace("stub:", "")
                    spies.append(subprocess.Popen(["py-spy", "record", "--pid", str(pid), "--rate", "200", "--threads",
                                                   "--format", "raw", "--nonblocking",
                                                   "--output", f"{args.py_spy}/{label}_c{c}.txt"],
                                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
                time.sleep(1.0)
            before = snapshot(pids)
            served = through_triton(server.endpoints, texts[:n], args.method, k, args.max_tokens, c, stream=not args.no_stream)
            used = difference(snapshot(pids), before)
            for spy in spies:
                spy.send_signal(2)
                spy.wait(timeout=60)
            tokens = served["tokens"]
            per_token = {proc: {"total_ms_per_token": 1e3 * sum(t.values()) / tokens,
                                "threads_ms_per_token": {name: round(1e3 * s / tokens, 3) for name, s in
                                                         sorted(t.items(), key=lambda kv: -kv[1]) if s > 0}}
                         for proc, t in used.items()}
            point = {"concurrency": c, "served": served, "cpu": per_token,
                     "wall_ms_per_token": 1e3 * served["wall_s"] / tokens}
            result["points"].append(point)
            print(f"c={c}: {served['output_tok_s']:.1f} tok/s, TTFT p50 {served['ttft_p50_ms']:.0f} ms, "
                  f"wall {point['wall_ms_per_token']:.2f} ms/token", flush=True)
            for proc, row in per_token.items():
                top = ", ".join(f"{n} {v:.2f}" for n, v in list(row["threads_ms_per_token"].items())[:5])
                print(f"   {proc:28s} {row['total_ms_per_token']:6.2f} ms CPU/token  ({top})", flush=True)
    finally:
        server.stop()
    out = write_result(args.out, result)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
