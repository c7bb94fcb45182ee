"""Deployments the benchmark compares: a Triton ensemble with TensorRT-LLM's tensor names
(this project's, or a stock tensorrtllm_backend one), or an OpenAI-compatible server (vLLM,
SGLang, llama-server, TensorRT-LLM's trtllm-serve, this project's front end).

An endpoint is written as a URL, so one flag names a whole deployment:

    grpc://HOST:PORT[/MODEL]          Triton over gRPC (MODEL defaults to ensemble)
    triton+http://HOST:PORT[/MODEL]   Triton over HTTP (generate_stream)
    openai+http://HOST:PORT/v1        OpenAI-compatible (/v1/completions, streamed); also openai+https

Query parameters:
    model=ID        the OpenAI model id (default: the server's first in /v1/models)
    method=NAME     ours: the speculative method (none = plain decoding)
    draft=K         ours: draft tokens per step (0 = plain decoding)
    stock=1         a stock tensorrtllm_backend ensemble: only TensorRT-LLM's own inputs are sent
    seed=NAME       the seed input's name on a stock ensemble (random_seed, or seed since 2025)
    metrics=URL     the server's Prometheus URL (per-position acceptance; ours only)
    name=LABEL      the label in the report (default baseline / candidate)
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, replace
from typing import Any, AsyncIterator
from urllib.parse import parse_qs, urlsplit

import specdec_wire as P

from specdec_client.client import AsyncSpecDecClient, Chunk, GenerateRequest
from specdec_client.errors import ClientConnectionError, RequestTimeoutError, ServerError, SpecDecClientError

TRITON_GRPC, TRITON_HTTP, OPENAI = "grpc", "triton+http", "openai"
SCHEMES = {"grpc": TRITON_GRPC, "triton+grpc": TRITON_GRPC, "triton+http": TRITON_HTTP,
           "openai+http": OPENAI, "openai+https": OPENAI}
QUERY_KEYS = ("model", "method", "draft", "stock", "seed", "metrics", "name")

# What a stock tensorrtllm_backend ensemble takes (Triton refuses an input a model does not
# declare): the request's text, length, streaming, sampling and stop words. Ours adds the
# method, the draft budget, ignore_eos, the chat template switch, guides and the cache salt.
STOCK_INPUTS = frozenset({P.TEXT_INPUT, P.MAX_TOKENS, P.STREAM, P.TEMPERATURE, P.TOP_K, P.TOP_P, P.RANDOM_SEED,
                          P.STOP_WORDS, P.BAD_WORDS, P.MIN_LENGTH, P.REPETITION_PENALTY, P.PRESENCE_PENALTY,
                          P.FREQUENCY_PENALTY, P.EXCLUDE_INPUT_IN_OUTPUT})


class EndpointError(SpecDecClientError, ValueError):
    """An endpoint URL cannot be used; the message names the part."""


@dataclass(frozen=True)
class Endpoint:
    kind: str  # TRITON_GRPC, TRITON_HTTP or OPENAI
    address: str  # host:port (Triton), or the base URL ending in /v1 (OpenAI)
    model: str | None = None  # Triton model name, or the OpenAI model id (None: ask the server)
    method: str | None = None
    num_draft_tokens: int | None = None
    stock: bool = False
    seed_input: str = P.RANDOM_SEED
    metrics_url: str | None = None
    label: str | None = None
    spec: str = ""  # as written on the command line

    @property
    def is_triton(self) -> bool:
        return self.kind != OPENAI

    @property
    def ours(self) -> bool:
        """This project's Triton ensemble: it takes the method and the draft budget."""
        return self.is_triton and not self.stock

    def describe(self) -> dict[str, Any]:
        return {"endpoint": self.spec, "kind": self.kind, "address": self.address, "model": self.model,
                "method": self.method, "num_draft_tokens": self.num_draft_tokens, "stock_trtllm": self.stock}


