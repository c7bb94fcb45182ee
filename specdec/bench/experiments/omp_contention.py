"""Plain decoding and the eagle3 chain, batch 1, in process: tokens/s under the OpenMP settings of
the environment it runs in. Two of these side by side at 2 threads each on 2 cores collapse (GNU
OpenMP threads spin before they sleep); at 1 thread each they do not (results/suite/speed.json).

    python -m specdec.bench.experiments.omp_contention LABEL        # one run
    OMP_NUM_THREADS=1 python -m ... A & OMP_NUM_THREADS=1 python -m ... B; wait
"""
from __future__ import annotations

import dataclasses
import sys
import time

from specdec.bench.head_acceptance import CHAIN, SHIPPED_HEAD
from specdec.config import EngineConfig, SamplingParams, default_model_dir
from specdec.serving.runtime import build_drafters, encode_prompt, load_target, load_tokenizer
from specdec.serving.spec_engine import SpecEngine
from specdec.tools.sharegpt import sharegpt_prompts


def main(label: str, prompts: int = 4, max_tokens: int = 64) -> None:
    tokenizer = load_tokenizer(default_model_dir())
    target = load_target(default_model_dir(), EngineConfig(weight_format="int8"))
    ids = [encode_prompt(tokenizer, t) for t in sharegpt_prompts(prompts, seed=0, tokenizer=tokenizer, min_tokens=4, max_tokens=256)]
    config = EngineConfig(max_batch_size=1, max_seq_len=2048)
    spec = {"chain": dataclasses.replace(CHAIN, speculative_model=str(SHIPPED_HEAD))}
    engine = SpecEngine(target, config, tokenizer, build_drafters(target.cfg, spec, config, embed=target.embed))
    tok_s = {}
    for rep in range(2):  # the first pass warms up; the second is reported
        for method in ("none", "chain"):
            tokens, t0 = 0, time.perf_counter()
            for i, prompt in enumerate(ids):
                for out in engine.generate(prompt, SamplingParams(max_tokens=max_tokens), method,
                                           CHAIN.max_draft_len if method == "chain" else 0, request_id=f"{method}{rep}{i}"):
                    tokens += len(out.new_token_ids)
            tok_s[method] = tokens / (time.perf_counter() - t0)
    print(label, " ".join(f"{m} {v:.1f} tok/s" for m, v in tok_s.items()), flush=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "run")
