"""Plain decoding and eagle3 chain, batch 1, in process: tokens/s. Run under different OMP env."""
import sys, time, dataclasses
from specdec.bench import head_acceptance as h
from specdec.config import default_model_dir, EngineConfig, SamplingParams
from specdec.serving.runtime import load_tokenizer, load_target, build_drafters
from specdec.serving.spec_engine import SpecEngine
tok=load_tokenizer(default_model_dir())
target=load_target(default_model_dir(), EngineConfig(weight_format="int8"))
from specdec.tools.sharegpt import sharegpt_prompts
from specdec.serving.runtime import encode_prompt
prompts=[encode_prompt(tok,t) for t in sharegpt_prompts(4, seed=0, tokenizer=tok, min_tokens=4, max_tokens=256)]
engine_cfg = EngineConfig(max_batch_size=1, max_seq_len=2048)
spec={"chain": dataclasses.replace(h.CHAIN, speculative_model=str(h.SHIPPED_HEAD))}
engine = SpecEngine(target, engine_cfg, tok, build_drafters(target.cfg, spec, engine_cfg, embed=target.embed))
res={}
for rep in range(2):
  for m in ("none","chain"):
    n=0; t=time.perf_counter()
    for i,ids in enumerate(prompts):
        for out in engine.generate(ids, SamplingParams(max_tokens=64), m, 5 if m=="chain" else 0, request_id=f"{m}{rep}{i}"):
            n+=len(out.new_token_ids)
    if rep: res[m]=n/(time.perf_counter()-t)
print(sys.argv[1], " ".join(f"{k} {v:.1f} tok/s" for k,v in res.items()), flush=True)
