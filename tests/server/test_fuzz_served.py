"""A fuzzer through the real server (issue 43, section 2): waves of concurrent requests with
random and hostile values for every input of `ensemble`, `ensemble_unary`, `speculative_loop`
and the OpenAI front end (tests/support/fuzz_inputs.py), some cancelled mid-stream, while a greedy
control stream runs beside them.

Pass means: every request is answered within ANSWER_TIMEOUT_S, with output or with an error
naming one of the fields made bad (a must-fail field is never served); after every wave no
Python stub died, the server is ready, and with the control paused between two of its runs no
slot is held (the loops' slot gauges at 0, no sequence live on the verifier or the drafter)
within DRAIN_TIMEOUT_S; every control run produced exactly its baseline, taken before the
fuzzing.

`make test` runs a short derandomized pass (the same waves every run); `make fuzz` sets
FUZZ_SECONDS and draws fresh waves until that much time has passed. A failure prints the wave
and, for each bad answer, the request and what came back.
"""
from __future__ import annotations

import json
import os
import queue
import re
import socket
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings

import specdec_wire as W
from specdec.config import SERVED_SETTINGS, SamplingParams, ServingConfig
from specdec.errors import InvalidRequestError
from specdec.serving.request import ServedOffer, parse_request
from specdec_openai.frontend import Frontend, OpenAIError, Served, create_app, parse_job
from specdec_client import GenerateRequest, SpecDecClient, server_metrics

from fuzz_inputs import GRPC, NUMPY_OF, Limits, OpenAICase, TritonCase, waves
from test_openai import BASE, api  # noqa: F401 - the front end on the session's server

FUZZ_SECONDS = float(os.environ.get("FUZZ_SECONDS", "0"))  # > 0: the long run (make fuzz)
SHORT_WAVES = 80  # make test: ~40 s on 2 quiet cores
LONG_BATCH = 25  # waves per hypothesis run in the long mode
WAVE_SIZE = 4
ANSWER_TIMEOUT_S = 180.0
DRAIN_TIMEOUT_S = 30.0
# conftest's triton_server: engine.max_seq_len and max_tokens_limit
MAX_SEQ_LEN = 512
CONTROL = GenerateRequest("List the days of the week, one per line.", max_tokens=16, temperature=0.0, method="eagle3")
INTERNAL_FAILURE = ("Traceback", "not healthy", "Stub process", "Internal Server Error")


@dataclass
class Answer:
    kind: str  # ok | error | cancelled (after output) | cancelled early (before any) | hang
    text: str = ""
    status: int | None = None  # HTTP status, where there is one
    param: str | None = None  # the OpenAI error's param


# ---- sending ---------------------------------------------------------------------------------------
def _grpc_inputs(case: TritonCase) -> list:
    import tritonclient.grpc as grpcclient

    inputs = []
    for name, field in case.fields:
        array = np.array(list(field.values), dtype=NUMPY_OF[field.wire]).reshape(field.shape)
        tensor = grpcclient.InferInput(name, list(field.shape), field.wire)
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


def send_grpc(url: str, case: TritonCase) -> Answer:
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(url)
    try:
        if case.model == W.ENSEMBLE_UNARY:  # ModelInfer: one answer
            try:
                result = client.infer(case.model, _grpc_inputs(case), client_timeout=ANSWER_TIMEOUT_S)
            except grpcclient.InferenceServerException as exc:
                return Answer("hang" if "Deadline" in str(exc) else "error", str(exc))
            return Answer("ok", repr(result.as_numpy(W.TEXT_OUTPUT)))
        answers: queue.Queue = queue.Queue()
        client.start_stream(callback=lambda result, error: answers.put((result, error)))
        try:
            client.async_stream_infer(case.model, _grpc_inputs(case), enable_empty_final_response=True)
            texts = []
            while True:
                try:
                    result, error = answers.get(timeout=ANSWER_TIMEOUT_S)
                except queue.Empty:
                    return Answer("hang")
                if error is not None:
                    return Answer("error", str(error))
                if result.get_response().outputs:
                    texts.append(repr(result.as_numpy(W.TEXT_OUTPUT)))
                if result.get_response().parameters["triton_final_response"].bool_param:
                    return Answer("ok", "".join(texts))
        finally:
            client.stop_stream(cancel_requests=False)  # every request ended (errors end it too)
    finally:
        client.close()


def _http_error(raw: str) -> str:
    text = raw.strip().removeprefix("data:").strip()
    try:
        return str(json.loads(text).get("error", text))
    except (ValueError, AttributeError):
        return text


