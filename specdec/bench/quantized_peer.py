"""Our quantized targets beside llama.cpp on the same GGUF file and threads, in one run (issue 73):
plain decode against llama-bench's tg128 and one 512-token prompt's prefill against its pp512, for
weight_format gguf (the file's own Q4_1/Q8_0 blocks) and int8, with the forward's own cost
(forward_ms: one sequence, k rows, a 256-token context) against the weight-streaming floor
measured in the same run.

    specdec bench-quantized --llama-bench tmp/llamacpp/build/bin/llama-bench --out results/llamacpp/quantized.json
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from specdec_client.envinfo import write_result

from specdec.bench.bench_engine import forward_ms, read_bandwidth_gbs
from specdec.bench.bench_formats import streamed_bytes
from specdec.bench.engine_runs import run_requests
from specdec.config import EngineConfig, SamplingParams
from specdec.engine.models.llama import build_batch
from specdec.engine.models.native_forward import engine_info
from specdec.serving.runtime import load_target
from specdec.serving.spec_engine import SpecEngine

DECODE_TOKENS = 128  # llama-bench's tg128
PROMPT_TOKENS = 512  # and its pp512
ROWS = (1, 2, 4, 8, 16, 32)


def prefill_tok_s(model, tokens: int, repeats: int = 3) -> float:
    """One prompt of `tokens` tokens prefilled in one forward (llama-bench's pp: one sequence, one batch)."""
    prompt = [(7 * j) % 1000 + 10 for j in range(tokens)]
    best = float("inf")
    for _ in range(repeats):
        cache = model.new_cache(1, tokens + 8, 8)
        slot = cache.allocate()
        batch = build_batch([slot], [0], [prompt])
        start = time.perf_counter()
        model(batch, cache, last_only=True)
        best = min(best, time.perf_counter() - start)
    return tokens / best


def decode_tok_s(model, config: EngineConfig, repeats: int = 3) -> float:
    """Plain greedy decoding of DECODE_TOKENS tokens from a one-token prompt, through the engine
    (scheduler, sampling and bookkeeping included): tokens after the first per second."""
    engine = SpecEngine(model, config)
    params = SamplingParams(max_tokens=DECODE_TOKENS, ignore_eos=True)
    run_requests(engine, [[1]], SamplingParams(max_tokens=8, ignore_eos=True), "none", 0, 1)  # warm-up
    return statistics.median(run_requests(engine, [[1]], params, "none", 0, 1)["per_user_tok_s"] for _ in range(repeats))


def bench_format(weight_format: str, bandwidth_gbs: float) -> dict:
    config = EngineConfig(max_batch_size=16, max_seq_len=1024, weight_format=weight_format)
    model = load_target(None, config)
    weights = streamed_bytes(model)
    floor_ms = weights / (bandwidth_gbs * 1e9) * 1e3
    rows = {f"b1_k{k}": round(forward_ms(model, 1, k), 3) for k in ROWS}
    rows["b16_k1"] = round(forward_ms(model, 16, 1), 3)
    one = rows["b1_k1"]
    return {
        **engine_info(model, weight_format), "streamed_bytes": weights, "floor_ms": round(floor_ms, 3), "forward_ms": rows,
        "one_row_over_floor": round(one / floor_ms, 3),
        "rows_over_one": {k: round(v / one, 3) for k, v in rows.items()},
        "decode_tok_s": decode_tok_s(model, config), "prefill_tok_s": prefill_tok_s(model, PROMPT_TOKENS),
    }


def run(llama_bench: Path | None, threads: int, out: Path) -> dict:
    from specdec.engine.models.loading import default_gguf_path

    torch.set_num_threads(threads)
    before = read_bandwidth_gbs()
    result: dict = {"threads": threads, "decode_tokens": DECODE_TOKENS, "prompt_tokens": PROMPT_TOKENS, "formats": {}}
    peer = None
    if llama_bench is not None:
        from specdec.bench.llama_cpp import llama_bench as run_llama_bench

        peer = run_llama_bench(llama_bench, default_gguf_path(), PROMPT_TOKENS, DECODE_TOKENS, threads)
        result["llama_cpp"] = peer
    for weight_format in ("gguf", "int8"):
        result["formats"][weight_format] = bench_format(weight_format, before)
    after = read_bandwidth_gbs()
    result["read_bandwidth_gbs"] = {"before": round(before, 2), "after": round(after, 2)}
    for r in result["formats"].values():  # the floor from the lower reading: the bound most favourable to it
        floor_ms = r["streamed_bytes"] / (min(before, after) * 1e9) * 1e3
        r["floor_ms"], r["one_row_over_floor"] = round(floor_ms, 3), round(r["forward_ms"]["b1_k1"] / floor_ms, 3)
        if peer is not None:
            r["decode_over_llama_cpp"] = round(r["decode_tok_s"] / peer["decode_tok_s"], 3)
            r["prefill_over_llama_cpp"] = round(r["prefill_tok_s"] / peer["prompt_tok_s"], 3)
    write_result(out, result)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="specdec bench-quantized", description=__doc__.splitlines()[0])
    parser.add_argument("--llama-bench", type=Path, default=None, help="llama.cpp's llama-bench (make bench-llamacpp builds it)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--out", type=Path, default=Path("results/llamacpp/quantized.json"))
    args = parser.parse_args(argv)
    result = run(args.llama_bench, args.threads, args.out)
    peer = result.get("llama_cpp")
    for name, r in result["formats"].items():
        line = (f"{name:5s} forward 1 row {r['forward_ms']['b1_k1']:.2f} ms ({r['one_row_over_floor']:.2f}x floor), "
                f"8 rows {r['rows_over_one']['b1_k8']:.2f}x, 16 rows {r['rows_over_one']['b1_k16']:.2f}x; "
                f"decode {r['decode_tok_s']:.1f} tok/s, prefill {r['prefill_tok_s']:.0f} tok/s")
        if peer:
            line += f"; x llama.cpp: decode {r['decode_over_llama_cpp']:.2f}, prefill {r['prefill_over_llama_cpp']:.2f}"
        print(line)
    if peer:
        print(f"llama.cpp: tg{DECODE_TOKENS} {peer['decode_tok_s']:.1f} tok/s, pp{PROMPT_TOKENS} {peer['prompt_tok_s']:.0f} tok/s")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
