"""Structured output (issue 35): a request's grammar (TensorRT-LLM's guided decoding, compiled
by xgrammar) enforced on the target at every tree node of every served method.

In process: greedy speculative output identical to the grammar-constrained baseline for
every served method, outputs that validate, the grammar's forced tokens drafted and counted
apart, compiled grammars cached, conflicts between rules and the grammar. Through the real
Triton server: the ensemble over gRPC (every method family, the drafter served apart
included, greedy and T=0.7), a regex over HTTP's generate endpoint, and bad guides refused
naming the field over gRPC and HTTP with the server still serving. The exact proof of
losslessness under a grammar (sampled chain, tree, hybrid, draft model) is in
tests/engine/test_exact_lossless.py."""
from __future__ import annotations

import json
import re
import urllib.request

import jsonschema
import pytest

import specdec_wire as P
from specdec.config import SamplingParams
from specdec.config import check_guide
from specdec.errors import InvalidRequestError
from specdec_client import GenerateRequest, ServerError

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "city": {"type": "string"}},
          "required": ["name", "age", "city"], "additionalProperties": False}
PROMPT = "Extract name, age and city as JSON: Maria is 34 and lives in Lisbon."


@pytest.fixture(scope="module")
def engine():
    from specdec.serving.runtime import build_engine

    return build_engine()


def generate(engine, prompt: str, params: SamplingParams, method: str = "none"):
    from specdec.serving.runtime import encode_prompt

    outs = list(engine.generate(encode_prompt(engine.tokenizer, prompt), params, method))
    return [t for o in outs for t in o.new_token_ids], outs[-1]


def test_every_served_method_equals_the_constrained_baseline_and_validates(engine):
    params = SamplingParams(max_tokens=48, guide_type="json_schema", guide=json.dumps(SCHEMA))
    base_ids, last = generate(engine, PROMPT, params)
    text = engine.tokenizer.decode(base_ids)
    jsonschema.validate(json.loads(text), SCHEMA)
    assert last.finish_reason == "eos"  # the grammar completed, then the end token
    forced = 0
    for method in engine.offer.methods:
        ids, last = generate(engine, PROMPT, params, method)
        assert ids == base_ids, method
        assert last.stats.drafts > 0, method
        forced += last.stats.forced_accepted_tokens
    assert forced > 0  # the grammar's forced strings were drafted (and accepted) somewhere
    free, _ = generate(engine, PROMPT, SamplingParams(max_tokens=48))
    assert free != base_ids  # the grammar changed the output (else this test would prove little)


def test_sampled_outputs_validate_under_every_guide_type(engine):
    cases = [("json_schema", json.dumps(SCHEMA), lambda t: jsonschema.validate(json.loads(t), SCHEMA)),
             ("json", None, lambda t: json.loads(t)),
             ("regex", r"\d{4}-\d{2}-\d{2}", lambda t: re.fullmatch(r"\d{4}-\d{2}-\d{2}", t) or pytest.fail(t)),
             ("ebnf_grammar", 'root ::= "yes" | "no"', lambda t: t in ("yes", "no") or pytest.fail(t))]
    for guide_type, guide, check in cases:
        for method, seed in (("eagle3-hybrid", 1), ("eagle3-tree", 2), ("ngram", 3)):
            params = SamplingParams(max_tokens=64, temperature=0.7, seed=seed, guide_type=guide_type, guide=guide)
            ids, last = generate(engine, PROMPT, params, method)
            if guide_type == "json" and last.finish_reason == "length":
                continue  # free JSON at T=0.7 may run past max_tokens (a list of people); bounded guides may not
            assert last.finish_reason == "eos", (guide_type, method, engine.tokenizer.decode(ids))
            check(engine.tokenizer.decode(ids))


def test_rules_and_grammar_conflicts_and_limits(engine):
    schema = json.dumps({"type": "string", "enum": ["yes", "no"]})
    # min_tokens beyond what the grammar allows: the grammar wins (the end token comes back)
    ids, last = generate(engine, "Is water wet?", SamplingParams(max_tokens=16, min_length=10, guide_type="json_schema", guide=schema), "eagle3")
    assert engine.tokenizer.decode(ids) in ('"yes"', '"no"') and last.finish_reason == "eos"
    # ignore_eos: the grammar's end still ends the request (nothing may follow it)
    ids, last = generate(engine, "Is water wet?", SamplingParams(max_tokens=16, ignore_eos=True, guide_type="json_schema", guide=schema))
    assert last.finish_reason == "eos"
    # a grammar that cannot complete within max_tokens: "length", with the text so far
    ids, last = generate(engine, PROMPT, SamplingParams(max_tokens=5, guide_type="json_schema", guide=json.dumps(SCHEMA)), "eagle3")
    assert last.finish_reason == "length" and len(ids) == 5 and engine.tokenizer.decode(ids).startswith("{")


