"""Medusa heads: the checkpoint layout, the hidden state each head reads (the union of tap
layers one target forward computes beside EAGLE-3's), greedy identity (chains and trees,
beside EAGLE-3 in one engine) and statistical losslessness of sampled chains and trees."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import save_file
from test_eagle3 import tiny  # noqa: F401  (the fixture: a tiny target and an EAGLE-3 head for it)
from test_speculative import PARAMS, TOY_VOCAB, chi_square_p, exact_first3, prompts, run_all, sample_first3

from specdec.config import EngineConfig, SamplingParams, SpeculativeConfig
from specdec.engine.drafters.base import Drafter
from specdec.engine.drafters.eagle3 import Eagle3Drafter
from specdec.engine.drafters.medusa import MedusaDrafter
from specdec.engine.models.eagle3_head import load_eagle3
from specdec.engine.models.llama import build_batch
from specdec.engine.models.medusa_heads import MedusaConfig, MedusaHeads, load_medusa, save_medusa
from specdec.errors import ConfigError
from specdec.engine.tree import DraftTree
from specdec.serving.spec_engine import SpecEngine


def random_heads(target_cfg, num_heads: int = 3, draft_vocab: int | None = None, sharpness: float = 8.0, seed: int = 0) -> MedusaHeads:
    """Heads with random residual blocks and a peaked lm_head over a random draft vocabulary."""
    g = torch.Generator().manual_seed(seed)
    V = target_cfg.vocab_size
    Vd = draft_vocab or V - 2
    heads = MedusaHeads(MedusaConfig.for_target(target_cfg, num_heads, Vd))
    vocab_ids = torch.randperm(V, generator=g)[:Vd].sort().values
    with torch.no_grad():
        for block in heads.medusa_head:
            block[0].linear.weight.copy_(torch.randn(block[0].linear.weight.shape, generator=g) * 0.3)
            block[0].linear.bias.copy_(torch.randn(block[0].linear.bias.shape, generator=g) * 0.3)
        heads.lm_head.weight.copy_(torch.randn(heads.lm_head.weight.shape, generator=g) * sharpness / target_cfg.hidden_size**0.5)
    heads.set_vocabulary(vocab_ids)
    return heads.eval()


def test_checkpoint_round_trips_in_medusa_names(tiny, tmp_path):  # noqa: F811
    target = tiny[0]
    heads = random_heads(target.cfg)
    save_medusa(heads, tmp_path / "m", dtype=torch.float32)
    again = load_medusa(tmp_path / "m", target.cfg)
    names = set(again.state_dict())
    assert {"medusa_head.0.0.linear.weight", "medusa_head.2.0.linear.bias", "lm_head.weight", "norm.weight", "d2t", "t2d"} <= names
    x = torch.randn(5, target.cfg.hidden_size)
    assert torch.equal(again(x), heads(x)) and again(x).shape == (3, 5, heads.cfg.draft_vocab_size)
    assert heads.cfg.source_layer == target.cfg.num_layers - 1
    bigger = dataclasses.replace(target.cfg, hidden_size=target.cfg.hidden_size * 2)
    with pytest.raises(ConfigError) as err:
        load_medusa(tmp_path / "m", bigger)
    assert err.value.field == "hidden_size"


def write_medusa_project(path, target_cfg, num_heads: int = 3, layers: int = 1, pt: bool = False, seed: int = 0) -> dict:
    """Random heads saved as the Medusa project saves them: config.json and
    medusa_lm_head.{safetensors,pt} with `{k}.{j}.linear.*` and each head's lm_head `{k}.{layers}.weight`."""
    g = torch.Generator().manual_seed(seed)
    H, V = target_cfg.hidden_size, target_cfg.vocab_size
    sd = {}
    for k in range(num_heads):
        for j in range(layers):
            sd[f"{k}.{j}.linear.weight"] = torch.randn(H, H, generator=g) * 0.3
            sd[f"{k}.{j}.linear.bias"] = torch.randn(H, generator=g) * 0.3
        sd[f"{k}.{layers}.weight"] = torch.randn(V, H, generator=g) * 8.0 / H**0.5
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({"medusa_num_heads": num_heads, "medusa_num_layers": layers,
                                                  "base_model_name_or_path": "tiny-target"}))
    if pt:
        torch.save(sd, path / "medusa_lm_head.pt")
    else:
        save_file(sd, str(path / "medusa_lm_head.safetensors"))
    return sd


