"""The models' internal contract: what the relays in front send the verifier (hosted in the
`ensemble` model, ENGINE_HOST) and what the verifier sends the `drafter`, and what they
answer. Not a public API (the public tensors are specdec_wire's); the tests check the
drafter's config.pbtxt against MODELS here, and the ensemble's against its public contract
plus ENGINE_WIRE."""
from __future__ import annotations

import dataclasses
import json
from typing import Callable

import numpy as np

import specdec_wire as W
from specdec.config import SamplingParams
from specdec.errors import InvalidRequestError
from specdec.triton_models.keys import INTERNAL_KEY, INTERNAL_KEY_ENV  # noqa: F401 - part of the contract

# The draft budget, one name everywhere: at the verifier's START, the request's most per
# step; to the drafter, how many it may draft now (the verifier's decision, STEP_STATS).
NUM_DRAFT_TOKENS = W.NUM_DRAFT_TOKENS
NUM_ACCEPTED = "num_accepted"
DRAFT_TOKENS = "draft_tokens"
DRAFT_PARENTS = "draft_parents"
DRAFT_PROBS = "draft_probs"
HIDDEN_STATES = "hidden_states"
RETURN_HIDDEN = "return_hidden"
# A generation handed to the verifier: the request's SamplingParams as the loop validated them
# (validate_request: token-level rules resolved, end_ids set) as JSON, beside input_ids,
# speculative_method and num_draft_tokens; the correlation id names the sequence. The verifier
# trusts them (only the loop holds the internal key) and reads only the wire's form.
GENERATION = "generation"
# A request to the verifier that ends the sequence of its correlation id (a client that
# cancelled or went away); answered at once, the sequence's own stream ends `cancelled`.
STOP = "stop"
# Whether the loop wants a response per round (a streamed request) or ONE final response
# with every round in it (each round's numbers a row of STEP_STATS, its token count in
# ROUND_TOKENS). One response is also what keeps a short non-streamed generation clear of a
# lost response: rounds of a tiny model a millisecond apart once left a request hanging.
ROUNDS = "rounds"
ROUND_TOKENS = "round_tokens"
# A sequence that ends with an error after its stream has carried rounds (a round that failed,
# a guide that reached a dead end) ends with a normal final response whose FINISH_REASON is
# this prefix and the error's message; the loop raises it. The bundled python_backend (late
# 2024) loses an error response sent on a decoupled stream after other responses: the caller's
# iterator never sees it, and the client waited forever.
FINISH_ERROR_PREFIX = "error: "
STEP_STATS = "step_stats"  # one FP32 row of RoundStats per round


@dataclasses.dataclass(frozen=True)
class RoundStats:
    """The verifier's numbers for one round of one sequence, made once (the verifier) and
    read once (the loop); on the wire one FP32 row of STEP_STATS, in field order."""

    verified: bool = False  # False for the prompt's first token
    accepted: int = 0
    draft_depth: int = 0
    draft_tokens: int = 0
    verify_seconds: float = 0.0
    draft_seconds: float = 0.0
    num_draft_tokens: int = 0  # the next tree's budget
    batch_sequences: int = 0  # sequences that shared the round's target forward
    forced_accepted: int = 0  # of accepted, the tokens the request's grammar forced
    cached_tokens: int = 0  # the prompt's tokens whose KV came from the prefix cache (first token's row)

    def to_row(self) -> list[float]:
        return [float(getattr(self, name)) for name in STEP_STATS_FIELDS]

    @classmethod
    def from_row(cls, row) -> "RoundStats":
        return cls(**{f.name: type(f.default)(value) for f, value in zip(dataclasses.fields(cls), row)})


STEP_STATS_FIELDS = tuple(f.name for f in dataclasses.fields(RoundStats))

# Sequence-batcher control inputs of the stateful drafter and verifier.
CONTROL_START = "START"
CONTROL_END = "END"
CONTROL_CORRID = "CORRID"

# Sampling settings as the loop sends them to the drafter (encode_sampling); the verifier
# takes the whole SamplingParams at once (GENERATION).
SAMPLING_INPUTS = ((W.MAX_TOKENS, "TYPE_INT32", (1,), True), *W.SAMPLING_INPUTS, (W.CACHE_SALT, "TYPE_STRING", (1,), True))

# The model that hosts the verifier (the engine and its scheduler: verifier_model.py) beside its
# own public contract: the one a client talks to, so a streamed token crosses one Python stub.
# The other served names (speculative_loop, ensemble_unary) relay to it through ENGINE_WIRE.
ENGINE_HOST = W.ENGINE_HOST_MODEL
# specdec.json's threads entry for the engine's forwards (the host's own entry is its main
# thread's, which runs no forward).
VERIFIER_THREADS = "verifier"

