"""`specdec openai`: an OpenAI-compatible HTTP front end for the Triton server.

FastAPI + uvicorn in front of `speculative_loop` (the ensemble's contract plus token ids),
reached over Triton's HTTP streaming endpoint: a client that goes away closes that stream
and the loop stops at its next step (the bundled Triton's gRPC frontend aborts on concurrent
client cancellations, server#7368, so HTTP is the safe transport here).

Endpoints: POST /v1/chat/completions (messages rendered with the target's chat template:
system prompt, multi-turn), POST /v1/completions (raw prompt), GET /v1/models, GET /health.
`stream: true` answers with SSE chunks ending in `data: [DONE]`
(`stream_options.include_usage` adds a usage chunk). Speculation: one model id per
configured method (`<base>:<method>`, `<base>:none` = the matched baseline, `<base>` =
the server's default method), or the extra body fields `speculative_method` and
`num_draft_tokens` (0 = the baseline); what it did comes back in the `specdec` field.
Errors use OpenAI's shape: 400 naming the parameter, 404 for an unknown model, 503 when
Triton is not reachable or ready. Log probs (`logprobs` / `top_logprobs`, vLLM's
`logprobs_mode`) come from the verification rows; `n` choices are n streams, the siblings
started once the prompt's KV is cached; `tools` / `tool_choice` in specdec_openai.tool_calls.
The options beside vLLM's and TensorRT-LLM's names: docs/serving.md.
"""

import argparse
import asyncio
import json
import time
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, AsyncIterator, Mapping

import specdec_wire as P
from specdec.config import GUIDE_EBNF, MAX_TOP_LOGPROBS, METHOD_NONE, ServingConfig
from specdec_openai.tool_calls import ToolError, ToolPlan, call_grammar, held_back, parse_tool_calls, template_takes_tools, tool_plan, with_tools

DEFAULT_MAX_TOKENS = 256
# Our tensor names -> the OpenAI parameter a client sent them as (for 400 errors).
PARAM_OF_FIELD = {P.MAX_TOKENS: "max_tokens", P.TEMPERATURE: "temperature", P.TOP_P: "top_p", P.TOP_K: "top_k",
                  P.RANDOM_SEED: "seed", P.SEED: "seed", P.STOP_WORDS: "stop", P.SPECULATIVE_METHOD: "speculative_method",
                  P.NUM_DRAFT_TOKENS: "num_draft_tokens", P.TEXT_INPUT: "messages", P.INPUT_IDS: "messages",
                  P.PRESENCE_PENALTY: "presence_penalty", P.FREQUENCY_PENALTY: "frequency_penalty",
                  P.REPETITION_PENALTY: "repetition_penalty", P.MIN_LENGTH: "min_tokens",
                  P.GUIDED_DECODING_GUIDE_TYPE: "response_format", P.GUIDED_DECODING_GUIDE: "response_format", P.CACHE_SALT: "cache_salt",
                  P.MIN_P: "min_p", P.EMBEDDING_BIAS_TOKEN_IDS: "logit_bias", P.EMBEDDING_BIAS_WEIGHTS: "logit_bias",
                  P.TOP_LOGPROBS: "top_logprobs", P.LOGPROBS_MODE: "logprobs_mode"}
# Accepted only at their neutral value (anything else would be silently different output).
NEUTRAL = {"echo": False, "best_of": 1, "suffix": None}
MAX_CHOICES = 16  # n: each choice is its own stream on the server


class OpenAIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class Served:
    """What this front end offers: model ids -> (method, draft budget or None = configured)."""

    base: str
    methods: Mapping[str, str]  # model id -> speculative_method ("" = the server's default)

    @staticmethod
    def from_settings(settings: ServingConfig, base: str) -> "Served":
        ids = {base: "", f"{base}:{METHOD_NONE}": METHOD_NONE}
        ids.update({f"{base}:{name}": name for name in settings.methods})
        return Served(base, ids)


