"""`specdec-client bench --baseline ENDPOINT --candidate ENDPOINT`: two deployments side by
side through one harness (issue 44). Endpoint parsing and the request each kind is sent
(no server), then real runs: our Triton ensemble against our OpenAI front end, and against
the same ensemble asked as a stock TensorRT-LLM one would be."""
from __future__ import annotations

import json

import pytest

import specdec_wire as P
from specdec_client import GenerateRequest
from specdec_client.bench import BenchConfigError, endpoint_modes
from specdec_client.commands import main
from specdec_client.endpoints import (OPENAI, TRITON_GRPC, TRITON_HTTP, EndpointError, chunk_of_event, completions_body,
                                      for_endpoint, parse_endpoint, stock_fields)
from specdec_client.summary import read_requests, validate
from test_openai import api  # noqa: F401 - the front end on a free port, as a fixture

PROMPTS = ["Name three colours.", "What is a cat?"]


def test_endpoints_parse_into_deployments():
    ours = parse_endpoint("grpc://localhost:8001?method=eagle3&draft=4&metrics=http://localhost:8002/metrics")
    assert (ours.kind, ours.address, ours.model, ours.method, ours.num_draft_tokens) == (TRITON_GRPC, "localhost:8001", "ensemble", "eagle3", 4)
    assert ours.ours and ours.metrics_url == "http://localhost:8002/metrics"
    stock = parse_endpoint("triton+http://10.0.0.2:8000/my_ensemble?stock=1&seed=seed&name=trtllm")
    assert (stock.kind, stock.model, stock.stock, stock.seed_input, stock.label) == (TRITON_HTTP, "my_ensemble", True, P.SEED, "trtllm")
    assert not stock.ours
    vllm = parse_endpoint("openai+http://gpu-box:8000/v1?model=Qwen/Qwen3-8B")
    assert (vllm.kind, vllm.address, vllm.model) == (OPENAI, "http://gpu-box:8000/v1", "Qwen/Qwen3-8B")
    assert parse_endpoint("openai+https://api.example:443").address == "https://api.example:443/v1"


@pytest.mark.parametrize("text, names", [
    ("http://localhost:8000", "scheme"),
    ("grpc://localhost", "host:port"),
    ("grpc://localhost:8001?draft=-1", "draft"),
    ("grpc://localhost:8001?mode=x", "'mode'"),
    ("grpc://localhost:8001?stock=1&method=ngram", "stock"),
    ("grpc://localhost:8001?model=ensemble", "path"),
    ("openai+http://localhost:8080/v1?method=ngram", "method"),
    ("grpc://localhost:8001?seed=rs", "seed"),
])
def test_a_bad_endpoint_is_refused_naming_the_part(text, names):
    with pytest.raises(EndpointError, match=names):
        parse_endpoint(text)


def test_a_stock_ensemble_is_sent_only_tensorrt_llms_own_inputs():
    request = GenerateRequest("hi", max_tokens=8, temperature=0.0, seed=3, method="ngram", num_draft_tokens=4, ignore_eos=True,
                              cache_salt="s", stop=("\n",), apply_chat_template=False)
    sent = stock_fields(request.fields(True))
    assert set(sent) == {P.TEXT_INPUT, P.MAX_TOKENS, P.STREAM, P.TEMPERATURE, P.RANDOM_SEED, P.STOP_WORDS,
                         P.EXCLUDE_INPUT_IN_OUTPUT}
    renamed = stock_fields(request.fields(True), P.SEED)
    assert renamed[P.SEED] == 3 and P.RANDOM_SEED not in renamed
    # ours is asked for its endpoint's mode, whatever the mode row says
    ours = parse_endpoint("grpc://h:1?method=none&draft=0")
    assert (for_endpoint(ours, request).method, for_endpoint(ours, request).num_draft_tokens) == ("none", 0)