# The verifier's wire (decoupled): one request per sequence, answered round by round (ids,
# text, stats) until the final response; or a STOP for a live sequence. Its tensors share the
# host's config.pbtxt, so a name the public contract has too keeps the public shape.
ENGINE_WIRE: tuple[dict[str, W.TensorSpec], dict[str, W.TensorSpec]] = (
    W.tensor_specs(
        (W.INPUT_IDS, "TYPE_INT32", (-1,), True),
        (W.SPECULATIVE_METHOD, "TYPE_STRING", (1,), True),
        (NUM_DRAFT_TOKENS, "TYPE_INT32", (1,), True),
        (GENERATION, "TYPE_STRING", (1,), True),
        (STOP, "TYPE_BOOL", (1,), True),
        (ROUNDS, "TYPE_BOOL", (1,), True),
        (INTERNAL_KEY, "TYPE_STRING", (1,), True),
        (W.PROMOTE_HEADS, "TYPE_STRING", (1,), True),  # an admin's head promotion (verifier_model.Verifier.promote)
        (W.ADMIN_KEY, "TYPE_STRING", (1,), True),
    ),
    W.tensor_specs((W.OUTPUT_IDS, "TYPE_INT32", (-1,)), (W.TEXT_OUTPUT, "TYPE_STRING", (1,)),
                   (W.FINISH_REASON, "TYPE_STRING", (1,)), (STEP_STATS, "TYPE_FP32", (-1, len(STEP_STATS_FIELDS))),
                   (ROUND_TOKENS, "TYPE_INT32", (-1,)), (W.OUTPUT_LOG_PROBS, "TYPE_FP32", (-1, -1)),
                   (W.TOP_LOG_PROB_IDS, "TYPE_INT32", (-1, -1, -1)), (W.TOP_LOG_PROBS, "TYPE_FP32", (-1, -1, -1))),
)


def served_tensors(model: str, public: dict) -> tuple[dict[str, W.TensorSpec], dict[str, W.TensorSpec]]:
    """What `model`'s config.pbtxt declares: its public contract (public: specdec_wire.MODELS),
    plus the wire on the engine's host; the internal models' from MODELS."""
    if model in MODELS:
        return MODELS[model]
    inputs, outputs = public[model]
    if model != ENGINE_HOST:
        return inputs, outputs
    wire_in, wire_out = ENGINE_WIRE
    return {**wire_in, **inputs}, {**outputs, **wire_out}


# internal model name -> (inputs, outputs), as specdec_wire.MODELS.
MODELS: dict[str, tuple[dict[str, W.TensorSpec], dict[str, W.TensorSpec]]] = {
    "drafter": (
        W.tensor_specs(
            (W.INPUT_IDS, "TYPE_INT32", (-1,), True),
            (NUM_ACCEPTED, "TYPE_INT32", (1,), True),
            (HIDDEN_STATES, "TYPE_FP32", (-1, -1), True),
            (NUM_DRAFT_TOKENS, "TYPE_INT32", (1,), True),
            (W.SPECULATIVE_METHOD, "TYPE_STRING", (1,), True),
            (INTERNAL_KEY, "TYPE_STRING", (1,), True),
            *SAMPLING_INPUTS,
        ),
        W.tensor_specs((DRAFT_TOKENS, "TYPE_INT32", (-1,)), (DRAFT_PARENTS, "TYPE_INT32", (-1,)), (DRAFT_PROBS, "TYPE_FP32", (-1, -1))),
    ),
}


# ---- sampling settings on the wire between the models: encoded once, decoded once ----------
def encode_sampling(params: SamplingParams) -> dict[str, np.ndarray]:
    """What the drafter needs of a request's sampling settings (max_tokens bounds drafting;
    the logits rules are the verifier's alone)."""
    out = {
        W.MAX_TOKENS: np.int32([params.max_tokens]), W.TEMPERATURE: np.float32([params.temperature]),
        W.TOP_K: np.int32([params.top_k]), W.TOP_P: np.float32([params.top_p]),
    }
    if params.seed is not None:
        out[W.RANDOM_SEED] = np.uint64([params.seed])
    if params.cache_salt is not None:
        out[W.CACHE_SALT] = np.array([params.cache_salt.encode()], dtype=np.object_)
    return out


def decode_sampling(read: Callable[[str], np.ndarray | None]) -> SamplingParams:
    """The inverse of encode_sampling; `read(name)` returns the tensor or None."""
    def one(name: str, default, cast):
        value = read(name)
        return default if value is None else cast(value.reshape(-1)[0])

    return SamplingParams(
        max_tokens=one(W.MAX_TOKENS, 1, int), temperature=one(W.TEMPERATURE, 0.0, float), top_k=one(W.TOP_K, 0, int),
        top_p=one(W.TOP_P, 1.0, float), seed=one(W.RANDOM_SEED, None, int),
        cache_salt=one(W.CACHE_SALT, None, lambda v: v.decode() if isinstance(v, bytes) else str(v)),
    )


# ---- a generation on the wire to the verifier: the parsed SamplingParams, once -------------
def encode_generation(params: SamplingParams) -> np.ndarray:
    return np.array([json.dumps(dataclasses.asdict(params)).encode()], dtype=np.object_)


def decode_generation(value: np.ndarray | None) -> SamplingParams:
    if value is None or value.size != 1:
        raise InvalidRequestError(GENERATION, "a generation needs its sampling settings (one JSON string)")
    raw = value.reshape(-1)[0]
    try:
        fields = json.loads(raw.decode() if isinstance(raw, bytes) else str(raw))
        tuples = {"stop", "bad_words", "end_ids"}
        fields = {k: tuple(v) if k in tuples else v for k, v in fields.items()}
        fields["bad_word_ids"] = tuple(tuple(word) for word in fields.get("bad_word_ids", ()))
        fields["logit_bias"] = tuple((int(token), float(bias)) for token, bias in fields.get("logit_bias", ()))
        fields["bias_words"] = tuple((str(word), float(bias)) for word, bias in fields.get("bias_words", ()))
        return SamplingParams(**fields)
    except (ValueError, TypeError, UnicodeDecodeError) as exc:
        raise InvalidRequestError(GENERATION, f"unreadable sampling settings: {exc}") from None