@dataclass(frozen=True)
class Job:
    """One validated OpenAI request, as the Triton request it becomes."""

    model: str
    prompt: str
    prompt_tokens: int
    max_tokens: int
    temperature: float
    top_p: float
    seed: int | None
    stop: tuple[str, ...]
    method: str | None
    num_draft_tokens: int | None
    stream: bool
    include_usage: bool
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # vLLM's extension
    min_tokens: int = 0  # vLLM's extension (TensorRT-LLM's min_length)
    guide_type: str | None = None  # from response_format (TensorRT-LLM's guided decoding)
    guide: str | None = None
    cache_salt: str | None = None  # vLLM's prefix-cache isolation
    min_p: float = 0.0  # vLLM's extension
    top_k: int = 0  # vLLM's extension (0 or -1: off)
    logit_bias: tuple[tuple[int, float], ...] = ()  # OpenAI's, token id -> bias
    logprobs: bool = False  # return each emitted token's log prob
    top_logprobs: int = 0  # and the likeliest this many at its position
    logprobs_mode: str | None = None  # vLLM's: raw_logprobs or processed_logprobs (None: the server's)
    n: int = 1  # choices, each its own stream (choice i seeded seed + i)
    tools: ToolPlan | None = None  # tools and tool_choice (specdec_openai.tool_calls)
    # ours: choices one after another, so each later sibling's suffix drafts find the earlier
    # siblings' finished text in the corpus (RL rollouts repeat each other)
    siblings_in_turn: bool = False


# What an integer's Triton tensor holds (INT32; the seed's UINT64): Triton's JSON parser wraps a
# wider value silently (max_tokens 2**32 + 4 arrived as 4), so the front end refuses it.
INT32_RANGE = (-2**31, 2**31 - 1)
UINT64_RANGE = (0, 2**64 - 1)


def _number(body: Mapping[str, Any], name: str, default, kind=float, bounds: tuple[int, int] = INT32_RANGE):
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and isinstance(value, float)
                                                                          and not value.is_integer()):
        raise OpenAIError(400, f"{name} must be {'an integer' if kind is int else 'a number'}, got {value!r}", name)
    try:
        value = kind(value)
    except OverflowError:  # an integer past a float's range
        raise OpenAIError(400, f"{name} is out of range", name) from None
    if kind is int and not bounds[0] <= value <= bounds[1]:
        raise OpenAIError(400, f"{name} must be an integer in [{bounds[0]}, {bounds[1]}], got {value}", name)
    return value


