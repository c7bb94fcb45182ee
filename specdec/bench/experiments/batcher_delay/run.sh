#!/bin/bash
# Verifier sequence-batcher delay 200 us (as shipped) vs 3 ms: baseline at c=16 and c=1, one server each, alternating.
cd /work/main
run() {  # repo tag
  .venv/bin/specdec serve --model-repository $1 --http-port 18000 --grpc-port 18001 --metrics-port 18002 > /tmp/prof/serve_$2.log 2>&1 &
  pid=$!
  for i in $(seq 1 150); do curl -sf localhost:18000/v2/health/ready >/dev/null && break; sleep 1; done
  .venv/bin/specdec-client bench --url localhost:18001 --metrics-url http://localhost:18002/metrics --methods ngram-adaptive --concurrency 1,16 --num-prompts 32 --max-tokens 64 --no-progress --out /tmp/prof/delay_$2 > /dev/null 2>&1
  kill $pid; wait $pid 2>/dev/null; sleep 2
  echo "== $2"; grep -E "^\| (baseline|ngram-adaptive) |^## c=" /tmp/prof/delay_$2/report.md | head -8
}
run /work/main/model_repository d200-1
run /tmp/mr3 d3000-1
