"""The model repository on the real Triton server (bundled in nvidia-pytriton), driven
with tritonclient through specdec_client: streaming, protocols, losslessness, concurrency,
cancellation and bad input."""
from __future__ import annotations

import dataclasses

import json
import re
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

import specdec_wire as P
from specdec_client import GenerateRequest, ServerError, SpecDecClient, server_metrics

pytestmark = pytest.mark.server

PROMPTS = [
    "List the days of the week.",
    "Repeat after me: speculative decoding is lossless. Repeat it again.",
    "Write a Python function that returns the square of a number.",
    "What is the capital of Italy?",
    "Count from one to ten in words.",
    "Name three primary colors.",
    "Explain what a CPU does in one sentence.",
    "Give me a short greeting in French.",
]


def request(prompt: str, **kw) -> GenerateRequest:
    return GenerateRequest(prompt, max_tokens=kw.pop("max_tokens", 32), **kw)


def metric(server, name: str, **labels) -> float:
    return server_metrics.total(server_metrics.scrape(server.endpoints.metrics_url), name, **labels)


def ready(server) -> bool:
    return urllib.request.urlopen(server.endpoints.http_url + "/v2/health/ready").status == 200


SPEC_MODES = [("ngram-tree", 6), ("eagle3-tree", 12), ("eagle3-apart", 5), ("draft_model", 4), ("draft-tiny", 3)]


def test_grpc_stream_speculative_equals_baseline(triton_server, grpc_client):
    """Explicit budgets, the conftest's served-apart modes among them (every shipped method at
    its own budget: test_methods_served)."""
    for prompt in PROMPTS[:2]:
        base = grpc_client.generate(request(prompt, num_draft_tokens=0))
        assert base.text
        for method, k in SPEC_MODES:
            spec = grpc_client.generate(request(prompt, method=method, num_draft_tokens=k))
            assert spec.text == base.text, (method, prompt)
        assert len(spec.chunk_times) >= 2  # streamed, not one blob
        assert base.perf[P.TOTAL_DRAFT_TOKENS] == 0 and base.perf[P.VERIFICATION_STEPS] == base.perf[P.OUTPUT_TOKENS] - 1
    assert spec.perf[P.TOTAL_DRAFT_TOKENS] > 0
    assert 0.0 <= spec.perf[P.ACCEPTANCE_RATE] <= 1.0


def test_sse_and_non_streaming_http_match_grpc(triton_server, grpc_client, http_client):
    prompt = PROMPTS[1]
    ref = grpc_client.generate(request(prompt, method="ngram", num_draft_tokens=4)).text
    chunks = list(http_client.stream(request(prompt, method="ngram", num_draft_tokens=4)))
    assert len(chunks) >= 2 and "".join(c.text for c in chunks) == ref
    assert http_client.generate(request(prompt, method="ngram", num_draft_tokens=4), stream=False).text == ref
    assert grpc_client.generate(request(prompt, method="ngram", num_draft_tokens=4), stream=False).text == ref


# Shipped methods at 1 and 4 streams against the baseline: test_methods_served; here the
# conftest's load-controlled and served-apart modes at 8 (the shipped ones in make test-all).
@pytest.mark.parametrize("method", [pytest.param(m, marks=pytest.mark.slow) for m in ("ngram", "eagle3-tree", "medusa-tree")]
                         + ["eagle3-busy", "eagle3-apart"])
def test_concurrent_streams_equal_solo(triton_server, grpc_client, method):
    """eagle3-busy (conftest) drafts nothing while more than 4 streams run, so its drafter
    catches up on skipped steps as the batch drains. medusa-tree's heads read the target's
    last layer from the same forward that taps EAGLE-3's layers for the other methods."""
    solo = [grpc_client.generate(request(p, method=method)).text for p in PROMPTS]

    def run(prompt):
        with SpecDecClient(triton_server.endpoints.grpc) as client:
            return client.generate(request(prompt, method=method)).text

    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(run, PROMPTS))
    assert together == solo


def test_loop_model_is_client_facing_too(triton_server, grpc_client):
    """speculative_loop takes the ensemble's tensor names directly (like tensorrt_llm_bls)."""
    with SpecDecClient(triton_server.endpoints.grpc, model="speculative_loop") as direct:
        assert direct.generate(request(PROMPTS[0], method="ngram")).text == grpc_client.generate(request(PROMPTS[0], method="ngram")).text


