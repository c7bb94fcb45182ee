"""What a generation request asks for, decided in one place: validate_request holds every
check a request gets, and every entry point calls it once per request (the Triton loop and
the TensorRT-LLM variant through parse_request, the in-process engine through
SpecEngine.prepare_request). The verifier behind the loop trusts what the loop validated, as
vLLM's engine core trusts its front end's requests: only a caller holding the server's
internal key reaches it."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import numpy as np

import specdec_wire as P
from specdec.config import DEFAULT_MAX_GUIDE_BYTES, LOGPROBS_PROCESSED, METHOD_NONE, SamplingParams, ServingConfig
from specdec.errors import InvalidRequestError
from specdec.engine.sequences import check_prompt_ids, check_token_ids


@dataclass(frozen=True)
class TokenRules:
    """What a server that applies a request's token-level rules itself knows of its model's
    tokens (ours does; TensorRT-LLM's LLM API applies its own)."""

    vocab_size: int
    eos_ids: frozenset[int]
    tokenize_word: Callable[[str], list[int]] | None  # None: an engine built without a tokenizer


def resolve_token_rules(params: SamplingParams, tokens: TokenRules) -> SamplingParams:
    """The request's rules at token level (the engine's logits rules see ids, not text): the
    ids that end the sequence (end_id, else the model's EOS ids) and each bad word's token
    ids (as TensorRT-LLM's preprocessing encodes them: the word alone, no special tokens)."""
    for name in (P.END_ID, P.PAD_ID):
        value = getattr(params, name)
        if value is not None:
            check_token_ids(name, [value], tokens.vocab_size)
    if params.logit_bias:
        check_token_ids(P.EMBEDDING_BIAS_TOKEN_IDS, [token for token, _ in params.logit_bias], tokens.vocab_size)
    bias = list(params.logit_bias)
    if params.bias_words:  # TensorRT-LLM's preprocessing: every token of a word gets its weight
        if tokens.tokenize_word is None:
            raise InvalidRequestError(P.EMBEDDING_BIAS_WORDS, "needs a tokenizer, and this engine was built without one")
        bias += [(token, weight) for word, weight in params.bias_words for token in tokens.tokenize_word(word)]
    # Token-level rules given directly (in-process callers) stand; text ones are resolved.
    end_ids = frozenset([params.end_id]) if params.end_id is not None else frozenset(params.end_ids) or tokens.eos_ids
    words = list(params.bad_word_ids)
    if params.stop and tokens.tokenize_word is None:
        raise InvalidRequestError(P.STOP_WORDS, "needs a tokenizer, and this engine was built without one")
    if params.bad_words:
        if tokens.tokenize_word is None:
            raise InvalidRequestError(P.BAD_WORDS, "needs a tokenizer, and this engine was built without one")
        words += [tuple(tokens.tokenize_word(word)) for word in params.bad_words]
        if not all(words):
            raise InvalidRequestError(P.BAD_WORDS, "a bad word encodes to no tokens")
    return dataclasses.replace(params, end_ids=tuple(sorted(end_ids)), bad_word_ids=tuple(words), logit_bias=tuple(bias), bias_words=())


# ---- the request parser: every entry point (the Triton loop, the in-process CLI, the
# TensorRT-LLM variant's model) reads a request's tensors through this one function ----------
@dataclass(frozen=True)
class ServedOffer:
    """What a server offers a request: its methods (name -> default draft tokens per step)
    and its limits. fixed: the method and budget were chosen at start (TensorRT-LLM)."""

    methods: Mapping[str, int]
    default_method: str
    max_num_draft_tokens: int
    max_tokens_limit: int
    apply_chat_template: bool = True
    max_guide_bytes: int = DEFAULT_MAX_GUIDE_BYTES
    fixed: bool = False
    # The context a prompt's tokens must fit (None: the engine behind checks, TensorRT-LLM's).
    max_seq_len: int | None = None
    # The model's tokens, where this server applies token-level rules itself (None: the
    # engine behind applies them, TensorRT-LLM's).
    tokens: TokenRules | None = None


@dataclass(frozen=True)
class ParsedRequest:
    """A request as the server understands it, after the one parser (names: the ensemble's)."""

    prompt: str | None  # text_input (None when input_ids came from preprocessing)
    prompt_ids: tuple[int, ...] | None  # input_ids as sent, or text_input tokenized (None: left to the engine behind)
    apply_chat_template: bool
    params: SamplingParams
    method: str  # METHOD_NONE when num_draft_tokens is 0: the matched baseline
    num_draft_tokens: int
    stream: bool = False
    return_perf_metrics: bool = False
    # TensorRT-LLM's, with its default: absent or False puts the prompt before the generated
    # text (and ids) of a non-streamed response; True returns only what was generated.
    # Streamed responses never repeat the prompt (TensorRT-LLM's streaming neither).
    exclude_input_in_output: bool = False
    return_num_input_tokens: bool = False
    return_num_output_tokens: bool = False


def served_offer(settings: ServingConfig, tokens: TokenRules | None = None) -> ServedOffer:
    """What our model repository's settings offer a request."""
    return ServedOffer(
        methods={name: settings.default_draft_tokens(name) for name in settings.methods},
        default_method=settings.default_method, max_num_draft_tokens=settings.engine.max_num_draft_tokens,
        max_tokens_limit=settings.engine.max_tokens_limit, apply_chat_template=settings.apply_chat_template,
        max_guide_bytes=settings.engine.max_guide_bytes, max_seq_len=settings.engine.max_seq_len, tokens=tokens,
    )


def validate_request(prompt_ids: Sequence[int] | None, params: SamplingParams, method: str | None,
                     num_draft_tokens: int | None, offer: ServedOffer,
                     prompt_field: str = P.TEXT_INPUT) -> tuple[SamplingParams, str, int]:
    """Every check a request gets, in one place; a bad field raises InvalidRequestError
    naming it. prompt_ids: the prompt's tokens (None: text the engine behind tokenizes);
    prompt_field: the input they came in. Returns (params with the token-level rules
    resolved where this server applies them, method, draft tokens per step)."""
    if prompt_ids is not None:
        check_prompt_ids(prompt_ids, offer.max_seq_len or math.inf,
                         None if offer.tokens is None else offer.tokens.vocab_size, name=prompt_field)
    params = params.validate(offer.max_tokens_limit, offer.max_guide_bytes)
    if offer.tokens is not None:
        params = resolve_token_rules(params, offer.tokens)
    return (params, *resolve_method(method, num_draft_tokens, offer))


def _values(inputs: Mapping[str, Any], name: str) -> list[Any] | None:
    value = inputs.get(name)
    if value is None:
        return None
    flat = np.asarray(value, dtype=object).reshape(-1).tolist()
    try:
        return [v.decode("utf-8") if isinstance(v, bytes) else v for v in flat]
    except UnicodeDecodeError as exc:
        raise InvalidRequestError(name, f"is not valid UTF-8 ({exc.reason} at byte {exc.start})") from None


def _scalar(inputs: Mapping[str, Any], name: str, default: Any, cast: Callable = lambda v: v) -> Any:
    values = _values(inputs, name)
    if values is None:
        return default
    if len(values) != 1:
        raise InvalidRequestError(name, f"expected one value, got {len(values)}")
    try:
        return cast(values[0])
    except (TypeError, ValueError) as exc:
        raise InvalidRequestError(name, f"cannot read {values[0]!r}: {exc}") from exc


def _words(inputs: Mapping[str, Any], name: str) -> tuple[str, ...]:
    """stop_words / bad_words: TensorRT-LLM clients send [""] for none, so empty ones are dropped."""
    return tuple(w for w in _values(inputs, name) or () if w)


def resolve_method(method: str | None, num_draft_tokens: int | None, offer: ServedOffer) -> tuple[str, int]:
    """(method, draft tokens per step): no method = the server's default; no budget = the
    method's configured one; 0 (or method none) = the matched baseline."""
    method = method or offer.default_method
    if offer.fixed and method != offer.default_method:
        raise InvalidRequestError(
            P.SPECULATIVE_METHOD, f"this server runs {offer.default_method!r} (chosen at start); got {method!r}")
    if method != METHOD_NONE and method not in offer.methods:
        known = ", ".join([METHOD_NONE, *offer.methods])
        raise InvalidRequestError(P.SPECULATIVE_METHOD, f"unknown method {method!r}; this server offers: {known}")
    default = 0 if method == METHOD_NONE else offer.methods[method]
    k = default if num_draft_tokens is None else num_draft_tokens
    if offer.fixed and k != default:
        raise InvalidRequestError(
            P.NUM_DRAFT_TOKENS, f"this server drafts a fixed {default} tokens per step ({method}, chosen at start); got {k}")
    limit = offer.max_num_draft_tokens
    if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= limit:
        raise InvalidRequestError(P.NUM_DRAFT_TOKENS, f"must be an integer in [0, {limit}], got {k!r}")
    if method == METHOD_NONE or k == 0:
        return METHOD_NONE, 0
    return method, k


def parse_prompt(inputs: Mapping[str, Any], chat_default: bool) -> tuple[str | None, tuple[int, ...] | None, bool]:
    """(text_input, input_ids, apply_chat_template): text, or token ids from preprocessing
    (their length and range are validate_request's)."""
    prompt = _scalar(inputs, P.TEXT_INPUT, None, str)
    ids = inputs.get(P.INPUT_IDS)
    prompt_ids = None if prompt is not None or ids is None else tuple(int(t) for t in np.asarray(ids).reshape(-1))
    if prompt_ids is None and not (prompt or "").strip():
        raise InvalidRequestError(P.TEXT_INPUT, "the prompt is empty")
    return prompt, prompt_ids, _scalar(inputs, P.APPLY_CHAT_TEMPLATE, chat_default, bool)


def parse_request(inputs: Mapping[str, Any], offer: ServedOffer,
                  encode: Callable[[str, bool], Sequence[int]] | None = None) -> ParsedRequest:
    """The ensemble's inputs (name -> array, absent = None) -> a validated request; a bad
    field raises InvalidRequestError naming it. encode(text, apply_chat_template): the
    prompt's tokens, where this server tokenizes (None: a text prompt goes on as text)."""
    prompt, prompt_ids, chat = parse_prompt(inputs, offer.apply_chat_template)
    prompt_field = P.INPUT_IDS if prompt_ids is not None else P.TEXT_INPUT
    if prompt_ids is None and encode is not None:
        prompt_ids = tuple(encode(prompt, chat))
    max_tokens = _scalar(inputs, P.MAX_TOKENS, None, int)
    if max_tokens is None:
        raise InvalidRequestError(P.MAX_TOKENS, "is required")
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=_scalar(inputs, P.TEMPERATURE, 0.0, float),
        top_k=_scalar(inputs, P.TOP_K, 0, int),
        top_p=_scalar(inputs, P.TOP_P, 1.0, float),
        seed=request_seed(inputs),
        stop=_words(inputs, P.STOP_WORDS),
        ignore_eos=_scalar(inputs, P.IGNORE_EOS, False, bool),
        min_length=request_min_tokens(inputs),
        end_id=_scalar(inputs, P.END_ID, None, int),
        pad_id=_scalar(inputs, P.PAD_ID, None, int),
        bad_words=_words(inputs, P.BAD_WORDS),
        repetition_penalty=_scalar(inputs, P.REPETITION_PENALTY, 1.0, float),
        presence_penalty=_scalar(inputs, P.PRESENCE_PENALTY, 0.0, float),
        frequency_penalty=_scalar(inputs, P.FREQUENCY_PENALTY, 0.0, float),
        min_p=_scalar(inputs, P.MIN_P, 0.0, float),
        **embedding_bias(inputs),
        return_log_probs=_scalar(inputs, P.RETURN_LOG_PROBS, False, bool),
        top_logprobs=_scalar(inputs, P.TOP_LOGPROBS, 0, int),
        logprobs_mode=_scalar(inputs, P.LOGPROBS_MODE, "", str) or LOGPROBS_PROCESSED,
        guide_type=_scalar(inputs, P.GUIDED_DECODING_GUIDE_TYPE, "", str) or None,
        guide=_scalar(inputs, P.GUIDED_DECODING_GUIDE, "", str) or None,
        cache_salt=_scalar(inputs, P.CACHE_SALT, "", str) or None,
    )
    params, method, k = validate_request(
        prompt_ids, params, _scalar(inputs, P.SPECULATIVE_METHOD, "", str), _scalar(inputs, P.NUM_DRAFT_TOKENS, None, int),
        offer, prompt_field)
    parsed = ParsedRequest(
        prompt=prompt, prompt_ids=prompt_ids,
        apply_chat_template=chat, params=params, method=method, num_draft_tokens=k,
        stream=_scalar(inputs, P.STREAM, False, bool), return_perf_metrics=_scalar(inputs, P.RETURN_PERF_METRICS, False, bool),
        exclude_input_in_output=_scalar(inputs, P.EXCLUDE_INPUT_IN_OUTPUT, False, bool),
        return_num_input_tokens=_scalar(inputs, P.RETURN_NUM_INPUT_TOKENS, False, bool),
        return_num_output_tokens=_scalar(inputs, P.RETURN_NUM_OUTPUT_TOKENS, False, bool),
    )
    # use_draft_logits (tensorrt_llm_bls) is read only to check its form: our verifier
    # always accepts against the target's distribution with the drafter's probabilities
    # where it has them, which is what the flag switches on there.
    _scalar(inputs, P.USE_DRAFT_LOGITS, False, bool)
    return parsed


