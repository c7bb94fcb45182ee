"""`specdec distill-answers`: the target's own greedy answers to first-turn ShareGPT
prompts, kept as token ids so that they accumulate across machines and sessions.

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

import numpy as np


ANSWERS_DIR = Path("data/answers")


def answers_dir(new_tokens: int, seed: int) -> Path:
    return ANSWERS_DIR / f"smollm2-135m-greedy-t{new_tokens}-seed{seed}"


def save_shard(path: Path, indices: list[int], prompts: list[list[int]], answers: list[list[int]]) -> None:
    def flat(rows: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
        offsets = np.cumsum([0] + [len(r) for r in rows]).astype(np.int64)
        return np.array([t for r in rows for t in r], dtype=np.uint16), offsets  # vocabulary 49,152 < 2**16

    prompt_ids, prompt_offsets = flat(prompts)
    answer_ids, answer_offsets = flat(answers)
    tmp = path.parent / f".{path.name}"  # not matched by shard_*.npz until renamed
    np.savez_compressed(tmp, index=np.array(indices, dtype=np.int64), prompt_ids=prompt_ids, prompt_offsets=prompt_offsets,
                        answer_ids=answer_ids, answer_offsets=answer_offsets)
    tmp.rename(path)  # a shard is there whole or not at all


def load_shard(path: Path) -> list[tuple[int, list[int], list[int]]]:
    """[(prompt index, prompt ids, answer ids)]"""
    z = np.load(path)
    po, ao = z["prompt_offsets"], z["answer_offsets"]
    return [(int(i), z["prompt_ids"][po[k] : po[k + 1]].astype(np.int64).tolist(), z["answer_ids"][ao[k] : ao[k + 1]].astype(np.int64).tolist())
            for k, i in enumerate(z["index"])]


def load_answers(directory: Path, limit: int | None = None) -> list[tuple[int, list[int], list[int]]]:
    """Every stored (prompt index, prompt ids, answer ids), in prompt order, up to `limit` prompts."""
    out = []
    for path in sorted(directory.glob("shard_*.npz")):
        out += load_shard(path)
        if limit is not None and len(out) >= limit:
            return out[:limit]
    return out


def greedy_answers(target, tokenizer, prompts: list[list[int]], new_tokens: int, batch: int) -> list[list[int]]:
    """Plain (baseline) greedy decoding of every prompt in the batched engine."""
    from specdec.config import EngineConfig, SamplingParams
    from specdec.serving.spec_engine import SpecEngine

    engine = SpecEngine(target, EngineConfig(max_batch_size=batch, max_seq_len=512), tokenizer, {})
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
    p.add_argument("--out", default=None, help=f"default: {ANSWERS_DIR}/smollm2-135m-greedy-t<new-tokens>-seed<seed>")
    p.add_argument("--model-dir", default=None)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--minutes", type=float, default=None, help="stop after the shard that passes this much time")
    args = p.parse_args(argv)

    import torch

    from specdec.training.train_eagle3 import distill_prompts, heldout_openings, target_and_tokenizer

    target, tokenizer = target_and_tokenizer(args)
    prompts = distill_prompts(tokenizer, args.prompts, args.seed, heldout_openings(tokenizer, args.conversations, args.max_len, args.seed))
    out = Path(args.out) if args.out else answers_dir(args.new_tokens, args.seed)
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
        save_shard(path, indices, part, answers)
        made += sum(len(a) for a in answers)
        elapsed = time.perf_counter() - t0
        print(f"{path.name}: prompts {indices[0]}-{indices[-1]}, {made} answer tokens, {made / elapsed:.0f} tok/s", flush=True)
        if args.minutes is not None and elapsed > args.minutes * 60:
            break
    return 0
