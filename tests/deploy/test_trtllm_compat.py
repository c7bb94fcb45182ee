"""What TensorRT-LLM's clients and configs mean, without a server: the request fields newer
ensembles send (min_tokens, use_draft_logits, return_num_*), upstream's default for
exclude_input_in_output, draft_len_schedule translated between the two runtimes'
meanings (ours: batch <= key; TensorRT-LLM's: batch >= key), and our medusa settings as
TensorRT-LLM's MedusaDecodingConfig (a static medusa_choices tree, engine backend)."""
from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
import yaml

import specdec_wire as P
from specdec.config import METHOD_EAGLE3, METHOD_MEDUSA, METHOD_NGRAM, ServingConfig, SpeculativeConfig
from specdec.errors import ConfigError, InvalidRequestError
from specdec.serving.request import ServedOffer, parse_request
from trtllm_repository import generator as trtllm
from trtllm_repository import requests as trtllm_requests
from trtllm_repository.medusa_choices import check_choices, derive_choices
from trtllm_repository.schedule import check_trtllm_schedule, from_trtllm, ours_draft_len, to_trtllm, trtllm_draft_len

OFFER = ServedOffer({"ngram": 4}, "ngram", 8, 512)


def inputs(**values) -> dict:
    """Tensors as Triton hands them over: batch of one, strings as bytes."""
    out = {}
    for name, value in values.items():
        items = value if isinstance(value, list) else [value]
        out[name] = np.array([[v.encode() if isinstance(v, str) else v for v in items]], dtype=object)
    return out


def parse(**values):
    return parse_request(inputs(text_input="Hi", max_tokens=8, **values), OFFER)


# ---- the request ---------------------------------------------------------------------------
def test_min_tokens_is_min_length_under_its_new_name():
    assert parse(min_tokens=5).params.min_length == 5
    assert parse(min_length=5).params.min_length == 5
    assert parse(min_tokens=5, min_length=5).params.min_length == 5
    assert parse().params.min_length == 0
    with pytest.raises(InvalidRequestError) as err:
        parse(min_tokens=5, min_length=6)
    assert err.value.field == P.MIN_TOKENS and P.MIN_LENGTH in str(err.value)
    for name in (P.MIN_TOKENS, P.MIN_LENGTH):  # a bad value is named as the client sent it
        with pytest.raises(InvalidRequestError) as err:
            parse(**{name: -1})
        assert err.value.field == name


def test_exclude_input_in_output_defaults_to_upstreams_false():
    assert parse().exclude_input_in_output is False
    assert parse(exclude_input_in_output=True).exclude_input_in_output is True
    # Every caller of ours says what it wants, so the default cannot change its output.
    from specdec_client import GenerateRequest

    assert GenerateRequest("hi").fields(stream=False)[P.EXCLUDE_INPUT_IN_OUTPUT] is True


def test_use_draft_logits_and_token_count_flags_are_accepted():
    req = parse(use_draft_logits=True, return_num_input_tokens=True, return_num_output_tokens=False)
    assert req.return_num_input_tokens and not req.return_num_output_tokens
    assert parse(use_draft_logits=False).params == parse().params  # ignored: it changes nothing
    with pytest.raises(InvalidRequestError) as err:
        parse(use_draft_logits=[True, False])
    assert err.value.field == P.USE_DRAFT_LOGITS


def test_the_contract_has_tensorrt_llms_names_types_and_shapes():
    """As in tensorrt_llm_bls / ensemble config.pbtxt (TensorRT-LLM triton_backend/all_models)."""
    for model in ("ensemble", P.ENSEMBLE_UNARY, "speculative_loop"):
        ins, outs = P.MODELS[model]
        for name in (P.MIN_TOKENS,):
            assert (ins[name].dtype, ins[name].dims, ins[name].optional) == ("TYPE_INT32", (1,), True)
        for name in (P.USE_DRAFT_LOGITS, P.RETURN_NUM_INPUT_TOKENS, P.RETURN_NUM_OUTPUT_TOKENS):
            assert (ins[name].dtype, ins[name].dims, ins[name].optional) == ("TYPE_BOOL", (1,), True)
        for name in (P.NUM_INPUT_TOKENS, P.NUM_OUTPUT_TOKENS):
            assert (outs[name].dtype, outs[name].dims) == ("TYPE_INT32", (1,))
    assert P.MODELS["ensemble"] == P.MODELS[P.ENSEMBLE_UNARY]


