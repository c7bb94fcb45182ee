"""`specdec train-medusa`: train Medusa heads for the target on this machine.

The data and features are train-eagle3's (one cache: the same ShareGPT conversations and
target-answered prompts record the EAGLE-3 taps and the last layer's output), so both
heads learn from the same text. Head k at position t learns the target's own argmax at
t + 2 + k (Medusa-1: the target frozen, one residual block per head, loss weights 0.8^k;
the heads share one lm_head over the draft vocabulary, started from the target's rows).
Writes config.json, model.safetensors, train_log.json and README.md (the model card).
"""
from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from specdec_client.envinfo import provenance, write_result
from specdec.engine.models.medusa_heads import MedusaConfig, MedusaHeads, save_medusa
from specdec.training.capture import add_data_arguments, training_data
from specdec.training.data import labelling_target, target_and_tokenizer, user_openings
from specdec.training.fit import STEP_WEIGHT, TrainingPaused, draft_vocabulary, make_batch, optimize, plot_curve, top1_by_position
from specdec.training.heldout import heldout_acceptance


def medusa_batch(features: list[dict], num_heads: int, target_to_draft: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(last-layer outputs [B, T, H], labels [K, B, T]): head k's label at t is the draft id
    of the target's prediction at position t + k + 1, i.e. of token t + k + 2 (make_batch's
    step k: EAGLE-3's first step guesses the same token from the same position)."""
    last, _, labels = make_batch([{**f, "taps": f["last"]} for f in features], num_heads, target_to_draft)
    return last, labels


def init_heads(target, num_heads: int, vocab_ids: torch.Tensor) -> MedusaHeads:
    """Residual blocks at zero (each head starts as the target's own next-token guess, as
    Medusa does), lm_head from the target's rows of the draft vocabulary, the target's norm."""
    heads = MedusaHeads(MedusaConfig.for_target(target.cfg, num_heads, len(vocab_ids)))
    with torch.no_grad():
        for block in heads.medusa_head:
            block[0].linear.weight.zero_()
            block[0].linear.bias.zero_()
        heads.lm_head.weight.copy_(target.lm_head.weight.detach().float()[vocab_ids])
        heads.norm.weight.copy_(target.norm.weight.detach().float())
        heads.set_vocabulary(vocab_ids)
    heads.norm.weight.requires_grad_(False)  # the target's, frozen
    return heads


def train(heads: MedusaHeads, train_set: list[dict], args, target_to_draft: torch.Tensor) -> list[dict]:
    def loss_of(batch: list[dict]):
        last, labels = medusa_batch(batch, heads.cfg.num_heads, target_to_draft)
        keep = (labels >= 0).any(0)  # [B, T] positions some head has a label for
        logits = heads(last[keep])  # [K, N, Vd]
        kept = labels[:, keep]
        losses = [F.cross_entropy(logits[k], kept[k], ignore_index=-100) for k in range(heads.cfg.num_heads)]
        return sum(STEP_WEIGHT**k * l for k, l in enumerate(losses)), lambda: {
            "step_losses": [l.item() for l in losses], "train_top1_by_position": top1_by_position(logits, kept)}

    return optimize(heads, train_set, args, loss_of)


@torch.no_grad()
def heldout_top1(heads: MedusaHeads, held: list[dict], target_to_draft: torch.Tensor) -> list[float]:
    """P(head k's argmax equals the target's token at t + 2 + k), held out; targets outside
    the draft vocabulary count as misses."""
    K = heads.cfg.num_heads
    hits, counts = [0] * K, [0] * K
    for i in range(0, len(held), 8):
        part = held[i : i + 8]
        last, labels = medusa_batch(part, K, torch.zeros_like(target_to_draft))  # any label (in the vocab or not)
        _, draft_labels = medusa_batch(part, K, target_to_draft)
        logits = heads(last)
        for k in range(K):
            valid = labels[k] >= 0
            hits[k] += ((logits[k].argmax(-1) == draft_labels[k]) & valid & (draft_labels[k] >= 0)).sum().item()
            counts[k] += valid.sum().item()
    return [h / max(1, c) for h, c in zip(hits, counts)]


def write_model_card(out: Path, record: dict) -> None:
    curve = record["curve"]
    plot_curve(out / "train_curve.png", curve, "weighted loss",
               {f"top-1 head {k}": [c["train_top1_by_position"][k] for c in curve] for k in range(record["num_heads"])},
               "train top-1 vs target")
    d, b, acc = record["data"], record["budget"], record["heldout_acceptance"]
    (out / "README.md").write_text(f"""# Medusa heads for SmolLM2-135M-Instruct (trained here)

Trained on this repository's CPU by:

```bash
{record['command']}
```

- {record['num_heads']} heads, one residual block each (Medusa-1), on the output of target layer {record['source_layer']} through
  the target's final norm; one shared lm_head over the {record['draft_vocab']}-token draft vocabulary (started from the target's rows)
- data: train-eagle3's feature cache: {d['sequences']} sequences (ShareGPT conversations and prompts answered by
  the target, greedy; the held-out conversations and the prompts the benchmarks draw are never trained on),
  {d['labelled_tokens']} labelled tokens; labels: the target's own argmax; the cache is made by
  `specdec train-eagle3 --features-only` with the same data options (one generation pass feeds both heads)
- budget: {b['train_s'] / 60:.1f} min on {b['threads']} threads; {b['epochs']} epochs, batch {b['batch_size']}, {b['optimizer_steps']} optimizer
  steps, lr {record['lr']}, head k weighted 0.8^k

## Held-out results

- top-1 agreement with the target by head (head k guesses the token k + 2 after the position; teacher-forced,
  held-out conversations): {', '.join(f'{a:.3f}' for a in record['heldout_top1_by_head'])}
- real greedy Medusa decoding (linear, {acc['num_draft_tokens']} draft tokens) on {acc['prompts']} held-out conversation
  openings, {acc['max_tokens']} new tokens: mean acceptance length {acc['mean_acceptance_length']:.2f},
  per-position acceptance {', '.join(f'{a:.2f}' for a in acc['per_position_acceptance'])}
""")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="specdec train-medusa", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="models/medusa-smollm2-135m")
    add_data_arguments(p, conversations=600, max_len=256, self_distill_tokens=192, eval_prompts=16, eval_tokens=128)
    p.add_argument("--num-heads", type=int, default=4)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--max-sequences", type=int, default=0, help="train on at most this many sequences (0: all)")
    args = p.parse_args(argv)
    started = provenance()  # the tree the head was trained from (train_log.json)
    target, tokenizer = target_and_tokenizer(args)
    labeller = labelling_target(target, args)  # --feature-format: features, labels and the held-out check
    seqs, n_held, train_set, held = training_data(args, labeller, tokenizer)
    if args.max_sequences:
        train_set = random.Random(args.seed).sample(train_set, min(args.max_sequences, len(train_set)))
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    vocab_ids = draft_vocabulary(train_set, args.draft_vocab, target.cfg.vocab_size, eos)
    heads = init_heads(target, args.num_heads, vocab_ids)
    target_to_draft = torch.full((target.cfg.vocab_size,), -100, dtype=torch.long)
    target_to_draft[vocab_ids] = torch.arange(len(vocab_ids))
    t0 = time.perf_counter()
    try:
        log = train(heads, train_set, args, target_to_draft)
    except TrainingPaused as paused:
        print(paused, flush=True)
        return 0
    t_train = time.perf_counter() - t0
    out = Path(args.out)
    save_medusa(heads, out)
    top1 = heldout_top1(heads, held, target_to_draft)
    openings = user_openings(seqs[-n_held:], tokenizer)[: args.eval_prompts]
    acceptance = heldout_acceptance(labeller, out, tokenizer, openings, args.eval_tokens, "medusa", args.num_heads)
    record = {
        "command": "specdec train-medusa " + " ".join(argv if argv is not None else __import__("sys").argv[2:]),
        "num_heads": args.num_heads, "source_layer": heads.cfg.source_layer, "draft_vocab": len(vocab_ids), "lr": args.lr,
        "data": {"sequences": len(train_set), "labelled_tokens": sum(int((f["labels"] >= 0).sum()) for f in train_set)},
        "budget": {"train_s": t_train, "threads": torch.get_num_threads(), "epochs": args.epochs, "batch_size": args.batch_size,
                   "optimizer_steps": log[-1]["step"] if log else 0},
        "heldout_top1_by_head": top1, "heldout_acceptance": acceptance, "curve": log,
    }
    write_result(out / "train_log.json", record, started)
    write_model_card(out, record)
    print(json.dumps({k: record[k] for k in ("budget", "heldout_top1_by_head", "heldout_acceptance")}, indent=2))
    return 0