def _check_utf8(body: Mapping[str, Any]) -> None:
    """JSON may carry lone surrogates (\\ud800), which no UTF-8 tokenizer or tensor takes: refused
    naming the parameter (the tokenizer raised a TypeError, a 500)."""
    for name, value in body.items():
        try:
            json.dumps(value, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise OpenAIError(400, f"{name} is not valid UTF-8 (it holds a lone surrogate)", name) from None
        except RecursionError:
            raise OpenAIError(400, f"{name} is nested too deeply", name) from None


def response_format(body: Mapping[str, Any]) -> tuple[str | None, str | None]:
    """OpenAI's response_format -> (guide type, guide): {"type": "text"} or absent: none;
    "json_object": any JSON object; "json_schema": its json_schema.schema (strict or not,
    the schema is enforced: a grammar is never looser than asked)."""
    fmt = body.get("response_format")
    if fmt is None:
        return None, None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None, None
    if kind == "json_object":
        return "json", None
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise OpenAIError(400, "response_format.json_schema.schema must be a JSON object (the schema)", "response_format")
        return "json_schema", json.dumps(schema)
    raise OpenAIError(400, f"response_format.type must be text, json_object or json_schema; got {kind!r}", "response_format")


def logit_bias(body: Mapping[str, Any]) -> tuple[tuple[int, float], ...]:
    """OpenAI's logit_bias: an object of token ids (as JSON strings) -> a bias; the range and
    the vocabulary are the server's checks (refused naming logit_bias too)."""
    value = body.get("logit_bias")
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise OpenAIError(400, "logit_bias must be an object of token ids to biases", "logit_bias")
    pairs = []
    for key, bias in value.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise OpenAIError(400, f"logit_bias keys must be token ids, got {key!r}", "logit_bias") from None
        if isinstance(bias, bool) or not isinstance(bias, (int, float)):
            raise OpenAIError(400, f"logit_bias values must be numbers, got {bias!r} for {key!r}", "logit_bias")
        if not INT32_RANGE[0] <= token <= INT32_RANGE[1]:
            raise OpenAIError(400, f"logit_bias key {key!r} is not a token id", "logit_bias")
        pairs.append((token, float(bias)))
    return tuple(pairs)


def log_prob_request(body: Mapping[str, Any], chat: bool) -> tuple[bool, int]:
    """(log probs wanted, how many alternatives): chat's logprobs (a boolean) + top_logprobs,
    completions' logprobs (how many alternatives; 0 = the emitted token's alone)."""
    if chat:
        wanted = body.get("logprobs")
        if wanted is not None and not isinstance(wanted, bool):
            raise OpenAIError(400, f"logprobs must be a boolean, got {wanted!r}", "logprobs")
        top = _number(body, "top_logprobs", 0, int, (0, MAX_TOP_LOGPROBS))
        if top and not wanted:
            raise OpenAIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        return bool(wanted), top
    if body.get("logprobs") is None:
        return False, 0
    return True, _number(body, "logprobs", 0, int, (0, MAX_TOP_LOGPROBS))


def parse_job(body: Any, served: Served, tokenizer, chat: bool) -> Job:
    """Validate an OpenAI request body; every refusal names its parameter."""
    if not isinstance(body, dict):
        raise OpenAIError(400, "the request body must be a JSON object")
    _check_utf8(body)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise OpenAIError(400, "model is required", "model")
    if model not in served.methods:
        raise OpenAIError(404, f"The model {model!r} does not exist; available: {', '.join(served.methods)}", "model",
                          code="model_not_found")
    for name, neutral in NEUTRAL.items():
        value = body.get(name)
        if not (value is None or value == neutral or (neutral is None and not value)):
            raise OpenAIError(400, f"{name} is not supported (only {neutral!r})", name)
    for name in ("tools", "tool_choice"):
        if not chat and body.get(name) is not None:
            raise OpenAIError(400, f"{name} is for /v1/chat/completions", name)
    try:
        tools = tool_plan(body) if chat else None
    except ToolError as exc:
        raise OpenAIError(400, str(exc), exc.param) from None
    prompt = render_messages(body.get("messages"), tokenizer, tools) if chat else _prompt_text(body.get("prompt"))
    # max_completion_tokens wins over the legacy max_tokens, but both are checked: a bad value is
    # refused, not dropped. The server checks the one used against its limit.
    counts = (1, INT32_RANGE[1])
    legacy_max_tokens = _number(body, "max_tokens", DEFAULT_MAX_TOKENS, int, counts)
    max_tokens = _number(body, "max_completion_tokens", None, int, counts) if body.get("max_completion_tokens") is not None \
        else legacy_max_tokens
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else (stop or [])
    if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(s, str) and s for s in stop):
        raise OpenAIError(400, "stop must be a non-empty string or a list of up to 4 of them", "stop")
    stream_options = body.get("stream_options") or {}
    if not isinstance(stream_options, dict):
        raise OpenAIError(400, "stream_options must be an object", "stream_options")
    method = body.get("speculative_method", served.methods[model] or None)
    if method is not None and not isinstance(method, str):
        raise OpenAIError(400, "speculative_method must be a string", "speculative_method")
    k = _number(body, "num_draft_tokens", None, int)
    if k is None and method == METHOD_NONE:
        k = 0
    seed = body.get("seed")
    if seed is not None:
        seed = _number(body, "seed", None, int, UINT64_RANGE)
    guide_type, guide = response_format(body)
    if tools is not None and tools.forced:
        if guide_type is not None:
            raise OpenAIError(400, "a forced tool call and response_format cannot both shape the answer", "tool_choice")
        guide_type, guide = GUIDE_EBNF, call_grammar(tools)
    cache_salt = body.get("cache_salt")
    if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
        raise OpenAIError(400, "cache_salt must be a non-empty string", "cache_salt")
    logprobs, top_logprobs = log_prob_request(body, chat)
    mode = body.get("logprobs_mode")
    if mode is not None and not isinstance(mode, str):
        raise OpenAIError(400, "logprobs_mode must be raw_logprobs or processed_logprobs", "logprobs_mode")
    n = _number(body, "n", 1, int, (1, MAX_CHOICES))
    in_turn = body.get("siblings_in_turn", False)
    if not isinstance(in_turn, bool):
        raise OpenAIError(400, "siblings_in_turn must be a boolean", "siblings_in_turn")
    return Job(siblings_in_turn=in_turn, tools=tools, logprobs=logprobs, top_logprobs=top_logprobs, logprobs_mode=mode, n=n, guide_type=guide_type, guide=guide, cache_salt=cache_salt, model=model, prompt=prompt, prompt_tokens=len(tokenizer(prompt, add_special_tokens=False).input_ids),
               max_tokens=max_tokens, temperature=_number(body, "temperature", 1.0), top_p=_number(body, "top_p", 1.0),
               seed=seed, stop=tuple(stop), method=method, num_draft_tokens=k, stream=bool(body.get("stream", False)),
               include_usage=bool(stream_options.get("include_usage", False)),
               ignore_eos=bool(body.get("ignore_eos", False)),  # vLLM's extension, which benchmark tools send
               presence_penalty=_number(body, "presence_penalty", 0.0), frequency_penalty=_number(body, "frequency_penalty", 0.0),
               repetition_penalty=_number(body, "repetition_penalty", 1.0), min_tokens=_number(body, "min_tokens", 0, int),
               min_p=_number(body, "min_p", 0.0), logit_bias=logit_bias(body), top_k=max(0, _number(body, "top_k", 0, int, (-1, INT32_RANGE[1]))))


