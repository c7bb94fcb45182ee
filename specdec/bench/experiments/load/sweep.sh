#!/usr/bin/env bash
# Issue 33's remaining load measurements, run back to back on a quiet machine (nothing else
# running): closed loop at c = 4, 8, 16, 32 greedy and c = 4, 16 at T=0.7 (4 waves per load,
# blocks of two waves), an open-loop Poisson rate sweep under an SLO, and Locust's production
# scenario with the baseline beside each method.
set -x
cd "$(dirname "$0")/../../../.."
OUT=results/bench/load
BIN=.venv/bin
METHODS=eagle3-hybrid,ngram-adaptive,eagle3-adaptive
$BIN/specdec-client bench --start-server --concurrency 4,8,16,32 --prompts-per-concurrency 4 --num-prompts 128 \
  --max-tokens 64 --methods $METHODS --no-progress --out $OUT/closed_greedy
$BIN/specdec-client bench --start-server --concurrency 4,16 --prompts-per-concurrency 4 --num-prompts 64 \
  --max-tokens 64 --temperature 0.7 --methods $METHODS --no-progress --out $OUT/closed_t07
$BIN/specdec-client bench --start-server --request-rate 0.5,1.0,1.5 --num-prompts 24 --max-tokens 64 \
  --slo-ttft-ms 2000 --slo-tpot-ms 150 --methods eagle3-hybrid,ngram-adaptive --no-progress --out $OUT/rate_sweep
$BIN/specdec-client bench --start-server --request-rate 1.0,2.0,3.0 --num-prompts 48 --max-tokens 64 \
  --slo-ttft-ms 2000 --slo-tpot-ms 150 --methods eagle3-hybrid,ngram-adaptive --no-progress --out $OUT/rate_sweep_high
$BIN/python -m loadtest.run --scenario production --start-server --duration 90s --max-tokens 64 \
  --methods eagle3-hybrid --out $OUT/locust_production
