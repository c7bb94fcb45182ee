#!/bin/bash
# c=16 baseline vs ngram-adaptive vs eagle3-hybrid on one running server; Triton's own per-model counters around each run.
cd /work/main
.venv/bin/specdec serve --http-port 18000 --grpc-port 18001 --metrics-port 18002 > /tmp/prof/serve.log 2>&1 &
for i in $(seq 1 120); do curl -sf localhost:18000/v2/health/ready && break; sleep 1; done
scrape() { curl -s localhost:18002/metrics | grep -E '^(nv_inference_exec_count|nv_inference_request_success|nv_inference_compute_infer_duration_us|nv_inference_queue_duration_us|nv_inference_request_duration_us|specdec_step_seconds_total|specdec_verify_seconds_total|specdec_verification_steps_total|specdec_draft_seconds_total)' ; }
for mode in baseline ngram-adaptive eagle3-hybrid baseline ngram-adaptive eagle3-hybrid; do
  scrape > /tmp/prof/m_before_$mode
  m=$mode; [ $mode = baseline ] && m=baseline
  .venv/bin/specdec-client bench --url localhost:18001 --metrics-url http://localhost:18002/metrics --methods $m --concurrency 16 --num-prompts 32 --max-tokens 64 --no-progress --warmup 0 --out /tmp/prof/m_$mode > /dev/null 2>&1
  scrape > /tmp/prof/m_after_$mode
  python3 - "$mode" <<'PY'
import sys, re, collections
mode = sys.argv[1]
def read(f):
    d = {}
    for line in open(f):
        name, val = line.rsplit(" ", 1); d[name] = float(val)
    return d
b, a = read(f"/tmp/prof/m_before_{mode}"), read(f"/tmp/prof/m_after_{mode}")
delta = {k: a[k] - b.get(k, 0) for k in a if a[k] - b.get(k, 0)}
def get(metric, model):
    return sum(v for k, v in delta.items() if k.startswith(metric + "{") and f'model="{model}"' in k)
for model in ("verifier", "speculative_loop", "ensemble", "preprocessing", "postprocessing"):
    n = get("nv_inference_exec_count", model); r = get("nv_inference_request_success", model)
    if n:
        print(f"{mode:15s} {model:17s} execs {n:6.0f} reqs {r:6.0f} compute/exec {get('nv_inference_compute_infer_duration_us', model)/n/1e3:7.1f} ms  queue/req {get('nv_inference_queue_duration_us', model)/max(r,1)/1e3:6.1f} ms")
steps = sum(v for k, v in delta.items() if k.startswith("specdec_verification_steps_total"))
step_s = sum(v for k, v in delta.items() if k.startswith("specdec_step_seconds_total"))
ver_s = sum(v for k, v in delta.items() if k.startswith("specdec_verify_seconds_total"))
if steps: print(f"{mode:15s} loop: steps {steps:.0f}, step {1e3*step_s/steps:.1f} ms, verify {1e3*ver_s/steps:.1f} ms")
PY
  grep "^| $mode " /tmp/prof/m_$mode/report.md | head -1
done
kill %1; sleep 3