def render_messages(messages: Any, tokenizer, tools: ToolPlan | None = None) -> str:
    """Chat messages through the target's chat template (system prompt, multi-turn, tool calls
    and tool results; the tools in the documented layout when the template takes none)."""
    if not isinstance(messages, list) or not messages:
        raise OpenAIError(400, "messages must be a non-empty list", "messages")
    rendered = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ("system", "developer", "user", "assistant", "tool"):
            raise OpenAIError(400, f"messages[{i}] needs a role of system, user, assistant or tool", f"messages[{i}].role")
        content = message.get("content")
        if isinstance(content, list):  # content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
                raise OpenAIError(400, "only text content parts are supported", f"messages[{i}].content")
            content = "".join(p["text"] for p in content)
        calls = message.get("tool_calls") if message["role"] == "assistant" else None
        if content is None and calls:
            content = ""
        if not isinstance(content, str):
            raise OpenAIError(400, "content must be a string or a list of text parts", f"messages[{i}].content")
        role = "system" if message["role"] == "developer" else message["role"]
        turn = {"role": role, "content": content}
        if calls:
            if not isinstance(calls, list) or not all(isinstance(c, dict) and isinstance(c.get("function"), dict)
                                                       and isinstance(c["function"].get("name"), str) for c in calls):
                raise OpenAIError(400, "tool_calls must be a list of {\"function\": {\"name\", \"arguments\"}}", f"messages[{i}].tool_calls")
            for c in calls:
                try:
                    json.loads(c["function"].get("arguments") or "{}")
                except (TypeError, ValueError):
                    raise OpenAIError(400, "tool call arguments must be a JSON string", f"messages[{i}].tool_calls") from None
            turn["tool_calls"] = calls
        rendered.append(turn)
    if tools is not None and tools.in_prompt and template_takes_tools(tokenizer):
        listed = [{"type": "function", "function": t} for t in tools.tools]
        for turn in rendered:  # the template's own layout: arguments as objects, as HF templates read them
            for c in turn.get("tool_calls", []):
                c["function"] = {**c["function"], "arguments": json.loads(c["function"].get("arguments") or "{}")}
        return tokenizer.apply_chat_template(rendered, tools=listed, add_generation_prompt=True, tokenize=False)
    return tokenizer.apply_chat_template(with_tools(rendered, tools), add_generation_prompt=True, tokenize=False)


def _prompt_text(prompt: Any) -> str:
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt.strip():
        raise OpenAIError(400, "prompt must be a non-empty string (one prompt per request)", "prompt")
    return prompt


