"""Capture from served traffic (issue 62; specdec/serving/traffic_capture.py): the scheduler records
what the target computed for the requests it samples, changes nothing it answers, keeps a
tenant's salted requests out unless named, and keeps its store under its cap."""
from __future__ import annotations

import json

import pytest
import torch

from specdec.config import REPO_ROOT, CaptureConfig, EngineConfig, SamplingParams, ServingConfig, SpeculativeConfig
from specdec.errors import ConfigError

HEAD = REPO_ROOT / "models" / "eagle3-smollm2-135m"
PROMPTS = ["Write a haiku about the sea.", "def fibonacci(n):", "List three prime numbers and explain why."]


def engine_with(model, tokenizer, capture: CaptureConfig | None, seed: int = 0):
    from specdec.serving.traffic_capture import TrafficCapture
    from specdec.serving.runtime import build_drafters
    from specdec.serving.spec_engine import SpecEngine

    cfg = EngineConfig(max_batch_size=4, max_seq_len=512, weight_format="int8")
    spec = {"eagle3": SpeculativeConfig(method="eagle3", max_draft_len=4, speculative_model=str(HEAD)),
            "ngram": SpeculativeConfig(method="ngram", max_draft_len=4)}
    observer = None if capture is None else TrafficCapture(capture, model.cfg, "SmolLM2-135M-Instruct", seed=seed)
    engine = SpecEngine(model, cfg, tokenizer, build_drafters(model.cfg, spec, cfg, embed=model.embed), methods=spec, observer=observer)
    return engine, observer


def run(engine, tokenizer, requests) -> list[list[int]]:
    from specdec.serving.runtime import encode_prompt

    outputs = []
    for i, (prompt, method, params) in enumerate(requests):
        ids = []
        for out in engine.generate(encode_prompt(tokenizer, prompt), params, method, None if method == "none" else 4, request_id=f"r{i}"):
            ids += out.new_token_ids
        outputs.append(ids)
    return outputs


REQUESTS = [
    (PROMPTS[0], "none", SamplingParams(max_tokens=24)),
    (PROMPTS[1], "eagle3", SamplingParams(max_tokens=24)),
    (PROMPTS[2], "ngram", SamplingParams(max_tokens=24)),
    (PROMPTS[0], "eagle3", SamplingParams(max_tokens=24, temperature=0.8, seed=7)),
]


def test_capture_records_what_the_target_computed_and_changes_no_answer(tmp_path, smol_int8_model, smol_tokenizer):
    """Every method's answer (greedy and seeded sampling) is the same with capture on; each
    recorded sequence holds the prompt and output tokens, and its taps and last layer are a
    teacher-forced pass's over them (exactly: the kernels are row-invariant), in fp16."""
    from specdec.serving.traffic_capture import read_captures
    from specdec.training.capture import captured_features, target_features

    plain, _ = engine_with(smol_int8_model, smol_tokenizer, None)
    expected = run(plain, smol_tokenizer, REQUESTS)
    store = tmp_path / "store"
    engine, capture = engine_with(smol_int8_model, smol_tokenizer, CaptureConfig(str(store), shard_sequences=3, flush_after_s=3600))
    assert run(engine, smol_tokenizer, REQUESTS) == expected
    capture.close()
    assert capture.captured == len(REQUESTS) and capture.dropped == 0
    assert len(list(store.glob("shard-*.npz"))) == 2  # 3 per shard, the last one written at close
    manifest = json.loads((store / "capture.json").read_text())
    assert manifest["layers"] == list(smol_int8_model.cfg.eagle3_tap_layers()) + [smol_int8_model.cfg.num_layers - 1]
    recorded = read_captures(store)
    from specdec.serving.runtime import encode_prompt

    for (prompt, method, _), output, seq in zip(REQUESTS, expected, recorded):
        ids = encode_prompt(smol_tokenizer, prompt) + output
        assert seq["tokens"].tolist() == ids[:-1] and seq["prompt_len"] == len(encode_prompt(smol_tokenizer, prompt))
        assert seq["method"] == method and seq["salt"] is None and seq["taps"].dtype == torch.float16
        ref = target_features(smol_int8_model, [ids[:-1]])[0]
        assert torch.equal(seq["taps"], ref["taps"]) and torch.equal(seq["last"], ref["last"])
    # Training reads them with the target's own predictions as labels: on a greedy answer, its next tokens.
    features = captured_features(smol_int8_model, store)
    greedy = features[1]
    n = recorded[1]["prompt_len"]
    assert greedy["labels"][n - 1 :].tolist() == expected[1]


