"""`specdec bench-draft`: does an independent draft model pay on this machine? -> results/draft/

For each draft directory (e.g. the same recipe at several depths): the cost of one draft pass
as a fraction of one target step (batch 1, 256 tokens of context), then greedy decoding of
the same ShareGPT prompts at concurrency 1 in process, the plain baseline and each draft at
each draft length, side by side in one run: output tok/s and its ratio to the baseline,
mean acceptance length and per-position acceptance. Nothing here is asserted.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

from specdec.bench.bench_engine import env_record
from specdec.bench.engine_runs import run_requests
from specdec_client.envinfo import write_result
from specdec.config import EngineConfig, SamplingParams, SpeculativeConfig
from specdec.tools.sharegpt import sharegpt_prompts
from specdec.serving.spec_engine import SpecEngine
from specdec.config import default_model_dir
from specdec.engine.models.loading import load_transformer
from specdec.serving.runtime import build_drafters, encode_prompt, load_tokenizer
from specdec.training.heldout import pass_ms


def run(args) -> dict:
    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = Path(args.model_dir or default_model_dir())
    tokenizer = load_tokenizer(model_dir)
    texts = sharegpt_prompts(args.prompts, seed=0, tokenizer=tokenizer, min_tokens=16, max_tokens=256)
    prompts = [encode_prompt(tokenizer, t) for t in texts]
    target = load_transformer(model_dir)
    cfg = EngineConfig(max_batch_size=4, max_seq_len=2048)
    drafts = {Path(d).name: SpeculativeConfig(method="draft_model", max_draft_len=max(args.lengths), speculative_model=str(d))
              for d in args.drafts}
    drafters = build_drafters(target.cfg, drafts, cfg, model_dir, embed=target.embed)
    engine = SpecEngine(target, cfg, tokenizer, drafters)
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    run_requests(engine, prompts[:1], SamplingParams(max_tokens=8, ignore_eos=True), "none", 0, 1)  # warm-up
    target_ms = pass_ms(target)
    result: dict = {"env": env_record("float32"), "prompts": len(prompts), "max_tokens": args.max_tokens, "concurrency": 1,
                    "target_step_ms": target_ms, "baseline": run_requests(engine, prompts, params, "none", 0, 1), "drafts": {}}
    base = result["baseline"]["output_tok_s"]
    for name, drafter in drafters.items():
        draft_ms = pass_ms(drafter.model)
        runs = {}
        for k in args.lengths:
            r = run_requests(engine, prompts, params, name, k, 1)
            r["over_baseline"] = r["output_tok_s"] / base
            runs[str(k)] = r
            print(f"{name} K={k}: {r['output_tok_s']:.1f} tok/s = {r['over_baseline']:.2f}x baseline, "
                  f"MAL {r['mean_acceptance_length']:.2f}", flush=True)
        params_mb = sum(p.numel() for n, p in drafter.model.named_parameters() if not n.startswith("embed.")) * 2 / 2**20
        result["drafts"][name] = {"path": str(drafts[name].speculative_model), "layers": drafter.model.cfg.num_layers,
                                  "bf16_mb_without_embedding": params_mb, "draft_pass_ms": draft_ms,
                                  "draft_cost_fraction": draft_ms / target_ms, "runs": runs}
    result["baseline_again"] = run_requests(engine, prompts, params, "none", 0, 1)  # drift check: the machine is noisy
    return result


def markdown(result: dict) -> str:
    rows = ["| draft | layers | MB (bf16) | pass / target step | K | tok/s vs baseline | mean acc. len | per-position acceptance |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, d in result["drafts"].items():
        for k, r in d["runs"].items():
            rows.append(f"| {name} | {d['layers']} | {d['bf16_mb_without_embedding']:.1f} | {d['draft_cost_fraction']:.3f} | {k} | "
                        f"{r['over_baseline']:.2f}x | {r['mean_acceptance_length']:.2f} | "
                        f"{', '.join(f'{a:.2f}' for a in r['per_position_acceptance'][: int(k)])} |")
    b0, b1 = result["baseline"]["output_tok_s"], result["baseline_again"]["output_tok_s"]
    rows.append(f"\nBaseline {b0:.1f} tok/s (again at the end: {b1:.1f}); target step {result['target_step_ms']:.1f} ms; "
                f"{result['prompts']} ShareGPT prompts x {result['max_tokens']} tokens, greedy, c=1, in process.")
    return "\n".join(rows) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="specdec bench-draft", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("drafts", nargs="+", help="draft model directories")
    p.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 3, 4])
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--model-dir", default=None)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default="results/draft")
    args = p.parse_args(argv)
    save(run(args), Path(args.out), "bench_draft", markdown)
    return 0


def save(result: dict, out: Path, stem: str, render) -> None:
    """A benchmark's result as <stem>.json and its table as <stem>.md (also printed)."""
    write_result(out / f"{stem}.json", result)
    (out / f"{stem}.md").write_text(render(result))
    print(render(result))
