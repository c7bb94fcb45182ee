"""`specdec openai` against the real Triton server, driven with the official OpenAI SDK:
greedy output identical to the same request through the ensemble, SSE streaming with usage,
speculation per model id or extra body field, OpenAI-shaped errors, and a client that goes
away stops the Triton stream."""
from __future__ import annotations

import json
import threading
import time

import httpx
from httpx_sse import connect_sse
import openai
import pytest

from specdec.config import ServingConfig
from specdec_openai.frontend import Frontend, Served, create_app
from specdec.serving.runtime import load_tokenizer
from specdec_client import GenerateRequest

from test_serving import metric

pytestmark = pytest.mark.server
BASE = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def api(triton_server, smol_dir):
    """The front end on a free port, in this process (uvicorn in a thread)."""
    import uvicorn

    from specdec.config import SERVED_SETTINGS
    from specdec.launcher import free_ports

    settings = ServingConfig.from_file(SERVED_SETTINGS)
    frontend = Frontend(triton_server.endpoints.http, Served.from_settings(settings, BASE), load_tokenizer(smol_dir))
    (port,) = free_ports(1)
    server = uvicorn.Server(uvicorn.Config(create_app(frontend), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 60
    while not server.started and time.time() < deadline:
        time.sleep(0.05)
    assert server.started
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=10)


@pytest.fixture()
def sdk(api):
    with openai.OpenAI(base_url=api + "/v1", api_key="unused", max_retries=0) as client:
        yield client


PROMPT = "Name three primary colors."


def test_chat_greedy_equals_the_ensemble_and_streams_with_usage(sdk, grpc_client):
    ref = grpc_client.generate(GenerateRequest(PROMPT, max_tokens=24, temperature=0.0, method="eagle3")).text
    out = sdk.chat.completions.create(model=BASE, messages=[{"role": "user", "content": PROMPT}], max_tokens=24, temperature=0)
    assert out.choices[0].message.content == ref and out.choices[0].message.role == "assistant"
    assert out.usage.completion_tokens > 0 and out.usage.prompt_tokens > 5
    assert out.choices[0].finish_reason in ("stop", "length")
    chunks = list(sdk.chat.completions.create(model=BASE, messages=[{"role": "user", "content": PROMPT}], max_tokens=24,
                                              temperature=0, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ref and sum(1 for c in chunks if c.choices and c.choices[0].delta.content) >= 2  # streamed, not one blob
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [out.choices[0].finish_reason]
    assert chunks[-1].usage.completion_tokens == out.usage.completion_tokens  # the usage chunk comes last
    # max_tokens reached -> "length"
    short = sdk.chat.completions.create(model=BASE, messages=[{"role": "user", "content": PROMPT}], max_completion_tokens=3, temperature=0)
    assert short.choices[0].finish_reason == "length" and short.usage.completion_tokens == 3


def test_multi_turn_with_system_prompt_and_raw_completions(sdk, grpc_client, smol_dir):
    messages = [{"role": "system", "content": "You answer in one word."}, {"role": "user", "content": "Sky color?"},
                {"role": "assistant", "content": "Blue."}, {"role": "user", "content": "Grass color?"}]
    rendered = load_tokenizer(smol_dir).apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ref = grpc_client.generate(GenerateRequest(rendered, max_tokens=16, temperature=0.0, apply_chat_template=False)).text
    chat = sdk.chat.completions.create(model=BASE, messages=messages, max_tokens=16, temperature=0)
    assert chat.choices[0].message.content == ref
    raw = sdk.completions.create(model=BASE, prompt=rendered, max_tokens=16, temperature=0)
    assert raw.choices[0].text == ref and raw.object == "text_completion"


def test_speculation_per_model_id_and_extra_body(sdk, api, smol_dir):
    ids = {m.id for m in sdk.models.list()}
    assert {BASE, f"{BASE}:none", f"{BASE}:ngram", f"{BASE}:eagle3"} <= ids
    messages = [{"role": "user", "content": "Repeat after me: speculative decoding is lossless. Repeat it again."}]
    base = sdk.chat.completions.create(model=f"{BASE}:none", messages=messages, max_tokens=32, temperature=0)
    assert base.model_extra["specdec"]["draft_tokens"] == 0
    for kwargs in (dict(model=f"{BASE}:ngram"), dict(model=BASE, extra_body={"speculative_method": "ngram", "num_draft_tokens": 4})):
        spec = sdk.chat.completions.create(messages=messages, max_tokens=32, temperature=0, **kwargs)
        assert spec.choices[0].message.content == base.choices[0].message.content
        assert spec.model_extra["specdec"]["draft_tokens"] > 0
    # OpenAI's penalties (and vLLM's repetition_penalty / min_tokens) reach the target: the
    # output changes, and speculation still equals the baseline under them.
    rules = dict(presence_penalty=1.0, frequency_penalty=0.5, extra_body={"repetition_penalty": 1.2, "min_tokens": 8})
    base_ruled = sdk.chat.completions.create(model=f"{BASE}:none", messages=messages, max_tokens=32, temperature=0, **rules)
    spec_ruled = sdk.chat.completions.create(model=f"{BASE}:eagle3", messages=messages, max_tokens=32, temperature=0, **rules)
    assert base_ruled.choices[0].message.content == spec_ruled.choices[0].message.content
    assert base_ruled.choices[0].message.content != base.choices[0].message.content
    # OpenAI's logit_bias (and vLLM's min_p): the first answer token banned moves the output,
    # and speculation equals the baseline under it (issue 47)
    opening = load_tokenizer(smol_dir)(base.choices[0].message.content, add_special_tokens=False).input_ids[:3]
    biased = dict(logit_bias={str(token): -100 for token in opening}, extra_body={"min_p": 0.05})
    base_biased = sdk.chat.completions.create(model=f"{BASE}:none", messages=messages, max_tokens=32, temperature=0, **biased)
    for model in (f"{BASE}:ngram", f"{BASE}:eagle3"):
        spec_biased = sdk.chat.completions.create(model=model, messages=messages, max_tokens=32, temperature=0, **biased)
        assert spec_biased.choices[0].message.content == base_biased.choices[0].message.content, model
    assert base_biased.choices[0].message.content != base.choices[0].message.content


@pytest.mark.parametrize("kwargs, status, param", [
    (dict(temperature=-1), 400, "temperature"),
    (dict(top_p=1.5), 400, "top_p"),
    (dict(max_tokens=0), 400, "max_tokens"),
    (dict(n=17), 400, "n"),
    (dict(top_logprobs=3), 400, "top_logprobs"),  # without logprobs: true
    (dict(logprobs=True, top_logprobs=21), 400, "top_logprobs"),
    (dict(logprobs=True, extra_body={"logprobs_mode": "raw_logits"}), 400, "logprobs_mode"),
    (dict(logit_bias={"999999": 5}), 400, "logit_bias"),
    (dict(logit_bias={"5": 101}), 400, "logit_bias"),
    (dict(extra_body={"min_p": 2}), 400, "min_p"),
    (dict(extra_body={"speculative_method": "lookahead"}), 400, "speculative_method"),
    (dict(model="gpt-4o"), 404, "model"),
    (dict(messages=[]), 400, "messages"),
])
def test_errors_have_openais_shape(sdk, kwargs, status, param):
    args = dict(model=BASE, messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    args.update(kwargs)
    with pytest.raises(openai.APIStatusError) as err:
        sdk.chat.completions.create(**args)
    assert err.value.status_code == status
    assert err.value.body["param"] == param, err.value.body


def test_health_and_unreachable_triton(api, smol_dir):
    assert httpx.get(api + "/health").status_code == 200
    import asyncio

    frontend = Frontend("127.0.0.1:9", Served(BASE, {BASE: ""}), load_tokenizer(smol_dir))
    assert asyncio.run(frontend.ready()) is False


@pytest.mark.parametrize("n", [1, 2])
def test_a_client_that_goes_away_stops_the_stream(api, triton_server, n):
    """Closing the SSE stream cancels the Triton request (each choice's, with n > 1): the
    verifier's slots are freed long before max_tokens would have been reached."""
    body = {"model": f"{BASE}:ngram", "messages": [{"role": "user", "content": "Count from one to a thousand in words."}],
            "max_tokens": 400, "temperature": 0, "stream": True, "n": n}
    cancelled = metric(triton_server, "specdec_requests_total", reason="cancelled")
    with httpx.Client(timeout=60) as client, connect_sse(client, "POST", api + "/v1/chat/completions", json=body) as source:
        events = source.iter_sse()
        chunks, streaming = [], set()
        while len(chunks) < 3 or streaming != set(range(n)):  # every choice streaming (bounded by max_tokens)
            chunks.append(json.loads(next(events).data))
            if chunks[-1]["choices"][0]["delta"].get("content"):
                streaming.add(chunks[-1]["choices"][0]["index"])
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)  # streamed, then abandoned
    deadline = time.time() + 60  # a poll that fails only when the slot is never freed
    while time.time() < deadline and metric(triton_server, "specdec_active_sequences", model="verifier") > 0:
        time.sleep(0.2)
    assert metric(triton_server, "specdec_active_sequences", model="verifier") == 0
    assert metric(triton_server, "specdec_requests_total", reason="cancelled") == cancelled + n


def test_response_format_json_schema_and_json_object(sdk, grpc_client):
    """OpenAI's response_format maps onto the ensemble's guided decoding: the same output
    as the ensemble with the same schema, valid, and a bad schema refused naming it."""
    import jsonschema

    schema = {"type": "object", "properties": {"color": {"type": "string", "enum": ["red", "green", "blue"]},
                                               "hex": {"type": "string", "pattern": "^#[0-9a-f]{6}$"}},
              "required": ["color", "hex"], "additionalProperties": False}
    messages = [{"role": "user", "content": "Pick a primary color and give its hex code as JSON."}]
    fmt = {"type": "json_schema", "json_schema": {"name": "color", "schema": schema, "strict": True}}
    out = sdk.chat.completions.create(model=f"{BASE}:eagle3", messages=messages, max_tokens=48, temperature=0, response_format=fmt)
    jsonschema.validate(json.loads(out.choices[0].message.content), schema)
    ref = grpc_client.generate(GenerateRequest(messages[0]["content"], max_tokens=48, temperature=0.0, method="none",
                                               guide_type="json_schema", guide=json.dumps(schema))).text
    assert out.choices[0].message.content == ref
    any_json = sdk.chat.completions.create(model=BASE, messages=messages, max_tokens=64, temperature=0,
                                           response_format={"type": "json_object"})
    assert isinstance(json.loads(any_json.choices[0].message.content), dict)
    with pytest.raises(openai.APIStatusError) as err:
        sdk.chat.completions.create(model=BASE, messages=messages, max_tokens=8, response_format={"type": "yaml"})
    assert err.value.status_code == 400 and err.value.body["param"] == "response_format"
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {"a": {"type": "nope"}}}}}
    with pytest.raises(openai.APIStatusError) as err:
        sdk.chat.completions.create(model=BASE, messages=messages, max_tokens=8, response_format=bad)
    assert err.value.status_code == 400 and err.value.body["param"] == "response_format", err.value.body


