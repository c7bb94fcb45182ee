"""Why one model's speed differs 2x between machines sold alike (issue 60): the int8 forward
on each vector path this CPU runs (SPECDEC_INT8_PATH caps it: what a CPU without AMX, or
without AVX-512 VNNI, would run) and on one thread or two (two vCPUs that are the two
hyperthreads of one core behave closer to one thread than to two cores).

    python -m specdec.bench.experiments.kernels.paths_and_threads --out results/kernels/paths_and_threads.json

Each (path, threads) point runs in its own process; points alternate for --rounds rounds and
the median per point is reported (forward_ms: one sequence verifying 1 and 16 rows over a
256-token context, and 16 sequences decoding one row each). Nothing is asserted.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from specdec.bench.bench_engine import env_record
from specdec_client.envinfo import write_result

PROBE = """
import json, sys, torch
torch.set_num_threads(int(sys.argv[1]))
from specdec.config import EngineConfig
from specdec.serving.runtime import load_target
from specdec.bench.bench_engine import forward_ms
model = load_target(None, EngineConfig(weight_format="int8"))
print(json.dumps({"k1": forward_ms(model, 1, 1, repeats=12), "k16": forward_ms(model, 1, 16, repeats=8),
                  "b16_k1": forward_ms(model, 16, 1, repeats=6)}))
"""


def probe(path: str, threads: int) -> dict[str, float]:
    env = {**os.environ, "SPECDEC_INT8_PATH": path}
    out = subprocess.run([sys.executable, "-c", PROBE, str(threads)], env=env, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--paths", default="avx2,avx512_vnni,amx")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    points = [(p, int(t)) for p in args.paths.split(",") for t in args.threads.split(",")]
    runs: dict[str, list[dict]] = {}
    for _ in range(args.rounds):
        for path, threads in points:
            runs.setdefault(f"{path}/{threads}", []).append(probe(path, threads))
            print(path, threads, runs[f"{path}/{threads}"][-1], flush=True)
    median = {key: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for key, rs in runs.items()}
    result = {"env": env_record("int8"), "command": "python -m specdec.bench.experiments.kernels.paths_and_threads "
              + " ".join(argv or sys.argv[1:]), "forward_ms_median": median, "runs": runs}
    write_result(args.out, result)
    for key, m in median.items():
        print(f"{key:16s} 1 row {m['k1']:6.1f} ms  16 rows {m['k16']:6.1f} ms  16 seqs {m['b16_k1']:6.1f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
