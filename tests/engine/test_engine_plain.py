"""Plain decoding through the engine (the matched baseline) and request validation."""
from __future__ import annotations

import pytest
import torch

from specdec.config import EngineConfig, SamplingParams
from specdec.serving.spec_engine import SpecEngine
from specdec.errors import CapacityError, InvalidRequestError, UnknownSequenceError
from specdec.serving.runtime import encode_prompt

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "Explain recursion to a five year old.",
    "List three uses of a paperclip.",
    "def fibonacci(n):",
]


def run(engine, ids, params, method="none", k=0, rid="r"):
    return [t for out in engine.generate(ids, params, method, k, request_id=rid) for t in out.new_token_ids]


def test_greedy_equals_transformers_generate(smol_dir, smol_model, smol_tokenizer):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(smol_dir), dtype=torch.float32).eval()
    engine = SpecEngine(smol_model, EngineConfig(max_batch_size=2, max_seq_len=512), tokenizer=smol_tokenizer)
    for prompt in PROMPTS:
        ids = encode_prompt(smol_tokenizer, prompt)
        ours = run(engine, ids, SamplingParams(max_tokens=24))
        with torch.no_grad():
            ref = hf.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)[0, len(ids):].tolist()
        if ref[-1] in engine.eos_token_ids:  # transformers keeps the EOS token; we stop before it
            ref = ref[:-1]
        assert ours == ref, prompt


def make_tiny_engine(tiny_llama_dir, **cfg):
    from specdec.engine.models.loading import load_transformer

    return SpecEngine(load_transformer(tiny_llama_dir), EngineConfig(**{"max_batch_size": 2, "max_seq_len": 64, "max_tokens_limit": 32, **cfg}))


@pytest.mark.parametrize(
    "prompt,params,field",
    [
        ([], SamplingParams(max_tokens=8), "text_input"),
        (list(range(3, 3 + 64)), SamplingParams(max_tokens=8), "text_input"),
        ([5, 6], SamplingParams(max_tokens=0), "max_tokens"),
        ([5, 6], SamplingParams(max_tokens=33), "max_tokens"),
        ([5, 6], SamplingParams(max_tokens=8, temperature=-0.1), "temperature"),
        ([5, 6], SamplingParams(max_tokens=8, temperature=1.0, top_p=0.0), "top_p"),
        ([5, 6], SamplingParams(max_tokens=8, temperature=1.0, top_p=1.5), "top_p"),
        ([5, 6], SamplingParams(max_tokens=8, temperature=1.0, top_k=-1), "top_k"),
        ([5, 6], SamplingParams(max_tokens=8, temperature=1.0, min_p=1.5), "min_p"),
        ([5, 6], SamplingParams(max_tokens=8, temperature=1.0, min_p=-0.1), "min_p"),
        ([5, 6], SamplingParams(max_tokens=8, logit_bias=((5, 101.0),)), "embedding_bias_weights"),
        ([5, 6], SamplingParams(max_tokens=8, logit_bias=((5, float("nan")),)), "embedding_bias_weights"),
        ([5, 6], SamplingParams(max_tokens=8, logit_bias=((10**6, 1.0),)), "embedding_bias_token_ids"),
        ([5, 6], SamplingParams(max_tokens=8, logit_bias=(("5", 1.0),)), "embedding_bias_token_ids"),
    ],
)
def test_bad_request_names_field_and_changes_nothing(tiny_llama_dir, prompt, params, field):
    engine = make_tiny_engine(tiny_llama_dir)
    free_before = engine.cache.num_free
    with pytest.raises(InvalidRequestError) as err:
        engine.add_request("bad", prompt, params)
    assert err.value.field == field and field in str(err.value)
    assert engine.cache.num_free == free_before and not engine.sequences
    # The engine still serves.
    assert len(run(engine, [5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True))) == 4


def test_no_free_slot_and_unknown_cancel(tiny_llama_dir):
    engine = make_tiny_engine(tiny_llama_dir)
    engine.add_request("a", [5, 6], SamplingParams(max_tokens=4))
    engine.add_request("b", [5, 6], SamplingParams(max_tokens=4))
    engine.step()  # prefill: both now hold a KV slot
    assert engine.cache.num_free == 0
    with pytest.raises(CapacityError):
        engine.add_request("c", [5, 6], SamplingParams(max_tokens=4))
    assert set(engine.sequences) == {"a", "b"}
    with pytest.raises(UnknownSequenceError) as err:
        engine.cancel("nope")
    assert err.value.field == "request_id"
    engine.cancel("a")
    assert engine.cache.num_free == 1
    while engine.has_work():
        engine.step()
    assert engine.cache.num_free == 2


def test_seeded_sampling_reproduces_and_respects_max_tokens(tiny_llama_dir):
    engine = make_tiny_engine(tiny_llama_dir)
    params = SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, top_k=20, seed=1234, ignore_eos=True)
    a = run(engine, [5, 6, 7], params)
    b = run(engine, [5, 6, 7], params)
    c = run(engine, [5, 6, 7], SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, top_k=20, seed=99, ignore_eos=True))
    assert a == b and len(a) == 20 and a != c