def _identity_distance() -> float:
    """The greedy-margin study's largest measured distance between a verification row's logits
    and the decode row's at the same position (results/identity/, float32 and int8): a token's
    log-softmax moves by at most twice it."""
    from specdec.config import REPO_ROOT

    studies = [json.loads((REPO_ROOT / "results" / "identity" / f"{fmt}.json").read_text()) for fmt in ("float32", "int8")]
    return max(m["distance"]["max"] for study in studies for m in study["methods"].values())


def test_log_probs_equal_the_baseline_for_every_method(sdk, triton_server, smol_dir):
    """The target's log probs of each emitted token, from the verification rows, equal plain
    decoding's for every served method, streamed or not, on chat and completions, raw and
    processed; the Triton tensors carry the same values. Exactly on the served int8 weights (the
    row-invariant kernels: a verification row's logits are the decode row's bits); within the
    measured row distance on a format without them."""
    from specdec.config import QUANTIZED_WEIGHT_FORMATS, ServingConfig
    from specdec.launcher import DEFAULT_MODEL_REPOSITORY
    from specdec_client import SpecDecClient

    served_format = ServingConfig.from_file(DEFAULT_MODEL_REPOSITORY / "specdec.json").engine.weight_format
    tolerance = 0.0 if served_format in QUANTIZED_WEIGHT_FORMATS else 2 * _identity_distance() + 1e-6
    messages = [{"role": "user", "content": "Repeat after me: speculative decoding is lossless. Repeat it again."}]
    args = dict(messages=messages, max_tokens=24, temperature=0, logprobs=True, top_logprobs=3)

    def log_probs(out):
        return [(e.token, e.logprob, [t.logprob for t in e.top_logprobs]) for e in out.choices[0].logprobs.content]

    base = sdk.chat.completions.create(model=f"{BASE}:none", **args)
    base_lp = log_probs(base)
    assert len(base_lp) == base.usage.completion_tokens and all(lp <= 0 for _, lp, _ in base_lp)
    assert all(lp == top[0] for _, lp, top in base_lp)  # greedy: the emitted token is a likeliest (int8 logits tie often)
    methods = [m.id for m in sdk.models.list() if m.id.startswith(f"{BASE}:") and m.id != f"{BASE}:none"]
    assert len(methods) >= 5
    for model in methods:
        spec = sdk.chat.completions.create(model=model, **args)
        assert spec.choices[0].message.content == base.choices[0].message.content, model
        spec_lp = log_probs(spec)
        assert [t for t, *_ in spec_lp] == [t for t, *_ in base_lp], model
        worst = max(abs(x - y) for a, b in zip(spec_lp, base_lp) for x, y in zip([a[1], *a[2]], [b[1], *b[2]]))
        assert worst <= tolerance, f"{model}: log probs differ by {worst:.2e} (> {tolerance:.2e})"
    # streamed: the same entries, riding with their tokens' text
    chunks = list(sdk.chat.completions.create(model=f"{BASE}:eagle3", stream=True, **args))
    streamed = [(e.token, e.logprob) for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [t for t, _ in streamed] == [t for t, *_ in base_lp]
    assert max(abs(a[1] - b[1]) for a, b in zip(streamed, base_lp)) <= tolerance
    # completions: logprobs=N, the legacy shape
    prompt = load_tokenizer(smol_dir).apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    legacy = sdk.completions.create(model=f"{BASE}:ngram", prompt=prompt, max_tokens=24, temperature=0, logprobs=2)
    assert legacy.choices[0].logprobs.tokens == [t for t, *_ in base_lp]
    assert max(abs(a - b[1]) for a, b in zip(legacy.choices[0].logprobs.token_logprobs, base_lp)) <= tolerance
    assert all(len(top) == 2 for top in legacy.choices[0].logprobs.top_logprobs)
    # raw vs processed (vLLM's logprobs_mode) under a presence penalty: processed is the
    # penalized distribution's, raw the model's own; each equals the baseline's of its kind
    ruled = dict(args, presence_penalty=1.5)
    modes = {}
    for mode in ("raw_logprobs", "processed_logprobs"):
        b = sdk.chat.completions.create(model=f"{BASE}:none", extra_body={"logprobs_mode": mode}, **ruled)
        s = sdk.chat.completions.create(model=f"{BASE}:eagle3", extra_body={"logprobs_mode": mode}, **ruled)
        assert max(abs(x[1] - y[1]) for x, y in zip(log_probs(s), log_probs(b))) <= tolerance, mode
        modes[mode] = [lp for _, lp, _ in log_probs(b)]
    assert modes["raw_logprobs"] != modes["processed_logprobs"]
    # the Triton tensors (output_log_probs, cum_log_probs) of speculative_loop carry the same values
    with SpecDecClient(triton_server.endpoints.grpc, model="speculative_loop") as client:
        gen = client.generate(GenerateRequest(prompt, max_tokens=24, temperature=0.0, method="eagle3", apply_chat_template=False,
                                              return_log_probs=True, top_logprobs=3))
    assert len(gen.log_probs) == len(base_lp) and len(gen.top_log_probs) == len(base_lp)
    assert max(abs(a - b[1]) for a, b in zip(gen.log_probs, base_lp)) <= tolerance


def test_n_choices_share_the_prompt_and_are_seeded_per_choice(sdk):
    """n=4: four choices, each the request alone with seed + i (so each is the target's
    sample, as the exact proof of siblings shows at engine level), the siblings' prompt from
    the prefix cache, speculation or not."""
    messages = [{"role": "user", "content": "Write one sentence about the sea."}]
    args = dict(messages=messages, max_tokens=16, temperature=1.0, top_p=0.95)
    for model in (f"{BASE}:none", f"{BASE}:eagle3"):
        out = sdk.chat.completions.create(model=model, n=4, seed=100, **args)
        assert [c.index for c in out.choices] == [0, 1, 2, 3]
        texts, tokens = [c.message.content for c in out.choices], 0
        for i, text in enumerate(texts):
            alone = sdk.chat.completions.create(model=model, seed=100 + i, **args)
            assert alone.choices[0].message.content == text, (model, i)
            tokens += alone.usage.completion_tokens
        assert len(set(texts)) > 1  # four draws, not one
        assert out.usage.completion_tokens == tokens and out.usage.prompt_tokens == alone.usage.prompt_tokens
        cached = [c["cached_tokens"] for c in out.model_extra["specdec"]["choices"]]
        assert all(c > 0 for c in cached[1:]), cached
    chunks = list(sdk.chat.completions.create(model=f"{BASE}:eagle3", n=4, seed=100, stream=True, **args))
    streamed = ["".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == i) for i in range(4)]
    assert streamed == texts
    assert sorted(c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason) == [0, 1, 2, 3]
