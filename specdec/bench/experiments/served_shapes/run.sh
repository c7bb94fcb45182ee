#!/usr/bin/env bash
# The EAGLE-3 draft shapes through Triton (issue 62 item 4): chains of 2-5 and trees of 6-12
# nodes (the served `eagle3` and `eagle3-tree` are two of them) and `eagle3-hybrid`, the shipped
# head on the served weights, 16 ShareGPT prompts, 96 tokens, greedy, c=1 and c=4, paired blocks,
# every output compared with the baseline's. ~15 min on 2 cores, quiet machine.
# Writes results/tree_shapes/served/{summary.json,report.md,specdec.json,...}.
set -euo pipefail
cd "$(dirname "$0")/../../../.."
OUT=results/tree_shapes/served
mkdir -p "$OUT"
.venv/bin/python specdec/bench/experiments/served_shapes/candidate_shapes.py "$OUT/specdec.json"
.venv/bin/specdec-client bench --start-server --server-settings "$OUT/specdec.json" --out "$OUT" \
  --num-prompts 16 --max-tokens 96 --concurrency 1,4 \
  --methods eagle3-k2,eagle3-k3,eagle3-k4,eagle3-k5,eagle3-tree-d3k2n6,eagle3-tree-d4k2n8,eagle3-tree-d4k4n12,eagle3-hybrid