def embedding_bias(inputs: Mapping[str, Any]) -> dict[str, tuple]:
    """TensorRT-LLM's embedding_bias_words, or our embedding_bias_token_ids, each paired with
    embedding_bias_weights (one weight per word or id) -> SamplingParams' bias fields."""
    words = tuple(str(w) for w in _values(inputs, P.EMBEDDING_BIAS_WORDS) or ())
    ids = inputs.get(P.EMBEDDING_BIAS_TOKEN_IDS)
    ids = () if ids is None else tuple(int(t) for t in np.asarray(ids).reshape(-1))
    weights = inputs.get(P.EMBEDDING_BIAS_WEIGHTS)
    weights = () if weights is None else tuple(float(w) for w in np.asarray(weights, dtype=np.float64).reshape(-1))
    if words and ids:
        raise InvalidRequestError(P.EMBEDDING_BIAS_TOKEN_IDS, f"give {P.EMBEDDING_BIAS_WORDS} or token ids, not both")
    keys = words or ids
    if len(weights) != len(keys):  # named by what was sent: the words or ids without their weights, or the weights
        field = P.EMBEDDING_BIAS_WEIGHTS if weights else P.EMBEDDING_BIAS_WORDS if words else P.EMBEDDING_BIAS_TOKEN_IDS
        raise InvalidRequestError(field, f"needs one {P.EMBEDDING_BIAS_WEIGHTS} value per biased word or token id: {len(keys)} "
                                         f"given, {len(weights)} weights")
    if words:  # an empty word biases nothing (TensorRT-LLM skips it), its weight with it
        return {"bias_words": tuple((word, weight) for word, weight in zip(words, weights) if word)}
    return {"logit_bias": tuple(zip(ids, weights))}


def request_seed(inputs: Mapping[str, Any]) -> int | None:
    """random_seed, or seed (its newer TensorRT-LLM name); both only when they agree."""
    old, new = _scalar(inputs, P.RANDOM_SEED, None, int), _scalar(inputs, P.SEED, None, int)
    if old is not None and new is not None and old != new:
        raise InvalidRequestError(P.SEED, f"and {P.RANDOM_SEED} are the same setting under two names; got {new} and {old}")
    return new if old is None else old


def request_min_tokens(inputs: Mapping[str, Any]) -> int:
    """min_length, or min_tokens (its current TensorRT-LLM name); both only when they agree."""
    old, new = _scalar(inputs, P.MIN_LENGTH, None, int), _scalar(inputs, P.MIN_TOKENS, None, int)
    if old is not None and new is not None and old != new:
        raise InvalidRequestError(P.MIN_TOKENS, f"and {P.MIN_LENGTH} are the same setting under two names; got {new} and {old}")
    name, value = (P.MIN_LENGTH, old) if new is None else (P.MIN_TOKENS, new)
    if value is not None and value < 0:  # named as the client sent it (the params say min_length)
        raise InvalidRequestError(name, f"must be an integer >= 0, got {value}")
    return 0 if value is None else value