def parse_endpoint(text: str) -> Endpoint:
    """'grpc://localhost:8001/ensemble?method=eagle3' -> Endpoint (module docstring)."""
    parts = urlsplit(text)
    kind = SCHEMES.get(parts.scheme)
    if kind is None:
        raise EndpointError(f"{text!r}: the scheme must be one of {', '.join(SCHEMES)} (e.g. grpc://localhost:8001, "
                            "openai+http://localhost:8080/v1)")
    if not parts.hostname or parts.port is None:
        raise EndpointError(f"{text!r}: give host:port")
    query = {k: v[-1] for k, v in parse_qs(parts.query, keep_blank_values=True).items()}
    unknown = sorted(set(query) - set(QUERY_KEYS))
    if unknown:
        raise EndpointError(f"{text!r}: unknown parameter {unknown[0]!r} (known: {', '.join(QUERY_KEYS)})")
    draft = query.get("draft")
    if draft is not None and not (draft.isdigit()):
        raise EndpointError(f"{text!r}: draft must be a non-negative integer, got {draft!r}")
    stock = query.get("stock", "0").lower() in ("1", "true", "yes")
    if kind == OPENAI:
        for key in ("method", "draft", "stock", "seed"):
            if key in query:
                raise EndpointError(f"{text!r}: {key} is for Triton endpoints; an OpenAI endpoint picks its mode by model id")
        http = parts.scheme.partition("+")[2]
        path = parts.path.rstrip("/") or "/v1"
        address, model = f"{http}://{parts.netloc}{path}", query.get("model")
    else:
        if stock and ("method" in query or "draft" in query):
            raise EndpointError(f"{text!r}: a stock TensorRT-LLM ensemble takes no method or draft (its engine decides)")
        address, model = parts.netloc, parts.path.strip("/") or "ensemble"
        if "model" in query:
            raise EndpointError(f"{text!r}: a Triton endpoint names its model in the path (grpc://host:port/MODEL)")
    seed_input = query.get("seed", P.RANDOM_SEED)
    if seed_input not in (P.RANDOM_SEED, P.SEED):
        raise EndpointError(f"{text!r}: seed must be {P.RANDOM_SEED} or {P.SEED}, got {seed_input!r}")
    return Endpoint(kind, address, model, query.get("method"), None if draft is None else int(draft), stock, seed_input,
                    query.get("metrics"), query.get("name"), text)


def stock_fields(fields: dict[str, Any], seed_input: str = P.RANDOM_SEED) -> dict[str, Any]:
    """A request's inputs as a stock tensorrtllm_backend ensemble takes them."""
    out = {k: v for k, v in fields.items() if k in STOCK_INPUTS}
    if seed_input != P.RANDOM_SEED and P.RANDOM_SEED in out:
        out[seed_input] = out.pop(P.RANDOM_SEED)
    return out


def for_endpoint(endpoint: Endpoint, request: GenerateRequest) -> GenerateRequest:
    """The request as this endpoint is asked: ours gets its method and draft budget."""
    if endpoint.ours and (endpoint.method is not None or endpoint.num_draft_tokens is not None):
        return replace(request, method=endpoint.method, num_draft_tokens=endpoint.num_draft_tokens)
    return request


# ---- OpenAI-compatible -------------------------------------------------------------------
def completions_body(request: GenerateRequest, model: str) -> dict[str, Any]:
    """/v1/completions, streamed, with the usage chunk (exact completion token counts).
    ignore_eos is vLLM's extension, which SGLang, llama-server and ours also take."""
    body: dict[str, Any] = {"model": model, "prompt": request.prompt, "max_tokens": request.max_tokens, "stream": True,
                            "stream_options": {"include_usage": True}}
    for key, value in (("temperature", request.temperature), ("top_p", request.top_p), ("top_k", request.top_k),
                       ("seed", request.seed)):
        if value is not None:
            body[key] = value
    if request.stop:
        body["stop"] = list(request.stop)
    if request.ignore_eos:
        body["ignore_eos"] = True
    return body