@pytest.mark.parametrize("layers", [1, 2])
def test_heads_in_the_medusa_projects_layout_load_and_draft(tiny, tmp_path, layers):  # noqa: F811
    """The Medusa project's own files: each head's residual blocks and full-vocabulary
    lm_head on the target's final norm, as Medusa computes them; the .pt file the same; a
    head for another vocabulary refused naming it; greedy drafting with them equals plain."""
    target, head_dir, _ = tiny
    target_dir = head_dir.parent / "target"
    sd = write_medusa_project(tmp_path / "st", target.cfg, layers=layers)
    heads = load_medusa(tmp_path / "st", target.cfg, target_dir)
    assert heads.cfg.own_lm_heads and heads.cfg.num_layers == layers and heads.cfg.source_layer == target.cfg.num_layers - 1
    x = torch.randn(5, target.cfg.hidden_size)
    h = torch.nn.functional.rms_norm(x, (x.shape[-1],), target.norm.weight, target.cfg.rms_norm_eps)
    for k in range(3):
        guess = h
        for j in range(layers):
            guess = guess + torch.nn.functional.silu(guess @ sd[f"{k}.{j}.linear.weight"].T + sd[f"{k}.{j}.linear.bias"])
        assert torch.allclose(heads(x)[k], guess @ sd[f"{k}.{layers}.weight"].T, atol=1e-5), k
    write_medusa_project(tmp_path / "pt", target.cfg, layers=layers, pt=True)
    assert torch.equal(load_medusa(tmp_path / "pt", target.cfg, target_dir)(x), heads(x))
    write_medusa_project(tmp_path / "other", dataclasses.replace(target.cfg, vocab_size=target.cfg.vocab_size + 7))
    with pytest.raises(ConfigError) as err:
        load_medusa(tmp_path / "other", target.cfg, target_dir)
    assert err.value.field == "vocab_size"
    cfg = EngineConfig(max_batch_size=4, max_seq_len=128, max_num_draft_tokens=8)
    engine = SpecEngine(target, cfg, drafters={"medusa": MedusaDrafter(heads, SpeculativeConfig(method="medusa", max_draft_len=3))})
    ps, params = prompts(6, seed=7), SamplingParams(max_tokens=16, ignore_eos=True)
    assert run_all(engine, ps, params, "medusa", 3, concurrent=4) == run_all(engine, ps, params, "none", 0, concurrent=1)
    assert engine.stats.accepted_tokens > 0


def engine_with_both(target, head_dir, heads, max_batch=8):
    cfg = EngineConfig(max_batch_size=max_batch, max_seq_len=128, max_num_draft_tokens=8)
    eagle = load_eagle3(head_dir, target.embed, target.cfg)
    drafters = {
        "eagle3": Eagle3Drafter(eagle, SpeculativeConfig(method="eagle3", max_draft_len=4), max_batch, 128),
        "medusa": MedusaDrafter(heads, SpeculativeConfig(method="medusa", max_draft_len=3)),
        "medusa-tree": MedusaDrafter(heads, SpeculativeConfig(method="medusa", max_draft_len=3, use_dynamic_tree=True,
                                                              dynamic_tree_max_topK=3, max_total_draft_tokens=8)),
        "medusa-adaptive": MedusaDrafter(heads, SpeculativeConfig(method="medusa", max_draft_len=3, adaptive=True)),
    }
    return SpecEngine(target, cfg, drafters=drafters)


class _Recorder(Drafter):
    """Drafts nothing; keeps the hidden states it is handed for the prompt."""

    name = "record"

    def __init__(self, tap_layers):
        self.tap_layers = tuple(tap_layers)

    def propose(self, seqs, budgets, keep_drafting=None):
        return [DraftTree() for _ in seqs]

    def on_prefill(self, seq, hidden):
        seq.drafter_state[self.name] = hidden


