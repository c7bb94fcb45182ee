import cProfile, pstats, time, statistics, sys, torch
from specdec.config import EngineConfig, SamplingParams, default_model_dir
from specdec.serving.runtime import build_engine, encode_prompt
from specdec.tools.sharegpt import sharegpt_prompts
cfg = EngineConfig(max_batch_size=16, max_seq_len=1024)
engine = build_engine(config=cfg)
tok = engine.tokenizer
prompts = [encode_prompt(tok, t) for t in sharegpt_prompts(32, seed=0, tokenizer=tok, min_tokens=16, max_tokens=320)]
params = SamplingParams(max_tokens=48, ignore_eos=True)
fwd = []
model = engine.target_pass.target
orig = model.forward
def timed(*a, **k):
    t0 = time.perf_counter(); r = orig(*a, **k); fwd.append(time.perf_counter() - t0); return r
model.forward = timed
def run(method, prof=None):
    todo = list(enumerate(prompts)); steps = []; fwd.clear(); n = 0
    t_start = time.perf_counter()
    while todo or engine.has_work():
        while todo and len(engine.sequences) < 16:
            i, p = todo.pop(0); engine.add_request(f"{method}{i}", p, params, method)  # no budget: the configured one
        t0 = time.perf_counter()
        if prof: prof.enable()
        outs = engine.step()
        if prof: prof.disable()
        steps.append(time.perf_counter() - t0); n += sum(len(o.new_token_ids) for o in outs)
    wall = time.perf_counter() - t_start
    return n / wall, statistics.median(steps), sum(fwd) / wall
methods = sys.argv[1:] or ["none", "ngram-adaptive", "eagle3-hybrid"]
run("none")
for rnd in range(2):
    for m in methods:
        tps, step, fshare = run(m)
        print(f"round {rnd} {m:16s} {tps:6.1f} tok/s  step p50 {1e3*step:6.1f} ms  forward share {fshare:.2f}", flush=True)
for m in methods[1:]:
    pr = cProfile.Profile(); run(m, pr)
    print("=====", m); pstats.Stats(pr).sort_stats("tottime").print_stats(18)