def chunk_of_event(payload: dict[str, Any], arrived: float) -> Chunk | None:
    """One streamed completion event -> a Chunk (text, or the usage as output_tokens)."""
    if "error" in payload:
        error = payload["error"]
        raise ServerError(error.get("message", str(error)) if isinstance(error, dict) else str(error))
    choices = payload.get("choices") or []
    text = "".join(c.get("text") or "" for c in choices)
    reason = next((c.get("finish_reason") for c in choices if c.get("finish_reason")), None)
    usage = payload.get("usage") or {}
    perf = {P.OUTPUT_TOKENS: float(usage["completion_tokens"])} if usage.get("completion_tokens") is not None else {}
    if not text and not perf and reason is None:
        return None
    return Chunk(text, arrived, perf, [], reason)


class AsyncOpenAIClient:
    """Streams /v1/completions through aiohttp (one session for all requests, no connection
    cap: the benchmark's concurrency must not queue inside the client)."""

    def __init__(self, base_url: str, model: str | None, timeout_s: float | None = 600.0):
        self.base_url, self.model, self.timeout_s = base_url.rstrip("/"), model, timeout_s
        self._session = None

    async def __aenter__(self) -> "AsyncOpenAIClient":
        import aiohttp

        # A connection per request (force_close): llama-server closes a connection as its
        # stream ends, and a pooled one reused in that moment failed ("Can not write request
        # body") 3 times in 160 requests at c=16. On localhost the handshake is ~0.1 ms; to a
        # remote server it adds one round trip to every request's TTFT, on every OpenAI side.
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_s),
                                              connector=aiohttp.TCPConnector(limit=0, force_close=True))
        if self.model is None:
            self.model = await self._first_model()
        return self

    async def __aexit__(self, *exc) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _first_model(self) -> str:
        import aiohttp

        try:
            async with self._session.get(f"{self.base_url}/models") as resp:
                data = await resp.json(content_type=None)
        except (aiohttp.ClientError, ValueError) as exc:
            raise ClientConnectionError(f"{self.base_url}/models: {exc}") from exc
        models = data.get("data") or [] if isinstance(data, dict) else []
        if not models:
            raise EndpointError(f"{self.base_url}: /models lists no model; give ?model=ID")
        return models[0]["id"]

    async def stream(self, request: GenerateRequest) -> AsyncIterator[Chunk]:
        import aiohttp

        try:
            async with self._session.post(f"{self.base_url}/completions", json=completions_body(request, self.model)) as resp:
                if resp.status != 200:
                    raise ServerError(f"HTTP {resp.status}: {(await resp.read()).decode('utf-8', 'replace')[:500]}")
                async for raw in resp.content:
                    line = raw.decode("utf-8").strip()
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        return
                    chunk = chunk_of_event(json.loads(data), time.perf_counter())
                    if chunk is not None:
                        yield chunk
        except aiohttp.ClientConnectionError as exc:
            raise ClientConnectionError(f"{self.base_url}: {exc}") from exc
        except TimeoutError as exc:
            raise RequestTimeoutError(str(exc)) from exc

    async def generate(self, request: GenerateRequest) -> None:
        async for _ in self.stream(request):
            pass


class AsyncEndpointClient:
    """One endpoint's streaming client, whichever kind it is: `stream(GenerateRequest)`."""

    def __init__(self, endpoint: Endpoint, timeout_s: float | None = 600.0):
        self.endpoint = endpoint
        if endpoint.is_triton:
            protocol = "grpc" if endpoint.kind == TRITON_GRPC else "http"
            only = (lambda fields: stock_fields(fields, endpoint.seed_input)) if endpoint.stock else None
            self._client = AsyncSpecDecClient(endpoint.address, protocol, endpoint.model, timeout_s, shape_fields=only)
        else:
            self._client = AsyncOpenAIClient(endpoint.address, endpoint.model, timeout_s)

    async def __aenter__(self) -> "AsyncEndpointClient":
        await self._client.__aenter__()
        return self

    async def __aexit__(self, *exc) -> None:
        await self._client.__aexit__(*exc)

    async def stream(self, request: GenerateRequest) -> AsyncIterator[Chunk]:
        async for chunk in self._client.stream(for_endpoint(self.endpoint, request)):
            yield chunk

    async def generate(self, request: GenerateRequest):
        async for _ in self.stream(request):
            pass