# ---- draft_len_schedule, both meanings --------------------------------------------------------
MAX_BATCH = 24


def _schedules(max_draft_len: int):
    """Every schedule of ours with bounds from a small set (values 0..max_draft_len+1, the
    last above max_draft_len to check the cap), whose batch-1 length TensorRT-LLM can state."""
    bounds = (1, 2, 3, 5, 8, 16, 40)
    for size in (1, 2, 3):
        for keys in itertools.combinations(bounds, size):
            for values in itertools.product(range(max_draft_len + 2), repeat=size):
                if min(values[0], max_draft_len) == max_draft_len:
                    yield dict(zip(keys, values))


@pytest.mark.parametrize("max_draft_len", [1, 3])
def test_a_schedule_drafts_the_same_under_both_meanings(max_draft_len):
    checked = 0
    for ours in _schedules(max_draft_len):
        theirs = to_trtllm(ours, max_draft_len)
        check_trtllm_schedule(theirs, max_draft_len)  # TensorRT-LLM's validator would take it
        back = from_trtllm(theirs, max_draft_len, MAX_BATCH)
        spec = SpeculativeConfig(method=METHOD_EAGLE3, max_draft_len=max_draft_len, draft_len_schedule=back)
        for batch in range(1, MAX_BATCH + 1):
            expected = ours_draft_len(ours, max_draft_len, batch)
            assert trtllm_draft_len(theirs, batch) == expected, (ours, theirs, batch)
            # ...and the schedule read back means the same to our engine.
            assert spec.scheduled_draft_tokens(max_draft_len, batch) == expected, (ours, back, batch)
        checked += 1
    assert checked > 50


def test_schedule_examples_and_refusals():
    assert to_trtllm({2: 5, 4: 1}, 5) == {1: 5, 3: 1, 5: 0}  # tests/conftest.py's eagle3-busy
    assert to_trtllm({4: 4, 8: 4, 32: 1}, 4) == {1: 4, 9: 1, 33: 0}
    assert from_trtllm({1: 4, 4: 2, 8: 0}, 4, 64) == {3: 4, 7: 2}  # TensorRT-LLM's documented example
    assert from_trtllm({"1": 4, "4": 2}, 4, 64) == {3: 4, 64: 2}  # open-ended: up to max_batch_size
    with pytest.raises(ConfigError, match="set max_draft_len to 2"):
        to_trtllm({4: 2, 8: 1}, 4)  # TensorRT-LLM drafts max_draft_len at batch size 1
    for bad in ({2: 4}, {1: 3}, {1: 4, 2: 5}):
        with pytest.raises(ConfigError) as err:
            from_trtllm(bad, 4, 64)
        assert err.value.field == "draft_len_schedule"


def test_the_generator_writes_tensorrt_llms_meaning_and_reads_it_back():
    busy = SpeculativeConfig(method=METHOD_EAGLE3, max_draft_len=5, draft_len_schedule={2: 5, 4: 1})
    deployment = trtllm.TrtllmDeployment(
        target=trtllm.ModelConfig.from_hf_dict(trtllm.LLAMA_3_1_8B_INSTRUCT), variants={"busy": busy}, max_batch_size=8)
    config = yaml.safe_load(deployment.files()["ensemble/1/busy.yaml"])
    assert config["speculative_config"]["draft_len_schedule"] == {1: 5, 3: 1, 5: 0}
    served = trtllm.served_variant(config)
    assert served.num_draft_tokens == 5
    config["speculative_config"]["draft_len_schedule"] = {2: 5}  # a hand edit TensorRT-LLM would refuse
    with pytest.raises(ConfigError) as err:
        trtllm.served_variant(config)
    assert err.value.field == "speculative_config.draft_len_schedule"


