"""TensorRT-LLM ensemble inputs beyond text / max_tokens / sampling, sent the way its
clients send them (JSON to /v2/models/ensemble/generate, TensorRT-LLM's names): each one
changes the output as TensorRT-LLM's does, and speculation keeps greedy output identical
to the matched baseline with the same settings (the rules shape the target's logits at
every tree node; specdec/engine/logits_processing.py)."""
from __future__ import annotations

import json
import re
import urllib.error
import urllib.request

import numpy as np
import pytest

import specdec_wire as P

pytestmark = pytest.mark.server

PROMPT = "What is the capital of Italy? Answer in one word."  # an answer that ends by itself, well before 30 tokens
COLORS = "Name three colors."
REPETITIVE = "Repeat after me: speculative decoding is lossless. Repeat it again."
# Co-located chain and tree, n-gram lookup, and a tree handed in by the drafter model.
METHODS = [("eagle3", 5), ("eagle3-tree", 12), ("ngram", 4), ("eagle3-apart", 5)]


def generate(server, model: str = "ensemble", **body) -> dict:
    body.setdefault("text_input", PROMPT)
    body.setdefault("max_tokens", 32)
    body.setdefault("return_perf_metrics", True)
    body.setdefault("exclude_input_in_output", True)  # the answer alone (upstream's default echoes the prompt)
    req = urllib.request.Request(server.endpoints.http_url + f"/v2/models/{model}/generate", data=json.dumps(body).encode())
    try:
        with urllib.request.urlopen(req) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        raise AssertionError(f"{exc.code}: {exc.read().decode()}") from None


def same_everywhere(server, **settings) -> dict:
    """The baseline's response, after checking every method gives the same text."""
    base = generate(server, num_draft_tokens=0, **settings)
    for method, k in METHODS:
        spec = generate(server, speculative_method=method, num_draft_tokens=k, **settings)
        assert spec[P.TEXT_OUTPUT] == base[P.TEXT_OUTPUT], (method, settings)
        assert spec[P.OUTPUT_TOKENS] == base[P.OUTPUT_TOKENS], (method, settings)
    return base


@pytest.fixture(scope="module")
def tokenizer(smol_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smol_dir))


def test_min_length_holds_back_the_end(triton_server):
    free = generate(triton_server, num_draft_tokens=0, max_tokens=64)
    assert free[P.OUTPUT_TOKENS] < 30  # the answer ends by itself, well before 30 tokens
    held = same_everywhere(triton_server, min_length=40, max_tokens=64)
    assert held[P.OUTPUT_TOKENS] >= 40
    assert held[P.TEXT_OUTPUT].startswith(free[P.TEXT_OUTPUT])


def test_bad_words_never_appear(triton_server):
    free = generate(triton_server, text_input=COLORS, num_draft_tokens=0)
    # a color the free answer names (which one, and its case, follow the weights' rounding)
    word = next(w for w in ("Red", "red", "Blue", "blue") if re.search(rf"\b{w}\b", free[P.TEXT_OUTPUT]))
    banned = same_everywhere(triton_server, text_input=COLORS, bad_words=[word, " " + word])
    assert not re.search(rf"\b{word}\b", banned[P.TEXT_OUTPUT]) and banned[P.TEXT_OUTPUT]
    # TensorRT-LLM clients send [""] for "none": accepted, and changes nothing.
    none = generate(triton_server, text_input=COLORS, num_draft_tokens=0, bad_words=[""], stop_words=[""])
    assert none[P.TEXT_OUTPUT] == free[P.TEXT_OUTPUT]


def test_end_id_ends_the_sequence(triton_server, tokenizer):
    free = generate(triton_server, num_draft_tokens=0)
    (period,) = tokenizer.encode(".", add_special_tokens=False)
    assert "." in free[P.TEXT_OUTPUT]
    ended = same_everywhere(triton_server, end_id=period, pad_id=period)
    assert ended[P.TEXT_OUTPUT] == free[P.TEXT_OUTPUT][: free[P.TEXT_OUTPUT].index(".")]
    # min_length holds back end_id too (not the model's EOS).
    later = same_everywhere(triton_server, end_id=period, min_length=ended[P.OUTPUT_TOKENS] + 3)
    assert len(later[P.TEXT_OUTPUT]) > len(ended[P.TEXT_OUTPUT])