def triton_error(message: str) -> OpenAIError:
    """A Triton error as OpenAI's: the field our server named -> the client's parameter."""
    text = message.strip()
    named = [(text.find(f"{field}:"), param) for field, param in PARAM_OF_FIELD.items() if f"{field}:" in text]
    if named:  # the first field the message names
        return OpenAIError(400, text, min(named)[1])
    if "busy" in text.lower():
        return OpenAIError(503, text, kind="server_busy")
    return OpenAIError(500, text, kind="server_error")


class Frontend:
    """The request path, apart from the web framework (so it is testable without one)."""

    def __init__(self, triton_http: str, served: Served, tokenizer, timeout_s: float = 600.0):
        self.triton_http, self.served, self.tokenizer, self.timeout_s = triton_http, served, tokenizer, timeout_s
        self.client = None

    async def start(self) -> None:
        from specdec_client import AsyncSpecDecClient

        self.client = AsyncSpecDecClient(self.triton_http, protocol="http", model="speculative_loop", timeout_s=self.timeout_s)
        await self.client.__aenter__()

    async def stop(self) -> None:
        if self.client is not None:
            await self.client.close()

    def request(self, job: Job):
        from specdec_client import GenerateRequest

        return GenerateRequest(job.prompt, max_tokens=job.max_tokens, temperature=job.temperature, top_p=job.top_p, top_k=job.top_k or None, seed=job.seed,
                               stop=job.stop, method=job.method, num_draft_tokens=job.num_draft_tokens, apply_chat_template=False,
                               ignore_eos=job.ignore_eos or None, min_length=job.min_tokens or None,
                               presence_penalty=job.presence_penalty or None, frequency_penalty=job.frequency_penalty or None,
                               repetition_penalty=job.repetition_penalty if job.repetition_penalty != 1.0 else None,
                               guide_type=job.guide_type, guide=job.guide, cache_salt=job.cache_salt, min_p=job.min_p or None,
                               logit_bias=job.logit_bias, return_log_probs=job.logprobs or None,
                               top_logprobs=job.top_logprobs or None, logprobs_mode=job.logprobs_mode)

    async def chunks(self, job: Job) -> AsyncIterator:
        from specdec_client import ClientConnectionError, ServerError

        try:
            async for chunk in self.client.stream(self.request(job)):
                yield chunk
        except ClientConnectionError as exc:
            raise OpenAIError(503, f"the Triton server is not reachable: {exc}", kind="service_unavailable") from exc
        except ServerError as exc:
            raise triton_error(str(exc)) from exc

    async def ready(self) -> bool:
        import aiohttp

        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
                async with session.get(f"http://{self.triton_http}/v2/models/speculative_loop/ready") as resp:
                    return resp.status == 200
        except (aiohttp.ClientError, TimeoutError):
            return False


def usage(job: Job, completion_tokens: int, perf: Mapping[str, float] | None = None) -> dict:
    """OpenAI's usage; prompt_tokens_details.cached_tokens from the prefix cache (num_cached_tokens)."""
    out = {"prompt_tokens": job.prompt_tokens, "completion_tokens": completion_tokens,
           "total_tokens": job.prompt_tokens + completion_tokens}
    if perf is not None and P.NUM_CACHED_TOKENS in perf:
        out["prompt_tokens_details"] = {"cached_tokens": int(perf[P.NUM_CACHED_TOKENS])}
    return out


def extension(perf: Mapping[str, float], job: Job) -> dict:
    """What speculation did for this request (the `specdec` field)."""
    return {"speculative_method": job.method or "(server default)", "acceptance_rate": perf.get(P.ACCEPTANCE_RATE, 0.0),
            "accepted_draft_tokens": int(perf.get(P.TOTAL_ACCEPTED_DRAFT_TOKENS, 0)),
            "draft_tokens": int(perf.get(P.TOTAL_DRAFT_TOKENS, 0)), "verification_steps": int(perf.get(P.VERIFICATION_STEPS, 0)),
            "cached_tokens": int(perf.get(P.NUM_CACHED_TOKENS, 0))}


def finish_reason(server_reason: str | None) -> str:
    """OpenAI's reason from the loop's: a stop string and the end token are both "stop"."""
    return "length" if server_reason == "length" else "stop"