@pytest.mark.parametrize("model, method", [("ensemble", "ngram"), ("speculative_loop", "ngram"), ("ensemble", "draft_model")])
def test_cancel_mid_stream_frees_state(triton_server, model, method):
    """A cancelled stream stops at its next step (counted as cancelled, not run to
    max_tokens) and frees its KV slots (the verifier's, and the drafter's for a draft model
    served apart), through either entry point."""
    cancelled = metric(triton_server, "specdec_requests_total", reason="cancelled")
    client = SpecDecClient(triton_server.endpoints.grpc, model=model)
    gen = client.stream(request(PROMPTS[4], max_tokens=400, ignore_eos=True, method=method))
    for _ in range(3):
        next(gen)
    assert metric(triton_server, "specdec_active_sequences", model="verifier") >= 1
    gen.close()  # stops the stream with cancel_requests=True
    deadline = time.time() + 60  # a poll that fails only when the slot is never freed
    while time.time() < deadline and metric(triton_server, "specdec_active_sequences", model="verifier") > 0:
        time.sleep(0.2)
    assert metric(triton_server, "specdec_active_sequences", model="verifier") == 0
    assert metric(triton_server, "specdec_active_sequences", model="drafter") == 0
    assert metric(triton_server, "specdec_requests_total", reason="cancelled") == cancelled + 1
    assert ready(triton_server)
    assert client.generate(request(PROMPTS[3], max_tokens=4)).text
    client.close()


def test_eight_drafting_streams_at_once_equal_the_baseline_token_ids(triton_server):
    """Overlapping streams that really draft (the adaptive methods have no static load
    controls; the shipped EAGLE-3 head and n-gram): token ids equal the baseline's."""
    def run(args):
        prompt, method, k = args
        with SpecDecClient(triton_server.endpoints.grpc, model="speculative_loop") as client:
            return client.generate(request(prompt, method=method, num_draft_tokens=k, max_tokens=24))

    with ThreadPoolExecutor(8) as pool:
        base = list(pool.map(run, [(p, "ngram", 0) for p in PROMPTS]))
        # draft-tiny (conftest): a draft model served apart by the `drafter` model, no load controls.
        for method in ("eagle3-adaptive", "ngram-adaptive", "draft-tiny"):
            drafted = metric(triton_server, "specdec_draft_tokens_total", method=method)
            got = list(pool.map(run, [(p, method, None) for p in PROMPTS]))
            assert [g.token_ids for g in got] == [b.token_ids for b in base], method
            assert all(len(b.token_ids) > 0 for b in base)
            assert metric(triton_server, "specdec_draft_tokens_total", method=method) > drafted, method


def test_the_verifier_says_how_its_forward_runs(triton_server):
    """The served target's weight format, forward and kernel path, on the metrics port: the shipped
    int8 target on the native forward, on the path this CPU runs."""
    from specdec.engine.kernels.int8 import ISA, best_isa

    samples = server_metrics.scrape(triton_server.endpoints.metrics_url)
    assert server_metrics.total(samples, P.ENGINE_INFO, weight_format="int8", forward="native",
                                kernel_path=ISA.NAMES[best_isa()]) == 1


def test_metrics_count_drafts(triton_server, grpc_client):
    before = metric(triton_server, "specdec_draft_tokens_total", method="ngram")
    steps = metric(triton_server, P.ACCEPTANCE_LENGTH + "_count", method="ngram")
    grpc_client.generate(request(PROMPTS[1], method="ngram", num_draft_tokens=4))
    assert metric(triton_server, "specdec_draft_tokens_total", method="ngram") > before
    # Tokens per step, a real histogram: one observation per verification step, >= 1 token each.
    samples = server_metrics.scrape(triton_server.endpoints.metrics_url)
    count = server_metrics.total(samples, P.ACCEPTANCE_LENGTH + "_count", method="ngram")
    assert count > steps
    assert server_metrics.total(samples, P.ACCEPTANCE_LENGTH + "_sum", method="ngram") >= count
    buckets = {float(le): n for le, n in server_metrics.by_label(samples, P.ACCEPTANCE_LENGTH + "_bucket", "le", method="ngram").items()}
    assert sorted(buckets) == [*P.ACCEPTANCE_LENGTH_BUCKETS, float("inf")] and buckets[float("inf")] == count
    assert all(buckets[a] <= buckets[b] for a, b in zip(sorted(buckets), sorted(buckets)[1:]))  # cumulative


