"""A fuzzer through the real server (issue 43, section 2): waves of concurrent requests with
random and hostile values for every input of `ensemble`, `ensemble_unary`, `speculative_loop`
and the OpenAI front end (tests/support/fuzz_inputs.py), some cancelled mid-stream, while a greedy
control stream runs beside them.

Pass means: every request is answered within ANSWER_TIMEOUT_S, with output or with an error
naming one of the fields made bad (a must-fail field is never served); every output holds what
its request asked for (issue 61 item 6; check_triton, check_openai: at most max_tokens tokens, a
finish reason that fits the output, no stop string in the text, a guided answer that its guide
accepts, the ids' text where ids come back, the prompt echoed where it is, n choices, tool calls
that parse and, forced, fit the tool's parameters; a stream cancelled after some output: what it
got so far); a stream cancelled before any output ended at the cancel, and the same request sent
again uncancelled is judged like any other; after every wave no Python stub died, the server is
ready, and with the control paused between two of its runs no slot is held (the loops' slot
gauges at 0, no sequence live on the verifier or the drafter) within DRAIN_TIMEOUT_S; every
control run (greedy, each prompt under its own speculative method) produced token for token what
plain decoding (the server's baseline, speculative_method "none") produced for its prompt before
the fuzzing.

`make test` runs a short derandomized pass (the same waves every run); `make fuzz` sets
FUZZ_SECONDS and draws fresh waves until that much time has passed. A failure prints the wave
and, for each bad answer, the request and what came back.
"""
from __future__ import annotations

import dataclasses
import json
import os
import queue
import re
import socket
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import httpx
import jsonschema
import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings

import specdec_wire as W
from specdec.config import SERVED_SETTINGS, SamplingParams, ServingConfig
from specdec.errors import InvalidRequestError
from specdec.serving.request import ServedOffer, parse_request
from specdec.serving.runtime import encode_prompt
from specdec_openai.frontend import Frontend, OpenAIError, Served, create_app, parse_job
from specdec_client import GenerateRequest, SpecDecClient, server_metrics

from fuzz_inputs import GRPC, NUMPY_OF, TOOLS, WIRE_OF, Field, Limits, OpenAICase, TritonCase, forced_tool_call, waves
from test_openai import BASE, api  # noqa: F401 - the front end on the session's server

FUZZ_SECONDS = float(os.environ.get("FUZZ_SECONDS", "0"))  # > 0: the long run (make fuzz)
FUZZ_RECORD = os.environ.get("FUZZ_RECORD", "")  # where the long run's record goes when it passes (make fuzz)
SHORT_WAVES = 80  # make test: ~40 s on 2 quiet cores
LONG_BATCH = 25  # waves per hypothesis run in the long mode
WAVE_SIZE = 4
ANSWER_TIMEOUT_S = 180.0
DRAIN_TIMEOUT_S = 30.0
# A cancel shuts the socket down under the reader, which wakes at once; generous for 2 busy cores.
CANCEL_END_S = 30.0
# conftest's triton_server: engine.max_seq_len and max_tokens_limit
MAX_SEQ_LEN = 512
# The control stream: greedy, each prompt under another speculative method (a chain, a dynamic
# tree, Medusa's heads' tree, prompt lookup); each run must equal plain decoding of its prompt.
CONTROLS = (
    GenerateRequest("List the days of the week, one per line.", max_tokens=16, temperature=0.0, method="eagle3"),
    GenerateRequest("Count from one to ten in words.", max_tokens=16, temperature=0.0, method="eagle3-tree"),
    GenerateRequest("Name three primary colours.", max_tokens=16, temperature=0.0, method="medusa-tree"),
    GenerateRequest("Repeat after me: red, green, blue, red, green, blue.", max_tokens=16, temperature=0.0, method="ngram"),
)
INTERNAL_FAILURE = ("Traceback", "not healthy", "Stub process", "Internal Server Error")
FINISHED = ("eos", "length", "stop")  # the loop's reasons for an answer that ran to its end
DEFAULT_OPENAI_MAX_TOKENS = 256  # specdec_openai.frontend's, for a body without max_tokens
# Every kind of answer check (Checker.counts' keys, by prefix) must have judged some answer in a
# run, the short derandomized one included: a check whose answers never come checks nothing.
CHECKS_THAT_MUST_FIRE = ("finish eos", "finish length", "finish stop", "stop strings", "text of ids", "prompt echo",
                         "guide whole", "guide start", "guide json", "openai n=1", "openai n=2", "openai usage",
                         "openai tokens (text re-encoded)", "tool call")


@dataclass
class Choice:
    """One OpenAI choice as it came (a stream's deltas joined)."""

    text: str = ""  # the message's content, or the completion's text
    tool_calls: list = field(default_factory=list)
    reasons: list = field(default_factory=list)  # every finish_reason it was given (one, once it ended)


@dataclass
class Output:
    """What a served answer carried, for the checks against its request."""

    text: str = ""  # Triton: text_output joined (a non-streamed answer's echo of its prompt first)
    ids: list[int] | None = None  # output_ids joined (None: the model returns none, e.g. the ensemble)
    reason: str | None = None  # the last non-empty finish_reason
    tokens: int | None = None  # the last output_tokens: the server's count of generated tokens
    choices: dict[int, Choice] | None = None  # OpenAI: by index
    order: list | None = None  # OpenAI, not streamed: the choices' indices as listed
    usage: dict | None = None  # OpenAI