# ---- the TensorRT-LLM variant's other settings ------------------------------------------------
def _configs() -> dict[str, dict]:
    files = trtllm.TrtllmDeployment(target=trtllm.ModelConfig.from_hf_dict(trtllm.LLAMA_3_1_8B_INSTRUCT),
                                    variants=trtllm.default_variants()).files()
    return {rel.split("/")[-1][: -len(".yaml")]: yaml.safe_load(text) for rel, text in files.items() if rel.endswith(".yaml")}


def test_one_model_eagle3_may_sample_and_the_others_need_no_flag():
    """1.2.x's one-model EAGLE-3 drafts and verifies greedily unless allow_advanced_sampling
    is set; the two-model paths (Draft_Target, NGram) sample without it."""
    configs = _configs()
    assert configs[METHOD_EAGLE3]["speculative_config"]["allow_advanced_sampling"] is True
    for name in (trtllm.DRAFT_TARGET, trtllm.NGRAM):
        assert "allow_advanced_sampling" not in configs[name]["speculative_config"]


def test_ngram_variant_uses_ngram_decoding_configs_fields():
    spec = _configs()[trtllm.NGRAM]["speculative_config"]
    # NGramDecodingConfig (1.2.x llm_args): max_draft_len, max_matching_ngram_size, is_keep_all,
    # is_use_oldest, is_public_pool; no weights.
    assert spec == {"decoding_type": "NGram", "max_draft_len": 4, "max_matching_ngram_size": 3, "is_public_pool": False}
    served = trtllm.served_variant(_configs()[trtllm.NGRAM], trtllm.PINNED_TRTLLM)
    assert (served.method, served.num_draft_tokens) == (METHOD_NGRAM, 4)
    with pytest.raises(ConfigError) as err:  # TensorRT-LLM matches down to one token
        trtllm.TrtllmDeployment(target=trtllm.ModelConfig.from_hf_dict(trtllm.LLAMA_3_1_8B_INSTRUCT),
                                variants={"ngram": SpeculativeConfig(method=METHOD_NGRAM, prompt_lookup_min=2)})
    assert err.value.field == "ngram.prompt_lookup_min"


def test_trtllm_requests_take_the_new_fields():
    served = trtllm_requests.ServedVariant(METHOD_EAGLE3, 3, max_batch_size=64, max_tokens_limit=8192, apply_chat_template=True)
    req = trtllm_requests.parse_request(inputs(text_input="Hi", max_tokens=8, min_tokens=3, use_draft_logits=True,
                                      return_num_input_tokens=True, return_num_output_tokens=True), served)
    assert req.sampling["min_tokens"] == 3
    assert req.return_num_input_tokens and req.return_num_output_tokens
    assert req.exclude_input_in_output is False  # upstream's default: the model echoes the prompt
    assert trtllm_requests.parse_request(inputs(text_input="Hi", max_tokens=8, exclude_input_in_output=True), served).exclude_input_in_output


# ---- Medusa: MedusaDecodingConfig on the TensorRT engine backend ---------------------------------
# The methods model_repository/specdec.json is to serve (not there yet): a chain and a tree.
MEDUSA_SETTINGS = {
    "engine": {"max_num_draft_tokens": 16},
    "methods": {
        "eagle3": {"method": "eagle3", "max_draft_len": 5},
        "medusa": {"method": "medusa", "max_draft_len": 4},
        "medusa-tree": {"method": "medusa", "max_draft_len": 4, "use_dynamic_tree": True, "dynamic_tree_max_topK": 4,
                        "max_total_draft_tokens": 12},
    },
}
MEDUSA_HEADS = "example-org/Llama-3.1-8B-Instruct-medusa"  # a name only: nothing is loaded
TREE_4X4_12 = [[0], [0, 0], [0, 0, 0], [0, 0, 0, 0],  # sum of positions 0: the argmax chain
               [1], [0, 1], [1, 0], [0, 0, 1], [0, 1, 0], [1, 0, 0], [0, 0, 0, 1], [0, 0, 1, 0]]  # sum 1, shallow first