BAD = [
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 100000}, "max_tokens"),
    ({"temperature": -1.0}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"num_draft_tokens": -1}, "num_draft_tokens"),
    ({"num_draft_tokens": 999}, "num_draft_tokens"),
    ({"method": "lookahead"}, "speculative_method"),
]


@pytest.mark.parametrize("fields,name", BAD, ids=[b[1] + str(i) for i, b in enumerate(BAD)])
def test_bad_request_fields_are_named(triton_server, grpc_client, fields, name):
    max_tokens = fields.pop("max_tokens", 8)
    with pytest.raises(ServerError, match=name):
        grpc_client.generate(GenerateRequest(PROMPTS[0], max_tokens=max_tokens, **fields))
    assert ready(triton_server)


def post(server, body: dict) -> tuple[int, str]:
    req = urllib.request.Request(server.endpoints.http_url + "/v2/models/ensemble/generate", data=json.dumps(body).encode())
    try:
        with urllib.request.urlopen(req) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_malformed_requests_are_named(triton_server):
    cases = [
        ({"max_tokens": 8}, "text_input"),  # missing required input
        ({"text_input": "", "max_tokens": 8}, "text_input"),  # empty prompt
        ({"text_input": "hi " * 600, "max_tokens": 8}, "text_input"),  # longer than the context
    ]
    for body, name in cases:
        status, text = post(triton_server, body)
        assert status >= 400 and re.search(name, text), (body, text)
    # A wrong JSON type is refused by Triton's own HTTP parser, whose message does not name
    # the field ("attempt to access JSON non-number as double"); gRPC names it (below).
    status, text = post(triton_server, {"text_input": "hi", "max_tokens": 8, "temperature": "hot"})
    assert status >= 400 and "error" in text
    import queue

    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(triton_server.endpoints.grpc)
    wrong = grpcclient.InferInput(P.MAX_TOKENS, [1, 1], "FP32")  # wrong dtype over gRPC
    wrong.set_data_from_numpy(np.array([[8.0]], dtype=np.float32))
    text_in = grpcclient.InferInput(P.TEXT_INPUT, [1, 1], "BYTES")
    text_in.set_data_from_numpy(np.array([[b"hi"]], dtype=np.object_))
    replies: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: replies.put(error))
    client.async_stream_infer("ensemble", [text_in, wrong])
    error = replies.get(timeout=30)
    client.stop_stream()
    assert error is not None and "max_tokens" in str(error) and "FP32" in str(error)
    assert ready(triton_server)
    assert metric(triton_server, "specdec_active_sequences", model="verifier") == 0


def test_sampled_requests_through_the_server_equal_the_in_process_engine(triton_server, grpc_client, smol_dir):
    """Sampling through Triton runs the same speculator with the same seeded generators as
    the in-process engine: with a seed, the served text equals the engine's, for chains with
    draft probabilities (eagle3), trees (eagle3-tree) and one-hot drafts (ngram). Both
    prefill the whole prompt (no prefix cache; a salt of its own on the server): a prefix
    cached by another request carries last-bit differences that the bf16 draft head can turn
    into other draws (the same distribution, not the same sample)."""
    from specdec.config import SamplingParams, ServingConfig
    from specdec.config import SERVED_SETTINGS
    from specdec.serving.runtime import build_engine, encode_prompt

    settings = ServingConfig.from_file(SERVED_SETTINGS)
    engine = build_engine(smol_dir, dataclasses.replace(settings.engine, enable_prefix_caching=False), settings.methods)
    prompt = PROMPTS[5]
    ids = encode_prompt(engine.tokenizer, prompt, chat=settings.apply_chat_template)
    for method, k in (("eagle3", 5), ("eagle3-tree", 12), ("ngram", 4), ("none", 0)):
        params = SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, top_k=50, seed=7)
        local = "".join(out.text_delta for out in engine.generate(ids, params, method, k))
        served = grpc_client.generate(request(prompt, max_tokens=24, temperature=0.8, top_p=0.9, top_k=50, seed=7,
                                              method=method, num_draft_tokens=k, cache_salt=f"sampled-{method}"))
        assert served.text == local, method


