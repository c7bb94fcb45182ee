"""The training loop the EAGLE-3, Medusa and draft-model trainers share: EAGLE-3's padded
batches (the labels draft step k learns; Medusa's head k reads the same), length-bucketed
order, AdamW with warm-up and cosine decay, top-1 by draft position, the draft vocabulary
(the most frequent target predictions) and the model card's training curve.
"""
from __future__ import annotations

import hashlib
import math
import random
import time
from pathlib import Path

import torch

from specdec.serving.heap import HeapTrimmer

STEP_WEIGHT = 0.8


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


class TrainingPaused(Exception):
    """The run stopped at --max-steps with its state checkpointed: the same command continues it."""


def checkpoint_path(out: Path) -> Path:
    return Path(out) / "checkpoint.pt"


def _trainable(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p for name, p in module.named_parameters() if p.requires_grad}


def _saved_buffers_sha256(module: torch.nn.Module) -> str:
    """A digest of the module's saved buffers (an EAGLE-3 head's d2t/t2d: its draft vocabulary).
    They are not trained, so the checkpoint does not hold them; a resumed run whose vocabulary
    differs (--new-vocab added or dropped) would load trained lm_head rows onto other tokens."""
    params = {name for name, _ in module.named_parameters()}
    digest = hashlib.sha256()
    for name, value in sorted(module.state_dict().items()):
        if name not in params:
            digest.update(name.encode())
            digest.update(value.detach().cpu().contiguous().flatten().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def optimize(module: torch.nn.Module, train_set: list[dict], args, loss_of, clip: float = 0.5) -> list[dict]:
    """The training loop the head, Medusa and draft-model trainers share: AdamW on the
    module's trainable parameters, 20 warm-up steps then cosine decay, length-bucketed
    batches of args.batch_size for args.epochs; under bfloat16 autocast with
    args.train_dtype bfloat16 (the forward and loss; weights, gradients and moments stay fp32). loss_of(batch features) -> (loss, report)
    where report() gives the log entry's measurements (called on logged steps only).

    Resumable: every args.checkpoint_every_min minutes (and at args.max_steps, which then
    raises TrainingPaused) the trainable weights, the optimizer's moments, the step and the
    log go to <args.out>/checkpoint.pt; the same command re-run loads it and continues at
    the next batch of the same order (each epoch's order is replayed from the seed), so a
    killed run ends where an uninterrupted one would. The checkpoint is deleted when the
    run completes; --restart ignores it. A checkpoint of other settings is refused."""
    params = _trainable(module)
    opt = torch.optim.AdamW(params.values(), lr=args.lr, weight_decay=0.0, betas=(0.9, 0.95))
    per_epoch = math.ceil(len(train_set) / args.batch_size)
    total = per_epoch * args.epochs
    rng = random.Random(args.seed)
    log, step, resumed_s = [], 0, 0.0
    ckpt = checkpoint_path(args.out) if getattr(args, "out", None) else None
    fingerprint = {"train_sequences": len(train_set), "train_tokens": sum(len(f["tokens"]) for f in train_set),
                   "batch_size": args.batch_size, "epochs": args.epochs, "lr": args.lr, "seed": args.seed,
                   "parameters": {name: list(w.shape) for name, w in sorted(params.items())},
                   "train_dtype": getattr(args, "train_dtype", "float32"), "feature_format": getattr(args, "feature_format", "float32"),
                   "saved_buffers_sha256": _saved_buffers_sha256(module)}
    autocast = fingerprint["train_dtype"] == "bfloat16"
    if ckpt is not None and ckpt.is_file() and not getattr(args, "restart", False):
        state = torch.load(ckpt, weights_only=True)
        # a checkpoint from before these fields (the buffers' digest: 2026-12-06) is compared without them
        saved = {"train_dtype": "float32", "feature_format": "float32", "saved_buffers_sha256": fingerprint["saved_buffers_sha256"],
                 **state["fingerprint"]}
        if isinstance(saved["parameters"], list):  # names only, before shapes were recorded
            saved["parameters"] = {name: fingerprint["parameters"].get(name) for name in saved["parameters"]}
        if saved != fingerprint:
            changed = sorted(k for k in fingerprint if saved.get(k) != fingerprint[k])
            raise SystemExit(f"{ckpt} was saved by a run with other settings ({', '.join(changed)} differ): "
                             "re-run that command, or pass --restart")
        with torch.no_grad():
            for name, p in params.items():
                p.copy_(state["weights"][name])
        opt.load_state_dict(state["optimizer"])
        step, log, resumed_s = state["step"], state["log"], state["elapsed_s"]
        print(f"resuming {ckpt} at step {step}/{total}", flush=True)
    start_step = step
    every_s = 60 * getattr(args, "checkpoint_every_min", 5.0)
    max_steps = getattr(args, "max_steps", None)
    t0 = time.perf_counter() - resumed_s
    last_save = time.perf_counter()

    def save() -> None:
        state = {"fingerprint": fingerprint, "step": step, "log": log, "elapsed_s": time.perf_counter() - t0,
                 "weights": {n: p.detach().clone() for n, p in params.items()}, "optimizer": opt.state_dict()}
        ckpt.parent.mkdir(parents=True, exist_ok=True)
        torch.save(state, ckpt.with_suffix(".tmp"))
        ckpt.with_suffix(".tmp").replace(ckpt)

    heap = HeapTrimmer()  # batches of every length: a run's RSS went from ~15 to 24 GB in 900 steps without it (killed)
    module.train()
    for epoch in range(args.epochs):
        order = length_bucketed(train_set, args.batch_size, rng)  # every epoch's, the replayed ones too: the seed's sequence
        for i in range(0, len(order), args.batch_size):
            if epoch * per_epoch + i // args.batch_size < start_step:  # done before the checkpoint
                continue
            lr = args.lr * min(1.0, (step + 1) / 20) * 0.5 * (1 + math.cos(math.pi * step / total))
            for group in opt.param_groups:
                group["lr"] = lr
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                loss, report = loss_of([train_set[j] for j in order[i : i + args.batch_size]])
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(list(params.values()), clip)
            opt.step()
            heap.maybe_trim()
            step += 1
            if step % args.log_every == 0 or step == total:
                with torch.no_grad():
                    entry = {"step": step, "epoch": epoch, "lr": lr, "loss": loss.item(), **report(), "elapsed_s": time.perf_counter() - t0}
                log.append(entry)
                top1 = entry.get("train_top1_by_position", entry.get("train_top1"))
                shown = [round(a, 3) for a in top1] if isinstance(top1, list) else round(top1, 3)
                print(f"step {step}/{total} loss {loss.item():.3f} top1 {shown} ({entry['elapsed_s']:.0f} s)", flush=True)
            if ckpt is not None and step < total and (time.perf_counter() - last_save >= every_s or step == max_steps):
                save()
                last_save = time.perf_counter()
                if step == max_steps:
                    module.eval()
                    raise TrainingPaused(f"paused at step {step}/{total}; state in {ckpt}: run the same command to continue")
    module.eval()
    if ckpt is not None:
        ckpt.unlink(missing_ok=True)
    return log


def top1_by_position(outputs, labels) -> list[float]:
    """Train top-1 agreement per draft position (labels -100: none)."""
    return [((o.argmax(-1) == labels[k]) & (labels[k] >= 0)).sum().item() / max(1, (labels[k] >= 0).sum().item())
            for k, o in enumerate(outputs)]


def draft_vocabulary(features: list[dict], size: int, vocab: int, always: list[int]) -> torch.Tensor:
    counts = torch.zeros(vocab, dtype=torch.long)
    for f in features:
        labels = f["labels"].long()
        counts += torch.bincount(labels[labels >= 0], minlength=vocab)
    counts[always] = counts.max() + 1
    return counts.topk(size).indices.sort().values  # [Vd] target ids


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