@dataclass
class Answer:
    kind: str  # ok | error | cancelled (after output) | cancelled early (before any) | hang
    text: str = ""
    status: int | None = None  # HTTP status, where there is one
    param: str | None = None  # the OpenAI error's param
    out: Output | None = None  # ok, cancelled: what came
    ended_s: float | None = None  # cancelled by time: seconds from the cancel to the end of the reader's stream


# ---- sending ---------------------------------------------------------------------------------------
def _grpc_inputs(case: TritonCase) -> list:
    import tritonclient.grpc as grpcclient

    inputs = []
    for name, field_ in case.fields:
        array = np.array(list(field_.values), dtype=NUMPY_OF[field_.wire]).reshape(field_.shape)
        tensor = grpcclient.InferInput(name, list(field_.shape), field_.wire)
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


def _flat(value) -> list:
    """An output's values (Triton's JSON gives a one-element output as a scalar)."""
    if isinstance(value, np.ndarray):
        value = value.tolist()
    return [x for v in value for x in _flat(v)] if isinstance(value, list) else [value]


def _str(value) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def absorb(out: Output, get) -> None:
    """One response's outputs into `out`; get(name): the output, or None."""
    for name in (W.TEXT_OUTPUT, W.OUTPUT_IDS, W.FINISH_REASON, W.OUTPUT_TOKENS):
        value = get(name)
        if value is None:
            continue
        values = _flat(value)
        if name == W.TEXT_OUTPUT:
            out.text += "".join(_str(v) for v in values)
        elif name == W.OUTPUT_IDS:
            out.ids = (out.ids or []) + [int(v) for v in values]
        elif name == W.FINISH_REASON:
            out.reason = _str(values[0]) if values and _str(values[0]) else out.reason
        elif values:
            out.tokens = int(values[0])


def send_grpc(url: str, case: TritonCase) -> Answer:
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(url)
    try:
        out = Output()
        if case.model == W.ENSEMBLE_UNARY:  # ModelInfer: one answer
            try:
                result = client.infer(case.model, _grpc_inputs(case), client_timeout=ANSWER_TIMEOUT_S)
            except grpcclient.InferenceServerException as exc:
                return Answer("hang" if "Deadline" in str(exc) else "error", str(exc))
            absorb(out, result.as_numpy)
            return Answer("ok", out.text, out=out)
        answers: queue.Queue = queue.Queue()
        client.start_stream(callback=lambda result, error: answers.put((result, error)))
        try:
            client.async_stream_infer(case.model, _grpc_inputs(case), enable_empty_final_response=True)
            while True:
                try:
                    result, error = answers.get(timeout=ANSWER_TIMEOUT_S)
                except queue.Empty:
                    return Answer("hang")
                if error is not None:
                    return Answer("error", str(error))
                if result.get_response().outputs:
                    absorb(out, result.as_numpy)
                if result.get_response().parameters["triton_final_response"].bool_param:
                    return Answer("ok", out.text, out=out)
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
        self.fired_at: float | None = None  # monotonic time of the cancel
        self.out: Output | None = None  # what the reader got (set by it)
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
        self.fired, self.fired_at = True, time.monotonic()
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
    answer = None
    try:
        with httpx.Client(timeout=ANSWER_TIMEOUT_S) as client, \
                client.stream("POST", url, content=body, headers={"content-type": "application/json"}) as resp:
            cancel.arm(resp)
            answer = read(resp, cancel)
            return answer
    except httpx.TimeoutException:
        answer = Answer("hang")
        return answer
    except (httpx.HTTPError, httpx.StreamError):
        if cancel.fired:
            answer = Answer("cancelled" if cancel.events else "cancelled early", out=cancel.out)
            return answer
        raise
    finally:
        cancel.disarm()
        if answer is not None and cancel.fired_at is not None and answer.kind.startswith("cancelled"):
            answer.ended_s = time.monotonic() - cancel.fired_at


def send_http(url: str, case: TritonCase) -> Answer:
    specs = W.MODELS[case.model][0]
    body = {name: field_.json_value(specs[name].dims if name in specs else (1,)) for name, field_ in case.fields}
    route = "generate_stream" if case.streamed else "generate"

    def read(resp: httpx.Response, seen: Canceller) -> Answer:
        if resp.status_code != 200:
            return Answer("error", _http_error(resp.read().decode("utf-8", "replace")), resp.status_code)
        out = seen.out = Output()
        if not case.streamed:
            payload = json.loads(resp.read())
            if "error" in payload:
                return Answer("error", str(payload["error"]), 200)
            absorb(out, payload.get)
            return Answer("ok", out.text, out=out)
        for line in resp.iter_lines():
            if not line.startswith("data:"):
                continue
            payload = json.loads(line[5:])
            if "error" in payload:
                return Answer("error", str(payload["error"]), 200)
            absorb(out, payload.get)
            seen.events += 1
            if case.cancel_after is not None and seen.events >= case.cancel_after:
                return Answer("cancelled", out.text, out=out)  # leaving the block closes the connection: the server cancels
        if seen.fired:  # our own shutdown ended the stream
            return Answer("cancelled" if seen.events else "cancelled early", out.text, out=out)
        return Answer("ok", out.text, out=out)

    return _post(f"http://{url}/v2/models/{case.model}/{route}", json.dumps(body).encode(), case, read)