def test_compiled_grammars_are_cached_and_bad_guides_named(engine):
    grammars = engine.speculator.target_pass.grammars
    first = grammars.compile("json_schema", json.dumps(SCHEMA))
    assert grammars.compile("json_schema", json.dumps(SCHEMA)) is first
    # The request's cheap check: type, presence, size, JSON syntax (no grammar parse).
    for guide_type, guide, field in [("xml", "x", P.GUIDED_DECODING_GUIDE_TYPE), ("json_schema", "{bad", P.GUIDED_DECODING_GUIDE),
                                     ("json_schema", None, P.GUIDED_DECODING_GUIDE), (None, "{}", P.GUIDED_DECODING_GUIDE_TYPE),
                                     ("regex", "a" * 101, P.GUIDED_DECODING_GUIDE)]:
        with pytest.raises(InvalidRequestError, match=field):
            check_guide(guide_type, guide, max_bytes=100)
    check_guide("regex", "a" * 100, max_bytes=100)
    # The grammar is parsed once, when compiled (off the scheduler's thread): named there.
    for guide_type, guide in [("regex", "a("), ("ebnf_grammar", "root ::= foo")]:
        check_guide(guide_type, guide)
        with pytest.raises(InvalidRequestError, match=P.GUIDED_DECODING_GUIDE):
            grammars.compile(guide_type, guide)
        with pytest.raises(InvalidRequestError, match=P.GUIDED_DECODING_GUIDE):
            grammars.prepare(guide_type, guide).result(timeout=60)
    assert not engine.sequences


def test_a_guide_compiles_off_the_scheduler_thread_within_its_limit(engine):
    """Issue 43: a client's guide compiled on the thread that steps every sequence froze
    every stream. Now it compiles on the guide worker, behind a probe process killed at
    engine.guide_compile_timeout_s: a guide past the limit is refused naming the field, its
    compile is stopped (the probe killed), a repeat is refused at once, a cancel while it
    compiles ends `cancelled`, and a stream decoding meanwhile is the same as alone."""
    import dataclasses

    from specdec.engine.grammar import Grammars
    from specdec.serving.runtime import encode_prompt
    from specdec.serving.engine_loop import EngineLoop
    from test_scheduler import ListSink as Collect

    plain = SamplingParams(max_tokens=40, ignore_eos=True)
    ids = encode_prompt(engine.tokenizer, "Tell me a story about a dragon.")
    alone, _ = generate(engine, "Tell me a story about a dragon.", plain)
    target_pass = engine.speculator.target_pass
    saved, saved_config = target_pass.grammars, engine.config
    target_pass.grammars = Grammars.for_tokenizer(lambda: engine.tokenizer, target_pass.target.cfg.vocab_size, compile_timeout_s=0.05)
    engine.config = dataclasses.replace(engine.config, guide_compile_timeout_s=0.05)
    target_pass.grammars.warm()
    scheduler = EngineLoop(engine)
    try:
        stream, slow, repeat, cancelled = Collect(), Collect(), Collect(), Collect()
        scheduler.submit("stream", ids, plain, "none", 0, stream)
        hostile = SamplingParams(max_tokens=8, guide_type="regex", guide="[a-z]{0,4000}")  # ~0.3 s to compile here
        scheduler.submit("slow", ids, hostile, "none", 0, slow)
        assert slow.done.wait(60) and isinstance(slow.error, InvalidRequestError)
        assert P.GUIDED_DECODING_GUIDE in str(slow.error) and "guide_compile_timeout_s" in str(slow.error)
        assert target_pass.grammars.probe_kills == 1
        scheduler.submit("repeat", ids, hostile, "none", 0, repeat)
        assert repeat.done.wait(60) and "guide_compile_timeout_s" in str(repeat.error)
        assert target_pass.grammars.probe_kills == 1  # refused from memory, nothing compiled again
        # Queued behind another slow guide, the cancel surely comes while it still compiles.
        scheduler.submit("blocker", ids, dataclasses.replace(hostile, guide="[a-z]{0,4002}"), "none", 0, Collect())
        scheduler.submit("cancelled", ids, dataclasses.replace(hostile, guide="[a-z]{0,4001}"), "none", 0, cancelled)
        scheduler.cancel("cancelled")
        assert cancelled.done.wait(60) and cancelled.outputs[-1].finish_reason == "cancelled"
        assert stream.done.wait(120) and stream.error is None and stream.ids == alone
    finally:
        scheduler.close()
        target_pass.grammars.close()
        target_pass.grammars, engine.config = saved, saved_config


