"""Held-out acceptance: real greedy speculative decoding in the batched engine, with a
freshly trained drafter, on the openings of conversations it never trained on (mean
acceptance length, acceptance rate, per position); for a draft model also the cost of
its pass against the target's step.
"""
from __future__ import annotations

import statistics
import time
from pathlib import Path

from specdec.engine.models.llama import Transformer, build_batch
from specdec.engine.models.loading import load_transformer


def heldout_acceptance(target: Transformer, head_dir: Path, tokenizer, held_prompts: list[list[int]], max_tokens: int,
                       method: str = "eagle3", draft_len: int = 5) -> dict:
    """Real greedy decoding with the head (linear, K=draft_len) on held-out conversation openings."""
    from specdec.config import EngineConfig, SamplingParams, SpeculativeConfig
    from specdec.serving.spec_engine import SpecEngine
    from specdec.serving.runtime import build_drafters

    engine_cfg = EngineConfig(max_batch_size=4, max_seq_len=2048)
    spec = {method: SpeculativeConfig(method=method, max_draft_len=draft_len, speculative_model=str(head_dir))}
    engine = SpecEngine(target, engine_cfg, tokenizer, build_drafters(target.cfg, spec, engine_cfg, embed=target.embed))
    for i, ids in enumerate(held_prompts):
        for _ in engine.generate(ids, SamplingParams(max_tokens=max_tokens), method, draft_len, request_id=f"h{i}"):
            pass
    s = engine.stats
    return {"prompts": len(held_prompts), "max_tokens": max_tokens, "num_draft_tokens": draft_len,
            "mean_acceptance_length": s.mean_acceptance_length, "acceptance_rate": s.acceptance_rate,
            "per_position_acceptance": s.per_position_acceptance}


def pass_ms(model, repeats: int = 30, context: int = 256) -> float:
    """Median milliseconds of one decode pass (batch 1, one new token, `context` cached)."""
    cache = model.new_cache(1, context + 8, 8)
    slot = cache.allocate()
    model(build_batch([slot], [0], [[(7 * j) % 1000 + 10 for j in range(context)]]), cache, last_only=True)
    cache.commit(slot, range(context))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        model(build_batch([slot], [context], [[11]]), cache)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1000


def heldout_decoding(target_dir: Path, draft_dir: Path, tokenizer, prompts: list[list[int]], max_tokens: int, k: int = 5) -> dict:
    """Real greedy speculative decoding with the draft (chain of k) on held-out openings,
    and the draft pass's cost relative to the target's."""
    from specdec.config import EngineConfig, SamplingParams, SpeculativeConfig
    from specdec.serving.spec_engine import SpecEngine
    from specdec.serving.runtime import build_drafters

    engine_cfg = EngineConfig(max_batch_size=4, max_seq_len=2048)
    target = load_transformer(target_dir)
    spec = {"draft": SpeculativeConfig(method="draft_model", max_draft_len=k, speculative_model=str(draft_dir))}
    drafters = build_drafters(target.cfg, spec, engine_cfg, target_dir, embed=target.embed)
    engine = SpecEngine(target, engine_cfg, tokenizer, drafters)
    for i, ids in enumerate(prompts):
        for _ in engine.generate(ids, SamplingParams(max_tokens=max_tokens), "draft", k, request_id=f"h{i}"):
            pass
    s = engine.stats
    draft_ms, target_ms = pass_ms(drafters["draft"].model), pass_ms(target)
    return {"prompts": len(prompts), "max_tokens": max_tokens, "num_draft_tokens": k,
            "mean_acceptance_length": s.mean_acceptance_length, "acceptance_rate": s.acceptance_rate,
            "per_position_acceptance": s.per_position_acceptance,
            "draft_pass_ms": draft_ms, "target_step_ms": target_ms, "draft_cost_fraction": draft_ms / target_ms}