def completion_tokens(perf: Mapping[str, float], streamed_ids: int) -> int:
    """The server's count of output tokens (a step whose text is held back for a possible
    stop string streams no chunk, so counting streamed ids could fall short)."""
    return int(perf.get(P.OUTPUT_TOKENS, streamed_ids))


def tool_finish(job: Job, server_reason: str | None) -> str:
    """OpenAI's reason for an answer with tool calls: "tool_calls", except for a named tool
    (OpenAI answers those "stop") and an answer cut by max_tokens ("length")."""
    if server_reason == "length":
        return "length"
    return "stop" if job.tools is not None and job.tools.choice == "function" else "tool_calls"


def choice_jobs(job: Job) -> list[Job]:
    """n choices as n requests; with a seed, choice i draws with seed + i (each reproducible
    alone, none sharing another's draws); without one, each its own random seed."""
    return [replace(job, n=1, seed=None if job.seed is None else (job.seed + i) % 2**64) for i in range(job.n)]


class LogProbWriter:
    """Emitted tokens' log probs in OpenAI's shapes: chat's logprobs.content entries, or the
    completions API's tokens / token_logprobs / top_logprobs / text_offset."""

    def __init__(self, tokenizer, chat: bool, top_n: int):
        self.tokenizer, self.chat, self.top_n = tokenizer, chat, top_n
        self.offset = 0  # the completions API's text_offset: characters before this token

    def _text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def _entry(self, token_id: int, log_prob: float) -> dict:
        text = self._text(token_id)
        return {"token": text, "logprob": log_prob, "bytes": list(text.encode("utf-8"))}

    def of(self, ids: list[int], log_probs: list[float], top: list[list[tuple[int, float]]]) -> dict:
        """The logprobs object for these tokens (one chunk's, or a whole answer's)."""
        if self.chat:
            content = []
            for i, (token_id, log_prob) in enumerate(zip(ids, log_probs)):
                entry = self._entry(token_id, log_prob)
                entry["top_logprobs"] = [self._entry(t, lp) for t, lp in (top[i] if top else [])][: self.top_n]
                content.append(entry)
            return {"content": content, "refusal": None}
        tokens, offsets = [self._text(t) for t in ids], []
        for text in tokens:
            offsets.append(self.offset)
            self.offset += len(text)
        top_dicts = [{self._text(t): lp for t, lp in row[: self.top_n]} for row in top] if top and self.top_n else None
        return {"tokens": tokens, "token_logprobs": list(log_probs), "top_logprobs": top_dicts, "text_offset": offsets}


@dataclass
class ChoiceResult:
    """One choice, folded from its chunks."""

    index: int
    text: list[str] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    top: list[list[tuple[int, float]]] = field(default_factory=list)
    perf: dict = field(default_factory=dict)
    server_reason: str | None = None

    def add(self, chunk) -> None:
        self.text.append(chunk.text)
        self.ids += chunk.token_ids
        self.log_probs += chunk.log_probs
        self.top += chunk.top_log_probs
        self.perf.update(chunk.perf)
        self.server_reason = chunk.finish_reason or self.server_reason


async def choice_chunks(frontend: "Frontend", job: Job) -> AsyncIterator[tuple[int, Any]]:
    """(choice index, chunk) of every choice, as they arrive. Choice 0 goes first; the others
    start once its first token is out, when its prompt's KV is in the prefix cache, so they
    prefill nothing but what the cache lacks; each is then verified on its own. Leaving early
    cancels every choice's stream."""
    jobs = choice_jobs(job)
    if len(jobs) == 1 or job.siblings_in_turn:
        for index, one in enumerate(jobs):
            async for chunk in frontend.chunks(one):
                yield index, chunk
        return
    queue: asyncio.Queue = asyncio.Queue()
    finished = object()
    tasks: list[asyncio.Task] = []
    closing = False  # the consumer left: start nothing more

    def start_siblings() -> None:
        if len(tasks) == 1 and not closing:
            tasks.extend(asyncio.create_task(pump(i, other)) for i, other in enumerate(jobs) if i)

    async def pump(index: int, one: Job) -> None:
        try:
            async for chunk in frontend.chunks(one):
                queue.put_nowait((index, chunk))
                if index == 0:  # the prompt is prefilled: the siblings may start
                    start_siblings()
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer, which raises it
            queue.put_nowait((index, exc))
        finally:
            queue.put_nowait((index, finished))
            if index == 0:  # choice 0 ended without a token: the others start anyway
                start_siblings()

    tasks.append(asyncio.create_task(pump(0, jobs[0])))
    open_choices = len(jobs)
    try:
        while open_choices:
            index, item = await queue.get()
            if item is finished:
                open_choices -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        closing = True
        for task in tasks:
            task.cancel()


