#!/bin/bash
# The prefill budget (issue 74 item 4) through Triton, the commit before it against the one after, ABBA
# (git worktrees at $BEFORE and $AFTER; one venv, each tree first on PYTHONPATH and the working directory,
# so the launcher serves that tree's model repository and code, and each run records that tree's commit):
#   waves: c=16 closed loop, 64 tokens, EOS ignored (every block starts with a wave of 16 prompts, and equal
#          lengths bring the next wave back together); baseline and eagle3-hybrid
#   to-eos: c=16 closed loop to EOS, at most 128 tokens (answers end apart: arrivals spread out)
#   c1-1000: c=1, synthetic 1,000-token prompts, 16 tokens (a long prompt alone: chunks cost it, or not)
# Then analyse.py -> results/bench/prefill-budget/summary.json.
set -e
BEFORE=${BEFORE:?a worktree of the commit before}; AFTER=${AFTER:?a worktree of the commit after}
OUT=$(git rev-parse --show-toplevel)/results/bench/prefill-budget
VENV=$(git rev-parse --show-toplevel)/.venv
for tree in "$BEFORE" "$AFTER"; do  # the kernels this checkout built (they are the same in both commits)
  cp -n "$(git rev-parse --show-toplevel)"/specdec/engine/kernels/_native*.so "$tree/specdec/engine/kernels/"
done
bench() {  # tree name args...
  local tree=$1 name=$2; shift 2
  (cd "$tree" && PYTHONPATH=$tree:$tree/client timeout 1200 "$VENV/bin/specdec-client" bench --start-server --no-progress \
     --out "$OUT/$name" "$@")
}
for round in 1 2; do
  order="before after"; [ $round = 2 ] && order="after before"
  for side in $order; do
    tree=$BEFORE; [ $side = after ] && tree=$AFTER
    bench "$tree" "waves-$side-$round" --methods baseline,eagle3-hybrid --concurrency 16 --num-prompts 32 --max-tokens 64
    bench "$tree" "to-eos-$side-$round" --methods baseline --concurrency 16 --num-prompts 48 --max-tokens 128 --no-ignore-eos
    bench "$tree" "c1-1000-$side-$round" --methods baseline --concurrency 1 --dataset synthetic --num-prompts 6 \
      --input-tokens 1000 --max-tokens 16
  done
done
"$VENV/bin/python" "$(dirname "$0")/analyse.py"
