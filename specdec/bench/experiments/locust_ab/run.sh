#!/bin/bash
# Locust production (16 users, 128 tokens, 120 s a mode: the baseline, eagle3-hybrid, ngram-adaptive) through
# Triton, an older commit against a newer one, in the order old, new, new, old (issue 74 item 5: beside
# 140f0e6 on one machine). Each tree is a git worktree ($OLD, $NEW) with its own kernels built
# (`python setup.py build_ext --inplace` there), first on PYTHONPATH and the working directory, so the launcher
# serves that tree's model repository and code and each record names that tree's commit.
set -e
OLD=${OLD:?a worktree of the older commit}; NEW=${NEW:?a worktree of the newer commit}
ROOT=$(git rev-parse --show-toplevel)
OUT=$ROOT/results/loadtest/issue74
for run in old-1 new-1 new-2 old-2; do
  tree=$OLD; [ "${run%-*}" = new ] && tree=$NEW
  (cd "$tree" && PYTHONPATH=$tree:$tree/client timeout 1500 "$ROOT/.venv/bin/python" -m loadtest.run --scenario production \
     --users 16 --duration 120s --max-tokens 128 --methods eagle3-hybrid,ngram-adaptive --start-server --out "$OUT/$run")
done