class Canceller:
    """Closes a streamed response after cancel_at_s (from another thread: the reader then
    sees the stream end, which is the cancellation it asked for)."""

    def __init__(self, case):
        self.at, self.fired, self._timer = case.cancel_at_s, False, None
        self.events = 0  # output the reader saw before (a cancel before any output says nothing of the request)

    def arm(self, resp: httpx.Response) -> None:
        if self.at is not None:
            self._timer = threading.Timer(self.at, self._fire, (resp,))
            self._timer.start()

    def _fire(self, resp: httpx.Response) -> None:
        """Shut the socket down rather than close it: a close from this thread while the reader
        blocks in recv frees the descriptor, another request's connection can take the same
        number, and the reader then waits on a stranger's socket (a 180 s "hang" in a 30-minute
        make fuzz, not reproducible). shutdown wakes the reader with the end of the stream and
        sends the server its disconnect; the reader's own close releases the descriptor."""
        self.fired = True
        stream = resp.extensions.get("network_stream")
        sock = stream.get_extra_info("socket") if stream is not None else None
        if sock is None:
            resp.close()
            return
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:  # already closed by the reader
            pass

    def disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()


def _post(url: str, body: bytes, case, read) -> Answer:
    """POST and read the answer with `read(resp)`; a Canceller closes it at cancel_at_s."""
    cancel = Canceller(case)
    try:
        with httpx.Client(timeout=ANSWER_TIMEOUT_S) as client, \
                client.stream("POST", url, content=body, headers={"content-type": "application/json"}) as resp:
            cancel.arm(resp)
            return read(resp, cancel)
    except httpx.TimeoutException:
        return Answer("hang")
    except (httpx.HTTPError, httpx.StreamError):
        if cancel.fired:
            return Answer("cancelled" if cancel.events else "cancelled early")
        raise
    finally:
        cancel.disarm()


def send_http(url: str, case: TritonCase) -> Answer:
    specs = W.MODELS[case.model][0]
    body = {name: field.json_value(specs[name].dims if name in specs else (1,)) for name, field in case.fields}
    route = "generate_stream" if case.streamed else "generate"

    def read(resp: httpx.Response, seen: Canceller) -> Answer:
        if resp.status_code != 200:
            return Answer("error", _http_error(resp.read().decode("utf-8", "replace")), resp.status_code)
        if not case.streamed:
            payload = json.loads(resp.read())
            return Answer("error", str(payload["error"]), 200) if "error" in payload else Answer("ok", payload.get(W.TEXT_OUTPUT, ""))
        for line in resp.iter_lines():
            if not line.startswith("data:"):
                continue
            payload = json.loads(line[5:])
            if "error" in payload:
                return Answer("error", str(payload["error"]), 200)
            seen.events += 1
            if case.cancel_after is not None and seen.events >= case.cancel_after:
                return Answer("cancelled")  # leaving the block closes the connection: the server cancels
        if seen.fired:  # our own shutdown ended the stream
            return Answer("cancelled" if seen.events else "cancelled early")
        return Answer("ok")

    return _post(f"http://{url}/v2/models/{case.model}/{route}", json.dumps(body).encode(), case, read)


def send_openai(base: str, case: OpenAICase) -> Answer:
    def read(resp: httpx.Response, seen: Canceller) -> Answer:
        if resp.status_code != 200 or not case.stream:
            raw = resp.read().decode("utf-8", "replace")
            try:
                payload = json.loads(raw)
            except ValueError:
                return Answer("error", raw, resp.status_code)
            if resp.status_code == 200 and isinstance(payload, dict) and "choices" in payload:
                return Answer("ok", json.dumps(payload["choices"])[:200], 200)
            error = payload.get("error") if isinstance(payload, dict) else None
            if not isinstance(error, dict):
                return Answer("error", raw, resp.status_code)
            return Answer("error", str(error.get("message")), resp.status_code, error.get("param"))
        for line in resp.iter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                return Answer("ok", status=200)
            payload = json.loads(data)
            if "error" in payload:
                return Answer("error", str(payload["error"].get("message")), 200, payload["error"].get("param"))
            choice = (payload.get("choices") or [{}])[0]
            if not (choice.get("text") or choice.get("delta", {}).get("content")):
                continue  # the role chunk goes out before the request reaches Triton
            seen.events += 1
            if case.cancel_after is not None and seen.events >= case.cancel_after:
                return Answer("cancelled", status=200)
        if seen.fired:  # our own shutdown ended the stream
            return Answer("cancelled" if seen.events else "cancelled early")
        return Answer("error", "the stream ended without [DONE]", 200)

    return _post(f"{base}/v1/{case.route}", case.body, case, read)


