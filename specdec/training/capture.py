"""Capture: the target's features a drafter trains on, and the cache they are read from.
One record per sequence: the tokens, the EAGLE-3 tap layers' outputs and the last layer's
(fp16 where they fit), and the target's own next token as the label (-1 where the text is
not the target's). They come from a teacher-forced prefill (conversations, stored
answers) or are recorded while the target answers (self-distillation: the taps the
verifier hands to drafters); cached in shards on disk, so a re-run reads them back and
resumes. `training_data` assembles what a trainer reads from its data options
(`add_data_arguments`).
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from torch import Tensor

from specdec.config import cache_root
from specdec.engine.drafters.base import Drafter
from specdec.engine.models.llama import Transformer, build_batch
from specdec.engine.tree import DraftTree
from specdec.serving.traffic_capture import feature_layers, read_captures
from specdec.training.data import (
    FEATURE_FORMATS, distill_prompts, feature_cache_suffix, load_shard, select_conversations, user_openings,
)


def compact(features: Tensor) -> Tensor:
    """fp16 halves the cache, but Gemma 3's residual stream passes fp16's range (its first
    features held inf, and training went NaN): those keep bf16's range instead."""
    return features.half() if features.abs().max() < torch.finfo(torch.float16).max else features.bfloat16()


def split_features(hidden: Tensor, num_layers: int) -> tuple[Tensor, Tensor]:
    """[T, num_layers * H] recorded feature_layers -> (EAGLE-3 taps, last layer [T, H]),
    compact."""
    H = hidden.shape[-1] // num_layers
    return compact(hidden[:, :-H]).contiguous(), compact(hidden[:, -H:]).contiguous()


class _TapRecorder(Drafter):
    """Drafts nothing; keeps the tap-layer outputs the verifier hands to drafters, so each
    self-distilled sequence comes out of its generation pass with its features (no second
    target pass). Prompt positions get no label (-1): only the answer is the target's own."""

    name = "record"

    def __init__(self, tap_layers: tuple[int, ...]):
        self.tap_layers = tuple(tap_layers)
        self.finished: dict[str, dict] = {}

    def propose(self, seqs, budgets):
        return [DraftTree() for _ in seqs]

    def on_prefill(self, seq, hidden):
        seq.drafter_state[self.name] = [hidden.float()]

    def on_verified(self, seq, emitted, accepted, hidden):
        seq.drafter_state[self.name].append(hidden.float())

    def on_finish(self, seq):
        taps, last = split_features(torch.cat(seq.drafter_state.pop(self.name)), len(self.tap_layers))  # positions 0 .. len(all_ids) - 2
        ids = seq.all_ids
        labels = torch.full((len(taps),), -1, dtype=torch.int32)
        labels[len(seq.prompt_ids) - 1 :] = torch.tensor(ids[len(seq.prompt_ids) : len(taps) + 1], dtype=torch.int32)
        self.finished[seq.request_id] = {"tokens": torch.tensor(ids[: len(taps)], dtype=torch.int32), "taps": taps, "last": last,
                                         "labels": labels}


def self_distilled_features(target: Transformer, tokenizer, n: int, new_tokens: int, seed: int, exclude: set[tuple[int, ...]],
                            feature_dir: Path, batch: int = 32, shard: int = 64, generate: bool = True) -> list[dict]:
    """First-turn ShareGPT prompts answered by the target itself (greedy, batched in our
    engine), with features recorded during generation: drafting happens on the target's
    own text, so train on it too. Cached in shards; re-running resumes."""
    from specdec.config import EngineConfig, SamplingParams
    from specdec.serving.spec_engine import SpecEngine

    prompts = distill_prompts(tokenizer, n, seed, exclude, draw=n + len(exclude) + 64)
    recorder = _TapRecorder(feature_layers(target.cfg))
    engine = SpecEngine(target, EngineConfig(max_batch_size=batch, max_seq_len=512), tokenizer, {recorder.name: recorder})

    def make(start: int, stop: int) -> list[dict]:
        todo = [(str(i), prompts[i]) for i in range(start, stop)]
        recorder.finished.clear()
        while todo or engine.has_work():
            while todo and len(engine.sequences) < batch:
                rid, ids = todo.pop(0)
                engine.add_request(rid, ids, SamplingParams(max_tokens=new_tokens), recorder.name, 1)
            engine.step()
        return [recorder.finished[k] for k in sorted(recorder.finished, key=int)]

    return cached_shards(feature_dir, len(prompts), shard, make, "self-distill (prompts; answer tokens)",
                         lambda part: sum(int((f["labels"] >= 0).sum()) for f in part), generate)