def test_the_forward_gives_a_compiling_guide_a_core_and_takes_it_back(engine):
    """While a guide compiles, the forward runs on one thread fewer (its OpenMP threads
    stacked on one core beside a compile stalled a stream for 1.2 s); the count is per
    thread under OpenMP, so it is read on the thread that runs the forwards."""
    import threading
    import types

    import torch

    target_pass = engine.speculator.target_pass
    saved = target_pass.grammars
    fake = types.SimpleNamespace(compiling=False)
    seen: list[int] = []

    def forward_thread():
        torch.set_num_threads(2)
        engine._threads, engine._narrowed = None, False
        for compiling in (False, True, True, False):
            fake.compiling = compiling
            engine.fit_threads_to_compiles()
            seen.append(torch.get_num_threads())

    target_pass.grammars = fake
    try:
        worker = threading.Thread(target=forward_thread)
        worker.start()
        worker.join(30)
    finally:
        target_pass.grammars = saved
        engine._threads, engine._narrowed = None, False
    assert seen == [2, 1, 1, 2]

    # The worker says it is busy from the moment a guide is taken until its result is out.
    import time

    from specdec.engine.guide_compiler import GuideCompiler

    gate = threading.Event()
    worker = GuideCompiler(lambda guide_type, guide: gate.wait(30) and "compiled", lambda: "", timeout_s=None)
    try:
        assert not worker.busy
        future = worker.submit("regex", "a+")
        deadline = time.monotonic() + 10
        while not worker.busy and time.monotonic() < deadline:
            time.sleep(0.01)
        assert worker.busy and not future.done()
        gate.set()
        assert future.result(30) == "compiled"
        deadline = time.monotonic() + 10
        while worker.busy and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not worker.busy
    finally:
        gate.set()
        worker.close()


# ---- through the real Triton server -------------------------------------------------------
@pytest.mark.server
@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_the_ensemble_serves_schemas_on_every_method_family(triton_server, grpc_client, temperature):
    def ask(method: str) -> tuple[str, dict]:
        out = grpc_client.generate(GenerateRequest(PROMPT, max_tokens=48, temperature=temperature, seed=5, method=method,
                                                   guide_type="json_schema", guide=json.dumps(SCHEMA)))
        jsonschema.validate(json.loads(out.text), SCHEMA)
        return out.text, out.perf

    base, perf = ask("none")
    assert perf[P.TOTAL_DRAFT_TOKENS] == 0 and perf[P.TOTAL_ACCEPTED_FORCED_TOKENS] == 0
    forced = 0
    for method in ("eagle3", "eagle3-tree", "eagle3-apart", "ngram", "medusa-tree", "draft_model"):
        text, perf = ask(method)
        if temperature == 0.0:
            assert text == base, method
        forced += perf[P.TOTAL_ACCEPTED_FORCED_TOKENS]
        assert perf[P.TOTAL_ACCEPTED_FORCED_TOKENS] <= perf[P.TOTAL_ACCEPTED_DRAFT_TOKENS]
    assert forced > 0


def _post(server, body: dict, model: str = "ensemble") -> tuple[int, str]:
    req = urllib.request.Request(f"{server.endpoints.http_url}/v2/models/{model}/generate", data=json.dumps(body).encode())
    try:
        with urllib.request.urlopen(req) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


@pytest.mark.server
def test_http_generate_with_a_regex_and_bad_guides_refused_over_grpc_and_http(triton_server, grpc_client):
    from test_serving import metric, ready

    status, text = _post(triton_server, {"text_input": "Make up a US phone number.", "max_tokens": 24,
                                         "guided_decoding_guide_type": "regex", "guided_decoding_guide": r"\(\d{3}\) \d{3}-\d{4}",
                                         "speculative_method": "ngram", "exclude_input_in_output": True})
    assert status == 200, text
    assert re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", json.loads(text)["text_output"]), text
    bad = [({"guided_decoding_guide_type": "xml", "guided_decoding_guide": "<a/>"}, P.GUIDED_DECODING_GUIDE_TYPE),
           ({"guided_decoding_guide_type": "json_schema", "guided_decoding_guide": "{not json"}, P.GUIDED_DECODING_GUIDE),
           ({"guided_decoding_guide_type": "regex", "guided_decoding_guide": "(unclosed"}, P.GUIDED_DECODING_GUIDE)]
    for fields, name in bad:
        status, text = _post(triton_server, {"text_input": "Hi", "max_tokens": 8, **fields})
        assert status >= 400 and name in text, (fields, text)
        with pytest.raises(ServerError, match=name):
            grpc_client.generate(GenerateRequest("Hi", max_tokens=8, method="eagle3", guide_type=fields["guided_decoding_guide_type"],
                                                 guide=fields["guided_decoding_guide"]))
    assert ready(triton_server)
    assert metric(triton_server, "specdec_active_sequences", model="verifier") == 0