# One penalty through the server in make test (the three share one code path, and every
# penalty is proved lossless exactly in process: tests/engine/test_exact_lossless.py's RULES).
@pytest.mark.parametrize("penalty", [{"repetition_penalty": 1.3}, pytest.param({"presence_penalty": 1.0}, marks=pytest.mark.slow),
                                     pytest.param({"frequency_penalty": 0.7}, marks=pytest.mark.slow)])
def test_penalties_change_the_output_and_stay_lossless(triton_server, penalty):
    free = generate(triton_server, text_input=REPETITIVE, num_draft_tokens=0, max_tokens=48)
    penalized = same_everywhere(triton_server, text_input=REPETITIVE, max_tokens=48, **penalty)
    assert penalized[P.TEXT_OUTPUT] != free[P.TEXT_OUTPUT]


def test_out_of_range_rules_are_named(triton_server):
    for body, name in (({"end_id": 10**6}, "end_id"), ({"pad_id": -1}, "pad_id"), ({"min_length": -2}, "min_length"),
                       ({"repetition_penalty": 0.0}, "repetition_penalty")):
        with pytest.raises(AssertionError, match=name):
            generate(triton_server, **body)


def test_exclude_input_in_output_false_puts_the_prompt_first(triton_server):
    """TensorRT-LLM's default (flag absent = false): a non-streamed answer starts with the prompt."""
    answer = generate(triton_server, num_draft_tokens=0)[P.TEXT_OUTPUT]
    whole = generate(triton_server, num_draft_tokens=0, exclude_input_in_output=False)[P.TEXT_OUTPUT]
    assert whole.endswith(answer) and PROMPT in whole[: -len(answer)]
    body = {"text_input": PROMPT, "max_tokens": 32, "num_draft_tokens": 0}  # no flag at all
    req = urllib.request.Request(triton_server.endpoints.http_url + "/v2/models/ensemble/generate", data=json.dumps(body).encode())
    with urllib.request.urlopen(req) as resp:
        assert json.loads(resp.read())[P.TEXT_OUTPUT] == whole


def test_min_tokens_is_min_length(triton_server):
    """Current TensorRT-LLM ensembles send min_tokens; it holds back the end exactly as min_length."""
    by_old = generate(triton_server, min_length=40, max_tokens=64, num_draft_tokens=0)
    assert by_old[P.OUTPUT_TOKENS] >= 40
    by_new = same_everywhere(triton_server, min_tokens=40, max_tokens=64)
    assert by_new[P.TEXT_OUTPUT] == by_old[P.TEXT_OUTPUT]
    with pytest.raises(AssertionError, match="min_tokens.*min_length"):
        generate(triton_server, min_tokens=40, min_length=41)
    # use_draft_logits (tensorrt_llm_bls) is accepted and changes nothing.
    assert generate(triton_server, use_draft_logits=True, num_draft_tokens=0)[P.TEXT_OUTPUT] == \
        generate(triton_server, num_draft_tokens=0)[P.TEXT_OUTPUT]