def _medusa_configs(**deployment) -> dict[str, dict]:
    variants = {trtllm.BASELINE: None, trtllm.BASELINE_TENSORRT: None,
                **trtllm.medusa_variants(ServingConfig.from_dict(MEDUSA_SETTINGS))}
    files = trtllm.TrtllmDeployment(target=trtllm.ModelConfig.from_hf_dict(trtllm.LLAMA_3_1_8B_INSTRUCT), variants=variants,
                                    **{"medusa_model": MEDUSA_HEADS, **deployment}).files()
    return {rel.split("/")[-1][: -len(".yaml")]: yaml.safe_load(text) for rel, text in files.items() if rel.endswith(".yaml")}


def test_medusa_choices_are_the_argmax_chain_and_the_cheapest_nodes_of_the_topk_tree():
    chain = SpeculativeConfig(method=METHOD_MEDUSA, max_draft_len=4)
    assert derive_choices(chain) == [[0], [0, 0], [0, 0, 0], [0, 0, 0, 0]]
    tree = SpeculativeConfig(method=METHOD_MEDUSA, max_draft_len=4, use_dynamic_tree=True, dynamic_tree_max_topK=4,
                             max_total_draft_tokens=12)
    assert derive_choices(tree) == TREE_4X4_12
    for depth, topk in itertools.product((1, 2, 3, 6), (1, 2, 4, 10)):
        for budget in range(depth, topk * depth + 1):
            spec = SpeculativeConfig(method=METHOD_MEDUSA, max_draft_len=depth, use_dynamic_tree=True,
                                     dynamic_tree_max_topK=topk, max_total_draft_tokens=budget)
            choices = derive_choices(spec)
            assert len(choices) == budget and max(map(len, choices)) == depth
            assert all(i < topk for path in choices for i in path)
            assert check_choices(choices, num_heads=depth) == choices  # a tree TensorRT-LLM can build
            costs = [(sum(p), len(p), p) for p in choices]
            assert costs == sorted(costs)  # the documented order: cheapest first, shallower, lexicographic


def test_medusa_choices_trtllm_would_refuse_are_refused_by_name():
    for bad in ([], [[0, 1]], [[0], [0]], [[-1]], [[0], [0, 0], [0, 0, 0]]):
        with pytest.raises(ConfigError) as err:
            check_choices(bad, num_heads=2)
        assert err.value.field == "speculative_config.medusa_choices", bad


def test_medusa_variants_use_medusa_decoding_configs_fields_on_the_engine_backend():
    """MedusaDecodingConfig (1.2.x llm_args): medusa_choices, num_medusa_heads, plus
    DecodingBaseConfig's max_draft_len and speculative_model (alias speculative_model_dir).
    supports_backend refuses pytorch, so the files say backend: tensorrt, without the
    PyTorch-only cuda_graph_config, and baseline-tensorrt.yaml is their matched baseline."""
    configs = _medusa_configs()
    assert configs["medusa"]["speculative_config"] == {
        "decoding_type": "Medusa", "speculative_model": MEDUSA_HEADS, "max_draft_len": 4, "num_medusa_heads": 4,
        "medusa_choices": [[0], [0, 0], [0, 0, 0], [0, 0, 0, 0]]}
    # The engine backend's max_draft_len is the tree's node count (build_config.max_draft_len).
    assert configs["medusa-tree"]["speculative_config"] == {
        "decoding_type": "Medusa", "speculative_model": MEDUSA_HEADS, "max_draft_len": 12, "num_medusa_heads": 4,
        "medusa_choices": TREE_4X4_12}
    assert set(configs) == {"baseline", "baseline-tensorrt", "medusa", "medusa-tree"}  # eagle3 is not a medusa method
    for name in ("medusa", "medusa-tree", "baseline-tensorrt"):
        assert configs[name]["backend"] == "tensorrt" and "cuda_graph_config" not in configs[name]
        rest = {k: v for k, v in configs[name].items() if k != "speculative_config"}
        assert rest == configs["baseline-tensorrt"], f"{name} is not matched"
    assert configs["baseline"]["backend"] == "pytorch" and "cuda_graph_config" in configs["baseline"]


