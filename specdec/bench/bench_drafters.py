"""`specdec bench-drafters`: every drafting family side by side, in process -> results/drafters/

The served methods named (model_repository/specdec.json settings, the shipped heads and
draft model) on the same ShareGPT prompts (the benchmarks' order, never trained on), at
each concurrency and temperature, with the plain baseline measured in the same run and
again at the end (drift check): mean acceptance length, per-position acceptance, drafting
and verifying milliseconds per sequence step, output tok/s and its ratio to the baseline.
The Triton numbers come from `specdec-client bench`; this is the engine alone. Nothing
here is asserted.
"""
from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import torch

from specdec.config import EngineConfig, SamplingParams, ServingConfig, default_model_dir
from specdec.engine.models.loading import load_transformer
from specdec.serving.runtime import build_drafters, encode_prompt, load_tokenizer, served_methods
from specdec.serving.spec_engine import SpecEngine
from specdec.bench.bench_draft import save
from specdec.bench.bench_engine import env_record
from specdec.bench.engine_runs import run_requests
from specdec.tools.sharegpt import sharegpt_prompts

DEFAULT_METHODS = "eagle3,eagle3-tree,eagle3-hybrid,medusa,medusa-tree,draft_model-colocated,ngram"


def run(args) -> dict:
    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = Path(args.model_dir or default_model_dir())
    tokenizer = load_tokenizer(model_dir)
    prompts = [encode_prompt(tokenizer, t) for t in sharegpt_prompts(args.prompts, seed=0, tokenizer=tokenizer, min_tokens=16, max_tokens=256)]
    target = load_transformer(model_dir)
    served = dict(ServingConfig.from_file(Path(args.settings)).methods) if args.settings else served_methods()
    methods = {name: spec for name, spec in served.items() if name in args.methods}
    if missing := [m for m in args.methods if m not in methods]:
        raise SystemExit(f"not in the settings: {', '.join(missing)}")
    cfg = EngineConfig(max_batch_size=max(args.concurrency), max_seq_len=2048)
    engine = SpecEngine(target, cfg, tokenizer, build_drafters(target.cfg, methods, cfg, model_dir, embed=target.embed))
    run_requests(engine, prompts[:1], SamplingParams(max_tokens=8, ignore_eos=True), "none", 0, 1)  # warm-up
    result: dict = {"env": env_record("float32"), "prompts": len(prompts), "max_tokens": args.max_tokens,
                    "settings": args.settings or "model_repository/specdec.json", "methods": {m: dataclasses.asdict(methods[m]) for m in args.methods},
                    "runs": []}
    for temperature in args.temperatures:
        params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, temperature=temperature, seed=0 if temperature else None)
        for c in args.concurrency:
            base = run_requests(engine, prompts, params, "none", 0, c)
            row = {"temperature": temperature, "concurrency": c, "baseline": base, "methods": {}}
            for name in args.methods:
                r = run_requests(engine, prompts, params, name, methods[name].max_total_draft_tokens, c)
                r["over_baseline"] = r["output_tok_s"] / base["output_tok_s"]
                row["methods"][name] = r
                print(f"T={temperature} c={c} {name}: {r['over_baseline']:.2f}x, MAL {r['mean_acceptance_length']:.2f}, "
                      f"draft {r['draft_ms_per_seq_step']:.1f} ms / verify {r['verify_ms_per_seq_step']:.1f} ms", flush=True)
            row["baseline_again"] = run_requests(engine, prompts, params, "none", 0, c)
            result["runs"].append(row)
    return result


def markdown(result: dict) -> str:
    lines = []
    for row in result["runs"]:
        b0, b1 = row["baseline"]["output_tok_s"], row["baseline_again"]["output_tok_s"]
        lines += [f"\n### T={row['temperature']}, c={row['concurrency']} (baseline {b0:.1f} tok/s, again at the end {b1:.1f})\n",
                  "| method | tok/s vs baseline | mean acc. len | draft ms / seq step | verify ms / seq step | per-position acceptance |",
                  "| --- | --- | --- | --- | --- | --- |"]
        for name, r in row["methods"].items():
            lines.append(f"| {name} | {r['over_baseline']:.2f}x | {r['mean_acceptance_length']:.2f} | {r['draft_ms_per_seq_step']:.1f} | "
                         f"{r['verify_ms_per_seq_step']:.1f} | {', '.join(f'{a:.2f}' for a in r['per_position_acceptance'][:6])} |")
    lines.append(f"\n{result['prompts']} ShareGPT prompts x {result['max_tokens']} tokens, in process, settings of {result['settings']}.")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="specdec bench-drafters", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--methods", type=lambda s: s.split(","), default=DEFAULT_METHODS.split(","))
    p.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4])
    p.add_argument("--temperatures", type=lambda s: [float(x) for x in s.split(",")], default=[0.0, 0.7])
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--settings", default=None, help="serving settings (JSON) naming the methods (default: model_repository/specdec.json)")
    p.add_argument("--model-dir", default=None)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default="results/drafters")
    args = p.parse_args(argv)
    save(run(args), Path(args.out), "bench_drafters", markdown)
    return 0
