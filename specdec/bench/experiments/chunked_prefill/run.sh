#!/bin/bash
# Chunked prefill A/B through Triton at c=16: the same tree, engine.prefill_chunk_tokens 256 (default) vs 0 (whole prompts),
# alternating; 32 ShareGPT prompts (<= 512 tokens) per block, so later requests arrive while others decode.
cd "$(git rev-parse --show-toplevel)"
# the whole-prompts settings: the served ones with engine.prefill_chunk_tokens 0
.venv/bin/python -c "import json; s = json.load(open('model_repository/specdec.json')); s['engine']['prefill_chunk_tokens'] = 0; json.dump(s, open('/tmp/chunk0.json', 'w'))"
for round in 1 2; do
  for mode in chunk256 chunk0; do
    if [ $mode = chunk0 ]; then export SPECDEC_SETTINGS=/tmp/chunk0.json; else unset SPECDEC_SETTINGS; fi
    timeout 900 .venv/bin/specdec-client bench --start-server --methods baseline,eagle3-hybrid,ngram-adaptive --concurrency 16 \
      --num-prompts 32 --max-tokens 64 --no-progress --out results/bench/chunked-prefill/$mode-$round
  done
done