# ---- judging ----------------------------------------------------------------------------------------
def _names_field(text: str, name: str) -> bool:
    """Our errors read `field: why`, Triton's `input 'field'` / `['field']`."""
    return re.search(rf"(?<![\w]){re.escape(name)}(?::|')", text) is not None


def judge(case, answer: Answer) -> str | None:
    """None when the answer is one the case allows, else what is wrong with it."""
    names = frozenset().union(*(b.names for b in case.bad))
    must_fail = any(b.must_fail for b in case.bad)
    if answer.kind == "hang":
        return f"no answer within {ANSWER_TIMEOUT_S:g} s"
    if answer.kind == "cancelled early":
        return None
    if answer.kind in ("ok", "cancelled"):
        return "served, but a field made bad must be refused" if must_fail else None
    if any(sign in answer.text for sign in INTERNAL_FAILURE):
        return "an internal failure"
    if not case.bad:
        return "a valid request was refused"
    if isinstance(case, OpenAICase):
        if answer.status is None or not 400 <= answer.status < 500 and answer.status != 200:
            return f"HTTP {answer.status}: not a client error"
        if not names:  # a body that is not a request: refused, whatever it names
            return None
        param = answer.param or ""
        return None if any(param == n or param.startswith(n + "[") for n in names) else f"param {param!r} is none of {sorted(names)}"
    return None if any(_names_field(answer.text, n) for n in names) else f"the error names none of {sorted(names)}"


# ---- the control stream and the server's state -------------------------------------------------------
class ControlStream(threading.Thread):
    """The same greedy request over and over while the fuzzing runs; paused (between two runs)
    while the server's slots are counted after each wave."""

    def __init__(self, url: str):
        super().__init__(daemon=True)
        self.url, self.runs, self.errors = url, [], []
        self.done, self.running, self.idle = threading.Event(), threading.Event(), threading.Event()

    def run(self) -> None:
        with SpecDecClient(self.url, model="speculative_loop", timeout_s=ANSWER_TIMEOUT_S) as client:
            while not self.done.is_set():
                self.idle.set()
                if not self.running.wait(0.1):
                    continue
                self.idle.clear()
                try:
                    out = client.generate(CONTROL)
                    self.runs.append((out.text, tuple(out.token_ids)))
                except Exception as exc:  # noqa: BLE001 - recorded, and the test fails on it
                    self.errors.append(repr(exc))
                    time.sleep(1)

    def pause(self) -> None:
        self.running.clear()
        self.idle.clear()
        assert self.idle.wait(ANSWER_TIMEOUT_S), "the control stream did not finish its run"

    def resume(self) -> None:
        self.running.set()


def held(server) -> dict[str, float]:
    """What holds a slot or waits for one now, per model (zeros left out)."""
    samples = server_metrics.scrape(server.endpoints.metrics_url)
    out = {}
    for name in (W.SLOT_OCCUPANCY, W.SLOT_WAITING, W.ACTIVE_SEQUENCES):
        out.update({f"{name}{{{model}}}": v for model, v in server_metrics.by_label(samples, name, "model").items() if v})
    return out


