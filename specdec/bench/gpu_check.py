"""`python -m specdec.bench.gpu_check`: the engine on a lent GPU, in one short prepared run.

A lent GPU machine is bare, offline and short-lived (minutes), with its own torch and
transformers and no Triton, so this checks the engine in process, with the deployment's
GPU settings (deploy/settings/gpu.json: bfloat16 on CUDA, every served method):

1. parity: our forward against transformers' on the same weights, float32 and bfloat16;
2. greedy identity: every method's output against the plain baseline, token for token,
   at concurrency 1 and 16 in bfloat16 and at concurrency 4 in float32 (the dtype whose
   identity the greedy-margin study proves on CPU);
3. throughput: per-user tok/s at c=1 and aggregate tok/s at c=16 for every method over
   the baseline, measured side by side in this run (baseline before and after).

Each section is timed against a deadline and written as it finishes, so a run cut short
still returns what it measured. Nothing here is asserted: it is a record (results/gpu/).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import time
import traceback
from pathlib import Path
from typing import Callable

import torch

from specdec.config import METHOD_NONE, SamplingParams, ServingConfig
from specdec.engine.models.llama import build_batch
from specdec.engine.models.loading import load_transformer
from specdec.serving.runtime import build_engine
from specdec.serving.spec_engine import SpecEngine
from specdec.bench.engine_runs import run_requests
from specdec_client.envinfo import provenance, write_result

REPO_ROOT = Path(__file__).resolve().parents[2]
GPU_SETTINGS = REPO_ROOT / "deploy" / "settings" / "gpu.json"


class Record:
    """The run's JSON, rewritten after every section (stamped with the provenance of its start:
    a lent machine's copy of the tree may not be a git checkout, and then says so: commit null)."""

    def __init__(self, path: Path, deadline: float):
        self.path, self.deadline = path, deadline
        self.started = provenance()
        self.data: dict = {"env": env(), "sections": {}}
        self.flush()

    def flush(self) -> None:
        write_result(self.path, self.data, self.started, indent=1)

    def section(self, name: str, fn: Callable[[], dict], need_s: float = 0.0) -> dict | None:
        left = self.deadline - time.monotonic()
        if left < need_s:
            self.data["sections"][name] = {"skipped": f"{left:.0f} s left of the run's budget, {need_s:.0f} needed"}
            self.flush()
            return None
        t0 = time.monotonic()
        try:
            out = fn()
        except Exception as exc:  # a record: the next section still runs
            out = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
        out["seconds"] = round(time.monotonic() - t0, 2)
        self.data["sections"][name] = out
        self.flush()
        print(f"== {name}: {json.dumps(out)[:1500]}", flush=True)
        return out


LAYER_NAMES = {  # GGUF tensor -> Hugging Face Llama name (per block)
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}


def hf_dir_from_gguf(gguf_path: Path, files_dir: Path, out_dir: Path) -> Path:
    """The prepared float32 directory, made with gguf's own de-quantiser and no transformers:
    the machine's transformers may read GGUF differently from the version `specdec prepare`
    pins. files_dir holds the prepared config and tokenizer files (small, carried); the
    weights are checked against `specdec prepare`'s on the CPU machine before a GPU run."""
    import shutil

    import numpy as np
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from safetensors.torch import save_file

    from specdec.engine.models.quantized import _unpermute_rows

    cfg = json.loads((files_dir / "config.json").read_text())
    heads = {"attn_q": cfg["num_attention_heads"], "attn_k": cfg["num_key_value_heads"]}
    state = {}
    for t in GGUFReader(str(gguf_path)).tensors:
        w = dequantize(t.data, t.tensor_type).astype(np.float32)
        w = w.reshape([int(d) for d in reversed(t.shape)])  # GGUF lists the input dimension first
        if t.name == "token_embd.weight":
            name = "model.embed_tokens.weight"
        elif t.name == "output_norm.weight":
            name = "model.norm.weight"
        elif t.name == "output.weight":
            name = "lm_head.weight"
        else:
            _, block, kind, _ = t.name.split(".")
            name = f"model.layers.{block}.{LAYER_NAMES[kind]}.weight"
            if kind in heads:
                w = w[_unpermute_rows(w.shape[0], heads[kind])]
        state[name] = torch.from_numpy(np.ascontiguousarray(w))
    out_dir.mkdir(parents=True, exist_ok=True)
    for f in files_dir.iterdir():
        shutil.copy(f, out_dir / f.name)
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return out_dir


