"""`specdec bench-head-acceptance`: each EAGLE-3 head version on each workload (issue 62).

Greedy decoding in process on the served weight format (int8), with prompts no head of the
comparison trained on unless the table says so:
- sharegpt: the benchmarks' first-turn prompts (reserved from every training set);
- code: the capture cycle's held-out code prompts (never served, never trained on);
- multi-turn: second turns of reserved conversations (turn one, its dataset answer, turn two);
- captured: the capture cycle's served traffic replayed (the captured head trained on it).
Per head and workload: mean acceptance length as a chain (K=5) and as a dynamic tree (depth 4 x
top-4, 12 nodes: eagle3-tree's served shape until 2026-12-06), and c=1 speed against plain
decoding, measured prompt by prompt beside it (interleaved, same process). Writes <out>/summary.json.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

from specdec_client.envinfo import provenance, write_result

from specdec.config import REPO_ROOT, SERVED_SETTINGS, EngineConfig, SamplingParams, ServingConfig, SpeculativeConfig, default_model_dir
from specdec.serving.runtime import build_drafters, encode_prompt, load_target, load_tokenizer
from specdec.serving.spec_engine import SpecEngine
from specdec.serving.stats import SpecStats
from specdec.tools.sharegpt import sharegpt_conversations, sharegpt_prompts
from specdec.training.data import benchmark_prompt_texts, second_turn, select_conversations, user_openings

SHIPPED_HEAD = REPO_ROOT / "models" / "eagle3-smollm2-135m"
# The shapes a head's acceptance is measured in (issue 62's targets: a chain of 5 and a dynamic
# tree): fixed here, not the served ones, which follow the verify cost (make bench-tree-shapes).
CHAIN = SpeculativeConfig(method="eagle3", max_draft_len=5)
TREE = SpeculativeConfig(method="eagle3", max_draft_len=4, use_dynamic_tree=True, dynamic_tree_max_topK=4, max_total_draft_tokens=12)


def served_engine(**overrides) -> EngineConfig:
    """The served engine settings (weight format, draft dtype, ...) with `overrides`."""
    return dataclasses.replace(ServingConfig.from_file(SERVED_SETTINGS).engine, **overrides)


def served_tree() -> SpeculativeConfig:
    """eagle3-tree as specdec.json serves it, without its concurrency cap."""
    raw = dict(json.loads(SERVED_SETTINGS.read_text())["methods"]["eagle3-tree"])
    raw.pop("max_concurrency", None)
    return SpeculativeConfig(**raw)


def trained_openings(tokenizer, heads: dict[str, str]) -> set[tuple[int, ...]]:
    """The user openings of every ShareGPT conversation a head of the comparison trained on
    (its train_log's selection): multi-turn prompts starting with one are left out."""
    out: set[tuple[int, ...]] = set()
    for head in heads.values():
        log = Path(head) / "train_log.json"
        data = json.loads(log.read_text()).get("data", {}) if log.exists() else {}
        if data.get("conversations"):
            seqs = select_conversations(tokenizer, data["conversations"], data["max_len"], data["seed"])
            out |= {tuple(ids) for ids in user_openings(seqs, tokenizer)}
    return out


def multi_turn_prompts(tokenizer, n: int, exclude: set[tuple[int, ...]]) -> list[list[int]]:
    """Second turns (turn one, its dataset answer, turn two) of conversations whose first prompt
    is reserved for benchmarks and that no head trained on."""
    reserved = benchmark_prompt_texts()
    out = []
    for conv in sharegpt_conversations():
        found = second_turn(tokenizer, conv, exclude)
        if found is not None and found[0].strip() in reserved and 32 <= len(found[1]) <= 768:
            out.append(found[1])
            if len(out) == n:
                break
    return out


def workloads(tokenizer, n: int, cycle_prompts: Path | None, heads: dict[str, str]) -> dict[str, list[list[int]]]:
    sets = {"sharegpt": [encode_prompt(tokenizer, t) for t in sharegpt_prompts(n, seed=0, tokenizer=tokenizer, min_tokens=4, max_tokens=256)],
            "multi-turn": multi_turn_prompts(tokenizer, n, trained_openings(tokenizer, heads))}
    if cycle_prompts and cycle_prompts.exists():
        cycle = json.loads(cycle_prompts.read_text())
        sets["code"] = [encode_prompt(tokenizer, t) for t in cycle["heldout"][:n]]
        sets["captured"] = [encode_prompt(tokenizer, t) for t in cycle["train"][:n]]
    return sets


def beside_plain(engine: SpecEngine, method: str, prompts: list[list[int]], max_tokens: int) -> dict:
    """Greedy `method` (its configured budget) with plain decoding run beside it prompt by
    prompt (interleaved, same process): acceptance, and c=1 speed against plain."""
    seconds, tokens, stats = {"none": 0.0, method: 0.0}, {"none": 0, method: 0}, SpecStats()
    for i, ids in enumerate(prompts):
        for name in ("none", method):
            t0 = time.perf_counter()
            # None: the method's configured budget (a tree's max_total_draft_tokens; max_draft_len
            # here cut the served tree to 4 nodes before 2026-12-06)
            for out in engine.generate(ids, SamplingParams(max_tokens=max_tokens), name, None if name == method else 0,
                                       request_id=f"{name}-{i}"):
                tokens[name] += len(out.new_token_ids)
            seconds[name] += time.perf_counter() - t0
            if name == method:
                stats.merge(out.stats)  # the request's own
    rows_per_step = 1 + stats.draft_tokens / max(stats.steps, 1)
    return {"mean_acceptance_length": stats.mean_acceptance_length, "acceptance_rate": stats.acceptance_rate,
            "per_position_acceptance": stats.per_position_acceptance, "steps": stats.steps, "draft_tokens": stats.draft_tokens,
            "rows_per_step": rows_per_step, "tokens_per_row": stats.mean_acceptance_length / rows_per_step,
            "speedup_c1": (tokens[method] / seconds[method]) / (tokens["none"] / seconds["none"]),
            "plain_tok_s": tokens["none"] / seconds["none"], "tok_s": tokens[method] / seconds[method]}


def measure(target, tokenizer, head: Path, prompts: list[list[int]], max_tokens: int) -> dict:
    """Chain and tree acceptance, and c=1 speed against plain decoding run beside each prompt."""
    engine_cfg = served_engine(max_batch_size=1, max_seq_len=2048)
    spec = {name: dataclasses.replace(cfg, speculative_model=str(head)) for name, cfg in (("chain", CHAIN), ("tree", TREE))}
    engine = SpecEngine(target, engine_cfg, tokenizer, build_drafters(target.cfg, spec, engine_cfg, embed=target.embed))
    return {"prompts": len(prompts), "max_tokens": max_tokens, **{name: beside_plain(engine, name, prompts, max_tokens) for name in spec}}


def run(args) -> dict:
    started = provenance()
    tokenizer = load_tokenizer(default_model_dir())
    target = load_target(default_model_dir(), served_engine())
    heads = dict(h.split("=", 1) for h in args.head) or {"shipped": str(SHIPPED_HEAD)}
    sets = workloads(tokenizer, args.prompts, Path(args.cycle_prompts) if args.cycle_prompts else None, heads)
    record: dict = {"heads": heads, "workloads": {name: len(p) for name, p in sets.items()}, "tree": TREE.__dict__,
                    "chain_draft_len": CHAIN.max_draft_len, "weight_format": served_engine().weight_format, "rows": []}
    for head_name, head_dir in heads.items():
        for workload, prompts in sets.items():
            t0 = time.perf_counter()
            row = {"head": head_name, "workload": workload, **measure(target, tokenizer, Path(head_dir), prompts, args.max_tokens)}
            record["rows"].append(row)
            print(f"{head_name:>12} {workload:>10}: chain MAL {row['chain']['mean_acceptance_length']:.2f} "
                  f"({row['chain']['speedup_c1']:.2f}x), tree MAL {row['tree']['mean_acceptance_length']:.2f} "
                  f"({row['tree']['speedup_c1']:.2f}x) [{time.perf_counter() - t0:.0f} s]", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_result(out / "summary.json", record, started)
    return record


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="specdec bench-head-acceptance", description=__doc__.splitlines()[0])
    p.add_argument("--head", action="append", default=[], metavar="NAME=DIR", help="a head version (repeatable; default: the shipped head)")
    p.add_argument("--cycle-prompts", default="results/capture_cycle/prompts.json",
                   help="the capture cycle's prompts: its held-out code prompts and its served traffic")
    p.add_argument("--prompts", type=int, default=12, help="prompts per workload")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--out", default="results/heads")
    run(p.parse_args(argv))


if __name__ == "__main__":
    main()