@torch.inference_mode()
def target_features(target: Transformer, seqs: list[list[int]]) -> list[dict]:
    """EAGLE-3 taps [T, 3H], the last layer's output [T, H] (fp16) and the target's argmax
    next token [T] per sequence."""
    cache = target.new_cache(len(seqs), max(len(s) for s in seqs) + 1, 1)
    slots = [cache.allocate() for _ in seqs]
    layers = feature_layers(target.cfg)
    out = target(build_batch(slots, [0] * len(seqs), seqs), cache, tap_layers=layers)
    features = []
    for b, s in enumerate(seqs):
        taps, last = split_features(out.hidden_taps[b, : len(s)], len(layers))
        features.append({"tokens": torch.tensor(s, dtype=torch.int32), "taps": taps, "last": last,
                         "labels": out.logits[b, : len(s)].argmax(-1).int()})
    return features


def cached_shards(feature_dir: Path, total: int, shard: int, make_part, label: str, count, make_missing: bool = True) -> list[dict]:
    """Features for items [0, total) in shards of `shard` files under feature_dir: existing
    shards are read, missing ones made by make_part(start, stop) and saved, so a re-run
    resumes. `count(part)` is the tokens a part adds (for the progress line). Without
    make_missing, the shards made so far (up to the first missing one) are the data."""
    feature_dir.mkdir(parents=True, exist_ok=True)
    features: list[dict] = []
    t0, made = time.perf_counter(), 0
    for start in range(0, total, shard):
        path = feature_dir / f"shard_{start // shard:05d}.pt"
        if path.is_file():
            features += torch.load(path, weights_only=True)
            continue
        if not make_missing:
            print(f"{label}: using the {len(features)} of {total} made so far (--no-generate)", flush=True)
            break
        part = make_part(start, min(start + shard, total))
        torch.save(part, path)
        features += part
        made += count(part)
        print(f"{label}: {len(features)}/{total}, {made / (time.perf_counter() - t0):.0f} tok/s", flush=True)
    return features


def build_features(target: Transformer, seqs: list[list[int]], feature_dir: Path, shard: int = 16) -> list[dict]:
    def make(start: int, stop: int) -> list[dict]:
        chunk = sorted(seqs[start:stop], key=len)
        part: list[dict] = []
        for i in range(0, len(chunk), 4):  # small ragged batches of similar length
            part += target_features(target, chunk[i : i + 4])
        return part

    return cached_shards(feature_dir, len(seqs), shard, make, "features (sequences)", lambda part: sum(len(f["tokens"]) for f in part))


def answer_features(target: Transformer, answers_dir: Path, feature_dir: Path, first_prompt: int = 0, batch: int = 4) -> list[dict]:
    """Features for the stored greedy answers (`specdec distill-answers`): one teacher-forced
    prefill of prompt + answer gives the taps and the target's argmax at every position;
    only answer positions keep a label (the prompt is ShareGPT's, the answer the target's
    own). Cached per answer shard (same file name), so answers added later, in any order,
    only cost their own prefill. Prompts before `first_prompt` are skipped."""
    feature_dir.mkdir(parents=True, exist_ok=True)
    features: list[dict] = []
    t0, made = time.perf_counter(), 0
    for path in sorted(answers_dir.glob("shard_*.npz")):
        cached = feature_dir / f"{path.stem}.pt"
        if cached.is_file():
            part = torch.load(cached, weights_only=True)
        else:
            rows = sorted(load_shard(path, target.cfg.vocab_size), key=lambda r: len(r[1]) + len(r[2]))
            if all(index < first_prompt for index, _, _ in rows):
                continue  # a shard the run skips whole: no prefill (cached shards are whole shards)
            part = []
            for i in range(0, len(rows), batch):  # ragged batches of similar length
                chunk = rows[i : i + batch]
                with torch.inference_mode():
                    made_features = target_features(target, [prompt + answer for _, prompt, answer in chunk])
                for (index, prompt, _), f in zip(chunk, made_features):
                    f["labels"] = f["labels"].clone()  # out of inference mode
                    f["labels"][: len(prompt) - 1] = -1  # ShareGPT's prompt: not the target's text
                    f["labels"][-1] = -1  # after the last answer token (after EOS, or past the token budget)
                    f["prompt_index"] = index
                    part.append(f)
            torch.save(part, cached)
            made += sum(len(f["tokens"]) for f in part)
            print(f"answer features: {path.name}, {made / (time.perf_counter() - t0):.0f} tok/s", flush=True)
        features += [f for f in part if f["prompt_index"] >= first_prompt]
    return features


@torch.inference_mode()
def captured_features(target: Transformer, directory: Path, salts: set[str | None] | None = None) -> list[dict]:
    """Sequences recorded from served traffic (specdec/serving/traffic_capture.py), each position
    labelled with the target's own prediction, recomputed from the recorded last layer
    (final norm, then lm_head; the argmax the served target took), as the conversations'
    are. `salts`: only those tenants' sequences (None in it: the unsalted)."""
    features = []
    for s in read_captures(directory, salts):
        last = s["last"].float()
        labels = torch.cat([target.lm_head(target.norm(last[i : i + 256])).argmax(-1) for i in range(0, len(last), 256)]).int()
        features.append({"tokens": s["tokens"], "taps": s["taps"], "last": s["last"], "labels": labels, "captured": True})
    return features