def create_app(frontend: Frontend):
    from contextlib import asynccontextmanager

    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse
    from sse_starlette import EventSourceResponse

    @asynccontextmanager
    async def lifespan(app):
        await frontend.start()
        yield
        await frontend.stop()

    app = FastAPI(title="specdec OpenAI-compatible API", lifespan=lifespan)

    @app.exception_handler(OpenAIError)
    async def _error(request, exc: OpenAIError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.get("/health")
    async def health():
        ok = await frontend.ready()
        return JSONResponse({"status": "ok" if ok else "unavailable"}, status_code=200 if ok else 503)

    @app.get("/v1/models")
    async def models():
        now = int(time.time())
        return {"object": "list", "data": [{"id": m, "object": "model", "created": now, "owned_by": "specdec"}
                                           for m in frontend.served.methods]}

    async def handle(request: Request, chat: bool):
        try:
            body = await request.json()
        except (ValueError, RecursionError) as exc:  # not JSON, not UTF-8, or nested past the parser's stack
            raise OpenAIError(400, f"the request body is not JSON: {exc}") from None
        job = parse_job(body, frontend.served, frontend.tokenizer, chat)
        if not await frontend.ready():
            raise OpenAIError(503, "the Triton server is not ready", kind="service_unavailable")
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        created = int(time.time())
        kind = "chat.completion" if chat else "text_completion"
        if job.stream:
            # sse-starlette frames the events (and stops the generator when the client goes away).
            return EventSourceResponse(_sse(frontend, job, rid, created, kind, chat), sep="\n")
        results = [ChoiceResult(i) for i in range(job.n)]
        async for index, chunk in choice_chunks(frontend, job):
            results[index].add(chunk)
        choices = []
        for result in results:
            choice = {"index": result.index, "finish_reason": finish_reason(result.server_reason), "logprobs": None}
            if job.logprobs:
                choice["logprobs"] = LogProbWriter(frontend.tokenizer, chat, job.top_logprobs).of(result.ids, result.log_probs, result.top)
            text = "".join(result.text)
            if chat and job.tools is not None and job.tools.parsed:
                content, calls = parse_tool_calls(text)
                message = {"role": "assistant", "content": content or None}
                if calls:
                    message["tool_calls"] = calls
                    choice["finish_reason"] = tool_finish(job, result.server_reason)
                choice["message"] = message
            else:
                choice.update({"message": {"role": "assistant", "content": text}} if chat else {"text": text})
            choices.append(choice)
        tokens = sum(completion_tokens(r.perf, len(r.ids)) for r in results)
        body = {"id": rid, "object": kind, "created": created, "model": job.model, "choices": choices,
                "usage": usage(job, tokens, results[0].perf), "specdec": extension(results[0].perf, job)}
        if job.n > 1:
            body["specdec"]["choices"] = [extension(r.perf, job) for r in results]
        return body

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, chat=False)

    return app


