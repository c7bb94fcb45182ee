"""`specdec bench-tree-shapes`: the EAGLE-3 draft's shape against the verifier's measured cost (issue 62, item 4).

With the row-invariant kernels a verification of n rows costs far less than n decodes, so the
shape that pays is the one whose extra accepted tokens outweigh its extra rows. This measures,
in process on the served weight format (int8) with the shipped head and held-out ShareGPT
prompts: for each shape (chains of K tokens, dynamic trees of depth x top-K with a node budget,
and the planner's own choice within the largest tree) and each head weight dtype asked for
(`--draft-dtype`, side by side shape by shape), greedy mean acceptance length (MAL), the
tokens each verified row yields, and c=1 speed against plain decoding run beside it prompt by
prompt (same process, interleaved). Writes <out>/summary.json.
"""
from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from specdec_client.envinfo import provenance, write_result

from specdec.bench.head_acceptance import SHIPPED_HEAD, beside_plain, served_engine, served_tree
from specdec.config import DRAFT_DTYPES, SpeculativeConfig, default_model_dir
from specdec.serving.runtime import build_drafters, encode_prompt, load_target, load_tokenizer
from specdec.serving.spec_engine import SpecEngine
from specdec.tools.sharegpt import sharegpt_prompts

# (name, settings): chains, then trees from narrow to wide, then the planner within the widest.
SHAPES: list[tuple[str, dict]] = [
    ("chain K=2", {"max_draft_len": 2}),
    ("chain K=3", {"max_draft_len": 3}),
    ("chain K=5", {"max_draft_len": 5}),
    ("tree d=3 k=2 n=6", {"max_draft_len": 3, "use_dynamic_tree": True, "dynamic_tree_max_topK": 2, "max_total_draft_tokens": 6}),
    ("tree d=4 k=2 n=8", {"max_draft_len": 4, "use_dynamic_tree": True, "dynamic_tree_max_topK": 2, "max_total_draft_tokens": 8}),
    ("tree d=4 k=4 n=12", {"max_draft_len": 4, "use_dynamic_tree": True, "dynamic_tree_max_topK": 4, "max_total_draft_tokens": 12}),
    ("tree d=5 k=4 n=16", {"max_draft_len": 5, "use_dynamic_tree": True, "dynamic_tree_max_topK": 4, "max_total_draft_tokens": 16}),
    ("tree d=6 k=4 n=24", {"max_draft_len": 6, "use_dynamic_tree": True, "dynamic_tree_max_topK": 4, "max_total_draft_tokens": 24}),
    ("planned, tree d=6 k=4 n=16", {"max_draft_len": 6, "use_dynamic_tree": True, "dynamic_tree_max_topK": 4, "max_total_draft_tokens": 16,
                                    "adaptive": True}),
]


def run(args) -> dict:
    started = provenance()
    tokenizer = load_tokenizer(default_model_dir())
    served = served_engine()
    target = load_target(default_model_dir(), served)
    prompts = [encode_prompt(tokenizer, t) for t in sharegpt_prompts(args.prompts, seed=0, tokenizer=tokenizer, min_tokens=4, max_tokens=256)]
    specs = {name: SpeculativeConfig(method="eagle3", speculative_model=str(args.head), **shape) for name, shape in SHAPES}
    most_nodes = max(s.get("max_total_draft_tokens", s["max_draft_len"]) for _, s in SHAPES)
    engines = {}
    for draft_dtype in args.draft_dtype or [served.draft_dtype]:  # one engine per draft dtype, sharing the target
        engine_cfg = dataclasses.replace(served, max_batch_size=1, max_seq_len=2048, draft_dtype=draft_dtype, max_num_draft_tokens=most_nodes)
        engines[draft_dtype] = SpecEngine(target, engine_cfg, tokenizer, build_drafters(target.cfg, specs, engine_cfg, embed=target.embed))
    record: dict = {"head": str(args.head), "weight_format": served.weight_format, "prompts": len(prompts),
                    "max_tokens": args.max_tokens, "served_eagle3_tree": served_tree().__dict__,
                    "served_draft_dtype": served.draft_dtype, "rows": []}
    for rep in range(args.repeats):
        for name, shape in SHAPES:
            for draft_dtype, engine in engines.items():  # the dtypes side by side, shape by shape
                row = {"shape": name, "settings": shape, "draft_dtype": draft_dtype, "repeat": rep,
                       **beside_plain(engine, name, prompts, args.max_tokens)}
                record["rows"].append(row)
                print(f"{name:>28} {draft_dtype:>8}: MAL {row['mean_acceptance_length']:.2f}, rows/step {row['rows_per_step']:.1f}, "
                      f"{row['speedup_c1']:.2f}x plain ({row['tok_s']:.1f} vs {row['plain_tok_s']:.1f} tok/s)", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_result(out / "summary.json", record, started)
    return record


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="specdec bench-tree-shapes", description=__doc__.splitlines()[0])
    p.add_argument("--head", type=Path, default=SHIPPED_HEAD)
    p.add_argument("--prompts", type=int, default=12, help="held-out ShareGPT prompts")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--repeats", type=int, default=1, help="passes over every shape (each pass is kept)")
    p.add_argument("--draft-dtype", action="append", choices=DRAFT_DTYPES,
                   help="the head's weights (repeatable: compared shape by shape; default: the served engine.draft_dtype)")
    p.add_argument("--out", default="results/tree_shapes")
    run(p.parse_args(argv))


if __name__ == "__main__":
    main()