def test_each_drafter_gets_its_own_layers_of_one_forward(tiny):  # noqa: F811
    """EAGLE-3's taps (0, 1, 2), Medusa's last layer (2) and a drafter wanting (2, 0) come
    out of one target forward (the union, ascending), each handed its own layers in its
    order; Medusa's state is the last layer's output at the last prompt position."""
    target, head_dir, _ = tiny
    engine = engine_with_both(target, head_dir, random_heads(target.cfg))
    engine = SpecEngine(target, engine.config, drafters={**engine.speculator.drafts.drafters, "record": _Recorder((2, 0))})
    assert engine.speculator.target_pass.tap_layers == (0, 1, 2)
    prompt = prompts(1, seed=2)[0]
    for method in ("medusa", "record"):
        engine.add_request(method, prompt, SamplingParams(max_tokens=4, ignore_eos=True), method, 3)
    engine.step()  # prefill: the drafters got the prompt's hidden states
    cache = target.new_cache(1, 64, 1)
    ref = target(build_batch([cache.allocate()], [0], [prompt]), cache, tap_layers=(0, 1, 2)).hidden_taps[0]
    H = target.cfg.hidden_size
    drafts = engine.speculator.drafts
    state = {drafts._seqs[k].method: drafts._seqs[k].drafter_state for k in drafts._seqs}
    assert torch.allclose(state["medusa"]["medusa"], ref[-1, 2 * H :], atol=1e-5)
    assert torch.allclose(state["record"]["record"], torch.cat([ref[:, 2 * H :], ref[:, :H]], -1), atol=1e-5)


def test_greedy_medusa_equals_plain(tiny):  # noqa: F811
    target, head_dir, _ = tiny
    heads = random_heads(target.cfg)
    ps = prompts(10, seed=6)
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    engine = engine_with_both(target, head_dir, heads)
    plain = run_all(engine, ps, params, "none", 0, concurrent=1)
    for method, k in (("medusa", 3), ("medusa-tree", 8), ("medusa-adaptive", 3), ("eagle3", 4)):
        for concurrent in (1, 8):
            assert run_all(engine, ps, params, method, k, concurrent) == plain, (method, concurrent)
    assert engine.stats.accepted_tokens > 0  # the heads' guesses were verified, some kept
    assert engine.cache.num_free == 8


@pytest.fixture(scope="module")
def toy_medusa(tmp_path_factory):
    from conftest import save_tiny_hf

    from specdec.engine.models.loading import load_transformer

    root = tmp_path_factory.mktemp("toy_medusa")
    target = load_transformer(save_tiny_hf(root / "t", vocab_size=TOY_VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                           initializer_range=0.15, seed=11, eos_token_id=0, bos_token_id=0))
    return target, random_heads(target.cfg, num_heads=3, sharpness=6.0, seed=4)


@pytest.mark.slow  # chi-square (make test-all); medusa and medusa-tree are proved exactly in tests/engine/test_exact_lossless.py
@pytest.mark.parametrize("tree", [False, pytest.param(True, id="tree")])
def test_medusa_sampling_is_lossless(toy_medusa, tree):
    """Sampled chains (each head's draw with its q, which does not depend on the draws
    before it) and top-k trees (one-hot rule) keep the target's distribution."""
    target, heads = toy_medusa
    spec = (SpeculativeConfig(method="medusa", max_draft_len=3, use_dynamic_tree=True, dynamic_tree_max_topK=2, max_total_draft_tokens=6)
            if tree else SpeculativeConfig(method="medusa", max_draft_len=3))
    counts = sample_first3(target, MedusaDrafter(heads, spec), PARAMS, seed0=4000)
    p = chi_square_p(counts, exact_first3(target, PARAMS))
    assert p > 1e-3, f"chi-square p={p:.2e}"


def test_head_k_learns_the_token_k_plus_2_after_its_position():
    """On a self-distilled answer (labels = the next token), head k's label at position t is
    token t + k + 2: head 0 guesses the token after the root (t + 1, the target's own guess)."""
    from specdec.training.train_medusa import medusa_batch

    tokens = torch.arange(10, 30, dtype=torch.int32)
    labels = torch.cat([tokens[1:], torch.tensor([-1], dtype=torch.int32)])  # the target's guess at t is token t + 1
    feature = {"tokens": tokens, "last": torch.randn(20, 4).half(), "taps": torch.randn(20, 12).half(), "labels": labels}
    identity = torch.arange(64)
    last, head_labels = medusa_batch([feature], 3, identity)
    assert last.shape == (1, 20, 4) and head_labels.shape == (3, 1, 20)
    for k in range(3):
        for t in range(20 - k - 2):
            assert int(head_labels[k, 0, t]) == int(tokens[t + k + 2]), (k, t)
        assert (head_labels[k, 0, 20 - k - 2 :] == -100).all()  # past the end: no label