def test_salted_requests_are_recorded_only_when_their_salt_is_named(tmp_path, smol_int8_model, smol_tokenizer):
    """A cache_salt scopes a tenant: unnamed salts are never recorded, a named one is, with
    its salt kept so it can be filtered out (or in) for training."""
    from specdec.serving.traffic_capture import read_captures

    store = tmp_path / "store"
    engine, capture = engine_with(smol_int8_model, smol_tokenizer, CaptureConfig(str(store), salts=("team-a",)))
    run(engine, smol_tokenizer, [(PROMPTS[0], "none", SamplingParams(max_tokens=8, cache_salt="team-b")),
                                 (PROMPTS[1], "none", SamplingParams(max_tokens=8, cache_salt="team-a")),
                                 (PROMPTS[2], "none", SamplingParams(max_tokens=8))])
    capture.close()
    assert [s["salt"] for s in read_captures(store)] == ["team-a", None]
    assert [s["salt"] for s in read_captures(store, salts={None})] == [None]
    assert not CaptureConfig("x").admits("team-a") and CaptureConfig("x").admits(None)


def test_the_store_keeps_under_its_cap_by_deleting_the_oldest(tmp_path, smol_int8_model, smol_tokenizer, monkeypatch):
    """One shard per sequence, a cap of 1 MiB: the oldest shards go, the newest stay, and
    the store never holds more than the cap; a sample rate draws a share of requests."""
    from specdec.serving.traffic_capture import CaptureStore

    written = []
    write = CaptureStore.write
    monkeypatch.setattr(CaptureStore, "write", lambda self, sequences: written.append(write(self, sequences)) or written[-1])
    store = tmp_path / "store"
    engine, capture = engine_with(smol_int8_model, smol_tokenizer, CaptureConfig(str(store), shard_sequences=1, max_bytes=1 << 20))
    prompt = " ".join(["A long prompt about ships and harbours and the weather at sea."] * 5)  # two or three shards fit the cap
    run(engine, smol_tokenizer, [(prompt, "none", SamplingParams(max_tokens=4))] * 6)
    capture.close()
    shards = sorted(store.glob("shard-*.npz"))
    sizes = [p.stat().st_size for p in shards]
    assert capture.captured == 6 and 1 <= len(shards) < 6  # some were rotated out
    assert len(shards) >= 2 and shards == written[-len(shards):], sizes  # what stays is the newest, in order
    assert sum(sizes) <= 1 << 20 and sizes[-1] > (1 << 20) // 6  # each shard is big enough that six pass the cap
    half, sampler = engine_with(smol_int8_model, smol_tokenizer, CaptureConfig(str(tmp_path / "half"), sample_rate=0.5), seed=3)
    run(half, smol_tokenizer, [(PROMPTS[0], "none", SamplingParams(max_tokens=2))] * 12)
    sampler.close()
    assert 0 < sampler.captured < 12


def test_capture_settings_name_the_field_they_break():
    base = {"engine": {}, "methods": {}, "default_method": "none"}
    assert ServingConfig.from_dict(base).capture is None  # off by default
    assert ServingConfig.from_dict({**base, "capture": {"directory": "/tmp/x", "salts": ["a"]}}).capture.salts == ("a",)
    for bad, field in [({"directory": ""}, "capture.directory"), ({"directory": "d", "sample_rate": 0}, "capture.sample_rate"),
                       ({"directory": "d", "sample_rate": 1.5}, "capture.sample_rate"), ({"directory": "d", "max_bytes": 10}, "capture.max_bytes"),
                       ({"directory": "d", "salts": [""]}, "capture.salts"), ({"directory": "d", "size": 1}, "capture.size"),
                       ({"directory": "d", "flush_after_s": 0}, "capture.flush_after_s")]:
        with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
            ServingConfig.from_dict({**base, "capture": bad})