async def _sse(frontend: Frontend, job: Job, rid: str, created: int, kind: str, chat: bool) -> AsyncIterator[str]:
    """OpenAI's streaming chunks, each one SSE event's data. If the client goes away, the
    response cancels this generator, which closes the Triton streams: the loop stops at its
    next step. Log probs ride with the text of their tokens (a token whose text is held back
    for a possible stop string waits for the next text, or the end)."""
    obj = f"{kind}.chunk" if chat else kind

    def event(choices: list, **extra) -> str:
        return json.dumps({"id": rid, "object": obj, "created": created, "model": job.model, "choices": choices, **extra})

    def delta(index: int, text: str | None, reason: str | None = None, role: bool = False, logprobs: dict | None = None) -> dict:
        if chat:
            d = {"role": "assistant", "content": ""} if role else ({"content": text} if text is not None else {})
            return {"index": index, "delta": d, "finish_reason": reason, "logprobs": logprobs}
        return {"index": index, "text": text or "", "finish_reason": reason, "logprobs": logprobs}

    results = [ChoiceResult(i) for i in range(job.n)]
    writers = [LogProbWriter(frontend.tokenizer, chat, job.top_logprobs) for _ in results]
    pending = [ChoiceResult(i) for i in range(job.n)]  # tokens whose log probs are not sent yet

    def flush(index: int) -> dict | None:
        waiting, pending[index] = pending[index], ChoiceResult(index)
        return writers[index].of(waiting.ids, waiting.log_probs, waiting.top) if job.logprobs else None

    ended: set[int] = set()
    parsing = chat and job.tools is not None and job.tools.parsed
    unsent = [""] * job.n  # each choice's text held back: it may be (the start of) a call block
    called = [False] * job.n

    def visible(index: int, text: str) -> str:
        """The content to send now: with tools, text that may start a call block waits."""
        if not parsing:
            return text
        waiting = unsent[index] + text
        keep = held_back(waiting)
        unsent[index] = waiting[len(waiting) - keep:]
        return waiting[: len(waiting) - keep]

    def tool_call_events(index: int) -> list[str]:
        """At a choice's end: what was held back, as content and tool_calls deltas (each call
        whole in one delta: its index, id, type, name and arguments, as the SDK accumulates them)."""
        if not parsing:
            return []
        content, calls = parse_tool_calls(unsent[index])
        unsent[index] = ""
        called[index] = bool(calls)
        events = [event([delta(index, content)])] if content else []
        for i, call in enumerate(calls):
            d = {"index": index, "delta": {"tool_calls": [{"index": i, **call}]}, "finish_reason": None, "logprobs": None}
            events.append(event([d]))
        return events

    def end(index: int) -> str:
        ended.add(index)
        result = results[index]
        last = flush(index) if pending[index].ids else None
        reason = tool_finish(job, result.server_reason) if called[index] else finish_reason(result.server_reason)
        return event([delta(index, None if chat else "", reason, logprobs=last)], specdec=extension(result.perf, job))

    try:
        if chat:
            for index in range(job.n):
                yield event([delta(index, None, role=True)])
        async for index, chunk in choice_chunks(frontend, job):
            results[index].add(chunk)
            pending[index].add(chunk)
            text = visible(index, chunk.text)
            if text:
                yield event([delta(index, text, logprobs=flush(index))])
            if chunk.finish_reason:
                for call_event in tool_call_events(index):
                    yield call_event
                yield end(index)
        for index in sorted(set(range(job.n)) - ended):  # a stream that closed without its reason
            for call_event in tool_call_events(index):
                yield call_event
            yield end(index)
        if job.include_usage:
            tokens = sum(completion_tokens(r.perf, len(r.ids)) for r in results)
            yield event([], usage=usage(job, tokens, results[0].perf))
    except OpenAIError as exc:  # after the 200 header: the error travels in the stream, as OpenAI's does
        yield json.dumps(exc.body())
    yield "[DONE]"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specdec openai", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--triton", default="localhost:8000", help="Triton's HTTP endpoint (host:port)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 inside a container)")
    p.add_argument("--port", type=int, default=9000)
    p.add_argument("--settings", default=None, help="the served specdec.json (default: $SPECDEC_SETTINGS or the repository's)")
    p.add_argument("--model-dir", default=None, help="the target's directory (its tokenizer and chat template)")
    p.add_argument("--model-name", default="smollm2-135m-instruct", help="the base model id")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import os

    import uvicorn

    from transformers import AutoTokenizer

    from specdec.config import SERVED_SETTINGS, resolve_model_dir

    settings = ServingConfig.from_file(Path(args.settings or os.environ.get("SPECDEC_SETTINGS") or SERVED_SETTINGS))
    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model_dir(args.model_dir or settings.model_dir)))
    frontend = Frontend(args.triton, Served.from_settings(settings, args.model_name), tokenizer)
    uvicorn.run(create_app(frontend), host=args.host, port=args.port, log_level="info")
    return 0