def drained(server, timeout_s: float = DRAIN_TIMEOUT_S) -> dict[str, float]:
    """{} once no slot is held and no sequence live; else what still is at the timeout."""
    deadline = time.monotonic() + timeout_s
    while (now := held(server)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return now


def ready(server) -> bool:
    try:
        return urllib.request.urlopen(server.endpoints.http_url + "/v2/health/ready", timeout=5).status == 200
    except OSError:
        return False


# ---- the fuzzer ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def limits(smol_dir) -> Limits:
    from specdec.engine.models.loading import read_model_config

    served = ServingConfig.from_file(SERVED_SETTINGS)
    return Limits(vocab_size=read_model_config(smol_dir).vocab_size, max_tokens_limit=MAX_SEQ_LEN, max_seq_len=MAX_SEQ_LEN,
                  max_num_draft_tokens=served.engine.max_num_draft_tokens, max_guide_bytes=served.engine.max_guide_bytes,
                  methods=tuple(served.methods), openai_models=(BASE, f"{BASE}:{W.METHOD_NONE}", f"{BASE}:ngram", f"{BASE}:eagle3"))


@pytest.mark.server
def test_fuzz_through_the_server(triton_server, api, limits):  # noqa: F811 - api: the fixture imported above
    grpc, http = triton_server.endpoints.grpc, triton_server.endpoints.http

    def send(case):
        if isinstance(case, OpenAICase):
            return send_openai(api, case)
        return send_grpc(grpc, case) if case.transport == GRPC else send_http(http, case)

    with SpecDecClient(grpc, model="speculative_loop") as client:
        baseline = [client.generate(CONTROL) for _ in range(2)]  # cold, then from the prefix cache
    expected = (baseline[0].text, tuple(baseline[0].token_ids))
    assert (baseline[1].text, tuple(baseline[1].token_ids)) == expected and expected[1]

    control = ControlStream(grpc)
    tally: dict[str, int] = {}
    pool = ThreadPoolExecutor(WAVE_SIZE)

    def one_wave(wave):
        answers = list(pool.map(send, wave))
        for case, answer in zip(wave, answers):
            key = f"{type(case).__name__}:{answer.kind}"
            tally[key] = tally.get(key, 0) + 1
        wrong = [f"{problem}\n    request: {case!r}\n    answer: {answer.kind} {answer.status or ''} {answer.param or ''} {answer.text[:500]!r}"
                 for case, answer in zip(wave, answers) if (problem := judge(case, answer)) is not None]
        assert not wrong, "\n".join(wrong)
        assert triton_server.dead_stubs() == [], "a Python stub died"
        assert ready(triton_server), "the server is not ready"
        control.pause()
        try:
            left = drained(triton_server)
            assert not left, f"held {DRAIN_TIMEOUT_S:g} s after the wave's last answer: {left}"
        finally:
            control.resume()

    control.start()
    control.resume()
    try:
        if FUZZ_SECONDS > 0:
            end = time.monotonic() + FUZZ_SECONDS
            while time.monotonic() < end:
                _run(limits, one_wave, LONG_BATCH, derandomize=False)
        else:
            _run(limits, one_wave, SHORT_WAVES, derandomize=True)
    finally:
        control.done.set()
        control.join(ANSWER_TIMEOUT_S)
        pool.shutdown()
    print(f"fuzz: {sum(tally.values())} requests {tally}; control runs {len(control.runs)}")
    assert not drained(triton_server), f"held after the fuzzing: {held(triton_server)}"
    assert triton_server.dead_stubs() == [] and ready(triton_server)
    assert not control.errors, control.errors
    assert len(control.runs) >= 2, "the control stream did not run beside the fuzzing"
    assert all(run == expected for run in control.runs), [run for run in control.runs if run != expected][:1]


def _run(limits: Limits, check, examples: int, derandomize: bool) -> None:
    """`examples` waves drawn by hypothesis, each checked by `check` (no shrinking: a wave's
    answers depend on what else runs, so the failing wave is printed as it was)."""
    @settings(max_examples=examples, deadline=None, derandomize=derandomize, database=None,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck), print_blob=True)
    @given(wave=waves(limits, WAVE_SIZE))
    def fuzz(wave):
        check(wave)

    fuzz()


# ---- what the fuzzer found, pinned --------------------------------------------------------------------
@pytest.mark.parametrize("ids", [[], list(range(MAX_SEQ_LEN))])
def test_a_prompt_of_token_ids_is_refused_by_its_name(ids):
    """speculative_loop with input_ids alone, empty or longer than the context, was refused
    naming text_input, which the client never sent."""
    offer = ServedOffer({"ngram": 4}, "ngram", 16, MAX_SEQ_LEN, max_seq_len=MAX_SEQ_LEN)
    with pytest.raises(InvalidRequestError) as err:
        parse_request({W.INPUT_IDS: np.int32(ids), W.MAX_TOKENS: np.int32([4])}, offer)
    assert err.value.field == W.INPUT_IDS


@pytest.mark.parametrize("extra, param", [
    ({"seed": -1}, "seed"), ({"seed": 2**64}, "seed"),  # Triton's JSON parser: a 500 naming nothing
    ({"max_tokens": 2**32 + 4}, "max_tokens"), ({"num_draft_tokens": 2**32 + 2}, "num_draft_tokens"),  # wrapped: served as 4, 2
    ({"min_tokens": 2**40}, "min_tokens"), ({"temperature": 10**400}, "temperature"),
    ({"messages": [{"role": "user", "content": "\ud800"}]}, "messages"),  # the tokenizer's TypeError, a 500
])
def test_the_front_end_refuses_what_the_servers_tensors_cannot_carry(smol_tokenizer, extra, param):
    body = {"model": BASE, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, **extra}
    with pytest.raises(OpenAIError) as err:
        parse_job(body, Served(BASE, {BASE: ""}), smol_tokenizer, chat=True)
    assert (err.value.status, err.value.param) == (400, param)