# ---- the requests NVIDIA's clients send ---------------------------------------------------------
def _unary(module, url: str, model: str, fields: dict):
    from specdec_client.client import grpc_inputs

    client = module.InferenceServerClient(url)
    try:
        return client.infer(model, grpc_inputs(module, fields))
    finally:
        client.close()


@pytest.mark.parametrize("method, k", [pytest.param("none", 0, marks=pytest.mark.slow), ("eagle3", 5), ("ngram", 4)])
def test_unary_infer_returns_what_the_stream_returns(triton_server, grpc_client, method, k):
    """tritonclient's .infer (gRPC ModelInfer, HTTP infer) on ensemble_unary: one response,
    the same text as the stream of `ensemble` for the same greedy request."""
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

    req = request(PROMPTS[1], method=method, num_draft_tokens=k)
    streamed = grpc_client.generate(req).text
    for module, url in ((grpcclient, triton_server.endpoints.grpc), (httpclient, triton_server.endpoints.http)):
        result = _unary(module, url, P.ENSEMBLE_UNARY, req.fields(stream=False))
        assert result.as_numpy(P.TEXT_OUTPUT).reshape(-1)[0].decode() == streamed, module.__name__
        assert int(result.as_numpy(P.OUTPUT_TOKENS).reshape(-1)[0]) > 0


def test_unary_clients_meet_a_clear_answer_on_the_streaming_names(triton_server):
    """Triton refuses unary calls to any decoupled model (why ensemble_unary exists), and
    ensemble_unary refuses stream: true naming the field."""
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

    fields = request(PROMPTS[0], max_tokens=4).fields(stream=False)
    for module, url in ((grpcclient, triton_server.endpoints.grpc), (httpclient, triton_server.endpoints.http)):
        with pytest.raises(Exception, match="decoupled"):
            _unary(module, url, "ensemble", fields)
        with pytest.raises(Exception, match="stream"):
            _unary(module, url, P.ENSEMBLE_UNARY, {**fields, P.STREAM: True})
    # Defaults as TensorRT-LLM's: without exclude_input_in_output the prompt comes first.
    answer = _unary(grpcclient, triton_server.endpoints.grpc, P.ENSEMBLE_UNARY, fields)
    echoed = _unary(grpcclient, triton_server.endpoints.grpc, P.ENSEMBLE_UNARY,
                    {k: v for k, v in fields.items() if k != P.EXCLUDE_INPUT_IN_OUTPUT})
    answer, echoed = (r.as_numpy(P.TEXT_OUTPUT).reshape(-1)[0].decode() for r in (answer, echoed))
    assert echoed.endswith(answer) and PROMPTS[0] in echoed
    assert ready(triton_server)


def test_vllm_benchmarks_trt_llm_request_is_served(triton_server, grpc_client):
    """vLLM's benchmark_serving `trt-llm` backend (backend_request_func.async_request_trt_llm):
    POST /v2/models/ensemble/generate_stream with accumulate_tokens (a request parameter to
    Triton, not an input), greedy, stream, and min_length = max_tokens for ignore_eos; it
    reads text_output from each SSE event."""
    body = {"accumulate_tokens": True, "text_input": PROMPTS[3], "temperature": 0.0, "top_p": 1.0, "max_tokens": 24,
            "stream": True, "min_length": 24}
    req = urllib.request.Request(triton_server.endpoints.http_url + "/v2/models/ensemble/generate_stream",
                                 data=json.dumps(body).encode())
    with urllib.request.urlopen(req) as resp:
        events = [json.loads(line[5:]) for line in resp.read().decode().splitlines() if line.startswith("data:")]
    assert len(events) >= 2 and all("error" not in e for e in events)
    text = "".join(e[P.TEXT_OUTPUT] for e in events)
    assert text == grpc_client.generate(request(PROMPTS[3], max_tokens=24, min_length=24)).text
    assert events[-1][P.FINISH_REASON] == "length"  # min_length held the end back to max_tokens


