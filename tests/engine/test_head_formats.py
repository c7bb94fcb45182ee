"""EAGLE-3 heads in the public formats: our shipped head exported in vLLM speculators' format
(`specdec export-head`) loads back with the same tensors, the same draft logits and the same
acceptance at every step; a speculators config made for another target, or with a flag this
head does not implement, is refused naming its key; speculators' norm_before_residual is
honoured."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from specdec.cli import main as specdec_main
from specdec.config import EngineConfig, SamplingParams, SpeculativeConfig
from specdec.engine.drafters.eagle3 import DEFAULT_HEAD
from specdec.engine.models.eagle3_head import load_eagle3
from specdec.errors import ConfigError
from specdec.serving.runtime import build_drafters, encode_prompt
from specdec.serving.spec_engine import SpecEngine

PROMPTS = ["Write a haiku about the sea.", "List three prime numbers and explain why they are prime.",
           "What is the capital of France? Answer in one sentence."]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    out = tmp_path_factory.mktemp("heads") / "speculators"
    assert specdec_main(["export-head", str(DEFAULT_HEAD), str(out), "--verifier", "HuggingFaceTB/SmolLM2-135M-Instruct"]) == 0
    return out


def test_the_export_is_in_the_speculators_layout(exported):
    config = json.loads((exported / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3" and config["architectures"] == ["Eagle3Speculator"]
    assert config["transformer_layer_config"]["hidden_size"] == 576 and config["eagle_aux_hidden_state_layer_ids"] == [1, 14, 26]
    assert config["speculators_config"]["verifier"]["name_or_path"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    from safetensors import safe_open
    with safe_open(str(exported / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "layers.0.self_attn.q_proj.weight" in names and not any(n.startswith("midlayer.") for n in names)


def test_the_export_loads_back_with_identical_tensors_and_head_passes(exported, smol_model):
    shipped = load_eagle3(DEFAULT_HEAD, smol_model.embed, smol_model.cfg)
    again = load_eagle3(exported, smol_model.embed, smol_model.cfg)
    assert again.cfg == shipped.cfg
    ours, theirs = shipped.state_dict(), again.state_dict()
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert torch.equal(ours[name], theirs[name]), name
    taps = torch.randn(2, 5, 3 * 576, generator=torch.Generator().manual_seed(0))
    tokens = torch.randint(0, 49152, (2, 5), generator=torch.Generator().manual_seed(1))
    mixed = [head._residual(head.fuse(taps), torch.zeros(2, 5, 576)) for head in (shipped, again)]
    assert torch.equal(mixed[0], mixed[1])
    assert torch.equal(shipped._mix(shipped.fuse(taps), tokens), again._mix(again.fuse(taps), tokens))


def _steps(engine: SpecEngine, prompt_ids: list[int], method: str) -> list[list[int]]:
    """The tokens each engine step emitted for one greedy request (accepted drafts + 1 each)."""
    engine.add_request("r", prompt_ids, SamplingParams(max_tokens=40, ignore_eos=True), method, 4)
    steps = []
    while engine.sequences:
        for out in engine.step():
            if out.new_token_ids:
                steps.append(list(out.new_token_ids))
    return steps


def test_the_export_drafts_with_the_same_acceptance_at_every_step(exported, smol_model, smol_tokenizer):
    cfg = EngineConfig(max_batch_size=1, max_seq_len=512, max_num_draft_tokens=4)
    methods = {"shipped": SpeculativeConfig(method="eagle3", max_draft_len=4),
               "exported": SpeculativeConfig(method="eagle3", max_draft_len=4, speculative_model=str(exported))}
    engine = SpecEngine(smol_model, cfg, tokenizer=smol_tokenizer,
                        drafters=build_drafters(smol_model.cfg, methods, cfg, embed=smol_model.embed))
    accepted_somewhere = False
    for prompt in PROMPTS:
        ids = encode_prompt(smol_tokenizer, prompt)
        shipped, again = _steps(engine, ids, "shipped"), _steps(engine, ids, "exported")
        assert again == shipped  # the same tokens, cut into the same steps: the same acceptance per step
        accepted_somewhere |= any(len(step) > 1 for step in shipped)
    assert accepted_somewhere  # the comparison saw real accepted drafts


@pytest.mark.parametrize("edit, key", [
    (lambda c: c["transformer_layer_config"].update(hidden_size=512), "transformer_layer_config.hidden_size"),
    (lambda c: c["transformer_layer_config"].update(vocab_size=32000), "transformer_layer_config.vocab_size"),
    (lambda c: c.update(eagle_aux_hidden_state_layer_ids=[1, 14, 30]), "eagle_aux_hidden_state_layer_ids"),
    (lambda c: c.update(target_hidden_size=1024), "target_hidden_size"),
    (lambda c: c.update(norm_before_fc=True, fc_norm=True), "fc_norm"),  # exclusive, as speculators says
    (lambda c: c.update(speculators_model_type="eagle"), "speculators_model_type"),
])
def test_a_head_that_does_not_fit_is_refused_naming_the_key(exported, smol_model, tmp_path, edit, key):
    head = tmp_path / "head"
    shutil.copytree(exported, head)
    config = json.loads((head / "config.json").read_text())
    edit(config)
    (head / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError) as err:
        load_eagle3(head, smol_model.embed, smol_model.cfg)
    assert err.value.field == key


def test_norm_before_residual_starts_the_residual_from_the_normed_hidden(exported, smol_model, tmp_path):
    head = tmp_path / "head"
    shutil.copytree(exported, head)
    config = json.loads((head / "config.json").read_text())
    config["norm_before_residual"] = True
    (head / "config.json").write_text(json.dumps(config))
    plain, normed = load_eagle3(exported, smol_model.embed, smol_model.cfg), load_eagle3(head, smol_model.embed, smol_model.cfg)
    assert normed.cfg.norm_before_residual and not plain.cfg.norm_before_residual
    hidden, attn_out = torch.randn(1, 3, 576), torch.randn(1, 3, 576)
    expected = normed.hidden_norm(hidden) + attn_out
    expected = expected + normed.mlp(normed.post_attention_layernorm(expected)).float()
    assert torch.equal(normed._residual(hidden, attn_out), expected)
    assert not torch.equal(plain._residual(hidden, attn_out), expected)  # control: the flag changes the pass


def _rms(x, weight, eps):
    """RMSNorm written out (the reference the head's norms are checked against)."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _with_flags(exported, tmp_path, flags: dict, tensors: dict):
    from safetensors.torch import load_file, save_file

    head = tmp_path / "_".join(flags) / "head"
    shutil.copytree(exported, head)
    config = json.loads((head / "config.json").read_text())
    config.update(flags)
    (head / "config.json").write_text(json.dumps(config))
    save_file({**load_file(str(head / "model.safetensors")), **tensors}, str(head / "model.safetensors"))
    return head


def test_eagle31_norms_before_fc_per_tap_and_on_the_carried_hidden(exported, smol_model, tmp_path):
    """EAGLE-3.1's flags as the speculators package defines them: norm_before_fc normalises the
    concatenated taps, fc_norm each tap, norm_output carries norm(h) to the next step (same
    logits); each checked against RMSNorm written out, with the plain head as the control."""
    torch.manual_seed(0)
    plain = load_eagle3(exported, smol_model.embed, smol_model.cfg)
    eps, taps = plain.cfg.rms_norm_eps, torch.randn(1, 4, 3 * 576)
    whole, per_tap = torch.rand(3 * 576) + 0.5, [torch.rand(576) + 0.5 for _ in range(3)]
    before_fc = load_eagle3(_with_flags(exported, tmp_path, {"norm_before_fc": True}, {"input_norm.weight": whole}),
                            smol_model.embed, smol_model.cfg)
    assert torch.allclose(before_fc.fuse(taps), plain.fc(_rms(taps, whole, eps)).float(), atol=1e-5)
    per = load_eagle3(_with_flags(exported, tmp_path, {"fc_norm": True}, {f"fc_norm.{i}.weight": w for i, w in enumerate(per_tap)}),
                      smol_model.embed, smol_model.cfg)
    expected = plain.fc(torch.cat([_rms(t, w, eps) for t, w in zip(taps.chunk(3, dim=-1), per_tap)], dim=-1)).float()
    assert torch.allclose(per.fuse(taps), expected, atol=1e-5)
    assert not torch.allclose(plain.fuse(taps), expected, atol=1e-3)  # control: the norms change the pass
    output = load_eagle3(_with_flags(exported, tmp_path, {"norm_output": True}, {}), smol_model.embed, smol_model.cfg)
    hidden, attn_out = plain.fuse(taps), torch.randn(1, 4, 576)
    (h_plain, logits_plain), (h_out, logits_out) = (head._carry(head._residual(hidden, attn_out)) for head in (plain, output))
    assert torch.equal(logits_out, logits_plain) and torch.allclose(h_out, _rms(h_plain, plain.norm.weight, eps), atol=1e-5)
    assert not torch.allclose(h_out, h_plain, atol=1e-3)


def test_an_eagle31_head_exports_and_loads_back_with_its_norms(exported, smol_model, tmp_path):
    from specdec.engine.models.eagle3_head import export_speculators

    per_tap = {f"fc_norm.{i}.weight": torch.rand(576) + 0.5 for i in range(3)}
    head = _with_flags(exported, tmp_path, {"fc_norm": True, "norm_output": True}, per_tap)
    again = export_speculators(head, tmp_path / "again", "SmolLM2-135M-Instruct")
    config = json.loads((again / "config.json").read_text())
    assert (config["fc_norm"], config["norm_output"], config["norm_before_fc"]) == (True, True, False)
    loaded = load_eagle3(again, smol_model.embed, smol_model.cfg)
    assert all(torch.equal(norm.weight, per_tap[f"fc_norm.{i}.weight"]) for i, norm in enumerate(loaded.fc_norm))


def test_the_speculators_package_reads_our_export(exported):
    """vLLM's speculators package (0.3.0, its own pydantic classes) parses the export: the same
    draft vocabulary, aux layers, shapes and drafting depth as we wrote."""
    from speculators.models.eagle3 import Eagle3SpeculatorConfig

    ours = json.loads((exported / "config.json").read_text())
    theirs = Eagle3SpeculatorConfig.from_pretrained(str(exported))
    shipped_vocab = json.loads((DEFAULT_HEAD / "config.json").read_text())["draft_vocab_size"]
    assert theirs.speculators_model_type == "eagle3" and theirs.draft_vocab_size == ours["draft_vocab_size"] == shipped_vocab
    assert theirs.eagle_aux_hidden_state_layer_ids == [1, 14, 26] and theirs.norm_before_residual is False
    assert theirs.transformer_layer_config.hidden_size == 576 and theirs.transformer_layer_config.vocab_size == 49152
    assert theirs.speculators_config.proposal_methods[0].speculative_tokens == ours["speculators_config"]["proposal_methods"][0]["speculative_tokens"]


def test_we_read_a_config_the_speculators_package_writes(smol_model, tmp_path):
    """A config built and saved by the speculators package's classes loads into ours with the
    values it was given, and is checked against the target like any other."""
    from speculators import SpeculatorsConfig, VerifierConfig
    from speculators.models.eagle3 import Eagle3SpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import LlamaConfig

    from specdec.engine.models.eagle3_head import Eagle3Config

    layer = LlamaConfig(num_hidden_layers=1, hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                        vocab_size=49152, rms_norm_eps=1e-5, rope_theta=100000.0, max_position_embeddings=8192)
    theirs = Eagle3SpeculatorConfig(
        transformer_layer_config=layer, draft_vocab_size=4096, norm_before_residual=True, eagle_aux_hidden_state_layer_ids=[2, 15, 27],
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3", proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=4)], default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path="HuggingFaceTB/SmolLM2-135M-Instruct", architectures=["LlamaForCausalLM"])))
    theirs.save_pretrained(str(tmp_path))
    raw = json.loads((tmp_path / "config.json").read_text())
    cfg = Eagle3Config.from_config_file(raw, smol_model.cfg)
    assert (cfg.hidden_size, cfg.draft_vocab_size, cfg.tap_layers, cfg.norm_before_residual) == (576, 4096, (2, 15, 27), True)
    assert (cfg.head_dim, cfg.num_key_value_heads, cfg.rope_theta) == (64, 3, 100000.0)
    cfg.check_fits(smol_model.cfg, speculators=True)
    raw["eagle_aux_hidden_state_layer_ids"] = [2, 15, 99]
    with pytest.raises(ConfigError) as err:
        Eagle3Config.from_config_file(raw, smol_model.cfg).check_fits(smol_model.cfg, speculators=True)
    assert err.value.field == "eagle_aux_hidden_state_layer_ids"
