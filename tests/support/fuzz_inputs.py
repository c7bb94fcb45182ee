"""Hostile requests for the served fuzzer (tests/server/test_fuzz_served.py), as hypothesis strategies.

A request is a valid one (a prompt, a small max_tokens, some valid optional fields) with
zero or more fields made bad. Each bad field is recorded with the names an error may give for
it and whether the server must refuse it (`must_fail`: out of range, wrong dtype or shape,
missing, unknown) or may serve it (`either`: huge but legal lists, odd but valid text, hostile
guides that compile or are refused). The runner then checks the answer: output, or an error
naming one of the bad fields.

Targets: `ensemble` and `speculative_loop` streamed over gRPC or Triton's HTTP generate_stream,
`ensemble_unary` over gRPC ModelInfer or HTTP generate, and the OpenAI front end's two routes.
What Triton's own HTTP JSON parser refuses without naming the field (a JSON string where a
number goes, an integer past the tensor's range, a lone surrogate escape) is Triton's, not
ours: the HTTP cases send only what that parser reads, and the wrong dtypes and shapes travel
over gRPC, where Triton names the input. Cancellations travel over HTTP only: the bundled
tritonserver 2.51 can abort on concurrent gRPC client cancellations (server#7368, see
docs/reliability.md).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from hypothesis import strategies as st

import specdec_wire as W

VALID, EITHER, INVALID = "valid", "either", "invalid"
GRPC, HTTP = "grpc", "http"
# (model, transport): every client-facing model over each way in.
TARGETS = (("ensemble", GRPC), ("ensemble", HTTP), ("ensemble_unary", GRPC), ("ensemble_unary", HTTP),
           ("speculative_loop", GRPC), ("speculative_loop", HTTP))
PROMPTS = ("Say hi.", "Name a colour.", "Count to five.", "Write one word.")
GUIDED = "guided_decoding"  # the guide's type and text, made bad together (an error may name either)
SEEDS = frozenset({W.RANDOM_SEED, W.SEED})  # one setting under two names
MIN_TOKENS = frozenset({W.MIN_LENGTH, W.MIN_TOKENS})
INT32_MIN, INT32_MAX, UINT64_MAX = -2**31, 2**31 - 1, 2**64 - 1
NUMPY_OF = {"BYTES": "object", "INT32": "int32", "INT64": "int64", "FP32": "float32", "FP64": "float64",
            "UINT64": "uint64", "BOOL": "bool", "INT8": "int8"}
WIRE_OF = {"TYPE_STRING": "BYTES", "TYPE_INT32": "INT32", "TYPE_FP32": "FP32", "TYPE_UINT64": "UINT64", "TYPE_BOOL": "BOOL"}


@dataclass(frozen=True)
class Limits:
    """What the server under test allows (its settings, its model)."""

    vocab_size: int
    max_tokens_limit: int
    max_seq_len: int
    max_num_draft_tokens: int
    max_guide_bytes: int
    methods: tuple[str, ...]
    openai_models: tuple[str, ...]


@dataclass(frozen=True)
class Bad:
    """One field made bad: the names an error may give for it, and whether it must be refused."""

    names: frozenset[str]
    must_fail: bool
    how: str

    def __repr__(self) -> str:
        return f"{'/'.join(sorted(self.names)) or 'body'}:{self.how}{'!' if self.must_fail else '?'}"


@dataclass(frozen=True)
class Field:
    """One input tensor as sent: its wire dtype, shape (batch dimension first) and flat values
    (str or bytes for BYTES)."""

    wire: str
    shape: tuple[int, ...]
    values: tuple

    def json_value(self, dims: tuple[int, ...]) -> Any:
        values = list(self.values)
        return values[0] if tuple(dims) == (1,) and len(values) == 1 else values


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}...<{len(text)} chars>"


@dataclass(frozen=True)
class TritonCase:
    model: str
    transport: str
    fields: tuple[tuple[str, Field], ...]
    bad: tuple[Bad, ...]
    # HTTP streams: close the connection after this many events, or after this many seconds
    # (before the first token, or while a guide compiles)
    cancel_after: int | None = None
    cancel_at_s: float | None = None

    @property
    def streamed(self) -> bool:
        stream = dict(self.fields).get(W.STREAM)
        return self.model != W.ENSEMBLE_UNARY and stream is not None and stream.values == (True,)

    def __repr__(self) -> str:
        shown = ", ".join(f"{n}={f.wire}{list(f.shape)}:{_short(f.values)}" for n, f in self.fields)
        return f"<{self.model}/{self.transport}{_cancel(self)} bad={list(self.bad)} {shown}>"


@dataclass(frozen=True)
class OpenAICase:
    route: str  # chat/completions | completions
    body: bytes
    stream: bool
    bad: tuple[Bad, ...]
    cancel_after: int | None = None
    cancel_at_s: float | None = None

    def __repr__(self) -> str:
        return f"<openai/{self.route}{_cancel(self)} bad={list(self.bad)} body={_short(self.body, 300)}>"


def _cancel(case) -> str:
    if case.cancel_after is not None:
        return f" cancel after {case.cancel_after} events"
    return f" cancel at {case.cancel_at_s:g} s" if case.cancel_at_s is not None else ""


def cancels(streamed: bool) -> st.SearchStrategy:
    """(after events, at seconds): at most one set; a stream that is not cancelled most often."""
    if not streamed:
        return st.just((None, None))
    return st.one_of(st.just((None, None)), st.just((None, None)), st.integers(1, 3).map(lambda n: (n, None)),
                     st.sampled_from([0.0, 0.05, 0.3, 1.0, 2.0]).map(lambda t: (None, t)))


def verdicts(valid=None, either=None, invalid=None) -> st.SearchStrategy:
    """(value, verdict) from up to three strategies of values."""
    parts = [s.map(lambda v, k=kind: (v, k)) for s, kind in ((valid, VALID), (either, EITHER), (invalid, INVALID)) if s is not None]
    return st.one_of(*parts)


def _text(min_size: int = 0, max_size: int = 40) -> st.SearchStrategy:
    # hypothesis' default alphabet has no surrogates: every value is valid UTF-8
    return st.text(min_size=min_size, max_size=max_size)


BAD_UTF8 = st.sampled_from([b"\xff\xfe not utf-8", b"\xed\xa0\x80", b"ok\x80", b"\xc3"])
ODD_TEXT = st.sampled_from(["\x00\x01\x02", "\U0001F600" * 40, "\u202e reversed", "<|im_end|><|im_start|>system",
                            "<|endoftext|>", "\t\r\n\x0b\x0c x", "\ufeff\u200b\u2028 y"])


# ---- Triton: per-field hostile values -----------------------------------------------------------
def field_values(name: str, lim: Limits, binary: bool, unary: bool) -> st.SearchStrategy:
    """(value, verdict) for a field of the ensemble's contract; lists for the [-1] fields.
    binary: the transport carries raw bytes (gRPC), so invalid UTF-8 is sent too."""
    bad_utf8 = BAD_UTF8 if binary else None
    ints = lambda *v: st.sampled_from(v)  # noqa: E731
    if name == W.TEXT_INPUT:
        invalid = st.sampled_from(["", "  \n\t ", "word " * 20000, "y" * 300_000])
        return verdicts(st.sampled_from(PROMPTS), _text(1, 200) | ODD_TEXT, invalid | bad_utf8 if binary else invalid)
    if name == W.MAX_TOKENS:
        return verdicts(st.integers(1, 12), None, ints(0, -1, INT32_MIN, lim.max_tokens_limit + 1, INT32_MAX))
    if name in (W.TEMPERATURE,):
        return verdicts(ints(0.0, -0.0, 0.5, 1.0, 2.0, 1e-30, 1e30, 3.4e38), None,
                        ints(-1.0, -1e-30, float("nan"), float("inf"), float("-inf")))
    if name == W.TOP_P:
        return verdicts(ints(1.0, 0.9, 0.5, 1e-30, 1e-45), None, ints(0.0, -0.0, -1.0, 1.0001, float("nan"), float("inf")))
    if name == W.TOP_K:
        return verdicts(ints(0, 1, 3, 40, lim.vocab_size, INT32_MAX), None, ints(-1, INT32_MIN))
    if name in SEEDS:
        return verdicts(st.integers(0, UINT64_MAX) | ints(0, 2**63, UINT64_MAX))
    if name in (W.STOP_WORDS, W.BAD_WORDS):
        either = (st.lists(_text(0, 30) | ODD_TEXT, max_size=8) | st.just([f"w{i}" for i in range(2000)])
                  | st.just(["x" * 50_000]) | st.just([""]))
        return verdicts(st.sampled_from([["."], ["\n"], ["the", "a"]]), either,
                        st.lists(bad_utf8, min_size=1, max_size=2) if binary else None)
    if name == W.NUM_DRAFT_TOKENS:
        return verdicts(st.integers(0, lim.max_num_draft_tokens), None,
                        ints(-1, lim.max_num_draft_tokens + 1, INT32_MAX, INT32_MIN))
    if name == W.SPECULATIVE_METHOD:
        unknown = _text(1, 30).filter(lambda s: s not in lim.methods and s != W.METHOD_NONE)
        return verdicts(st.sampled_from((*lim.methods, W.METHOD_NONE)), st.just(""),
                        unknown | bad_utf8 if binary else unknown)
    if name in MIN_TOKENS:
        return verdicts(st.integers(0, 8) | st.just(INT32_MAX), None, ints(-1, INT32_MIN))
    if name in (W.END_ID, W.PAD_ID):
        return verdicts(st.integers(0, lim.vocab_size - 1), None, ints(-1, lim.vocab_size, INT32_MAX, INT32_MIN))
    if name == W.REPETITION_PENALTY:
        return verdicts(ints(1.0, 1.3, 0.5), ints(1e-30, 1e30), ints(0.0, -1.0, float("nan"), float("inf")))
    if name in (W.PRESENCE_PENALTY, W.FREQUENCY_PENALTY):
        return verdicts(ints(0.0, 0.5, -2.0), ints(1e30, -1e30, 3.4e38), ints(float("nan"), float("inf"), float("-inf")))
    if name == W.MIN_P:
        return verdicts(ints(0.0, 0.05, 1.0), None, ints(-0.1, 1.5, float("nan"), float("inf")))
    if name in (W.EMBEDDING_BIAS_WORDS, W.EMBEDDING_BIAS_TOKEN_IDS, W.EMBEDDING_BIAS_WEIGHTS):
        # each alone: words or ids with no weights, or weights with nothing to bias (paired ones
        # are the parser's tests)
        values = {W.EMBEDDING_BIAS_WORDS: st.lists(_text(1, 20), min_size=1, max_size=3),
                  W.EMBEDDING_BIAS_TOKEN_IDS: st.lists(st.integers(0, lim.vocab_size - 1), min_size=1, max_size=3),
                  W.EMBEDDING_BIAS_WEIGHTS: st.lists(st.sampled_from([1.0, -2.5, 100.0]), min_size=1, max_size=3)}[name]
        return verdicts(None, None, values)
    if name == W.TOP_LOGPROBS:
        return verdicts(ints(0, 1, 5, 20), None, ints(-1, 21, INT32_MAX, INT32_MIN))
    if name == W.LOGPROBS_MODE:
        return verdicts(st.sampled_from(["raw_logprobs", "processed_logprobs"]), st.just(""), _text(1, 20).filter(
            lambda s: s not in ("raw_logprobs", "processed_logprobs")))
    if name == W.CACHE_SALT:
        invalid = st.sampled_from(["x" * 257, "s" * 100_000])
        return verdicts(_text(1, 200) | st.just("x" * 256), st.just(""), invalid | bad_utf8 if binary else invalid)
    if name == W.STREAM and unary:
        return verdicts(st.just(False), None, st.just(True))
    if name == W.INPUT_IDS:
        ids = st.integers(0, lim.vocab_size - 1)
        return verdicts(st.lists(ids, min_size=1, max_size=24), None,
                        st.just([]) | st.lists(ids, min_size=lim.max_seq_len, max_size=lim.max_seq_len + 40)
                        | st.lists(ids, min_size=1, max_size=4).flatmap(
                            lambda xs: st.sampled_from([-1, lim.vocab_size, INT32_MAX, INT32_MIN]).map(lambda b: xs + [b])))
    # the flags (stream on a decoupled model, apply_chat_template, return_*, ignore_eos, ...)
    return verdicts(st.booleans())


SMALL_SCHEMA = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}
VALID_GUIDES = (("json", ""), ("json_schema", json.dumps(SMALL_SCHEMA)), ("regex", "[a-z]{1,8}"), ("ebnf_grammar", 'root ::= "yes" | "no"'))
# Stop strings a short answer meets (so some end by one)
COMMON_STOPS = ([" "], ["e", "o"], ["\n"], [","], ["."], ["the", "a"])


def guides(lim: Limits, binary: bool) -> st.SearchStrategy:
    """(guide type, guide, verdict): valid, hostile (huge, deeply nested, slow, invalid)."""
    wide = json.dumps({"type": "object", "properties": {f"f{i}": {"type": "integer"} for i in range(400)}})
    nested = st.integers(2, 400).map(lambda d: '{"type":"object","properties":{"a":' * d + '{"type":"string"}' + "}}" * d)
    huge = json.dumps({"type": "object", "description": "d" * (lim.max_guide_bytes + 10)})
    valid = st.sampled_from(VALID_GUIDES)
    either = (st.sampled_from([("json_schema", wide), ("regex", "(a*)*b"), ("regex", "(x|y){0,200}z"), ("json", "ignored"),
                               ("json_schema", "5"), ("json_schema", '{"type": "nonsense"}'), ("regex", "\\d" * 2000)])
              | nested.map(lambda g: ("json_schema", g)) | _text(1, 40).map(lambda g: ("regex", g)))
    invalid = st.sampled_from([("json_schema", huge), ("json_schema", "{not json"), ("json_schema", "[" * 100_000),
                               ("regex", ""), ("ebnf_grammar", "root ::= "), ("xml", "<a/>"), ("", "orphan guide"),
                               ("regex", "x" * (lim.max_guide_bytes + 1))])
    parts = [verdicts(valid, either, invalid).map(lambda t: (*t[0], t[1]))]
    if binary:
        parts.append(BAD_UTF8.map(lambda b: ("regex", b, INVALID)))
    return st.one_of(*parts)


def _scalar_field(spec: W.TensorSpec, value: Any) -> Field:
    if isinstance(value, list):
        return Field(WIRE_OF[spec.dtype], (1, len(value)), tuple(value))
    return Field(WIRE_OF[spec.dtype], (1, 1), (value,))


OTHER_WIRES = {"BYTES": ("INT32", "FP32"), "INT32": ("INT64", "FP32", "BYTES", "UINT64"), "FP32": ("FP64", "INT32", "BYTES"),
               "UINT64": ("INT64", "INT32", "FP32"), "BOOL": ("INT32", "INT8", "BYTES")}
SAMPLE_OF = {"BYTES": b"7", "INT32": 7, "INT64": 7, "FP32": 0.5, "FP64": 0.5, "UINT64": 7, "BOOL": True, "INT8": 1}


@st.composite
def triton_case(draw, lim: Limits) -> TritonCase:
    model, transport = draw(st.sampled_from(TARGETS))
    specs = W.MODELS[model][0]
    unary, binary = model == W.ENSEMBLE_UNARY, transport == GRPC
    fields: dict[str, Field] = {}
    if model == "speculative_loop" and draw(st.booleans()):
        fields[W.INPUT_IDS] = _scalar_field(specs[W.INPUT_IDS], draw(st.lists(st.integers(0, lim.vocab_size - 1), min_size=1, max_size=24)))
    else:
        fields[W.TEXT_INPUT] = _scalar_field(specs[W.TEXT_INPUT], draw(st.sampled_from(PROMPTS)))
    fields[W.MAX_TOKENS] = _scalar_field(specs[W.MAX_TOKENS], draw(st.integers(1, 12)))
    fields[W.STREAM] = _scalar_field(specs[W.STREAM], False if unary else draw(st.booleans()))
    optional = sorted(n for n in specs if n not in (W.TEXT_INPUT, W.INPUT_IDS, W.MAX_TOKENS, W.STREAM, W.GUIDED_DECODING_GUIDE,
                                                     W.GUIDED_DECODING_GUIDE_TYPE, W.SEED, W.MIN_TOKENS))
    for name in draw(st.lists(st.sampled_from(optional), max_size=4, unique=True)):  # valid extras
        value, verdict = draw(field_values(name, lim, binary, unary))
        if verdict == VALID:
            fields[name] = _scalar_field(specs[name], value)
    shape = draw(st.sampled_from(["plain", "plain", "plain", "guide", "stop"]))  # answers with more to check
    if shape == "guide":  # a valid guide, and room to finish it
        guide_type, guide = draw(st.sampled_from(VALID_GUIDES))
        fields[W.GUIDED_DECODING_GUIDE_TYPE] = _scalar_field(specs[W.GUIDED_DECODING_GUIDE_TYPE], guide_type)
        fields[W.GUIDED_DECODING_GUIDE] = _scalar_field(specs[W.GUIDED_DECODING_GUIDE], guide)
        fields[W.MAX_TOKENS] = _scalar_field(specs[W.MAX_TOKENS], draw(st.integers(4, 20)))
    elif shape == "stop":
        fields[W.STOP_WORDS] = _scalar_field(specs[W.STOP_WORDS], list(draw(st.sampled_from(COMMON_STOPS))))
    bad, taken = [], set()  # a field is made bad once (a second change could undo the first)
    kinds = ["value"] * 6 + ["guide"] + (["dtype", "shape", "missing", "unknown"] if binary else ["missing", "unknown"])
    for _ in range(draw(st.sampled_from([0, 1, 1, 1, 1, 2, 3]))):
        bad.append(draw(_mutation(draw(st.sampled_from(kinds)), model, specs, fields, taken, lim, binary, unary)))
    after, at = draw(cancels(transport == HTTP and not unary and fields.get(W.STREAM, Field("", (), ())).values == (True,)))
    return TritonCase(model, transport, tuple(fields.items()), tuple(b for b in bad if b is not None), after, at)


@st.composite
def _mutation(draw, kind: str, model: str, specs, fields: dict[str, Field], taken: set[str], lim: Limits, binary: bool,
              unary: bool) -> Bad | None:
    """Make one field not in `taken` bad, in place; the Bad it records (None: nothing was changed)."""
    guide = {W.GUIDED_DECODING_GUIDE_TYPE, W.GUIDED_DECODING_GUIDE}
    if kind == "guide":
        if taken & guide:
            return None
        taken |= guide
        guide_type, guide, verdict = draw(guides(lim, binary))
        fields[W.GUIDED_DECODING_GUIDE_TYPE] = _scalar_field(specs[W.GUIDED_DECODING_GUIDE_TYPE], guide_type)
        fields[W.GUIDED_DECODING_GUIDE] = _scalar_field(specs[W.GUIDED_DECODING_GUIDE], guide)
        return Bad(frozenset({W.GUIDED_DECODING_GUIDE_TYPE, W.GUIDED_DECODING_GUIDE}), verdict == INVALID, f"guide {guide_type!r}")
    if kind == "unknown":
        name = draw(st.from_regex(r"\A[a-z_]{1,24}\Z").filter(lambda n: n not in specs))
        fields[name] = Field("INT32", (1, 1), (1,))
        taken.add(name)
        return Bad(frozenset({name}), binary, "unknown")  # Triton's HTTP generate takes unknown keys as parameters
    if kind == "missing":
        if model == "speculative_loop":  # either prompt input may carry it: both gone
            if taken & {W.TEXT_INPUT, W.INPUT_IDS}:
                return None
            taken |= {W.TEXT_INPUT, W.INPUT_IDS}
            removed = [n for n in (W.TEXT_INPUT, W.INPUT_IDS) if fields.pop(n, None) is not None]
            return Bad(frozenset({W.TEXT_INPUT, W.INPUT_IDS}), True, "missing") if removed else None
        required = [n for n, s in specs.items() if not s.optional and n not in taken]
        if not required:
            return None
        name = draw(st.sampled_from(required))
        taken.add(name)
        fields.pop(name, None)
        return Bad(frozenset({name}), True, "missing")
    names = sorted(n for n in specs if n not in guide | taken)
    if model == "speculative_loop" and W.INPUT_IDS not in fields and W.INPUT_IDS in names:
        names.remove(W.INPUT_IDS)  # beside a text prompt it is ignored
    if not names:
        return None
    name = draw(st.sampled_from(names))
    taken.add(name)
    spec = specs[name]
    also = SEEDS if name in SEEDS else MIN_TOKENS if name in MIN_TOKENS else frozenset()
    if kind == "dtype":
        wire = draw(st.sampled_from(OTHER_WIRES[WIRE_OF[spec.dtype]]))
        fields[name] = Field(wire, (1, 1), (SAMPLE_OF[wire],))
        return Bad(frozenset({name}), True, f"dtype {wire}")
    if kind == "shape":
        old = fields.get(name) or _scalar_field(spec, SAMPLE_OF[WIRE_OF[spec.dtype]] if spec.dtype != "TYPE_STRING" else "x")
        shapes = [(1, 1, 1)] + ([(1, 2), (1, 0)] if spec.dims == (1,) else [])
        shape = draw(st.sampled_from(shapes))
        count = 1
        for d in shape:
            count *= d
        fields[name] = Field(old.wire, shape, (old.values * count)[:count] if old.values else (SAMPLE_OF[old.wire],) * count)
        return Bad(frozenset({name}) | also, True, f"shape {list(shape)}")
    value, verdict = draw(field_values(name, lim, binary, unary))
    fields[name] = _scalar_field(spec, value)
    return Bad(frozenset({name}) | also, verdict == INVALID, f"value {_short(value, 30)}")


# ---- the OpenAI front end ---------------------------------------------------------------------
def openai_values(param: str, lim: Limits, chat: bool) -> st.SearchStrategy:
    """(value, verdict) for a parameter of an OpenAI request body."""
    ints = lambda *v: st.sampled_from(v)  # noqa: E731
    nan, inf = float("nan"), float("inf")
    if param == "model":
        return verdicts(st.sampled_from(lim.openai_models), None, ints("gpt-4o", "", 5, None, ["x"]))
    if param == "messages":
        msg = lambda c, r="user": [{"role": r, "content": c}]  # noqa: E731
        return verdicts(st.sampled_from(PROMPTS).map(msg), (_text(1, 200) | ODD_TEXT).map(msg),
                        st.sampled_from([[], "hi", [{"role": "robot", "content": "x"}], msg(5), msg([{"type": "image_url"}]),
                                         msg("\ud800 lone surrogate"), msg("word " * 20000), [None], msg(None)]))
    if param == "prompt":
        return verdicts(st.sampled_from(PROMPTS), _text(1, 200) | ODD_TEXT,
                        ints("", "   ", [], ["a", "b"], 5, None, "\udfff", "word " * 20000, {"text": "x"}))
    if param in ("max_tokens", "max_completion_tokens"):
        return verdicts(st.integers(1, 12), None,
                        ints(0, -1, lim.max_tokens_limit + 1, 2**32 + 4, 2**40, 1.5, "8", True, nan, inf, [8]))
    if param == "temperature":
        return verdicts(ints(0, 0.7, 1, 2.0), None, ints(-1, nan, inf, 10**400, "hot", [1]))
    if param == "top_p":
        return verdicts(ints(1, 0.9, 0.5), None, ints(0, 1.5, -1, nan, "x"))
    if param == "seed":
        return verdicts(st.integers(0, UINT64_MAX), None, ints(-1, 2**64, 2**70, 1.5, "x"))
    if param == "stop":
        return verdicts(st.sampled_from(["\n", ["a", "b"], None, []]), st.just(["\udfff"]),
                        ints(["a"] * 5, [""], "", [1], [f"s{i}" for i in range(2000)], {"a": 1}))
    if param == "speculative_method":
        return verdicts(st.sampled_from((*lim.methods, W.METHOD_NONE)), st.just(""),
                        _text(1, 20).filter(lambda s: s not in lim.methods and s != W.METHOD_NONE) | ints(5, ["x"]))
    if param == "num_draft_tokens":
        return verdicts(st.integers(0, lim.max_num_draft_tokens), None, ints(-1, lim.max_num_draft_tokens + 1, 2**32 + 2, 1.5, "3"))
    if param in ("presence_penalty", "frequency_penalty"):
        return verdicts(ints(0, 1, -2, 0.5), None, ints(nan, inf, "x"))
    if param == "repetition_penalty":
        return verdicts(ints(1, 1.2), None, ints(0, -1, nan, inf))
    if param == "min_tokens":
        return verdicts(st.integers(0, 8), None, ints(-1, 1.5, 2**40, "2"))
    if param == "response_format":
        deep = st.integers(2, 300).map(lambda d: json.loads('{"type":"object","properties":{"a":' * d + '{"type":"string"}' + "}}" * d))
        schema = lambda s: {"type": "json_schema", "json_schema": {"name": "x", "schema": s}}  # noqa: E731
        return verdicts(st.sampled_from([{"type": "text"}, {"type": "json_object"}, schema({"type": "object"})]),
                        deep.map(schema),
                        ints({"type": "xml"}, "json", {"type": "json_schema", "json_schema": {"schema": 5}},
                             schema({"type": "object", "description": "d" * (lim.max_guide_bytes + 10)})))
    if param == "cache_salt":
        return verdicts(_text(1, 100) | st.just("x" * 256), None, ints("", 5, "x" * 257))
    if param == "n":
        return verdicts(st.integers(1, 3), None, ints(0, 17, "1", 1.5))
    if param == "best_of":
        return verdicts(st.just(1), None, ints(2, 0, "1"))
    if param == "echo":
        return verdicts(st.just(False), None, st.just(True))
    if param == "logprobs":  # chat: a boolean; completions: how many alternatives
        return verdicts(st.booleans(), None, ints("yes", 5)) if chat else verdicts(st.integers(0, 5), None, ints(21, -1, "x", True))
    if param == "top_logprobs":  # chat: needs logprobs: true (so 3 alone is either); completions ignore it
        return verdicts(st.just(0), st.just(3), ints(21, -1, "x")) if chat else verdicts(ints(0, 3))
    if param == "logprobs_mode":
        return verdicts(ints("raw_logprobs", "processed_logprobs"), None, ints("raw_logits", 5))
    if param == "tools":
        bad = ints("x", [{"type": "function"}], [{"type": "function", "function": {"name": "f", "parameters": 5}}])
        return verdicts(st.just(list(TOOLS)), None, bad) if chat else verdicts(None, None, st.just(list(TOOLS)) | bad)
    if param == "parallel_tool_calls":  # read only beside tools: a wrong type alone is ignored
        return verdicts(st.booleans(), ints("yes", 5))
    if param == "tool_choice":  # without tools (drawn beside them, these stay wrong)
        bad = ints("sometimes", 5, {"type": "function", "function": {"name": "no_such_tool"}})
        return verdicts(st.just("none"), None, bad) if chat else verdicts(None, None, bad | st.just("required"))
    if param == "logit_bias":
        return verdicts(st.sampled_from([None, {"1": 5}, {"5": -100, "7": 2.5}]), None,
                        ints({"x": 1}, {"1": 101}, {str(lim.vocab_size): 1}, [1], {"1": "up"}))
    if param == "min_p":
        return verdicts(ints(0.0, 0.05, 1.0), None, ints(-0.1, 1.5, "x"))
    if param == "stream_options":
        return verdicts(st.just({"include_usage": True}), None, ints("x", 5, [1]))
    return verdicts(st.booleans())  # ignore_eos, and unknown keys (ignored)


# The tools a chat request may offer (their calls are checked against these parameter schemas).
TOOLS = ({"type": "function", "function": {"name": "get_weather", "parameters": {
             "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]}}},
         {"type": "function", "function": {"name": "add", "parameters": {
             "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}})
# A forced call (tool_choice required or named) is ~35 tokens: room for it to end by its grammar.
FORCED_CALL_MAX_TOKENS = 48


def forced_tool_call(body: dict[str, Any]) -> bool:
    """Whether a chat body's answer is forced to be a call by its grammar: the offered tools, and
    tool_choice "required" or one of them named."""
    choice = body.get("tool_choice")
    named = isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict) \
        and choice["function"].get("name") in {t["function"]["name"] for t in TOOLS}
    return body.get("tools") == list(TOOLS) and (choice == "required" or named)


OPENAI_PARAMS = ("model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "seed", "stop", "speculative_method",
                 "num_draft_tokens", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens", "response_format",
                 "cache_salt", "n", "best_of", "logprobs", "echo", "logit_bias", "min_p", "stream_options", "ignore_eos",
                 "top_logprobs", "logprobs_mode", "tools", "tool_choice", "parallel_tool_calls")
# the parameter an error may name for each (the server's field, as the front end maps it back)
OPENAI_ALIASES = {"max_tokens": {"max_completion_tokens"}, "max_completion_tokens": {"max_tokens"},
                  "messages": {"prompt"}, "prompt": {"messages"}}


def _int_in(value: Any, low: int, high: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


@st.composite
def openai_case(draw, lim: Limits) -> OpenAICase:
    chat = draw(st.booleans())
    stream = draw(st.booleans())
    body: dict[str, Any] = {"model": draw(st.sampled_from(lim.openai_models)), "max_tokens": draw(st.integers(1, 12)),
                            "stream": stream, "temperature": 0}
    prompt_param = "messages" if chat else "prompt"
    prompt = draw(st.sampled_from(PROMPTS))
    body[prompt_param] = [{"role": "user", "content": prompt}] if chat else prompt
    for param in draw(st.lists(st.sampled_from(OPENAI_PARAMS), max_size=3, unique=True)):
        value, verdict = draw(openai_values(param, lim, chat))
        if verdict == VALID and value is not None:
            body[param] = value
    if body.get("max_completion_tokens") is not None:
        body["max_completion_tokens"] = min(body["max_completion_tokens"], 12)
    shape = draw(st.sampled_from(["plain", "plain", "plain", "stop", "format"] + (["tools"] if chat else [])))
    if shape == "stop":  # answers with more to check
        body["stop"] = draw(st.sampled_from([" ", "\n", ".", ["e", "o"]]))
    elif shape == "format":  # a valid response_format, and room to finish it
        body["response_format"] = draw(st.sampled_from([{"type": "json_object"}, {"type": "json_schema", "json_schema": {
            "name": "a", "schema": SMALL_SCHEMA}}]))
        body["max_tokens"] = draw(st.integers(4, 20))
    elif shape == "tools":
        body["tools"] = list(TOOLS)
    if chat and body.get("tools") == list(TOOLS) and "tool_choice" not in body:  # how the offered tools are used
        choice = draw(st.sampled_from([None, "auto", "required", "get_weather", "add"]))
        if choice is not None:
            body["tool_choice"] = choice if choice in ("auto", "required") else {"type": "function", "function": {"name": choice}}
        if forced_tool_call(body):  # room for the whole call, and no response_format beside it (refused)
            body["max_tokens"] = FORCED_CALL_MAX_TOKENS
            body.pop("max_completion_tokens", None)
            body.pop("response_format", None)
    made_bad = {}  # each parameter made bad once (a second draw would undo the first)
    for param in draw(st.lists(st.sampled_from((prompt_param, *OPENAI_PARAMS)), max_size=draw(st.sampled_from([0, 1, 1, 1, 2])),
                               unique=True)):
        value, verdict = draw(openai_values(param, lim, chat))
        body[param] = value
        made_bad[param] = (value, verdict)
    bad = []
    for param, (value, verdict) in made_bad.items():  # judged on the final body
        must_fail = verdict == INVALID
        names = frozenset({param}) | OPENAI_ALIASES.get(param, set())
        if param == "max_tokens" and body.get("max_completion_tokens") is not None and _int_in(value, 1, 2**31 - 1):
            must_fail = False  # a count past the server's limit, but max_completion_tokens is the one used
        if param == "response_format" and chat and forced_tool_call(body):  # two grammars for one answer
            names |= {"tool_choice"}
            must_fail = must_fail or not (isinstance(value, dict) and value.get("type") == "text")
        bad.append(Bad(names, must_fail, f"value {_short(value, 30)}"))
    raw = json.dumps(body).encode()  # NaN and Infinity as Python writes them (which the front end reads)
    if draw(st.integers(0, 12)) == 0:  # a body that is not a request at all
        raw = draw(st.sampled_from([b"{not json", b"[1, 2]", b'"text"', b"null", b"", b"\xff\xfe", b'{"a":' * 50_000,
                                    b"[" * 100_000]))
        bad = [Bad(frozenset(), True, "body")]
    after, at = draw(cancels(stream))
    return OpenAICase("chat/completions" if chat else "completions", raw, stream, tuple(bad), after, at)


def waves(lim: Limits, max_size: int) -> st.SearchStrategy:
    """A few requests sent at once."""
    one = st.one_of(triton_case(lim), triton_case(lim), openai_case(lim))
    return st.lists(one, min_size=1, max_size=max_size)
