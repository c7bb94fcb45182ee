"""`specdec distill-answers`: the target's own greedy answers to first-turn ShareGPT
prompts (`--turn 2`: to second turns, after turn one and its dataset answer), kept as token ids
so that they accumulate across machines and sessions.

Decoding is the slow part of making target-regenerated training data (about 170 answer
tokens/s on 2 CPU cores); the features a head trains on are recomputed from the ids by one
teacher-forced prefill per answer (several times faster), so only the ids are worth
keeping. Shards of `--shard` prompts are written as they finish (`shard_00042.npz`: the
prompt indices, the prompt and answer ids, flat, with offsets); a re-run skips the shards
already there, so generation can stop at any time and resume elsewhere. The prompt order
is train-eagle3's self-distillation order (seeded, the benchmarks' prompts and the
held-out conversations left out), so shard k always holds the same prompts.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

from specdec.training.data import (
    ANSWERS_DIR, DEFAULT_ANSWERS_TARGET, answers_dir, distill_prompts, heldout_openings, save_shard, second_turn_prompts, target_and_tokenizer,
)


def greedy_answers(target, tokenizer, prompts: list[list[int]], new_tokens: int, batch: int) -> list[list[int]]:
    """Plain (baseline) greedy decoding of every prompt in the batched engine."""
    from specdec.config import EngineConfig, SamplingParams
    from specdec.serving.spec_engine import SpecEngine

    # room for the longest prompt and its whole answer (second turns run to 512 prompt tokens)
    max_seq_len = max(512, max((len(p) for p in prompts), default=0) + new_tokens)
    engine = SpecEngine(target, EngineConfig(max_batch_size=batch, max_seq_len=max_seq_len), tokenizer, {})
    todo = [(str(i), ids) for i, ids in enumerate(prompts)]
    answers: dict[str, list[int]] = {}
    while todo or engine.has_work():
        while todo and len(engine.sequences) < batch:
            rid, ids = todo.pop(0)
            engine.add_request(rid, ids, SamplingParams(max_tokens=new_tokens))
        for out in engine.step():
            answers.setdefault(out.request_id, []).extend(out.new_token_ids)
    return [answers[str(i)] for i in range(len(prompts))]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="specdec distill-answers", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=12000, help="prompts in the order (the first --start are skipped)")
    p.add_argument("--start", type=int, default=0, help="first prompt index to answer (earlier shards are left alone)")
    p.add_argument("--new-tokens", type=int, default=192)
    p.add_argument("--batch", type=int, default=32, help="sequences decoded at once")
    p.add_argument("--shard", type=int, default=64)
    p.add_argument("--seed", type=int, default=0, help="train-eagle3's --seed (its conversations' held-out part is left out)")
    p.add_argument("--conversations", type=int, default=600, help="train-eagle3's --conversations (for the held-out part)")
    p.add_argument("--max-len", type=int, default=256, help="train-eagle3's --max-len (for the held-out part)")
    p.add_argument("--turn", type=int, choices=(1, 2), default=1,
                   help="1: first-turn prompts; 2: second turns (turn one, its dataset answer, turn two), their own order and directory")
    p.add_argument("--out", default=None, help=f"default: {ANSWERS_DIR}/<target>-greedy-t<new-tokens>-seed<seed>[-turn2] "
                                                f"(<target>: {DEFAULT_ANSWERS_TARGET}, or --model-dir's name)")
    p.add_argument("--model-dir", default=None)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--minutes", type=float, default=None, help="stop after the shard that passes this much time")
    args = p.parse_args(argv)

    import torch

    target, tokenizer = target_and_tokenizer(args)
    held = heldout_openings(tokenizer, args.conversations, args.max_len, args.seed)
    prompts = (distill_prompts if args.turn == 1 else second_turn_prompts)(tokenizer, args.prompts, args.seed, held)
    name = DEFAULT_ANSWERS_TARGET if args.model_dir is None else Path(args.model_dir).resolve().name.lower()
    out = Path(args.out) if args.out else answers_dir(args.new_tokens, args.seed, args.turn, name)
    out.mkdir(parents=True, exist_ok=True)
    t0, made = time.perf_counter(), 0
    first = args.start // args.shard
    for k in range(first, (len(prompts) + args.shard - 1) // args.shard):
        path = out / f"shard_{k:05d}.npz"
        if path.is_file():
            continue
        indices = list(range(k * args.shard, min((k + 1) * args.shard, len(prompts))))
        part = [prompts[i] for i in indices]
        with torch.inference_mode():
            answers = greedy_answers(target, tokenizer, part, args.new_tokens, args.batch)
        save_shard(path, indices, part, answers, target.cfg.vocab_size)
        made += sum(len(a) for a in answers)
        elapsed = time.perf_counter() - t0
        print(f"{path.name}: prompts {indices[0]}-{indices[-1]}, {made} answer tokens, {made / elapsed:.0f} tok/s", flush=True)
        if args.minutes is not None and elapsed > args.minutes * 60:
            break
    return 0