def _openai_choice(raw: dict) -> Choice:
    message = raw.get("message") or {}
    text = message.get("content") if "message" in raw else raw.get("text")
    return Choice(text or "", list(message.get("tool_calls") or []), [raw["finish_reason"]] if raw.get("finish_reason") else [])


def send_openai(base: str, case: OpenAICase) -> Answer:
    def read(resp: httpx.Response, seen: Canceller) -> Answer:
        if resp.status_code != 200 or not case.stream:
            raw = resp.read().decode("utf-8", "replace")
            try:
                payload = json.loads(raw)
            except ValueError:
                return Answer("error", raw, resp.status_code)
            if resp.status_code == 200 and isinstance(payload, dict) and "choices" in payload:
                out = Output(choices={c.get("index"): _openai_choice(c) for c in payload["choices"]},
                             order=[c.get("index") for c in payload["choices"]], usage=payload.get("usage"))
                return Answer("ok", json.dumps(payload["choices"])[:200], 200, out=out)
            error = payload.get("error") if isinstance(payload, dict) else None
            if not isinstance(error, dict):
                return Answer("error", raw, resp.status_code)
            return Answer("error", str(error.get("message")), resp.status_code, error.get("param"))
        out = seen.out = Output(choices={})
        for line in resp.iter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                return Answer("ok", "".join(c.text for c in out.choices.values())[:200], 200, out=out)
            payload = json.loads(data)
            if "error" in payload:
                return Answer("error", str(payload["error"].get("message")), 200, payload["error"].get("param"))
            out.usage = payload.get("usage") or out.usage
            texts = 0
            for raw in payload.get("choices") or []:
                choice = out.choices.setdefault(raw.get("index"), Choice())
                delta = raw.get("delta") or {}
                text = delta.get("content") if "delta" in raw else raw.get("text")
                choice.text += text or ""
                texts += bool(text)
                choice.tool_calls += delta.get("tool_calls") or []
                if raw.get("finish_reason"):
                    choice.reasons.append(raw["finish_reason"])
            if not texts:
                continue  # the role chunk goes out before the request reaches Triton
            seen.events += 1
            if case.cancel_after is not None and seen.events >= case.cancel_after:
                return Answer("cancelled", status=200, out=out)
        if seen.fired:  # our own shutdown ended the stream
            return Answer("cancelled" if seen.events else "cancelled early", out=out)
        return Answer("error", "the stream ended without [DONE]", 200)

    return _post(f"{base}/v1/{case.route}", case.body, case, read)


# ---- checking an answer against its request --------------------------------------------------------
# Regexes of fuzz_inputs.guides in Python's re (no backtracking blow-up on a wrong answer; \d is
# wider than xgrammar's [0-9]): a finished answer must fullmatch its guide.
PYTHON_REGEX = {"[a-z]{1,8}": r"[a-z]{1,8}", "(a*)*b": r"a*b", "(x|y){0,200}z": r"[xy]{0,200}z", "\\d" * 2000: r"\d{2000}"}
EBNF_ANSWERS = {'root ::= "yes" | "no"': {"yes", "no"}}
# A JSON schema's grammar takes seconds to build past a few thousand characters (deep nesting):
# longer ones are checked by jsonschema alone, on finished answers.
MAX_MATCHED_SCHEMA = 4000


def plain_validator(guide_type: str, guide: str | None):
    """The guide's meaning, checked without xgrammar (as tests/server/test_structured.py checks
    structured output: json, jsonschema, re.fullmatch): a function of a finished answer that
    raises when the answer is wrong; None where there is none for this guide."""
    if guide_type == "json":
        def whole_json(text: str) -> None:
            if not isinstance(json.loads(text), (dict, list)):  # xgrammar's JSON: an object or an array
                raise ValueError("not a JSON object or array")
        return whole_json
    if guide_type == "json_schema":
        try:
            schema = json.loads(guide or "")
            if not isinstance(schema, dict):
                return None
            validator = jsonschema.validators.validator_for(schema)
            validator.check_schema(schema)
        except (ValueError, jsonschema.SchemaError, RecursionError):
            return None
        return lambda text: validator(schema).validate(json.loads(text))
    if guide_type == "regex" and guide in PYTHON_REGEX:
        def fullmatch(text: str) -> None:
            if re.fullmatch(PYTHON_REGEX[guide], text) is None:
                raise ValueError(f"does not match {PYTHON_REGEX[guide]!r}")
        return fullmatch
    if guide_type == "ebnf_grammar" and guide in EBNF_ANSWERS:
        def one_of(text: str) -> None:
            if text not in EBNF_ANSWERS[guide]:
                raise ValueError(f"is none of {sorted(EBNF_ANSWERS[guide])}")
        return one_of
    return None


