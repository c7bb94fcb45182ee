#!/bin/bash
# Baseline at c=16 through Triton, the commit before packing vs the one after, alternating
# (git worktrees: /work/old at a87af80, /work/new at 6e62a64; one venv, each tree first on
# PYTHONPATH, so the launcher serves that tree's model repository and code).
set -x
for round in 1 2; do
  for tree in old new; do
    PYTHONPATH=/work/$tree:/work/$tree/client timeout 900 .venv/bin/specdec-client bench --start-server \
      --methods baseline --concurrency 16 --num-prompts 16 --repeats 2 --max-tokens 64 --no-progress \
      --out results/bench/prefill-ab/$tree-$round
  done
done