def test_an_openai_endpoint_streams_completions_with_usage():
    body = completions_body(GenerateRequest("hi", max_tokens=8, temperature=0.0, seed=1, ignore_eos=True, stop=("x",)), "m")
    assert body == {"model": "m", "prompt": "hi", "max_tokens": 8, "stream": True, "stream_options": {"include_usage": True},
                    "temperature": 0.0, "seed": 1, "stop": ["x"], "ignore_eos": True}
    assert chunk_of_event({"choices": [{"text": "ab", "finish_reason": None}]}, 1.0).text == "ab"
    assert chunk_of_event({"choices": [], "usage": {"completion_tokens": 7}}, 1.0).perf == {P.OUTPUT_TOKENS: 7.0}
    assert chunk_of_event({"choices": [{"text": "", "finish_reason": None}]}, 1.0) is None
    with pytest.raises(Exception, match="boom"):
        chunk_of_event({"error": {"message": "boom"}}, 1.0)


def test_two_deployments_need_distinct_names():
    a = parse_endpoint("grpc://h:1?name=x")
    with pytest.raises(BenchConfigError, match="name"):
        endpoint_modes(a, [parse_endpoint("grpc://h:2?name=x")])
    modes = endpoint_modes(parse_endpoint("grpc://h:1"), [parse_endpoint("openai+http://h:2/v1")], "both")
    assert [(m.name, m.is_baseline) for m in modes] == [("baseline", True), ("baseline/no-cache", True),
                                                        ("candidate", False), ("candidate/no-cache", False)]
    several = endpoint_modes(parse_endpoint("grpc://h:1"), [parse_endpoint("grpc://h:2"), parse_endpoint("grpc://h:3")])
    assert [m.name for m in several] == ["baseline", "candidate1", "candidate2"]


def _bench(tmp_path, *args):
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    out = tmp_path / "bench"
    rc = main(["bench", *args, "--concurrency", "1,2", "--dataset", "jsonl", "--dataset-path", str(data),
               "--num-prompts", "2", "--max-tokens", "16", "--warmup", "1", "--no-progress", "--out", str(out)])
    summary = json.loads((out / "summary.json").read_text())
    validate(summary)
    return rc, summary, read_requests(out / "requests.jsonl"), (out / "report.md").read_text()


@pytest.mark.server
def test_our_ensemble_against_our_openai_front_end(triton_server, api, tmp_path):  # noqa: F811
    """The same engine behind two deployments: the chat-rendered prompt reaches both as the
    same text, so greedy outputs are identical, and token counts come from each side."""
    ep = triton_server.endpoints
    rc, summary, requests, report = _bench(
        tmp_path, "--baseline", f"grpc://{ep.grpc}?method=none&draft=0&metrics={ep.metrics_url}",
        "--candidate", f"openai+http://{api.removeprefix('http://')}/v1?model=smollm2-135m-instruct:ngram&name=openai-ngram")
    assert rc == 0
    assert {r["mode"] for r in requests} == {"baseline", "openai-ngram"} and len(requests) == 2 * 2 * 2
    assert all(r["error"] is None and r["output_tokens"] == 16 and r["output_tokens_from_server"] for r in requests)
    assert summary["lossless"] == {"greedy": True, "compared": 4, "identical": 4,
                                   "by_mode": [{"mode": "openai-ngram", "compared": 4, "identical": 4}]}
    assert {(s["mode"], s["load"]) for s in summary["speedup"]} == {("openai-ngram", "c=1"), ("openai-ngram", "c=2")}
    deployments = summary["env"]["server"]["deployments"]
    assert deployments["baseline"]["server"]["version"] and deployments["openai-ngram"]["kind"] == OPENAI
    assert "`openai-ngram`" in report and "## Lossless check" in report


@pytest.mark.server
def test_a_stock_tensorrt_llm_ensemble_is_benchmarked_with_its_own_inputs(triton_server, tmp_path):
    """Asked only with TensorRT-LLM's inputs (no method, no ignore_eos), our ensemble runs its
    default method (Triton would refuse any input it does not declare, so a stock ensemble
    gets nothing of ours); its outputs match our plain decoding."""
    ep = triton_server.endpoints
    rc, summary, requests, _ = _bench(tmp_path, "--baseline", f"grpc://{ep.grpc}?draft=0&method=none",
                                      "--candidate", f"triton+http://{ep.http}/ensemble?stock=1",
                                      "--prompt-text", "raw", "--no-ignore-eos")
    assert rc == 0
    stock = [r for r in requests if r["mode"] == "candidate"]
    assert stock and all(r["error"] is None and r["output_tokens"] > 0 for r in stock)
    assert summary["lossless"]["compared"] == 4 and summary["lossless"]["identical"] == 4
