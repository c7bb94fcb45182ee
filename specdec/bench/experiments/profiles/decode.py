"""Plain decode c=1 profile: engine step vs model forward vs GEMV-only probe."""
import sys, time, statistics, torch
from specdec.config import EngineConfig, SamplingParams, default_model_dir
from specdec.engine.models.loading import load_transformer
from specdec.engine.models.llama import build_batch
from specdec.serving.spec_engine import SpecEngine
from specdec.bench.bench_engine import read_bandwidth_gbs

dtype = sys.argv[1] if len(sys.argv) > 1 else "float32"
model = load_transformer(default_model_dir(), dtype=dtype)
weights = sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())
bw = read_bandwidth_gbs()
print(f"dtype={dtype} weights={weights/1e6:.0f}MB bw={bw:.1f}GB/s floor={bw*1e9/weights:.1f} tok/s threads={torch.get_num_threads()}")
engine = SpecEngine(model, EngineConfig(max_batch_size=4, max_seq_len=1024, dtype=dtype))
prompt = list(range(100, 300))
def run(n):
    engine.add_request("r", prompt, SamplingParams(max_tokens=n, ignore_eos=True))
    times = []
    while engine.has_work():
        t0 = time.perf_counter(); engine.step(); times.append(time.perf_counter() - t0)
    return times
run(8)
t = run(129)[1:]
print(f"engine step median {1e3*statistics.median(t):.2f} ms -> {1/statistics.median(t):.1f} tok/s")
# forward alone, one token, context ~300
cache = model.new_cache(1, 1024, 16); s = cache.allocate()
model(build_batch([s], [0], [prompt]), cache, last_only=True); cache.commit(s, range(len(prompt)))
b = build_batch([s], [len(prompt)], [[5]])
for _ in range(5): model(b, cache)
ts = []
for _ in range(30):
    t0 = time.perf_counter(); model(b, cache); ts.append(time.perf_counter() - t0)
print(f"forward b1k1 median {1e3*statistics.median(ts):.2f} ms")
tb = []
for _ in range(30):
    t0 = time.perf_counter(); build_batch([s], [len(prompt)], [[5]]); tb.append(time.perf_counter() - t0)
print(f"build_batch {1e3*statistics.median(tb):.3f} ms")
# GEMV-only probe through the same Linear modules
x = torch.randn(1, 1, model.cfg.hidden_size)
lins = []
for layer in model.layers:
    lins += [(layer.attn.wqkv, model.cfg.hidden_size), (layer.attn.wo, layer.attn.wo.in_features), (layer.mlp.w13, model.cfg.hidden_size), (layer.mlp.w2, layer.mlp.w2.in_features)]
lins.append((model.lm_head, model.cfg.hidden_size))
xs = {n: torch.randn(1, n) for _, n in lins}
def gemv():
    with torch.inference_mode():
        for lin, n in lins: lin(xs[n])
gemv(); gemv()
tg = []
for _ in range(30):
    t0 = time.perf_counter(); gemv(); tg.append(time.perf_counter() - t0)
print(f"linears only {1e3*statistics.median(tg):.2f} ms ({len(lins)} calls) -> {weights/statistics.median(tg)/1e9:.1f} GB/s")
with torch.profiler.profile() as prof:
    for _ in range(10): model(b, cache)
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18))