def test_token_counts_come_with_their_flags(triton_server, tokenizer):
    from specdec.serving.runtime import encode_prompt

    plain = generate(triton_server, speculative_method="eagle3", num_draft_tokens=5)
    assert P.NUM_INPUT_TOKENS not in plain and P.NUM_OUTPUT_TOKENS not in plain  # not asked for: absent, as upstream
    counted = generate(triton_server, speculative_method="eagle3", num_draft_tokens=5,
                       return_num_input_tokens=True, return_num_output_tokens=True)
    assert counted[P.NUM_INPUT_TOKENS] == len(encode_prompt(tokenizer, PROMPT))
    assert counted[P.NUM_OUTPUT_TOKENS] == counted[P.OUTPUT_TOKENS] == plain[P.OUTPUT_TOKENS]
    only_in = generate(triton_server, num_draft_tokens=0, return_num_input_tokens=True)
    assert P.NUM_INPUT_TOKENS in only_in and P.NUM_OUTPUT_TOKENS not in only_in
    # Streamed: each response counts its own ids, held-back steps included, so they add up.
    body = {"text_input": PROMPT, "max_tokens": 32, "stream": True, "speculative_method": "eagle3", "num_draft_tokens": 5,
            "return_num_output_tokens": True, "return_perf_metrics": True}
    req = urllib.request.Request(triton_server.endpoints.http_url + "/v2/models/ensemble/generate_stream",
                                 data=json.dumps(body).encode())
    with urllib.request.urlopen(req) as resp:
        events = [json.loads(line[5:]) for line in resp.read().decode().splitlines() if line.startswith("data:")]
    assert len(events) >= 2 and sum(e[P.NUM_OUTPUT_TOKENS] for e in events) == events[-1][P.OUTPUT_TOKENS] == plain[P.OUTPUT_TOKENS]


def test_log_probs_are_the_targets(triton_server, smol_dir, tokenizer):
    """output_log_probs: log p(token) under the served target, per emitted token; checked
    against its own forward over prompt + answer (and near transformers'), and equal for
    speculative and baseline."""
    import torch
    from transformers import AutoModelForCausalLM

    from specdec.config import SERVED_SETTINGS, ServingConfig
    from specdec.engine.models.llama import build_batch
    from specdec.serving.runtime import encode_prompt, load_target

    base = generate(triton_server, "speculative_loop", num_draft_tokens=0, return_log_probs=True)
    log_probs = np.asarray(base[P.OUTPUT_LOG_PROBS], dtype=np.float64).reshape(-1)
    assert len(log_probs) == base[P.OUTPUT_TOKENS] and (log_probs <= 0).all()
    assert np.isclose(np.asarray(base[P.CUM_LOG_PROBS]).reshape(-1)[0], log_probs.sum(), atol=1e-3)
    for method, k in METHODS:
        spec = generate(triton_server, speculative_method=method, num_draft_tokens=k, return_log_probs=True)
        assert np.allclose(np.asarray(spec[P.OUTPUT_LOG_PROBS]).reshape(-1), log_probs, atol=2e-3), method
    prompt = encode_prompt(tokenizer, PROMPT)
    answer = [int(t) for t in np.asarray(base[P.OUTPUT_IDS]).reshape(-1)]
    assert len(answer) == len(log_probs)

    def answer_log_probs(logits):
        return torch.log_softmax(logits.double(), -1)[torch.arange(len(answer)), torch.tensor(answer)].numpy()

    # The served target (its weight format, model_repository/specdec.json) over prompt + answer
    # in one forward: its forward is row-invariant in the quantized formats, so the same numbers.
    served = load_target(None, ServingConfig.from_file(SERVED_SETTINGS).engine)
    cache = served.new_cache(1, len(prompt) + len(answer) + 8, 16)
    logits = served(build_batch([cache.allocate()], [0], [prompt + answer]), cache).logits[0, len(prompt) - 1 : -1]
    assert np.allclose(log_probs, answer_log_probs(logits), atol=1e-4), np.abs(log_probs - answer_log_probs(logits)).max()
    # and near transformers' float32 forward of the same GGUF: the served weights are int8 of
    # these (log probs move by up to ~0.07 here); a wrong token or position is off by far more
    hf = AutoModelForCausalLM.from_pretrained(str(smol_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        expected = answer_log_probs(hf(torch.tensor([prompt + answer])).logits[0, len(prompt) - 1 : -1])
    assert np.allclose(log_probs, expected, atol=0.25), np.abs(log_probs - expected).max()
    # Without return_log_probs the generate endpoint (which asks for every output) gets
    # zeros, as TensorRT-LLM's ensemble answers.
    plain = generate(triton_server, num_draft_tokens=0)
    assert not np.asarray(plain.get(P.OUTPUT_LOG_PROBS, [])).any() and not np.asarray(plain[P.CUM_LOG_PROBS]).any()
