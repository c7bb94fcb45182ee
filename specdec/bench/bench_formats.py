"""`specdec bench-formats`: the target's plain decode in each weight format, side by side in one
run -> results/quantized/formats.json (issue 44).

Per format (engine.weight_format: float32, bfloat16, int8, gguf): the bytes a decode step
streams (every weight but the embedding, which is a lookup), the machine's read bandwidth and
the weight-streaming floor (bandwidth / bytes), greedy decode at concurrency 1 (per-user
tok/s) and 16 (aggregate tok/s), and the forward's latency against the rows verified (one
sequence, 1 to 32 rows) and at 16 sequences of one row. Beside them, one layer's cost curve
(the 3072 x 576 gate|up weight, 1 to 32 rows): our int8 kernel against PyTorch's weight-only
int8 kernel (bfloat16 activations, what the formats ran on before) and oneDNN's int8 x int8
`torch._int_mm` (the issue's timing baseline; it takes more than 16 rows). Nothing is asserted.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from specdec_client.envinfo import provenance, write_result

from specdec.config import WEIGHT_FORMATS, EngineConfig, SamplingParams, default_model_dir
from specdec.serving.runtime import encode_prompt, load_target, load_tokenizer
from specdec.serving.spec_engine import SpecEngine
from specdec.bench.bench_engine import forward_ms, read_bandwidth_gbs
from specdec.bench.engine_runs import run_requests
from specdec.tools.sharegpt import sharegpt_prompts


def streamed_bytes(model: torch.nn.Module) -> int:
    """What one decode step reads: every parameter and weight buffer except the embedding
    table (a row per token), counted once when tied to the lm_head."""
    seen, total = set(), 0
    embed = model.embed.weight
    lm_head_weight = getattr(model.lm_head, "weight", None)
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if id(t) in seen or name.endswith("inv_freq") or (t is embed and t is not lm_head_weight):
            continue
        seen.add(id(t))
        total += t.numel() * t.element_size()
    return total


def bench_format(weight_format: str, prompts: list[list[int]], max_tokens: int) -> dict:
    config = EngineConfig(max_batch_size=16, max_seq_len=1024, weight_format=weight_format)
    model = load_target(None, config)
    engine = SpecEngine(model, config)
    greedy = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    run_requests(engine, prompts[:1], SamplingParams(max_tokens=8, ignore_eos=True), "none", 0, 1)  # warm-up
    c1 = run_requests(engine, prompts[:4], greedy, "none", 0, 1)
    c16 = run_requests(engine, prompts[:16], greedy, "none", 0, 16)
    bandwidth = read_bandwidth_gbs()
    weights = streamed_bytes(model)
    floor = bandwidth * 1e9 / weights
    return {"streamed_bytes": weights, "read_bandwidth_gbs": round(bandwidth, 1), "floor_tok_s": round(floor, 1),
            "c1_per_user_tok_s": round(c1["per_user_tok_s"], 2), "c1_of_floor": round(c1["per_user_tok_s"] / floor, 3),
            "c16_aggregate_tok_s": round(c16["output_tok_s"], 1),
            "forward_ms": {"b1_k1": round(forward_ms(model, 1, 1), 2), "b16_k1": round(forward_ms(model, 16, 1), 2),
                           **{f"b1_k{k}": round(forward_ms(model, 1, k), 2) for k in CURVE_ROWS if k > 1}}}


CURVE_ROWS = (1, 2, 4, 8, 16, 32)


def layer_curve_us(repeats: int = 200) -> dict[str, dict[str, float]]:
    """One layer (gate|up, 3072 x 576) in microseconds against rows, per kernel: the median of
    `repeats` calls, the weight hot in cache (the compute side of the curve)."""
    from specdec.engine.kernels.int8 import Format, PackedInt8, int8_linear

    g = torch.Generator().manual_seed(0)
    codes = torch.randint(-127, 128, (3072, 576), generator=g, dtype=torch.int32).to(torch.int8)
    scale = torch.rand(3072, generator=g) * 0.01
    ours = PackedInt8.pack(codes, Format.ROW, column_scale=scale)
    codes_t = codes.t().contiguous()

    def timed(fn) -> float:
        for _ in range(10):
            fn()
        samples = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
        return round(sorted(samples)[len(samples) // 2] * 1e6, 1)

    curve: dict[str, dict[str, float]] = {"ours": {}, "torch_weight_int8pack_mm_bf16": {}, "torch_int_mm": {}}
    for rows in CURVE_ROWS:
        x = torch.randn(rows, 576, generator=g)
        curve["ours"][str(rows)] = timed(lambda: int8_linear(x, ours))
        xb = x.to(torch.bfloat16)
        curve["torch_weight_int8pack_mm_bf16"][str(rows)] = timed(
            lambda: torch.ops.aten._weight_int8pack_mm(xb, codes, scale.to(torch.bfloat16)))
        if rows > 16:
            xq = torch.randint(-127, 128, (rows, 576), generator=g, dtype=torch.int32).to(torch.int8)
            curve["torch_int_mm"][str(rows)] = timed(lambda: torch._int_mm(xq, codes_t))
    return curve


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="specdec bench-formats", description=__doc__.split("\n\n")[0])
    ap.add_argument("--formats", default=",".join(WEIGHT_FORMATS))
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("results/quantized/formats.json"))
    args = ap.parse_args(argv)
    tokenizer = load_tokenizer(default_model_dir())
    prompts = [encode_prompt(tokenizer, t) for t in sharegpt_prompts(16, seed=args.seed, tokenizer=tokenizer, min_tokens=8, max_tokens=200)]
    result = {**provenance(), "command": "specdec bench-formats " + " ".join(argv or []), "threads": torch.get_num_threads(),
              "max_tokens": args.max_tokens, "formats": {}}
    result["layer_curve_us"] = layer_curve_us()
    print("layer", json.dumps(result["layer_curve_us"]), flush=True)
    for weight_format in args.formats.split(","):
        t0 = time.monotonic()
        result["formats"][weight_format] = bench_format(weight_format, prompts, args.max_tokens)
        print(weight_format, json.dumps(result["formats"][weight_format]), f"({time.monotonic() - t0:.0f} s)", flush=True)
    write_result(args.out, result, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