def _first_difference(a, b) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


class Checker:
    """Every served answer against its request (check_triton, check_openai); `counts` tallies
    what was checked."""

    def __init__(self, tokenizer):
        import xgrammar as xgr

        self.tokenizer = tokenizer
        self.counts: dict[str, int] = {}
        # Guides are matched on the answer's text, so a vocabulary of the 256 bytes (grammars
        # compile in milliseconds) stands in for the model's; the grammar is the server's
        # (specdec.engine.grammar.parse_guide).
        info = xgr.TokenizerInfo([bytes([b]) for b in range(256)] + [b"</s>"], stop_token_ids=[256])
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self._grammars: dict[tuple[str, str], object] = {}

    def _count(self, what: str) -> None:
        self.counts[what] = self.counts.get(what, 0) + 1

    def _grammar(self, guide_type: str, guide: str | None):
        """The guide's compiled grammar, an InvalidRequestError (it does not parse), or None (too slow to build)."""
        from specdec.engine.grammar import parse_guide

        if guide_type == "json_schema" and len(guide or "") > MAX_MATCHED_SCHEMA:
            return None
        key = (guide_type, "" if guide_type == "json" else guide or "")
        if key not in self._grammars:
            if len(self._grammars) > 256:
                self._grammars.clear()
            try:
                self._grammars[key] = self._compiler.compile_grammar(parse_guide(guide_type, guide))
            except InvalidRequestError as exc:
                self._grammars[key] = exc
        return self._grammars[key]

    def guide(self, guide_type: str, guide: str | None, text: str, finished: bool) -> list[str]:
        """A guided answer: finished (by the end token the grammar allows only at its end), a
        whole answer of the guide; cut (max_tokens, a stop string, a cancel), the start of one."""
        import xgrammar as xgr

        problems = []
        grammar = self._grammar(guide_type, guide)
        if isinstance(grammar, InvalidRequestError):
            problems.append(f"served with a guide its grammar refuses: {grammar}")
        elif grammar is not None:
            matcher = xgr.GrammarMatcher(grammar)
            cut = text if finished else text.rstrip("\ufffd")  # a character cut by max_tokens reads U+FFFD
            if not matcher.accept_string(cut):
                problems.append(f"the {guide_type} guide does not take {text!r}")
            elif finished and not matcher.is_completed():
                problems.append(f"ended, but {text!r} is not a whole answer of its {guide_type} guide")
            self._count(f"guide {'whole' if finished else 'start'} (xgrammar)")
        check = plain_validator(guide_type, guide) if finished else None
        if check is not None:
            try:
                check(text)
                self._count(f"guide {guide_type} ({'jsonschema' if guide_type == 'json_schema' else 'plain'})")
            except (ValueError, jsonschema.ValidationError) as exc:
                why = exc.message if isinstance(exc, jsonschema.ValidationError) else str(exc)
                problems.append(f"ended, but {text!r} is not a valid answer of its {guide_type} guide: {why[:200]}")
        return problems

    def check(self, case, answer: Answer) -> list[str]:
        if answer.out is None:
            return ["no output recorded"]
        finished = answer.kind == "ok"
        return self.check_openai(case, answer.out, finished) if isinstance(case, OpenAICase) \
            else self.check_triton(case, answer.out, finished)

    def check_triton(self, case: TritonCase, out: Output, finished: bool) -> list[str]:
        """finished: the whole answer (else what a cancelled stream got before its cancel)."""
        values = {name: f.values for name, f in case.fields}

        def one(name, default=None):
            return values[name][0] if len(values.get(name, ())) == 1 else default

        problems = []
        max_tokens = int(one(W.MAX_TOKENS))
        stops = [w for w in values.get(W.STOP_WORDS, ()) if w]  # empty ones are none (TensorRT-LLM's [""])
        guide_type, guide = one(W.GUIDED_DECODING_GUIDE_TYPE) or None, one(W.GUIDED_DECODING_GUIDE) or None
        if W.TEXT_INPUT in values:
            prompt_ids = encode_prompt(self.tokenizer, one(W.TEXT_INPUT), bool(one(W.APPLY_CHAT_TEMPLATE, True)))
        else:
            prompt_ids = [int(t) for t in values[W.INPUT_IDS]]
        limit = min(max_tokens, MAX_SEQ_LEN - len(prompt_ids))  # what max_tokens and the context leave
        text, ids = out.text, out.ids
        if not case.streamed and not one(W.EXCLUDE_INPUT_IN_OUTPUT, False):  # TensorRT-LLM's default: the prompt first
            echo = self.tokenizer.decode(prompt_ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
            if not text.startswith(echo):
                problems.append(f"the text does not start with its prompt {echo[:100]!r}")
            text = text[len(echo):]
            if ids is not None:
                if ids[: len(prompt_ids)] != prompt_ids:
                    problems.append("the ids do not start with the prompt's")
                ids = ids[len(prompt_ids):]
            self._count("prompt echo")
        count = len(ids) if ids is not None else out.tokens
        if count is None:
            problems.append(f"no {W.OUTPUT_TOKENS} to count its tokens")
            count = 0
        if finished and ids is not None and out.tokens != len(ids):
            problems.append(f"{len(ids)} output ids but {W.OUTPUT_TOKENS} {out.tokens}")
        if count > limit:
            problems.append(f"{count} tokens, past max_tokens {max_tokens} (or the context's {MAX_SEQ_LEN - len(prompt_ids)})")
        reason = out.reason
        if finished:
            guided = guide_type is not None
            if reason not in FINISHED:
                problems.append(f"finish_reason {reason!r} for a finished answer")
            elif reason == "length" and count != limit:
                problems.append(f"finish_reason length after {count} tokens, with room for {limit}")
            elif reason == "eos":
                min_tokens = one(W.MIN_TOKENS, one(W.MIN_LENGTH, 0))
                if count >= limit:
                    problems.append(f"finish_reason eos after {count} tokens, all max_tokens allows: that is length")
                if one(W.IGNORE_EOS, False) and not guided:
                    problems.append("finish_reason eos with ignore_eos")
                if not guided and count < min_tokens:  # a guide's end overrides min_tokens
                    problems.append(f"finish_reason eos after {count} tokens, before min_tokens {min_tokens}")
            elif reason == "stop" and not stops:
                problems.append("finish_reason stop without a stop string")
            self._count(f"finish {reason}")
        held = [s for s in stops if s in text]
        if held:
            problems.append(f"the text holds its stop string {held[0][:50]!r}")
        if stops:
            self._count("stop strings")
        if ids is not None:  # the text is the ids' (cut before the stop string that ended it)
            decoded = self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
            if finished and reason != "stop":
                if text != decoded:
                    at = _first_difference(text, decoded)
                    problems.append(f"the text is not its ids' text from character {at}: {text[at:at + 40]!r} vs {decoded[at:at + 40]!r}")
            elif not decoded.startswith(text):
                problems.append(f"the text {text[:80]!r} is not the start of its ids' text {decoded[:80]!r}")
            elif finished and not any(decoded[len(text):].startswith(s) for s in stops):
                problems.append(f"finish_reason stop, but no stop string follows the text in its ids' text {decoded[len(text):][:40]!r}")
            self._count("text of ids")
        if guide_type is not None:
            problems += self.guide(guide_type, guide, text, finished and reason == "eos")
        return problems

    def check_openai(self, case: OpenAICase, out: Output, finished: bool) -> list[str]:
        body = json.loads(case.body)
        chat = case.route == "chat/completions"
        n = body.get("n") or 1
        max_tokens = next((body[k] for k in ("max_completion_tokens", "max_tokens") if body.get(k) is not None),
                          DEFAULT_OPENAI_MAX_TOKENS)
        stop = body.get("stop")
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        parsed = chat and bool(body.get("tools")) and body.get("tool_choice") != "none"  # the answer is read for calls
        forced = chat and forced_tool_call(body)
        named = forced and isinstance(body.get("tool_choice"), dict)
        parameters = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
        fmt = body.get("response_format") if isinstance(body.get("response_format"), dict) else {}
        guide_type, guide = {"json_object": ("json", None), "json_schema": (
            "json_schema", json.dumps((fmt.get("json_schema") or {}).get("schema")))}.get(fmt.get("type"), (None, None))
        problems = []
        choices = out.choices or {}
        if out.order is not None and out.order != list(range(n)):
            problems.append(f"choices {out.order} for n={n}")
        if (sorted(choices) != list(range(n))) if finished else not set(choices) <= set(range(n)):
            problems.append(f"choices {sorted(choices, key=str)} for n={n}")
        self._count(f"openai n={n}")
        for index, choice in choices.items():
            where = f"choice {index}: "
            if finished and len(choice.reasons) != 1:
                problems.append(f"{where}finish_reason given {len(choice.reasons)} times: {choice.reasons}")
            reason = choice.reasons[-1] if choice.reasons else None
            if reason is not None and reason not in ("stop", "length", "tool_calls"):
                problems.append(f"{where}finish_reason {reason!r}")
            held = [s for s in stops if s in choice.text]
            if held:
                problems.append(f"{where}the text holds its stop string {held[0]!r}")
            if choice.tool_calls and not parsed:
                problems.append(f"{where}tool calls without tools to call")
            for call in choice.tool_calls:
                function = call.get("function") or {}
                name = function.get("name")
                try:
                    arguments = json.loads(function.get("arguments"))
                except (TypeError, ValueError):
                    problems.append(f"{where}the arguments of {name!r} are not JSON: {function.get('arguments')!r}")
                    continue
                if not isinstance(name, str) or call.get("type") != "function" or not call.get("id"):
                    problems.append(f"{where}a malformed tool call {call!r}")
                if forced:  # the call's grammar is the tool's parameters
                    if name not in parameters or (named and name != body["tool_choice"]["function"]["name"]):
                        problems.append(f"{where}a forced call of {name!r}, not a tool asked for")
                        continue
                    try:
                        jsonschema.validate(arguments, parameters[name])
                    except jsonschema.ValidationError as exc:
                        problems.append(f"{where}the arguments of {name} do not fit its parameters: {exc.message}")
                self._count("tool call (schema)" if forced else "tool call (parsed)")
            if choice.tool_calls and reason not in (None, "length", "stop" if named else "tool_calls"):
                problems.append(f"{where}finish_reason {reason!r} for an answer with tool calls")
            if reason == "tool_calls" and not choice.tool_calls:
                problems.append(f"{where}finish_reason tool_calls without a call")
            if finished and body.get("ignore_eos") is True and guide_type is None and not forced and not stops and reason != "length":
                problems.append(f"{where}finish_reason {reason!r} with ignore_eos and no stop string")
            if forced and finished and reason != "length" and not stops:  # ended by the grammar: the whole call
                if not choice.tool_calls:
                    problems.append(f"{where}a forced call ended without a call: {choice.text[:200]!r}")
                elif (named or not body.get("parallel_tool_calls")) and len(choice.tool_calls) != 1:
                    problems.append(f"{where}{len(choice.tool_calls)} calls where one was forced")
                if choice.text.strip():
                    problems.append(f"{where}text beside a forced call: {choice.text[:100]!r}")
            if guide_type is not None and not choice.tool_calls:  # ended by its end token: neither cut nor stopped
                problems += [where + p for p in self.guide(guide_type, guide, choice.text, finished and reason == "stop" and not stops)]
        usage = out.usage
        if finished and usage is not None:
            tokens = usage.get("completion_tokens")
            if not isinstance(tokens, int) or tokens > n * max_tokens:
                problems.append(f"completion_tokens {tokens!r} past n x max_tokens = {n} x {max_tokens}")
            elif n == 1 and choices.get(0) and choices[0].reasons:
                reason = choices[0].reasons[-1]
                if reason == "length" and tokens != max_tokens and usage.get("prompt_tokens", 0) + tokens < MAX_SEQ_LEN - 1:
                    problems.append(f"finish_reason length after {tokens} of max_tokens {max_tokens}")
                if reason != "length" and not stops:  # the end token
                    if tokens >= max_tokens:
                        problems.append(f"finish_reason {reason} (the end token) after {tokens} tokens, all max_tokens allows")
                    if guide_type is None and not forced and tokens < (body.get("min_tokens") or 0):  # a guide's end overrides it
                        problems.append(f"finish_reason {reason} (the end token) after {tokens} tokens, before min_tokens")
            self._count("openai usage")
        elif usage is None:  # a stream without include_usage: each text's tokens, counted by re-encoding it
            for index, choice in choices.items():
                if choice.tool_calls:  # the text is the parsed call's, not the tokens'
                    continue
                # Re-encoding gives BPE's canonical tokens, in practice no more than the generated
                # ones; a character cut by max_tokens reads U+FFFD and is left out.
                tokens = len(self.tokenizer.encode(choice.text.rstrip("\ufffd"), add_special_tokens=False))
                if tokens > max_tokens:
                    problems.append(f"choice {index}: {tokens} tokens (its text re-encoded), past max_tokens {max_tokens}")
                self._count("openai tokens (text re-encoded)")
        return problems


# ---- judging ----------------------------------------------------------------------------------------
def _names_field(text: str, name: str) -> bool:
    """Our errors read `field: why`, Triton's `input 'field'` / `['field']`."""
    return re.search(rf"(?<![\w]){re.escape(name)}(?::|')", text) is not None


def judge(case, answer: Answer, checker: Checker) -> str | None:
    """None when the answer is one the case allows, else what is wrong with it."""
    names = frozenset().union(*(b.names for b in case.bad))
    must_fail = any(b.must_fail for b in case.bad)
    if answer.kind == "hang":
        return f"no answer within {ANSWER_TIMEOUT_S:g} s"
    if answer.kind.startswith("cancelled") and answer.ended_s is not None and answer.ended_s > CANCEL_END_S:
        return f"the stream went on {answer.ended_s:.1f} s after its cancel"
    if answer.kind == "cancelled early":  # the wave's drain and an uncancelled repeat judge the rest
        return None
    if answer.kind in ("ok", "cancelled"):
        if must_fail:
            return "served, but a field made bad must be refused"
        return "; ".join(checker.check(case, answer)) or None
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
    """The CONTROLS requests in turn while the fuzzing runs; paused (between two runs) while
    the server's slots are counted after each wave."""

    def __init__(self, url: str):
        super().__init__(daemon=True)
        self.url, self.errors = url, []
        self.runs: list[tuple[int, str, tuple[int, ...]]] = []  # (index in CONTROLS, text, ids)
        self.done, self.running, self.idle = threading.Event(), threading.Event(), threading.Event()

    def run(self) -> None:
        with SpecDecClient(self.url, model="speculative_loop", timeout_s=ANSWER_TIMEOUT_S) as client:
            turn = 0
            while not self.done.is_set():
                self.idle.set()
                if not self.running.wait(0.1):
                    continue
                self.idle.clear()
                index, turn = turn % len(CONTROLS), turn + 1
                try:
                    out = client.generate(CONTROLS[index])
                    self.runs.append((index, out.text, tuple(out.token_ids)))
                except Exception as exc:  # noqa: BLE001 - recorded; test_fuzz_through_the_server fails on it
                    self.errors.append(repr(exc))
                    time.sleep(1)

    def pause(self) -> None:
        self.running.clear()
        self.idle.clear()
        assert self.idle.wait(ANSWER_TIMEOUT_S), "the control stream did not finish its run"

    def resume(self) -> None:
        self.running.set()


def plain_decoding(url: str) -> list[tuple[str, tuple[int, ...]]]:
    """Each control prompt's (text, ids) under plain decoding: the server's baseline (speculative
    method none), the same settings, once per prompt, before the fuzzing."""
    with SpecDecClient(url, model="speculative_loop", timeout_s=ANSWER_TIMEOUT_S) as client:
        outs = [client.generate(dataclasses.replace(request, method=W.METHOD_NONE)) for request in CONTROLS]
    return [(out.text, tuple(out.token_ids)) for out in outs]


def control_differences(runs, expected) -> list[str]:
    """Each control run that is not exactly its prompt's plain decoding, where it first differs."""
    wrong = []
    for index, text, ids in runs:
        if (text, ids) != expected[index]:
            at = _first_difference(ids, expected[index][1])
            wrong.append(f"control {index} ({CONTROLS[index].method}) differs from plain decoding at token {at}: "
                         f"{list(ids[at:at + 4])} vs {list(expected[index][1][at:at + 4])}; {text!r} vs {expected[index][0]!r}")
    return wrong


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
def test_fuzz_through_the_server(triton_server, api, limits, smol_tokenizer):  # noqa: F811 - api: the fixture imported above
    from specdec_client.envinfo import provenance, write_result

    recording = FUZZ_SECONDS > 0 and bool(FUZZ_RECORD)
    started, t0 = provenance() if recording else None, time.monotonic()
    grpc, http = triton_server.endpoints.grpc, triton_server.endpoints.http
    checker = Checker(smol_tokenizer)

    def send(case):
        if isinstance(case, OpenAICase):
            return send_openai(api, case)
        return send_grpc(grpc, case) if case.transport == GRPC else send_http(http, case)

    expected = plain_decoding(grpc)
    assert all(ids for _, ids in expected), expected

    control = ControlStream(grpc)
    tally: dict[str, int] = {}
    pool = ThreadPoolExecutor(WAVE_SIZE)

    def judged(cases, answers, how: str = "") -> list[str]:
        for case, answer in zip(cases, answers):
            key = f"{type(case).__name__}:{answer.kind}{' (again)' if how else ''}"
            tally[key] = tally.get(key, 0) + 1
        return [f"{how}{problem}\n    request: {case!r}\n    answer: {answer.kind} {answer.status or ''} {answer.param or ''} "
                f"{answer.text[:500]!r}" for case, answer in zip(cases, answers) if (problem := judge(case, answer, checker)) is not None]

    def settle(after: str) -> None:
        assert triton_server.dead_stubs() == [], "a Python stub died"
        assert ready(triton_server), "the server is not ready"
        control.pause()
        try:
            left = drained(triton_server)
            assert not left, f"held {DRAIN_TIMEOUT_S:g} s after {after}: {left}"
        finally:
            control.resume()

    def one_wave(wave):
        answers = list(pool.map(send, wave))
        wrong = judged(wave, answers)
        assert not wrong, "\n".join(wrong)
        settle("the wave's last answer")  # the cancelled ones released too
        # A cancel before any output hid the answer: the same request again, uncancelled
        again = [dataclasses.replace(case, cancel_after=None, cancel_at_s=None)
                 for case, answer in zip(wave, answers) if answer.kind == "cancelled early"]
        if again:
            wrong = judged(again, list(pool.map(send, again)), "sent again without the cancel that came before any output: ")
            assert not wrong, "\n".join(wrong)
            settle("the uncancelled repeats")

    control.start()
    control.resume()
    try:
        one_wave(fixed_wave())
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
    print(f"fuzz: {sum(tally.values())} requests {tally}; checked {checker.counts}; control runs "
          f"{[sum(1 for i, *_ in control.runs if i == k) for k in range(len(CONTROLS))]}")
    silent = [check for check in CHECKS_THAT_MUST_FIRE if not any(k.startswith(check) for k in checker.counts)]
    assert not silent, f"checks that never fired (their answers never came, or the check is dead): {silent}"
    assert not drained(triton_server), f"held after the fuzzing: {held(triton_server)}"
    assert triton_server.dead_stubs() == [] and ready(triton_server)
    assert not control.errors, control.errors
    assert len(control.runs) >= 2, "the control stream did not run beside the fuzzing"
    wrong = control_differences(control.runs, expected)
    assert not wrong, f"{len(wrong)} of {len(control.runs)} control runs:\n" + "\n".join(wrong[:4])
    if recording:  # the long run's record, written only when every check above held
        write_result(FUZZ_RECORD, {"command": f"make fuzz FUZZ_SECONDS={FUZZ_SECONDS:g}", "passed": True,
                                   "seconds": round(time.monotonic() - t0, 1), "requests": dict(tally),
                                   "checked": dict(checker.counts), "control_runs": len(control.runs),
                                   "waves": {"requests_per_wave": WAVE_SIZE, "waves_per_draw": LONG_BATCH,
                                             "hypothesis": "fresh draws (derandomize off)"}}, started)


def _run(limits: Limits, check, examples: int, derandomize: bool) -> None:
    """`examples` waves drawn by hypothesis, each checked by `check` (no shrinking: a wave's
    answers depend on what else runs, so the failing wave is printed as it was)."""
    @settings(max_examples=examples, deadline=None, derandomize=derandomize, database=None,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck), print_blob=True)
    @given(wave=waves(limits, WAVE_SIZE))
    def fuzz(wave):
        check(wave)

    fuzz()