def env() -> dict:
    import transformers

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
            "cuda": torch.version.cuda, "gpu": gpu, "date": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


@torch.no_grad()
def parity(model_dir: Path, prompts: list[list[int]], device: str) -> dict:
    """Full-sequence logits, ours vs transformers, per dtype; bfloat16 also against the
    float32 reference (its own rounding is the yardstick: transformers' bf16 vs fp32)."""
    from transformers import AutoModelForCausalLM

    out: dict = {"prompts": len(prompts), "positions": sum(len(p) for p in prompts)}
    logits: dict = {}
    for dtype, torch_dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        ours = load_transformer(model_dir, dtype=dtype, device=device)
        hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch_dtype).to(device).eval()
        cache = ours.new_cache(2, max(len(p) for p in prompts) + 8, 16)
        slot = cache.allocate()
        for i, ids in enumerate(prompts):
            a = ours(build_batch([slot], [0], [ids], device=device), cache).logits[0].float()
            b = hf(torch.tensor([ids], device=device)).logits[0].float()
            logits[(dtype, "ours", i)], logits[(dtype, "hf", i)] = a, b
        del ours, hf

    def compare(x: tuple, y: tuple) -> dict:
        diffs = [(logits[(*x, i)] - logits[(*y, i)]).abs().max().item() for i in range(len(prompts))]
        agree = sum((logits[(*x, i)].argmax(-1) == logits[(*y, i)].argmax(-1)).sum().item() for i in range(len(prompts)))
        return {"max_abs_logit_diff": max(diffs), "top1_agreement": agree / out["positions"]}

    out["ours_fp32_vs_hf_fp32"] = compare(("float32", "ours"), ("float32", "hf"))
    out["ours_bf16_vs_hf_bf16"] = compare(("bfloat16", "ours"), ("bfloat16", "hf"))
    out["ours_bf16_vs_hf_fp32"] = compare(("bfloat16", "ours"), ("float32", "hf"))
    out["hf_bf16_vs_hf_fp32"] = compare(("bfloat16", "hf"), ("float32", "hf"))
    return out


def generate(engine: SpecEngine, prompts: list[list[int]], params: SamplingParams, method: str, concurrency: int) -> dict:
    """engine_runs.run_requests with each request's token ids (under "ids"), and a limit: a
    stuck engine must not eat the lease."""
    ids: dict[str, list[int]] = {}
    return {**run_requests(engine, prompts, params, method, None, concurrency, token_ids=ids, limit_s=60.0), "ids": ids}


def identity(run: dict, baseline: dict) -> dict:
    """Requests whose tokens equal the baseline's; for the others, where they part."""
    same, parted = 0, []
    for rid, want in baseline["ids"].items():
        got = run["ids"].get(rid, [])
        if got == want:
            same += 1
        else:
            parted.append(next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want))))
    return {"identical": same, "requests": len(baseline["ids"]), "first_divergence": parted}


def summary(run: dict, baseline: dict, key: str) -> dict:
    return {key: round(run[key], 2), "over_baseline": round(run[key] / baseline[key], 3),
            "acceptance_length": round(run["mean_acceptance_length"], 3), **identity(run, baseline)}


def engine_for(model_dir: Path, settings: ServingConfig, dtype: str, device: str) -> SpecEngine:
    config = dataclasses.replace(settings.engine, dtype=dtype, device=device)
    return build_engine(model_dir, config, settings.methods)


