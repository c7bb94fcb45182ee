"""What the grammar costs per step at c=16 (issue 35: "the mask costs <= 10% of a step").

In process (SpecEngine, the served settings), the structured workload's first 32 tasks,
16 at a time (closed loop), greedy, max_tokens as each task says (160), per mode: every call into the grammar
(pruning and forced drafts before the forward, the tree walk filling bitmasks, applying
them to the logits, advancing the matchers) is timed, next to the engine's step wall time.
Run: .venv/bin/python specdec/bench/experiments/structured/mask_cost.py > results/bench/structured/mask_cost.txt
"""
from __future__ import annotations

import json
import time
from pathlib import Path

from specdec.config import SamplingParams
from specdec.engine import grammar as G
from specdec.serving.runtime import build_engine, encode_prompt

TASKS = Path(__file__).resolve().parents[4] / "data" / "structured" / "tasks.jsonl"
SPENT = {"draft (prune + forced)": 0.0, "masks (tree walk)": 0.0, "apply (logits)": 0.0, "advance": 0.0}
NAMES = {"draft": "draft (prune + forced)", "masks": "masks (tree walk)", "apply": "apply (logits)", "advance": "advance"}


def timed(name, fn):
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            SPENT[NAMES[name]] += time.perf_counter() - t0
    return wrapper


for name in NAMES:
    setattr(G.GuidedSequence, name, timed(name, getattr(G.GuidedSequence, name)))


def run(engine, tasks, method: str, concurrency: int = 16) -> tuple[float, int, int]:
    pending = list(tasks)
    tokens = steps = 0
    step_s = 0.0
    n = 0

    def admit():
        nonlocal n
        while pending and len(engine.sequences) < concurrency:
            task = pending.pop(0)
            params = SamplingParams(max_tokens=task["max_tokens"], guide_type=task["guide_type"], guide=task["guide"])
            engine.add_request(f"r{n}", encode_prompt(engine.tokenizer, task["prompt"]), params, method)
            n += 1

    admit()
    while engine.has_work():
        t0 = time.perf_counter()
        outs = engine.step()
        step_s += time.perf_counter() - t0
        steps += 1
        tokens += sum(len(o.new_token_ids) for o in outs)
        admit()
    return step_s, steps, tokens


def main() -> None:
    tasks = [json.loads(line) for line in TASKS.read_text().splitlines()][:32]
    engine = build_engine()
    run(engine, tasks[:4], "none", 4)  # warm-up: compiles the grammars, the first forwards
    print("c=16, 32 structured tasks, greedy, max_tokens 160, in process")
    print("| mode | step wall s | steps | tokens | grammar s | grammar share of step time | " + " | ".join(SPENT) + " |")
    print("|---|---|---|---|---|---|" + "---|" * len(SPENT))
    for method in ("none", "eagle3-hybrid", "eagle3", "ngram-tree"):
        for key in SPENT:
            SPENT[key] = 0.0
        step_s, steps, tokens = run(engine, tasks, method)
        grammar_s = sum(SPENT.values())
        print(f"| {method} | {step_s:.2f} | {steps} | {tokens} | {grammar_s:.3f} | {100 * grammar_s / step_s:.1f}% | "
              + " | ".join(f"{v:.3f}" for v in SPENT.values()) + " |")


if __name__ == "__main__":
    main()
