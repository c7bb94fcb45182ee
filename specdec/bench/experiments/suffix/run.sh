#!/usr/bin/env bash
# Repeated tasks through Triton (issue 36): many users asking variations of a dozen tasks
# (data/repeated/tasks.jsonl, from its seeded generator), c=1, greedy, answers to EOS. Each
# mode learns only from its own earlier requests in the run (the benchmark scopes the cache
# and the suffix corpus per mode). Our `suffix` beside Arctic Inference's (when
# build_arctic.sh has installed it), the hybrid with and without suffix, and prompt lookup.
# ~20 min on 2 cores. Writes results/bench/suffix/{summary.json,report.md,...}.
set -euo pipefail
cd "$(dirname "$0")/../../../.."
OUT=results/bench/suffix
.venv/bin/python specdec/bench/experiments/suffix/settings.py "$OUT/specdec.json"
METHODS=suffix,eagle3-hybrid,eagle3-hybrid-ngram,ngram-tree
if grep -q '"arctic-suffix"' "$OUT/specdec.json"; then METHODS=$METHODS,arctic-suffix; fi
.venv/bin/specdec-client bench --start-server --server-settings "$OUT/specdec.json" --out "$OUT" \
  --dataset jsonl --dataset-path data/repeated/tasks.jsonl --num-prompts 32 --max-tokens 128 --no-ignore-eos \
  --methods "$METHODS" --concurrency 1 --block-size 8 --warmup 1
