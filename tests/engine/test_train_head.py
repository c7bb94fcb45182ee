"""`specdec train-head` (issue 62): a head trained on served traffic, and a run that is killed
and re-run ends exactly where an uninterrupted one does."""
from __future__ import annotations

import json

import torch
from safetensors.torch import load_file

from specdec.config import CaptureConfig, EngineConfig, SamplingParams


def capture_store(model, tokenizer, directory):
    """A small store recorded the way the server records it."""
    from specdec.serving.traffic_capture import TrafficCapture
    from specdec.serving.runtime import encode_prompt
    from specdec.serving.spec_engine import SpecEngine

    capture = TrafficCapture(CaptureConfig(str(directory)), model.cfg, "SmolLM2-135M-Instruct", seed=0)
    engine = SpecEngine(model, EngineConfig(max_batch_size=2, max_seq_len=256), tokenizer, {}, observer=capture)
    for i, prompt in enumerate(["def add(a, b):\n    return", "import numpy as np\nx = np.", "for i in range(10):\n   "]):
        for _ in engine.generate(encode_prompt(tokenizer, prompt), SamplingParams(max_tokens=24), request_id=str(i)):
            pass
    capture.close()
    return capture.captured


def test_a_killed_run_continues_where_it_stopped_and_ends_as_an_uninterrupted_one(tmp_path, smol_model, smol_tokenizer):
    """train-head on ShareGPT plus captured traffic: paused after one optimizer step (the
    checkpoint a kill would leave), the same command re-run resumes from it; its head equals,
    bit for bit, the head of a run that was never stopped, and its record counts the captures."""
    from specdec.training.fit import checkpoint_path
    from specdec.training.train_head import main

    assert capture_store(smol_model, smol_tokenizer, tmp_path / "captures") == 3
    common = ["--quick", "--features-dir", str(tmp_path / "features"), "--captures", str(tmp_path / "captures"), "--log-every", "1",
              "--batch-size", "4"]
    whole, paused = tmp_path / "whole", tmp_path / "paused"
    assert main(["--head", "eagle3", *common, "--out", str(whole)]) == 0
    assert main(["--head", "eagle3", *common, "--out", str(paused), "--max-steps", "1"]) == 0
    assert checkpoint_path(paused).is_file() and not (paused / "model.safetensors").exists()
    assert torch.load(checkpoint_path(paused), weights_only=True)["step"] == 1
    assert main(["--head", "eagle3", *common, "--out", str(paused), "--max-steps", "1"]) == 0  # the same command: continues
    assert not checkpoint_path(paused).exists()  # a finished run leaves none behind
    a, b = load_file(whole / "model.safetensors"), load_file(paused / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    record = json.loads((paused / "train_log.json").read_text())
    steps = record["budget"]["optimizer_steps"]
    assert steps > 1 and [c["step"] for c in record["curve"]] == list(range(1, steps + 1))
    assert record["data"]["captured_sequences"] == 3 and "served traffic" in (paused / "README.md").read_text()
    # a checkpoint of other settings is refused, not silently mixed in
    assert main(["--head", "eagle3", *common, "--out", str(tmp_path / "other"), "--max-steps", "1"]) == 0
    import pytest

    with pytest.raises(SystemExit, match="lr"):
        main(["--head", "eagle3", *common, "--out", str(tmp_path / "other"), "--lr", "1e-4"])


def test_int8_features_label_with_the_served_targets_own_greedy_tokens(tmp_path, smol_dir, smol_model, smol_int8_model, smol_tokenizer):
    """--feature-format int8: the features and labels come from the served CPU target itself. Its
    teacher-forced prefill labels every answer position with the token the served engine
    emitted there (the int8 forward is row-invariant), and its features live in their own
    cache directory, never mixed with float32's."""
    import argparse

    from specdec.serving.runtime import encode_prompt
    from specdec.serving.spec_engine import SpecEngine
    from specdec.training.capture import target_features
    from specdec.training.data import labelling_target
    from specdec.training.train_head import main

    # a prompt whose 64 served tokens the float32 target labels differently at 4 positions (measured)
    prompt = encode_prompt(smol_tokenizer, "Explain what a hash map is to a child.")
    engine = SpecEngine(smol_int8_model, EngineConfig(max_batch_size=1, max_seq_len=256, weight_format="int8"), smol_tokenizer, {})
    served = [t for out in engine.generate(prompt, SamplingParams(max_tokens=64), request_id="a") for t in out.new_token_ids]
    labeller = labelling_target(None, argparse.Namespace(feature_format="int8", model_dir=str(smol_dir)))
    with torch.inference_mode():
        (features,) = target_features(labeller, [prompt + served])
    assert len(served) == 64 and features["labels"][len(prompt) - 1 : len(prompt) - 1 + len(served)].tolist() == served
    with torch.inference_mode():
        (float32_features,) = target_features(smol_model, [prompt + served])
    # the prompt tells the formats apart: float32 labels some of these positions otherwise
    assert float32_features["labels"][len(prompt) - 1 : len(prompt) - 1 + len(served)].tolist() != served

    features_dir = tmp_path / "features"
    assert main(["--head", "eagle3", "--quick", "--features-only", "--features-dir", str(features_dir), "--feature-format", "int8"]) == 0
    assert any((tmp_path / "features-int8").glob("shard_*.pt")) and not features_dir.exists()


def test_bfloat16_training_resumes_and_a_float32_run_refuses_its_checkpoint(tmp_path):
    """--train-dtype bfloat16 (autocast; fp32 master weights): its first step's loss is not
    float32's (the autocast is on), a paused run's checkpoint records the dtype, the same
    command continues it to a head with finite weights, and a float32 run is refused that
    checkpoint, naming train_dtype."""
    import pytest

    from specdec.training.fit import checkpoint_path
    from specdec.training.train_head import main

    common = ["--head", "eagle3", "--quick", "--features-dir", str(tmp_path / "features"), "--batch-size", "4", "--log-every", "1"]
    out = tmp_path / "bf16"
    assert main([*common, "--out", str(out), "--train-dtype", "bfloat16", "--max-steps", "1"]) == 0
    state = torch.load(checkpoint_path(out), weights_only=True)
    assert state["fingerprint"]["train_dtype"] == "bfloat16"
    assert main([*common, "--out", str(tmp_path / "fp32"), "--max-steps", "1"]) == 0
    float32_state = torch.load(checkpoint_path(tmp_path / "fp32"), weights_only=True)
    assert state["log"][0]["loss"] != float32_state["log"][0]["loss"]
    with pytest.raises(SystemExit, match="train_dtype"):
        main([*common, "--out", str(out), "--max-steps", "2"])
    assert main([*common, "--out", str(out), "--train-dtype", "bfloat16"]) == 0
    weights = load_file(out / "model.safetensors")
    record = json.loads((out / "train_log.json").read_text())
    assert all(torch.isfinite(w.float()).all() for w in weights.values()) and record["curve"][-1]["step"] > 1


def test_a_new_draft_vocabulary_keeps_what_the_head_learned(smol_model, tmp_path, capsys):
    """--new-vocab on a continued head: every token it drafted before and keeps scores exactly
    as before (its trained lm_head rows and the rest of its weights unchanged); a token new to
    the vocabulary starts from the target's own lm_head row, scaled to the trained rows."""
    from pathlib import Path

    import pytest

    from specdec.engine.models.eagle3_head import load_eagle3
    from specdec.training.train_eagle3 import frozen_embedding, with_vocabulary
    from specdec.training.train_head import main

    with pytest.raises(SystemExit):  # a fresh head has no vocabulary to change: refused before anything is written
        main(["--head", "eagle3", "--quick", "--new-vocab", "--out", str(tmp_path / "refused")])
    assert "--init-from" in capsys.readouterr().err and not (tmp_path / "refused").exists()
    shipped = Path(__file__).resolve().parents[2] / "models" / "eagle3-smollm2-135m"
    head = load_eagle3(shipped, frozen_embedding(smol_model), smol_model.cfg).float()
    old = head.draft_to_target
    added = torch.tensor(sorted(set(range(smol_model.cfg.vocab_size)) - set(old.tolist()))[:1000])
    vocab = torch.cat([old[::2], added]).sort().values  # half the old tokens kept, 1,000 new ones
    new = with_vocabulary(head, smol_model, vocab).float()
    assert new.cfg.draft_vocab_size == len(vocab) and new.draft_to_target.tolist() == vocab.tolist()
    torch.manual_seed(0)
    taps, next_tokens = torch.randn(2, 12, 3 * smol_model.cfg.hidden_size), torch.randint(0, 1000, (2, 14))
    with torch.no_grad():
        before, after = head.ttt_forward(taps, next_tokens, 2), new.ttt_forward(taps, next_tokens, 2)
    kept = torch.isin(vocab, old)
    old_column = {t: i for i, t in enumerate(old.tolist())}
    columns = torch.tensor([old_column[t] for t in vocab[kept].tolist()])
    for b, a in zip(before, after):
        assert torch.allclose(a[..., kept], b[..., columns], rtol=1e-5, atol=1e-5)
    fresh = new.lm_head.weight[~kept]
    target_rows = smol_model.lm_head.weight.detach().float()[vocab[~kept]]
    assert torch.allclose(torch.nn.functional.cosine_similarity(fresh, target_rows, dim=1), torch.ones(len(fresh)), atol=1e-5)
    assert torch.allclose(fresh.norm(dim=1), target_rows.norm(dim=1) * new.lm_head.weight[kept].norm(dim=1).mean()
                          / smol_model.lm_head.weight.detach().float()[vocab[kept]].norm(dim=1).mean(), rtol=1e-4)


def test_added_layers_start_as_the_identity_and_then_train(smol_model):
    """--layers on a continued head: the grown head drafts exactly as the old one (its new
    layer's output projections are zero) and every weight of the new layer gets a gradient
    within two optimizer steps (the zeros do not stay a fixed point)."""
    from pathlib import Path

    from specdec.engine.models.eagle3_head import load_eagle3
    from specdec.training.train_eagle3 import frozen_embedding, with_layers

    shipped = Path(__file__).resolve().parents[2] / "models" / "eagle3-smollm2-135m"
    head = load_eagle3(shipped, frozen_embedding(smol_model), smol_model.cfg).float()
    grown = with_layers(head, smol_model, 2).float()
    assert grown.cfg.num_hidden_layers == 2 and len(grown.layers) == 1
    torch.manual_seed(0)
    taps, next_tokens = torch.randn(2, 12, 3 * smol_model.cfg.hidden_size), torch.randint(0, 1000, (2, 15))
    with torch.no_grad():
        for before, after in zip(head.ttt_forward(taps, next_tokens, 3), grown.ttt_forward(taps, next_tokens, 3)):
            assert torch.equal(before, after)
    new_layer = dict(grown.layers.named_parameters())
    opt = torch.optim.SGD([p for p in grown.parameters() if p.requires_grad], lr=1e-2)
    moved = set()
    for _ in range(2):
        opt.zero_grad()
        loss = sum(torch.nn.functional.cross_entropy(o.flatten(0, 1), next_tokens[:, :12].flatten() % 2048)
                   for o in grown.ttt_forward(taps, next_tokens, 3))
        loss.backward()
        moved |= {n for n, p in new_layer.items() if p.grad is not None and p.grad.abs().sum() > 0}
        opt.step()
    assert moved == set(new_layer), set(new_layer) - moved


def test_a_resumed_run_with_another_draft_vocabulary_is_refused(tmp_path):
    """The draft vocabulary (an EAGLE-3 head's d2t/t2d buffers) is not trained and not in the
    checkpoint: a run re-started over another vocabulary (--new-vocab added or dropped) would
    put the trained lm_head rows on other tokens, so the checkpoint's digest of the saved
    buffers must match; the same vocabulary resumes."""
    import argparse

    import pytest

    from specdec.training.fit import TrainingPaused, checkpoint_path, optimize

    class Toy(torch.nn.Module):
        def __init__(self, vocab: list[int]):
            super().__init__()
            self.lm_head = torch.nn.Linear(4, len(vocab))
            self.register_buffer("d2t", torch.tensor(vocab) - torch.arange(len(vocab)))

    def loss_of(batch):
        return sum(toy.lm_head(f["x"]).square().mean() for f in batch), lambda: {"train_top1": 0.0}

    train_set = [{"tokens": [0, 1], "x": torch.randn(2, 4)} for _ in range(4)]
    args = argparse.Namespace(out=str(tmp_path), lr=1e-3, batch_size=2, epochs=1, seed=0, log_every=1, max_steps=1)
    toy = Toy([3, 5, 7])
    with pytest.raises(TrainingPaused):
        optimize(toy, train_set, args, loss_of)
    assert checkpoint_path(tmp_path).is_file()
    toy = Toy([3, 5, 8])  # same shapes, another token in the last row
    with pytest.raises(SystemExit, match="saved_buffers_sha256"):
        optimize(toy, train_set, args, loss_of)
    toy = Toy([3, 5, 7])
    args.max_steps = None
    optimize(toy, train_set, args, loss_of)
    assert not checkpoint_path(tmp_path).exists()  # resumed and finished
