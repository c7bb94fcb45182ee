#!/usr/bin/env bash
# Conversations through Triton (issue 36): ShareGPT conversations replayed turn by turn, each
# turn sending the whole history with the model's own answers; every mode with the prefix
# cache and without it (a salt per request), side by side in one run, c=1, greedy.
# ~15 min on 2 cores. Writes results/bench/conversations/{summary.json,report.md,...}.
set -euo pipefail
cd "$(dirname "$0")/../../../.."
OUT=results/bench/conversations
.venv/bin/python specdec/bench/experiments/suffix/settings.py "$OUT/specdec.json"
.venv/bin/specdec-client bench --start-server --server-settings "$OUT/specdec.json" --out "$OUT" \
  --dataset sharegpt-multiturn --turns 4 --num-prompts 5 --max-input-tokens 160 --max-tokens 48 --no-ignore-eos \
  --prefix-cache both --methods eagle3,eagle3-hybrid,eagle3-hybrid-ngram,suffix --concurrency 1 --block-size 5 --warmup 1