def test_promoted_heads_replace_every_method_of_their_kind(tmp_path):
    """The settings a promoted version of the engine's host reads: each method of the kind
    drafts with the new head, the others keep theirs; a wrong kind or path names the field."""
    settings = ServingConfig.from_dict({"engine": {}, "default_method": "eagle3", "methods": {
        "eagle3": {"method": "eagle3", "max_draft_len": 5}, "eagle3-tree": {"method": "eagle3", "max_draft_len": 4, "use_dynamic_tree": True,
                                                                            "max_total_draft_tokens": 12},
        "ngram": {"method": "ngram", "max_draft_len": 4}}})
    promoted = settings.with_heads({"eagle3": str(tmp_path)})
    assert [m.speculative_model for m in promoted.methods.values()] == [str(tmp_path), str(tmp_path), None]
    with pytest.raises(ConfigError, match="medusa_heads"):
        settings.with_heads({"medusa": str(tmp_path)})  # no medusa method served
    with pytest.raises(ConfigError, match="eagle3_head"):
        settings.with_heads({"eagle3": str(tmp_path / "missing")})


def test_a_promoted_drafter_serves_new_sequences_and_running_ones_finish_with_theirs(smol_int8_model, smol_tokenizer):
    """DraftService.replace (a head promoted into a running engine): the sequence that was
    running keeps drafting with the head it started with, the next one drafts with the new
    head, and both answers equal plain decoding's."""
    from specdec.serving.runtime import build_drafters, encode_prompt

    engine, _ = engine_with(smol_int8_model, smol_tokenizer, None)
    plain, _ = engine_with(smol_int8_model, smol_tokenizer, None)
    expected = run(plain, smol_tokenizer, [(PROMPTS[0], "none", SamplingParams(max_tokens=32)),
                                           (PROMPTS[1], "none", SamplingParams(max_tokens=32))])
    drafts = engine.speculator.drafts
    old = drafts.drafters["eagle3"]
    new = build_drafters(smol_int8_model.cfg, {"eagle3": old.config}, engine.config, embed=smol_int8_model.embed)["eagle3"]
    calls = {id(old): [], id(new): []}
    for drafter in (old, new):
        propose = drafter.propose
        drafter.propose = lambda seqs, *a, _p=propose, _d=drafter: calls[id(_d)].extend(s.record.seq_id for s in seqs) or _p(seqs, *a)
    engine.add_request("a", encode_prompt(smol_tokenizer, PROMPTS[0]), SamplingParams(max_tokens=32), "eagle3", 4)
    outputs = {"a": [], "b": []}
    for _ in range(3):
        for out in engine.step():
            outputs[out.request_id] += out.new_token_ids
    drafts.replace({"eagle3": new})
    engine.add_request("b", encode_prompt(smol_tokenizer, PROMPTS[1]), SamplingParams(max_tokens=32), "eagle3", 4)
    while engine.has_work():
        for out in engine.step():
            outputs[out.request_id] += out.new_token_ids
    assert [outputs["a"], outputs["b"]] == expected
    assert set(calls[id(old)]) == {"a"} and set(calls[id(new)]) == {"b"}
    with pytest.raises(ConfigError, match="tap_layers"):
        drafts.replace({"eagle3": build_drafters(smol_int8_model.cfg, {"ngram": SpeculativeConfig(method="ngram")}, engine.config)["ngram"]})


def test_a_shard_keeps_values_past_fp16s_range_in_bf16(tmp_path):
    """Gemma 3's residual stream passes fp16's range: such a sequence is stored as bf16,
    rounded as torch rounds, beside an fp16 one in the same shard."""
    import numpy as np

    from specdec.serving.traffic_capture import encode_rows, read_shard, write_shard

    rng = np.random.default_rng(0)
    small = rng.normal(size=(5, 6)).astype(np.float32)
    large = (rng.normal(size=(5, 6)) * 1e5).astype(np.float32)
    sequences = []
    for i, x in enumerate((small, large)):
        taps, taps_bf16 = encode_rows(x)
        last, last_bf16 = encode_rows(x[:, :2])
        sequences.append({"tokens": np.arange(5, dtype=np.int32) + i, "prompt_len": 2, "taps": taps, "last": last,
                          "bf16": (taps_bf16, last_bf16), "method": "none", "salt": None})
    path = tmp_path / "shard.npz"
    write_shard(path, sequences)
    fp16, bf16 = read_shard(path)
    assert fp16["taps"].dtype == torch.float16 and torch.equal(fp16["taps"], torch.from_numpy(small).half())
    assert bf16["taps"].dtype == torch.bfloat16 and torch.equal(bf16["taps"], torch.from_numpy(large).bfloat16())
    assert bf16["tokens"].tolist() == [1, 2, 3, 4, 5] and bf16["prompt_len"] == 2
