"""`specdec bench-capture`: what recording served traffic costs (issue 62: target < 3%).

Two of our Triton servers on the same settings, one with capture on for every request
(sample_rate 1, every salt: the worst case), judged by the A/B harness
(`specdec-client bench --baseline ... --candidate ...`) at c=1 and c=16: the same prompts,
interleaved blocks, the default method. Writes results/capture/c<N>/ (the harness's report)
and results/capture/capture_cost.json (throughput ratios, the store's size).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import subprocess
import tempfile
import sys
from pathlib import Path
from typing import Iterator

from specdec_client.envinfo import provenance, write_result

from specdec.config import SERVED_SETTINGS
from specdec.launcher import DEFAULT_MODEL_REPOSITORY, TritonServer, free_ports


@contextlib.contextmanager
def server(out: Path, name: str, capture: Path | None) -> Iterator[int]:
    """One server on the served settings (capture into `capture` when given); yields its gRPC port."""
    settings = json.loads(SERVED_SETTINGS.read_text())
    if capture is not None:
        settings["capture"] = {"directory": str(capture.resolve()), "sample_rate": 1.0, "salts": ["*"]}
    path = out / f"specdec-{name}.json"
    path.write_text(json.dumps(settings, indent=1))
    http, grpc, metrics = free_ports(3)
    with TritonServer(log_path=out / f"triton-{name}.log") as triton:
        triton.start(DEFAULT_MODEL_REPOSITORY, http_port=http, grpc_port=grpc, metrics_port=metrics,
                     env={"SPECDEC_SETTINGS": str(path.resolve())})
        triton.wait_ready(timeout=600)
        yield grpc


def run(args) -> dict:
    started = provenance()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    store = Path(tempfile.mkdtemp(prefix="specdec-capture-"))  # measured, then deleted (never results/)
    results = {"method": "the served default", "max_tokens": args.max_tokens, "load_points": {}}
    with server(out, "off", None) as plain, server(out, "on", store) as capturing:
        for concurrency in args.concurrency:
            prompts = args.prompts if concurrency == 1 else args.prompts_per_slot * concurrency
            cmd = [str(Path(sys.executable).parent / "specdec-client"), "bench",
                   "--baseline", f"grpc://127.0.0.1:{plain}?name=capture-off",
                   "--candidate", f"grpc://127.0.0.1:{capturing}?name=capture-on",
                   "--concurrency", str(concurrency), "--num-prompts", str(prompts), "--max-tokens", str(args.max_tokens),
                   "--repeats", str(args.repeats), "--warmup", "2", "--prefix-cache", "off", "--no-progress",
                   "--out", str(out / f"c{concurrency}")]
            print("+", " ".join(cmd), flush=True)
            subprocess.run(cmd, check=True)
            summary = json.loads((out / f"c{concurrency}" / "summary.json").read_text())
            results["load_points"][str(concurrency)] = {"speedup": summary.get("speedup"), "prompts": prompts}
    shards = sorted(store.glob("shard-*.npz"))
    results["store"] = {"shards": len(shards), "bytes": sum(p.stat().st_size for p in shards)}
    write_result(out / "capture_cost.json", results, started)
    print(json.dumps(results, indent=1))
    return results


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="specdec bench-capture", description=__doc__.splitlines()[0])
    p.add_argument("--out", default="results/capture")
    p.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16])
    p.add_argument("--prompts", type=int, default=16, help="prompts at c=1")
    p.add_argument("--prompts-per-slot", type=int, default=4, help="prompts per stream at c>1")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    run(p.parse_args(argv))


if __name__ == "__main__":
    main()