# ---- the checker's controls: a wrong answer of each kind is rejected ----------------------------------
def _triton(stream: bool = True, **values) -> TritonCase:
    """An ensemble request of these inputs, streamed over gRPC."""
    fields = {W.TEXT_INPUT: "Hi", W.MAX_TOKENS: 4, W.STREAM: stream, **values}
    specs = W.MODELS["ensemble"][0]

    def field_of(name, value) -> Field:
        values = value if isinstance(value, tuple) else (value,)
        return Field(WIRE_OF[specs[name].dtype], (1, len(values)), values)

    return TritonCase("ensemble", GRPC, tuple((name, field_of(name, v)) for name, v in fields.items()), ())


def _openai(**body) -> OpenAICase:
    route = "chat/completions" if "messages" in body else "completions"
    return OpenAICase(route, json.dumps({"model": BASE, **body}).encode(), bool(body.get("stream")), ())


WEATHER_CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
CHAT = {"messages": [{"role": "user", "content": "Weather in Oslo?"}], "tools": list(TOOLS), "max_tokens": 48}
# (what is wrong, the request, the right answer, the wrong one, what the checker must say)
WRONG_ANSWERS = {
    "too many tokens": (_triton(), Output(text="one two", reason="length", tokens=4),
                        Output(text="one two three", reason="length", tokens=6), "past max_tokens"),
    "a stop string left in": (_triton(**{W.STOP_WORDS: ("END",)}), Output(text="one", reason="stop", tokens=2),
                              Output(text="one END", reason="stop", tokens=2), "holds its stop string"),
    "a finish reason its count denies": (_triton(), Output(text="one", reason="length", tokens=4),
                                         Output(text="one", reason="length", tokens=2), "with room for 4"),
    "an invalid guided output": (_triton(**{W.GUIDED_DECODING_GUIDE_TYPE: "json", W.MAX_TOKENS: 16}),
                                 Output(text='{"a": 1}', reason="eos", tokens=5),
                                 Output(text='{"a": 1', reason="eos", tokens=4), "guide"),
    "the wrong choice count": (_openai(prompt="Hi", n=2, max_tokens=4),
                               Output(choices={0: Choice("a", reasons=["stop"]), 1: Choice("b", reasons=["stop"])}),
                               Output(choices={0: Choice("a", reasons=["stop"])}), "for n=2"),
    "an unparseable tool call": (_openai(**CHAT), Output(choices={0: Choice(tool_calls=[WEATHER_CALL], reasons=["tool_calls"])}),
                                 Output(choices={0: Choice(tool_calls=[{**WEATHER_CALL, "function": {
                                     "name": "get_weather", "arguments": '{"city": "Os'}}], reasons=["tool_calls"])}),
                                 "not JSON"),
    "too many tokens in a stream without usage": (
        _openai(prompt="Hi", max_tokens=3, stream=True), Output(choices={0: Choice("one two", reasons=["length"])}),
        Output(choices={0: Choice(" ".join(["word"] * 12), reasons=["length"])}), "past max_tokens 3"),
}


