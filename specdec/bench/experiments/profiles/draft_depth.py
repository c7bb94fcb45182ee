"""What one EAGLE-3 draft depth costs beside one target forward (issue 73 item 3, for the drafts
issue): the served engine in process (int8 target on the native forward, int8 head), c=1, the
shipped chain (`eagle3`) and dynamic tree (`eagle3-tree`), each call timed where it is made.

    python -m specdec.bench.experiments.profiles.draft_depth --out results/profiles/draft_depth.json

Reports medians of: a target forward (the verification step), one head pass (a draft depth), one
propose (every depth of a step plus its Python), and their ratios. Nothing is asserted.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from specdec_client.envinfo import write_result

from specdec.bench.engine_runs import run_requests
from specdec.config import EngineConfig, SamplingParams
from specdec.engine.drafters.eagle3 import Eagle3Drafter
from specdec.engine.models import native_forward
from specdec.serving.runtime import build_engine, encode_prompt
from specdec.tools.sharegpt import sharegpt_prompts

METHODS = ("eagle3", "eagle3-tree")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="results/profiles/draft_depth.json")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=96)
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    engine = build_engine(config=EngineConfig(max_batch_size=4, max_seq_len=1024, weight_format="int8", draft_dtype="int8"))
    texts = sharegpt_prompts(args.prompts, seed=0, tokenizer=engine.tokenizer, min_tokens=16, max_tokens=256)
    prompts = [encode_prompt(engine.tokenizer, t) for t in texts]
    times: dict[str, list[float]] = {"target": [], "depth": [], "propose": []}

    def timed(key, fn):
        def wrapper(*a, **k):
            start = time.perf_counter()
            result = fn(*a, **k)
            times[key].append(time.perf_counter() - start)
            return result
        return wrapper

    native_forward.ForwardPlan.forward = timed("target", native_forward.ForwardPlan.forward)
    Eagle3Drafter._step = timed("depth", Eagle3Drafter._step)
    Eagle3Drafter.propose = timed("propose", Eagle3Drafter.propose)
    run_requests(engine, prompts[:1], SamplingParams(max_tokens=8, ignore_eos=True), "eagle3", None, 1)  # warm-up
    out = {}
    for method in METHODS:
        for samples in times.values():
            samples.clear()
        run = run_requests(engine, prompts, SamplingParams(max_tokens=args.max_tokens, ignore_eos=True), method, None, 1)
        target_ms, depth_ms, propose_ms = (1e3 * statistics.median(times[k]) for k in ("target", "depth", "propose"))
        out[method] = {
            "target_forward_ms": round(target_ms, 3), "draft_depth_ms": round(depth_ms, 3), "propose_ms": round(propose_ms, 3),
            "depths_per_propose": round(len(times["depth"]) / max(1, len(times["propose"])), 2),
            "draft_depth_over_target_forward": round(depth_ms / target_ms, 3),
            "propose_over_target_forward": round(propose_ms / target_ms, 3),
            "per_user_tok_s": round(run["per_user_tok_s"], 1), "mean_acceptance_length": round(run["mean_acceptance_length"], 2),
        }
        print(method, out[method])
    write_result(args.out, {"prompts": args.prompts, "max_tokens": args.max_tokens, "methods": out})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
