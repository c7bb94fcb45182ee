"""Greedy identity at bfloat16 weights: speculative vs the bf16 baseline, in process.
Writes results/bf16/identity.json. (python specdec/bench/experiments/profiles/bf16_identity.py)"""
import sys
from specdec.config import EngineConfig, SamplingParams
from specdec.serving.runtime import build_engine, encode_prompt
from specdec.tools.sharegpt import sharegpt_prompts
from specdec_client.envinfo import provenance, write_result

N, TOKENS = 12, 64
started = provenance()
out = {"prompts": N, "max_tokens": TOKENS, "dtypes": {}}
for dtype in ("bfloat16", "float32"):
    engine = build_engine(config=EngineConfig(max_batch_size=4, max_seq_len=1024, dtype=dtype))
    tok = engine.tokenizer
    prompts = [encode_prompt(tok, t) for t in sharegpt_prompts(N, seed=3, tokenizer=tok, min_tokens=16, max_tokens=256)]
    params = SamplingParams(max_tokens=TOKENS, ignore_eos=True)
    def ids(p, method):
        got = []
        for o in engine.generate(p, params, method):  # no budget: the method's configured one
            got += o.new_token_ids
        return got
    base = [ids(p, "none") for p in prompts]
    res = {}
    for method in ("ngram", "eagle3", "eagle3-hybrid"):
        before = engine.stats.as_dict()
        outs = [ids(p, method) for p in prompts]
        after = engine.stats.as_dict()
        steps = after["steps"] - before["steps"]
        diverge = [next((i for i, (a, b) in enumerate(zip(o, b_)) if a != b), None) for o, b_ in zip(outs, base)]
        res[method] = {"identical": sum(d is None for d in diverge), "of": N, "first_divergence": diverge,
                       "mean_acceptance_length": (after["emitted_tokens"] - before["emitted_tokens"]) / steps if steps else 0.0}
        print(dtype, method, res[method], flush=True)
    out["dtypes"][dtype] = res
write_result("results/bf16/identity.json", out, started, indent=1)
