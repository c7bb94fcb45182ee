"""The independent draft model (method draft_model): loads HF checkpoints (sharded) with the
target's vocabulary, refuses mismatches at load with the field named, drafts chains and
trees that leave greedy output unchanged, and frees its KV slots."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from specdec.config import EngineConfig, SamplingParams, SpeculativeConfig
from specdec.serving.spec_engine import SpecEngine
from specdec.errors import ConfigError
from specdec.engine.models.loading import load_transformer
from specdec.serving.runtime import build_drafters

from conftest import save_tiny_hf
from test_speculative import prompts, run_all

ENGINE = EngineConfig(max_batch_size=8, max_seq_len=128, max_num_draft_tokens=12, draft_dtype="float32")


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return save_tiny_hf(tmp_path_factory.mktemp("target"), initializer_range=0.3, seed=3)


@pytest.fixture(scope="module")
def draft_dirs(tmp_path_factory, target_dir):
    """Three drafts for the tiny target: itself (accepts nearly everything), the target with
    noisy weights (accepts some), and an unrelated random model (accepts almost nothing)."""
    noisy = tmp_path_factory.mktemp("noisy")
    shutil.copy(target_dir / "config.json", noisy)
    gen = torch.Generator().manual_seed(0)
    state = {}
    for shard in sorted(target_dir.glob("*.safetensors")):
        for name, w in load_file(str(shard)).items():
            state[name] = w + 0.03 * w.std() * torch.randn(w.shape, generator=gen) if "layers" in name else w
    save_file(state, str(noisy / "model.safetensors"))
    unrelated = save_tiny_hf(tmp_path_factory.mktemp("unrelated"), initializer_range=0.3, seed=9, num_hidden_layers=1)
    return {"same": target_dir, "noisy": noisy, "unrelated": unrelated}


def engine_with(target_dir, draft, **spec) -> SpecEngine:
    target = load_transformer(target_dir)
    methods = {"draft": SpeculativeConfig(method="draft_model", speculative_model=str(draft), **spec)}
    return SpecEngine(target, ENGINE, drafters=build_drafters(target.cfg, methods, ENGINE, target_dir))


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
@pytest.mark.parametrize("which", ["same", "noisy", "unrelated"])
def test_greedy_output_equals_plain(target_dir, draft_dirs, which, tree):
    spec = dict(max_draft_len=4, use_dynamic_tree=True, dynamic_tree_max_topK=3, max_total_draft_tokens=10) if tree else dict(max_draft_len=5)
    engine = engine_with(target_dir, draft_dirs[which], **spec)
    ps = prompts(8)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    plain = run_all(engine, ps, params, "none", 0, concurrent=1)
    for concurrent in (1, 8):
        assert run_all(engine, ps, params, "draft", 8, concurrent) == plain
    stats = engine.stats
    if which != "unrelated":
        assert stats.accepted_tokens > 0.2 * stats.draft_tokens, (stats.accepted_tokens, stats.draft_tokens)
    drafter = engine.drafts.drafters["draft"]
    assert drafter.cache.num_free == drafter.cache.max_slots  # every finished sequence gave its slot back


def test_cancelled_sequences_free_the_drafts_slots(target_dir, draft_dirs):
    engine = engine_with(target_dir, draft_dirs["noisy"], max_draft_len=4)
    for i, p in enumerate(prompts(6)):
        engine.add_request(str(i), p, SamplingParams(max_tokens=50, ignore_eos=True), "draft", 4)
    engine.step()
    engine.step()
    drafter = engine.drafts.drafters["draft"]
    assert drafter.cache.num_free == drafter.cache.max_slots - 6
    for i in range(6):
        engine.cancel(str(i))
    engine.step()
    assert drafter.cache.num_free == drafter.cache.max_slots


def _variant(tmp_path, source, **config_changes):
    out = tmp_path / "variant"
    shutil.copytree(source, out)
    raw = json.loads((out / "config.json").read_text())
    raw.update(config_changes)
    (out / "config.json").write_text(json.dumps(raw))
    return out


def test_bad_drafts_fail_at_load_naming_the_field(tmp_path, target_dir):
    target = load_transformer(target_dir)

    def build(path):
        return build_drafters(target.cfg, {"d": SpeculativeConfig(method="draft_model", speculative_model=str(path))}, ENGINE, target_dir)

    with pytest.raises(ConfigError, match="speculative_model.*no draft model"):
        build(tmp_path / "missing")
    other_vocab = save_tiny_hf(tmp_path / "vocab", vocab_size=80)
    with pytest.raises(ConfigError, match="speculative_model.*vocabulary size 80 differs"):
        build(other_vocab)
    short = save_tiny_hf(tmp_path / "short", max_position_embeddings=64)
    with pytest.raises(ConfigError, match="speculative_model.*context.*shorter than engine.max_seq_len"):
        build(short)
    with pytest.raises(ConfigError, match="speculative_model.*eos_token_id"):
        build(_variant(tmp_path, target_dir, eos_token_id=5))
    with pytest.raises(ConfigError, match="draft_dtype"):
        SpeculativeConfig(method="draft_model", draft_dtype="int4")


def test_train_draft_quick_mode_writes_a_loadable_draft(tmp_path, smol_dir, smol_model):
    """specdec train-draft end to end on a tiny budget: the written draft (bf16, reduced
    output vocabulary, the target's embedding shared) loads through the same path as any
    draft and leaves greedy output unchanged."""
    from specdec.training.train_draft import main as train_main

    out = tmp_path / "draft"
    assert train_main(["--quick", "--layers", "1", "--out", str(out), "--features-dir", str(tmp_path / "features")]) == 0
    raw = json.loads((out / "config.json").read_text())
    assert raw["num_hidden_layers"] == 1 and raw["specdec"]["shares_target_embedding"] is True
    log = json.loads((out / "train_log.json").read_text())
    assert log["command"].startswith("specdec train-draft") and log["curve"]
    cfg = EngineConfig(max_batch_size=2, max_seq_len=512)
    methods = {"draft": SpeculativeConfig(method="draft_model", speculative_model=str(out), max_draft_len=3)}
    drafters = build_drafters(smol_model.cfg, methods, cfg, smol_dir, embed=smol_model.embed)
    assert drafters["draft"].draft_to_target is not None and len(drafters["draft"].draft_to_target) == 2048
    engine = SpecEngine(smol_model, cfg, drafters=drafters)
    prompt = [1, 9690, 198, 2683, 359, 253, 5356, 31, 2, 198]
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    assert run_all(engine, [prompt], params, "draft", 3, 1) == run_all(engine, [prompt], params, "none", 0, 1)


def test_a_gguf_file_drafts_through_the_same_path(smol_dir, smol_model):
    """speculative_model may be a .gguf file (converted once into the cache). The embedded
    target's own GGUF as its draft: same weights, so nearly every draft token is accepted,
    and the output still equals plain decoding."""
    from specdec.engine.models.loading import default_gguf_path

    cfg = EngineConfig(max_batch_size=2, max_seq_len=512, draft_dtype="float32")
    methods = {"self": SpeculativeConfig(method="draft_model", speculative_model=str(default_gguf_path()), max_draft_len=4)}
    engine = SpecEngine(smol_model, cfg, drafters=build_drafters(smol_model.cfg, methods, cfg, smol_dir, embed=smol_model.embed))
    prompt = [1, 9690, 198, 2683, 359, 253, 5356, 31, 2, 198]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    assert run_all(engine, [prompt], params, "self", 4, 1) == run_all(engine, [prompt], params, "none", 0, 1)
    assert engine.stats.accepted_tokens > 0.9 * engine.stats.draft_tokens