def fixed_wave() -> list:
    """Answers the drawn waves may not bring in a short run, so that every check judges some:
    a stop string that ends the answer (nearly every English sentence holds an "e"), two
    choices, a forced tool call streamed and a named one not streamed."""
    return [_triton(**{W.TEXT_INPUT: "Write one sentence about the sea.", W.MAX_TOKENS: 16, W.STOP_WORDS: ("e",)}),
            _triton(**{W.TEXT_INPUT: "Reply with one word: yes or no. Is water wet?", W.MAX_TOKENS: 48}),  # ends by its end token
            _openai(prompt="Name a colour.", n=2, max_tokens=8),
            _openai(**CHAT, stream=True, tool_choice="required"),
            _openai(**CHAT, tool_choice={"type": "function", "function": {"name": "add"}}),
            _openai(prompt="Count to five.", max_tokens=6, stream=True, stream_options={"include_usage": True})]


@pytest.mark.parametrize("kind", WRONG_ANSWERS)
def test_the_checker_rejects_a_wrong_answer_of_each_kind(kind, smol_tokenizer):
    """The fuzzer's validator given the right answer passes it, and given a wrong one of this
    kind names what is wrong: a check that cannot fire would pass both."""
    case, right, wrong, said = WRONG_ANSWERS[kind]
    checker = Checker(smol_tokenizer)
    assert checker.check(case, Answer("ok", out=right)) == []
    problems = checker.check(case, Answer("ok", out=wrong))
    assert any(said in problem for problem in problems), problems


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
