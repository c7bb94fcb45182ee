import cProfile, pstats, time, statistics, torch
from specdec.config import EngineConfig, SamplingParams, default_model_dir
from specdec.engine.models.loading import load_transformer
from specdec.serving.spec_engine import SpecEngine
from specdec.serving.runtime import load_tokenizer
model = load_transformer(default_model_dir(), dtype="float32")
engine = SpecEngine(model, EngineConfig(max_batch_size=4, max_seq_len=1024), tokenizer=load_tokenizer(default_model_dir()))
prompt = list(range(100, 300))
fwd = []
orig = model.forward
def timed(*a, **k):
    t0 = time.perf_counter(); r = orig(*a, **k); fwd.append(time.perf_counter() - t0); return r
model.forward = timed
def run(n):
    engine.add_request("r", prompt, SamplingParams(max_tokens=n, ignore_eos=True))
    ts = []
    while engine.has_work():
        t0 = time.perf_counter(); engine.step(); ts.append(time.perf_counter() - t0)
    return ts
run(8); fwd.clear()
pr = cProfile.Profile(); pr.enable(); ts = run(100)[1:]; pr.disable()
f = fwd[1:]
print(f"step median {1e3*statistics.median(ts):.2f} ms, forward median {1e3*statistics.median(f):.2f} ms, outside {1e3*(statistics.median(ts)-statistics.median(f)):.2f} ms")
pstats.Stats(pr).sort_stats("tottime").print_stats(25)