def test_medusa_files_are_read_back_and_hand_edits_refused_by_name():
    configs = _medusa_configs()
    for name, tokens in (("medusa", 4), ("medusa-tree", 12)):
        served = trtllm.served_variant(configs[name], trtllm.PINNED_TRTLLM)
        assert (served.method, served.num_draft_tokens) == (METHOD_MEDUSA, tokens)
        assert served.offer().methods == {METHOD_MEDUSA: tokens}
    assert trtllm.served_variant(configs["baseline-tensorrt"]).method == "none"
    edits = {
        "backend": lambda c: c.update(backend="pytorch"),
        "cuda_graph_config": lambda c: c.update(cuda_graph_config={"max_batch_size": 64}),
        "speculative_config.max_draft_len": lambda c: c["speculative_config"].update(max_draft_len=4),
        "speculative_config.medusa_choices": lambda c: c["speculative_config"].update(num_medusa_heads=3),
        "speculative_config.num_medusa_heads": lambda c: c["speculative_config"].pop("num_medusa_heads"),
        "speculative_config.speculative_model": lambda c: c["speculative_config"].pop("speculative_model"),
        "speculative_config.max_concurrency": lambda c: c["speculative_config"].update(max_concurrency=4),
    }
    for field, edit in edits.items():
        config = _medusa_configs()["medusa-tree"]
        edit(config)
        with pytest.raises(ConfigError) as err:
            trtllm.served_variant(config)
        assert err.value.field == field


def test_medusa_needs_heads_in_trtllms_format_and_no_pytorch_only_controls():
    with pytest.raises(ConfigError) as err:
        _medusa_configs(medusa_model=None)
    assert err.value.field == "medusa_model" and "draft-vocabulary lm_head" in str(err.value)
    target = trtllm.ModelConfig.from_hf_dict(trtllm.LLAMA_3_1_8B_INSTRUCT)
    for field, value in (("max_concurrency", 4), ("adaptive", True)):
        spec = SpeculativeConfig(method=METHOD_MEDUSA, max_draft_len=4, **{field: value})
        with pytest.raises(ConfigError) as err:
            trtllm.TrtllmDeployment(target=target, variants={"m": spec}, medusa_model=MEDUSA_HEADS)
        assert err.value.field == f"m.{field}"


def test_the_cli_writes_medusa_files_only_for_settings_with_medusa_methods(tmp_path):
    settings = tmp_path / "specdec.json"
    settings.write_text(json.dumps(MEDUSA_SETTINGS))
    out = tmp_path / "repo"
    # No heads named: the medusa methods are skipped (ours do not load in TensorRT-LLM), the rest written.
    assert trtllm.main(["--settings", str(settings), "--out", str(out)]) == 0
    written = sorted(p.stem for p in (out / "ensemble" / "1").glob("*.yaml"))
    assert written == ["baseline", "draft-target", "eagle3", "ngram"]
    assert trtllm.main(["--settings", str(settings), "--medusa-model", MEDUSA_HEADS, "--out", str(tmp_path / "with")]) == 0
    written = sorted(p.stem for p in (tmp_path / "with" / "ensemble" / "1").glob("*.yaml"))
    assert written == ["baseline", "baseline-tensorrt", "draft-target", "eagle3", "medusa", "medusa-tree", "ngram"]
    assert yaml.safe_load((tmp_path / "with" / "ensemble" / "1" / "medusa-tree.yaml").read_text()) == _medusa_configs()["medusa-tree"]
    # The served settings ship medusa methods (with load controls, not carried to the engine backend).
    assert set(trtllm.medusa_variants(ServingConfig.from_file(trtllm.DEFAULT_SETTINGS))) == {"medusa", "medusa-tree"}
    assert trtllm.main(["--medusa-model", MEDUSA_HEADS, "--out", str(tmp_path / "shipped")]) == 0
    shipped = yaml.safe_load((tmp_path / "shipped" / "ensemble" / "1" / "medusa.yaml").read_text())
    assert "max_concurrency" not in shipped["speculative_config"] and shipped["backend"] == "tensorrt"