def sweep(new_engine: Callable[[], SpecEngine], methods: list[str], prompts: list[list[int]], new_tokens: int,
          concurrency: int, key: str, deadline: float, record: "Record", name: str) -> dict:
    """Baseline, every method, baseline again (the drift between the two is the noise). Each
    run has its own cache salt: no run reuses another's prefix KV or learns (suffix decoding)
    from the answers an earlier run generated for the same prompts."""
    def params(run: str) -> SamplingParams:
        return SamplingParams(max_tokens=new_tokens, ignore_eos=True, cache_salt=f"{run}-c{concurrency}")

    # On a GPU the first passes of each shape are several times slower (lazy kernel loading,
    # the caching allocator growing): a first lease measured the baseline at 22.7 tok/s per
    # user, then 74.6 after the sweep. Every run is warmed at its own concurrency first.
    warm = SamplingParams(max_tokens=32, ignore_eos=True, cache_salt="warm-up")
    engine = new_engine()
    generate(engine, prompts, warm, METHOD_NONE, concurrency)
    baseline = generate(engine, prompts, params("baseline"), METHOD_NONE, concurrency)
    out: dict = {"concurrency": concurrency, "requests": len(prompts), "new_tokens": new_tokens,
                 "baseline": {key: round(baseline[key], 2)}, "methods": {}}
    record.data["sections"][name] = out  # partial results survive a cut-short run
    for method in methods:
        if time.monotonic() > deadline:
            out["methods"][method] = {"skipped": "out of time"}
            continue
        try:
            generate(engine, prompts, warm, method, concurrency)
            out["methods"][method] = summary(generate(engine, prompts, params(method), method, concurrency), baseline, key)
        except Exception as exc:  # recorded; the engine may hold the failed requests, so the next method gets a fresh one
            out["methods"][method] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-2500:]}
            engine = new_engine()
        record.flush()
        print(f"   {method} c={concurrency}: {json.dumps(out['methods'][method])[-600:]}", flush=True)
    again = generate(engine, prompts, params("baseline-again"), METHOD_NONE, concurrency)
    out["baseline_again"] = {key: round(again[key], 2), **identity(again, baseline)}
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", required=True, type=Path)
    parser.add_argument("--model-files", required=True, type=Path, help="the prepared model's config and tokenizer files")
    parser.add_argument("--model-dir", required=True, type=Path, help="where the float32 directory is written")
    parser.add_argument("--prompts", required=True, type=Path, help="JSON list of chat-encoded prompt ids")
    parser.add_argument("--settings", type=Path, default=GPU_SETTINGS)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--budget-s", type=float, default=360.0)
    parser.add_argument("--device", default="cuda", help="cpu: a dry run of the script itself")
    parser.add_argument("--methods", nargs="*", help="a subset of the settings' methods (default: all)")
    parser.add_argument("--skip-parity", action="store_true")
    parser.add_argument("--scale", type=float, default=1.0, help="fraction of the requests and tokens (a dry run)")
    args = parser.parse_args(argv)
    deadline = time.monotonic() + args.budget_s
    record = Record(args.out, deadline)
    prompts = json.loads(args.prompts.read_text())
    settings = ServingConfig.from_file(args.settings)
    methods = args.methods or list(settings.methods)
    settings = dataclasses.replace(settings, methods={m: settings.methods[m] for m in methods})
    record.data["settings"] = str(args.settings.relative_to(REPO_ROOT)) if args.settings.is_relative_to(REPO_ROOT) else str(args.settings)
    model_dir = hf_dir_from_gguf(args.gguf, args.model_files, args.model_dir)
    if not args.skip_parity:
        record.section("parity", lambda: parity(model_dir, prompts[:4], args.device))

    def run(name: str, dtype: str, concurrency: int, count: int, new_tokens: int, key: str, stop_at: float) -> dict:
        count, new_tokens = max(1, int(count * args.scale)), max(4, int(new_tokens * args.scale))
        return sweep(lambda: engine_for(model_dir, settings, dtype, args.device), methods, (prompts * 4)[:count],
                     new_tokens, concurrency, key, stop_at, record, name)

    # The bf16 sweeps are the deployment's; float32 identity comes last (most likely to be cut).
    for name, dtype, c, count, new, key, stop in (("bfloat16_c1", "bfloat16", 1, 3, 96, "per_user_tok_s", 0.55),
                                                  ("bfloat16_c16", "bfloat16", 16, 16, 96, "output_tok_s", 0.8),
                                                  ("float32_c4_identity", "float32", 4, 8, 64, "output_tok_s", 0.97)):
        stop_at = deadline - (1 - stop) * args.budget_s  # each sweep leaves the next its share
        record.section(name, lambda: run(name, dtype, c, count, new, key, stop_at), need_s=20)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
