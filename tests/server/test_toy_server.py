"""Sampled speculative decoding through the real Triton server keeps the target's
distribution: a toy target (six-token vocabulary, so the exact distribution of the first
three tokens has 216 cells) is served by the same model repository, thousands of seeded
requests go through `speculative_loop`, and the counts are compared (chi-square) with the
exact distribution computed with transformers and a processing written independently of
the engine's (tests/engine/test_speculative.py's numpy reference).

Each request emits its first token at prefill and the next two in one verification step
(max_tokens 4 leaves room for two draft tokens), so the scored tokens 2 and 3 went through
drafting and acceptance: one-hot n-gram chains, draft-model chains with draft
probabilities sent across the wire from the `drafter` model, and draft-model trees drafted
beside the target.

What this test can and cannot see: 1,500 requests over 216 cells catch a broken wiring (a
seed ignored, draft probabilities lost or misaligned across the wire, a distribution from
the wrong context), which moves whole cells; the negative control below
(test_the_served_distribution_test_rejects_wrong_distributions, slow like this test: make
test-all) shows two such alternatives rejected at p < 1e-6 with these very counts. It cannot see a 2% bias in one
step of acceptance: that is proven exactly, for every shipped method, in
tests/engine/test_exact_lossless.py (deterministic, with such biases as its controls)."""
from __future__ import annotations

import itertools
import json
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from conftest import TEST_INTERNAL_KEY, save_tiny_hf
import specdec_wire as P
from specdec.triton_models import contract as C
from specdec.config import SamplingParams
from test_speculative import chi_square_p, reference_probs

# make test-all only (~80 s with its own server): in make test, sampling through the server is
# held by test_serving's seeded requests equal to the in-process engine's draws, and the
# engine's distribution is proved exactly (tests/engine/test_exact_lossless.py).
pytestmark = [pytest.mark.server, pytest.mark.slow]

VOCAB = 6
PROMPT = [1, 2, 3, 1, 2, 3, 1, 2]  # repetitive, so n-gram lookup finds continuations
REQUESTS = 1500
PARAMS = SamplingParams(max_tokens=4, temperature=0.9, top_p=0.95, ignore_eos=True)
METHODS = {
    "none": {},
    "ngram": {"method": "ngram", "max_draft_len": 2, "prompt_lookup_min": 1, "prompt_lookup_max": 3},
    "toy-draft": {"method": "draft_model", "max_draft_len": 2, "colocated": False},
    "toy-draft-tree": {"method": "draft_model", "max_draft_len": 2, "use_dynamic_tree": True, "dynamic_tree_max_topK": 2},
}


def save_word_tokenizer(path) -> None:
    """A word-level tokenizer over the toy vocabulary (the loop loads the target's)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {"<eos>": 0, **{chr(ord("a") + i - 1): i for i in range(1, VOCAB)}}
    tokenizer = Tokenizer(models.WordLevel(words, unk_token="<eos>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>", bos_token="<eos>").save_pretrained(str(path))


@pytest.fixture(scope="module")
def toy_server(tmp_path_factory):
    from specdec.launcher import DEFAULT_MODEL_REPOSITORY, TritonServer, free_ports

    shape = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                 initializer_range=0.3, eos_token_id=0, bos_token_id=0, max_position_embeddings=128)
    target = save_tiny_hf(tmp_path_factory.mktemp("toy_target"), seed=3, num_hidden_layers=2, **shape)
    save_word_tokenizer(target)
    draft = save_tiny_hf(tmp_path_factory.mktemp("toy_draft"), seed=4, num_hidden_layers=1, **shape)
    methods = {name: {**spec, "speculative_model": str(draft)} if spec.get("method") == "draft_model" else spec
               for name, spec in METHODS.items() if spec}
    settings = json.loads((DEFAULT_MODEL_REPOSITORY / "specdec.json").read_text())
    settings.update(model_dir=str(target), default_method="ngram", apply_chat_template=False, methods=methods)
    settings["engine"].update(max_seq_len=64, max_tokens_limit=16, max_num_draft_tokens=4)
    path = tmp_path_factory.mktemp("toy_settings") / "specdec.json"
    path.write_text(json.dumps(settings))
    http, grpc, metrics = free_ports(3)
    server = TritonServer(log_path=tmp_path_factory.mktemp("toy_triton") / "triton.log")
    server.start(DEFAULT_MODEL_REPOSITORY, http_port=http, grpc_port=grpc, metrics_port=metrics,
                 env={"SPECDEC_SETTINGS": str(path), C.INTERNAL_KEY_ENV: TEST_INTERNAL_KEY})
    try:
        server.wait_ready(timeout=300)
        yield server, target
    finally:
        server.stop()


def first3(server, method: str, seed: int) -> tuple[tuple[int, ...], int]:
    body = {P.INPUT_IDS: PROMPT, P.MAX_TOKENS: PARAMS.max_tokens, P.TEMPERATURE: PARAMS.temperature, P.TOP_P: PARAMS.top_p,
            P.IGNORE_EOS: True, P.RANDOM_SEED: seed, P.SPECULATIVE_METHOD: method, P.RETURN_PERF_METRICS: True,
            P.EXCLUDE_INPUT_IN_OUTPUT: True}  # the generated ids only (upstream echoes the prompt by default)
    req = urllib.request.Request(server.endpoints.http_url + "/v2/models/speculative_loop/generate", data=json.dumps(body).encode())
    with urllib.request.urlopen(req, timeout=120) as resp:
        reply = json.loads(resp.read())
    ids = [int(t) for t in np.asarray(reply[P.OUTPUT_IDS]).reshape(-1)]
    return tuple(ids[:3]), int(reply[P.TOTAL_DRAFT_TOKENS])


def exact_first3(target_dir) -> np.ndarray:
    """P(t1, t2, t3 | PROMPT): transformers' forward over every prefix, numpy processing."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
    prefixes = [()] + [(a,) for a in range(VOCAB)] + list(itertools.product(range(VOCAB), repeat=2))
    with torch.no_grad():
        probs = {p: reference_probs(model(torch.tensor([PROMPT + list(p)])).logits[0, -1].double().numpy(), PARAMS)
                 for p in prefixes}
    joint = np.zeros((VOCAB,) * 3)
    for a, b in itertools.product(range(VOCAB), repeat=2):
        joint[a, b] = probs[()][a] * probs[(a,)][b] * probs[(a, b)]
    return joint.ravel()


