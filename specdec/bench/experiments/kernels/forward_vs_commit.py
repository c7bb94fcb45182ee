"""The target's whole forward, this tree against another commit's, side by side in one run
(issue 59: "its 1-row forward is at least 2x faster than 2e7831c's, measured side by side").

    python -m specdec.bench.experiments.kernels.forward_vs_commit --before 2e7831c \
        --formats int8,gguf --out results/kernels/forward_vs_2e7831c.json

The other commit is checked out into a git worktree under tmp/ and imported from there
(PYTHONPATH), in its own process; the two trees alternate for --rounds rounds, each round
measuring one sequence verifying 1..32 rows (a chain over a 256-token context: `forward_ms`,
the minimum of repeated forwards) and 16 sequences decoding one row each. Reported: the median
over rounds per tree, and after/before ratios. Nothing is asserted.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from specdec_client.envinfo import provenance, write_result

ROOT = Path(__file__).resolve().parents[4]
ROWS = (1, 2, 4, 8, 16, 32)

PROBE = """
import json, sys, torch
from specdec.config import EngineConfig
from specdec.serving.runtime import load_target
from specdec.bench.bench_engine import forward_ms
model = load_target(None, EngineConfig(weight_format=sys.argv[1]))
curve = {str(k): forward_ms(model, 1, k, repeats=12) for k in %s}
curve["b16_k1"] = forward_ms(model, 16, 1, repeats=8)
print(json.dumps(curve))
""" % (ROWS,)


def worktree(commit: str) -> Path:
    path = ROOT / "tmp" / f"worktree-{commit}"
    if not path.is_dir():
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-f", str(path), commit], check=True,
                       capture_output=True)
    return path


def probe(tree: Path, weight_format: str) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run([sys.executable, "-c", PROBE, weight_format], cwd=tree, env=env, check=True, capture_output=True,
                         text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", required=True, help="the commit to compare against")
    ap.add_argument("--formats", default="int8")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    trees = {"before": worktree(args.before), "after": ROOT}
    runs: dict[str, dict[str, list[dict]]] = {f: {"before": [], "after": []} for f in args.formats.split(",")}
    for r in range(args.rounds):
        for weight_format, by_tree in runs.items():
            for name in (("before", "after") if r % 2 == 0 else ("after", "before")):
                by_tree[name].append(probe(trees[name], weight_format))
                print(r, weight_format, name, json.dumps(by_tree[name][-1]), flush=True)
    result = {**provenance(), "command": "python -m specdec.bench.experiments.kernels.forward_vs_commit "
              + " ".join(argv if argv is not None else sys.argv[1:]), "before": args.before, "rounds": args.rounds,
              "formats": {}}
    for weight_format, by_tree in runs.items():
        median = {name: {key: round(statistics.median(run[key] for run in curves), 2) for key in curves[0]}
                  for name, curves in by_tree.items()}
        result["formats"][weight_format] = {
            "forward_ms": median,
            "after_over_before": {key: round(median["after"][key] / median["before"][key], 3) for key in median["after"]},
            "rows16_over_rows1": {name: round(m["16"] / m["1"], 2) for name, m in median.items()},
        }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_result(args.out, result, indent=1)
    print(json.dumps(result["formats"], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