def test_the_front_end_refuses_a_body_it_cannot_read(smol_tokenizer):
    """Not UTF-8, or nested past the JSON parser's stack (a RecursionError, a 500): a 400."""
    from fastapi.testclient import TestClient

    with TestClient(create_app(Frontend("127.0.0.1:9", Served(BASE, {BASE: ""}), smol_tokenizer))) as client:
        for body in (b"\xff\xfe", b"[" * 100_000, b'{"a":' * 50_000):
            resp = client.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
            assert resp.status_code == 400 and resp.json()["error"]["type"] == "invalid_request_error"


def test_a_guide_the_vocabulary_cannot_spell_ends_alone():
    """A regex with a character no token spells (SmolLM2 has none for \\x16) left its sequence
    where the grammar allows no token: the masked row was all -inf, its argmax token 0, and the
    grammar's refusal of it failed the whole round, every stream in it with that error. Now the
    sequence emits what plain decoding would before the dead end and ends alone, naming the
    guide (the dead row is found among the step's masks, its bonus token dropped); one stuck at
    its start is refused at compile; a stream beside it decodes as alone."""
    from specdec.engine.grammar import UNPRODUCIBLE
    from specdec.serving.runtime import build_engine, encode_prompt, served_methods
    from specdec.serving.engine_loop import EngineLoop
    from test_scheduler import ListSink

    engine = build_engine(speculative={m: served_methods()[m] for m in ("eagle3", "eagle3-tree")})
    ids = encode_prompt(engine.tokenizer, "Count to five.")
    plain = SamplingParams(max_tokens=16, ignore_eos=True)
    alone = [t for out in engine.generate(ids, plain, "eagle3") for t in out.new_token_ids]
    scheduler = EngineLoop(engine)
    try:
        beside, midway, sampled, baseline, at_start = ListSink(), ListSink(), ListSink(), ListSink(), ListSink()
        # log probs asked: a round that emits nothing must give none (it failed the round, found by make fuzz)
        stuck = dict(max_tokens=12, guide_type="regex", guide="\U0010f786\x16n", return_log_probs=True)
        scheduler.submit("beside", ids, plain, "eagle3", None, beside)
        scheduler.submit("midway", ids, SamplingParams(**stuck), "eagle3", None, midway)
        scheduler.submit("sampled", ids, SamplingParams(**stuck, temperature=0.9, seed=3), "eagle3-tree", None, sampled)
        scheduler.submit("baseline", ids, SamplingParams(**stuck), "none", 0, baseline)
        scheduler.submit("at_start", ids, SamplingParams(max_tokens=12, guide_type="regex", guide="\x16n"), "none", 0, at_start)
        for sink in (beside, midway, sampled, baseline, at_start):
            assert sink.done.wait(120)
        assert beside.error is None and beside.ids == alone
        for sink in (midway, sampled, baseline, at_start):
            assert isinstance(sink.error, InvalidRequestError) and sink.error.field == W.GUIDED_DECODING_GUIDE
            assert UNPRODUCIBLE in str(sink.error)
        # the 4 byte tokens of U+10F786, then the end: drafted (forced) or one per forward alike
        assert len(midway.ids) == 4 and midway.ids == sampled.ids == baseline.ids and not at_start.ids
        assert not engine.sequences and engine.cache.num_free == engine.cache.max_slots
    finally:
        scheduler.close()


@pytest.mark.parametrize("model", ["ensemble", "speculative_loop"])
@pytest.mark.parametrize("method, temperature", [("none", 0.0), ("eagle3", 0.0), ("medusa-tree", 1.0)])
def test_an_error_after_streamed_tokens_reaches_the_client(triton_server, model, method, temperature):
    """The guide's dead end comes after two streamed tokens. The verifier's error response
    after other responses was lost by the bundled python_backend (the loop waited forever, the
    client until its timeout); it now rides in a normal final round (FINISH_ERROR_PREFIX)."""
    req = GenerateRequest("Say something.", max_tokens=16, temperature=temperature, seed=5 if temperature else None,
                          method=None if method == "none" else method, num_draft_tokens=0 if method == "none" else None,
                          guide_type="regex", guide="ab\x16")
    texts = []
    with SpecDecClient(triton_server.endpoints.grpc, model=model, timeout_s=60) as client:
        with pytest.raises(Exception) as err:
            for chunk in client.stream(req):
                texts.append(chunk.text)
    assert "".join(texts) == "ab"
    assert W.GUIDED_DECODING_GUIDE in str(err.value) and "Deadline" not in str(err.value)
