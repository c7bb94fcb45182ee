"""`specdec greedy-margin`: why greedy speculation emits exactly the baseline's tokens, and
by how much that could fail.

A greedy baseline emits each step's argmax from a one-row decode forward; speculation
emits the argmax of a verification row (the root or an accepted node of a tree, several
rows in one forward, tree-masked attention). The two rows compute the same function on
different shapes, so they can differ in the last bits, and the outputs stay identical as
long as that difference never reaches the gap between the two best logits. This measures
both sides on the same prompts, in process:

- the margin: at every step of the baseline, top-1 minus top-2 logit (smallest reached,
  quantiles, how many steps fall under small thresholds);
- the distance: every target row that emitted a token under a method, compared with the
  baseline's row at the same position (max abs difference over the vocabulary), up to the
  first token that differs; a token can only flip where 2 x distance >= margin;
- identity: outputs identical to the baseline's, and at each divergence the baseline's
  margin there and the distance that flipped it.

Prefix caching is off so every run starts from a fresh prefill. Writes one JSON file with
commit, date and machine (`make greedy-margin`).
"""
from __future__ import annotations

import argparse
import contextlib
import time
from typing import Iterator

import numpy as np
import torch

import specdec.engine.target as target_module
from specdec.config import METHOD_NONE, WEIGHT_FORMATS, EngineConfig, SamplingParams
from specdec.serving.runtime import build_engine, encode_prompt, served_methods
from specdec.tools.sharegpt import sharegpt_prompts
from specdec_client.envinfo import provenance, write_result

MARGIN_THRESHOLDS = (1e-4, 1e-3, 1e-2, 1e-1)


@contextlib.contextmanager
def recorded_rows() -> Iterator[list[torch.Tensor]]:
    """Every target row that emits a token, in emission order (one request at a time): the
    prompt's last row (first token), then per verification the root and each accepted node."""
    rows: list[torch.Tensor] = []
    verify, first_token = target_module.verify_greedy, target_module.TargetPass._first_token

    def recording_verify(tree, logits):
        result = verify(tree, logits)
        rows.append(logits[[0] + [node + 1 for node in result.accepted_nodes]].float().clone())
        return result

    def recording_first_token(self, seq, last_logits):
        rows.append(last_logits[:1].float().clone())
        return first_token(self, seq, last_logits)

    target_module.verify_greedy, target_module.TargetPass._first_token = recording_verify, recording_first_token
    try:
        yield rows
    finally:
        target_module.verify_greedy, target_module.TargetPass._first_token = verify, first_token


def decode(engine, prompt: list[int], params: SamplingParams, method: str,
           num_draft_tokens: int | None = None) -> tuple[list[int], torch.Tensor, int]:
    """Output ids, the logits row behind each (up to max_tokens) and the number of outputs
    (the prefill's, then one per step); num_draft_tokens None: the method's own budget."""
    with recorded_rows() as rows:
        ids, steps = [], 0
        for out in engine.generate(prompt, params, method, num_draft_tokens, request_id=f"margin-{method}"):
            ids += out.new_token_ids
            steps += 1
    return ids, torch.cat(rows)[: len(ids)], steps


def margins(logits: torch.Tensor) -> np.ndarray:
    top2 = logits.topk(2, dim=-1).values
    return (top2[:, 0] - top2[:, 1]).numpy()


def quantiles(values: list[float] | np.ndarray) -> dict[str, float | None]:
    if len(values) == 0:
        return {"min": None, "p0.1": None, "p1": None, "p50": None, "max": None}
    v = np.asarray(values, dtype=np.float64)
    return {"min": float(v.min()), "p0.1": float(np.quantile(v, 0.001)), "p1": float(np.quantile(v, 0.01)),
            "p50": float(np.quantile(v, 0.5)), "max": float(v.max())}


def study(dtype: str, methods: list[str], num_prompts: int, max_tokens: int, seed: int, log=print,
          weight_format: str | None = None) -> dict:
    engine = build_engine(config=EngineConfig(max_batch_size=2, max_seq_len=1024, dtype=dtype, weight_format=weight_format,
                                              enable_prefix_caching=False))
    tok = engine.tokenizer
    prompts = [encode_prompt(tok, t) for t in sharegpt_prompts(num_prompts, seed=seed, tokenizer=tok, min_tokens=8, max_tokens=256)]
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    all_margins: list[np.ndarray] = []
    per_method = {m: {"identical": 0, "of": 0, "compared_rows": 0, "distances": [], "flippable_rows": 0,
                      "divergences": [], "emitted": 0, "steps": 0} for m in methods}
    t0 = time.monotonic()
    for p, prompt in enumerate(prompts):
        base_ids, base_logits, _ = decode(engine, prompt, params, METHOD_NONE)
        base_margin = margins(base_logits)
        all_margins.append(base_margin)
        for method in methods:
            ids, logits, steps = decode(engine, prompt, params, method)
            rec = per_method[method]
            rec["of"] += 1
            rec["emitted"] += len(ids) - 1  # speculative steps only: the prefill's first token is not one
            rec["steps"] += steps - 1
            first_diff = next((i for i, (a, b) in enumerate(zip(ids, base_ids)) if a != b), None)
            same = len(ids) if first_diff is None else first_diff + 1  # the diverging row is compared too
            dist = (logits[:same] - base_logits[:same]).abs().amax(dim=-1).numpy()
            rec["compared_rows"] += same
            rec["distances"].extend(dist.tolist())
            rec["flippable_rows"] += int((2 * dist >= base_margin[:same]).sum())
            if first_diff is None:
                rec["identical"] += 1
            else:
                rec["divergences"].append({"prompt": p, "position": first_diff, "baseline_margin": float(base_margin[first_diff]),
                                           "distance": float(dist[first_diff])})
        if (p + 1) % 10 == 0 or p + 1 == len(prompts):
            summary = ", ".join(f"{m} {r['identical']}/{r['of']}" for m, r in per_method.items())
            log(f"[{weight_format or dtype}] {p + 1}/{len(prompts)} prompts, {time.monotonic() - t0:.0f} s: identical {summary}")
    margin_all = np.concatenate(all_margins)
    out_methods = {}
    for method, rec in per_method.items():
        distances = rec.pop("distances")
        out_methods[method] = {**rec, "distance": quantiles(distances),
                               "mean_acceptance_length": rec["emitted"] / rec["steps"] if rec["steps"] else None}  # max_tokens cuts the last
    return {
        "dtype": dtype, "weight_format": weight_format or dtype, "prompts": len(prompts), "max_tokens": max_tokens, "seed": seed,
        "baseline": {"rows": int(margin_all.size), "margin": quantiles(margin_all),
                     "rows_with_margin_below": {str(t): int((margin_all < t).sum()) for t in MARGIN_THRESHOLDS}},
        "methods": out_methods,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="specdec greedy-margin", description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--weight-format", default=None, choices=list(WEIGHT_FORMATS),
                    help="the target's weights (engine.weight_format; default: dense in --dtype)")
    ap.add_argument("--prompts", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--methods", default="all", help="comma-separated methods of model_repository/specdec.json, or all")
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    methods = list(served_methods()) if args.methods == "all" else args.methods.split(",")
    started = provenance()
    result = {"command": "specdec greedy-margin " + " ".join(argv or []),
              **study(args.dtype, methods, args.prompts, args.max_tokens, args.seed, weight_format=args.weight_format)}
    write_result(args.out, result, started, indent=1)
    print(f"wrote {args.out}")
    return 0