@pytest.fixture(scope="module")
def exact(toy_server) -> np.ndarray:
    return exact_first3(toy_server[1])


@pytest.fixture(scope="module")
def served_first3(toy_server):
    """method -> (counts of the first three tokens over REQUESTS seeded requests, draft
    tokens verified), each method's requests sent once per module."""
    server, _ = toy_server
    done: dict[str, tuple[np.ndarray, int]] = {}

    def get(method: str) -> tuple[np.ndarray, int]:
        if method not in done:
            with ThreadPoolExecutor(max_workers=12) as pool:  # concurrent: sequences share verification batches
                replies = list(pool.map(lambda seed: first3(server, method, seed), range(REQUESTS)))
            counts = np.zeros(VOCAB**3)
            for (a, b, c), _ in replies:
                counts[(a * VOCAB + b) * VOCAB + c] += 1
            done[method] = counts, sum(d for _, d in replies)
        return done[method]

    return get


# In make test: the draft model served apart (the path with most moving parts: the drafter
# model, the verifier's budget in its reply); the others are marked slow (make test-all).
@pytest.mark.parametrize("method", [m if m == "toy-draft" else pytest.param(m, marks=pytest.mark.slow) for m in METHODS])
def test_sampling_through_triton_keeps_the_targets_distribution(served_first3, exact, method):
    counts, drafted = served_first3(method)
    assert (drafted > 0) == (method != "none"), drafted  # the speculative methods did draft
    p = chi_square_p(counts, exact)
    assert p > 1e-3, f"{method}: chi-square p={p:.2e} over {REQUESTS} requests"


def test_the_served_distribution_test_rejects_wrong_distributions(served_first3, exact):
    """Negative control: the same counts (ngram's) and the same statistic fail against
    distributions a broken sampler would produce. The third token shifted by one id (a
    sampler off by one: mass lands outside the target's top-p support), and the two likeliest
    third tokens swapped after every prefix (the same support, so only the chi-square
    statistic itself can tell)."""
    counts, _ = served_first3("ngram")
    joint = exact.reshape(VOCAB, VOCAB, VOCAB)
    shifted = np.roll(joint, 1, axis=-1)
    swapped = joint.copy()
    for a, b in itertools.product(range(VOCAB), repeat=2):
        first, second = np.argsort(-joint[a, b])[:2]
        if joint[a, b, second] > 0:
            swapped[a, b, [first, second]] = joint[a, b, [second, first]]
    assert np.isclose(swapped.sum(), 1.0) and ((swapped > 0) == (joint > 0)).all() and not np.allclose(swapped, joint)
    assert chi_square_p(counts, exact) > 1e-3  # the right one still passes with these counts
    for name, wrong in (("shifted", shifted), ("swapped", swapped)):
        p = chi_square_p(counts, wrong.ravel())
        assert p < 1e-6, f"{name}: chi-square p={p:.2e}"