def add_data_arguments(p: argparse.ArgumentParser, conversations: int, max_len: int, self_distill_tokens: int,
                       eval_prompts: int, eval_tokens: int) -> None:
    """The data and run options train-eagle3 and train-draft share (one feature cache)."""
    p.add_argument("--model-dir", default=None)
    p.add_argument("--conversations", type=int, default=conversations)
    p.add_argument("--holdout", type=float, default=0.05)
    p.add_argument("--max-len", type=int, default=max_len)
    p.add_argument("--self-distill", type=int, default=0, help="also train on N prompts answered by the target (greedy)")
    p.add_argument("--self-distill-tokens", type=int, default=self_distill_tokens)
    p.add_argument("--gen-batch", type=int, default=32, help="sequences generated at once for --self-distill")
    p.add_argument("--answers", action="append", default=[],
                   help="also train on the target's stored answers (a `specdec distill-answers` directory; repeatable)")
    p.add_argument("--answers-from", type=int, default=0,
                   help="only the first --answers directory's answers to prompts from this index on (the others whole)")
    p.add_argument("--no-generate", action="store_true", help="train on the self-distilled shards made so far (no generation)")
    p.add_argument("--features-only", action="store_true", help="make the feature cache, then stop (no training)")
    p.add_argument("--captures", action="append", default=[], help="also train on a store of served traffic "
                   "(`specdec serve --capture DIR`; repeatable)")
    p.add_argument("--capture-salt", action="append", default=None, help="only the captured sequences of this cache_salt "
                   "('' for the unsalted; repeatable; default: all)")
    p.add_argument("--feature-format", choices=FEATURE_FORMATS, default="float32",
                   help="the target's weight format that computes the training features and labels (and runs EAGLE-3's and "
                        "Medusa's held-out check): int8, the served CPU target's own; bfloat16, faster; each its own feature cache")
    p.add_argument("--train-dtype", choices=("float32", "bfloat16"), default="float32",
                   help="bfloat16: the drafter's forward and loss under bfloat16 autocast (fp32 weights, gradients "
                        "and optimizer; ~2x the steps a minute on CPUs with AMX)")
    p.add_argument("--checkpoint-every-min", type=float, default=5.0, help="save the run's state this often (a killed run, "
                   "re-run with the same command, continues from the last save)")
    p.add_argument("--max-steps", type=int, default=None, help="pause after this optimizer step (checkpointed; re-run to continue)")
    p.add_argument("--restart", action="store_true", help="ignore a checkpoint left by an earlier run of this command")
    p.add_argument("--draft-vocab", type=int, default=8192)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--eval-prompts", type=int, default=eval_prompts)
    p.add_argument("--eval-tokens", type=int, default=eval_tokens)
    p.add_argument("--features-dir", default=None, help="feature cache (default: <cache>/head-features/<settings>; "
                   "with --feature-format int8 or bfloat16, the format is appended to its name)")
    p.add_argument("--quick", action="store_true", help="tiny run for tests: 24 conversations, 1 epoch")


def training_data(args, target: Transformer, tokenizer) -> tuple[list[list[int]], int, list[dict], list[dict]]:
    """(conversations, held-out count, training features, held-out features): ShareGPT
    conversations with the target's features and labels (cached), plus the self-distilled
    answers when asked for."""
    if args.quick:
        args.conversations, args.max_len, args.epochs, args.draft_vocab, args.eval_prompts, args.eval_tokens = 24, 96, 1, 2048, 2, 16
    seqs = select_conversations(tokenizer, args.conversations, args.max_len, args.seed)
    n_held = max(1, int(len(seqs) * args.holdout))
    # keyed by the target too: two targets' features must never share a cache
    target_key = "" if args.model_dir is None else f"{Path(args.model_dir).resolve().name}-"
    suffix = feature_cache_suffix(args.feature_format)
    base = Path(args.features_dir or cache_root() / "head-features" / f"{target_key}n{args.conversations}-len{args.max_len}-seed{args.seed}")
    feature_dir = base.with_name(base.name + suffix)
    features = build_features(target, seqs, feature_dir)
    train_set, held = features[:-n_held], features[-n_held:]
    if args.self_distill:
        distill_dir = feature_dir.parent / f"{target_key}selfdistill-rec-n{args.self_distill}-t{args.self_distill_tokens}-seed{args.seed}{suffix}"
        held_openings = {tuple(ids) for ids in user_openings(seqs[-n_held:], tokenizer)}
        train_set = train_set + self_distilled_features(target, tokenizer, args.self_distill, args.self_distill_tokens, args.seed,
                                                        held_openings, distill_dir, batch=args.gen_batch, generate=not args.no_generate)
    for directory in args.captures:
        salts = None if args.capture_salt is None else {salt or None for salt in args.capture_salt}
        train_set = train_set + captured_features(target, Path(directory), salts)
    for i, directory in enumerate(args.answers):
        answers = Path(directory)
        train_set = train_set + answer_features(target, answers, feature_dir.parent / f"{target_key}answers-{answers.name}{suffix}",
                                                args.answers_from if i == 0 else 0)
    return seqs, n_held, train_set, held