def test_genai_perf_tensorrtllm_request_is_served(triton_server, grpc_client):
    """genai-perf's tensorrtllm input (TensorRTLLMConverter, sent by perf_analyzer over a gRPC
    stream): text_input, max_tokens, stream, min_length for deterministic lengths, plus the
    [""] word lists TensorRT-LLM clients send for "none"."""
    import queue

    import tritonclient.grpc as grpcclient

    def tensor(name, array, dtype):
        t = grpcclient.InferInput(name, list(array.shape), dtype)
        t.set_data_from_numpy(array)
        return t

    inputs = [
        tensor(P.TEXT_INPUT, np.array([[PROMPTS[5].encode()]], dtype=np.object_), "BYTES"),
        tensor(P.MAX_TOKENS, np.array([[16]], dtype=np.int32), "INT32"),
        tensor(P.STREAM, np.array([[True]]), "BOOL"),
        tensor(P.MIN_LENGTH, np.array([[16]], dtype=np.int32), "INT32"),
        tensor(P.BAD_WORDS, np.array([[b""]], dtype=np.object_), "BYTES"),
        tensor(P.STOP_WORDS, np.array([[b""]], dtype=np.object_), "BYTES"),
    ]
    client = grpcclient.InferenceServerClient(triton_server.endpoints.grpc)
    replies: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: replies.put((result, error)))
    client.async_stream_infer("ensemble", inputs, enable_empty_final_response=True)
    texts = []
    while True:
        result, error = replies.get(timeout=120)
        assert error is None, error
        texts.append(result.as_numpy(P.TEXT_OUTPUT).reshape(-1)[0].decode() if result.as_numpy(P.TEXT_OUTPUT) is not None else "")
        if result.get_response().parameters["triton_final_response"].bool_param:
            break
    client.stop_stream()
    client.close()
    assert len(texts) >= 2 and "".join(texts) == grpc_client.generate(request(PROMPTS[5], max_tokens=16, min_length=16)).text


# eagle3-apart in make test: chunked beside a running stream, with the drafter served apart
# getting the whole prompt's features (the plain and colocated cases in make test-all).
@pytest.mark.parametrize("method", [pytest.param("none", marks=pytest.mark.slow), pytest.param("eagle3", marks=pytest.mark.slow),
                                    "eagle3-apart"])
def test_a_long_prompt_joins_a_running_stream_in_chunks(triton_server, grpc_client, method):
    """A prompt longer than engine.prefill_chunk_tokens (256) arriving while another stream
    decodes is prefilled in chunks beside it (its START answers no tokens, the loop
    continues it; the drafter served apart gets the whole prompt's features): both texts
    equal the ones each gets alone, and the verifier counted forwards that carried part of
    the prompt (with chunking off the texts would match too; the counter would not move)."""
    def chunked_rounds() -> float:
        return server_metrics.total(server_metrics.scrape(triton_server.endpoints.metrics_url), P.PREFILL_CHUNKED_ROUNDS_TOTAL)

    long_prompt = "Summarise these notes, keeping every number: " + " ".join(
        f"step {i}: the server restarted after {3 * i} minutes and {i + 2} requests were retried;" for i in range(18))
    running = request(PROMPTS[4], max_tokens=96, ignore_eos=True, method=method)
    joining = request(long_prompt, max_tokens=24, ignore_eos=True, method=method, cache_salt=f"solo-{method}")
    solo = [grpc_client.generate(running).text, grpc_client.generate(joining).text]
    joining = dataclasses.replace(joining, cache_salt=f"joined-{method}")  # not the solo run's cached prompt: prefilled again
    before = chunked_rounds()
    with SpecDecClient(triton_server.endpoints.grpc) as first, SpecDecClient(triton_server.endpoints.grpc) as second:
        stream = first.stream(running)
        text = next(stream).text
        with ThreadPoolExecutor(1) as pool:
            joined = pool.submit(lambda: second.generate(joining).text)
            text += "".join(chunk.text for chunk in stream)
            assert [text, joined.result()] == solo
    deadline = time.monotonic() + 10  # the verifier publishes its counters when it goes idle
    while chunked_rounds() - before < 1 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert chunked_rounds() - before >= 1  # a forward carried part of the prompt and left the rest
