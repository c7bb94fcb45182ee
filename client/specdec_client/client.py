"""Clients for the speculative-decoding ensemble over tritonclient: gRPC (default) and
HTTP (generate / generate_stream SSE), sync and asyncio. Streaming yields text chunks with
their arrival times; every failure becomes a specific exception carrying the server's text.

Tensor names come from specdec_wire (the TensorRT-LLM ensemble's names), so this
client drives either this server or a TensorRT-LLM one.
"""
from __future__ import annotations

import json
import os
import queue
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Iterator

import numpy as np

import specdec_wire as P

from specdec_client.errors import ClientConnectionError, RequestTimeoutError, ServerError

PERF_FIELDS = (P.ACCEPTANCE_RATE, *[row[0] for row in P.PERF_COUNTS])


@dataclass
class Chunk:
    text: str
    time: float  # time.perf_counter() at arrival
    perf: dict[str, float] = field(default_factory=dict)
    token_ids: list[int] = field(default_factory=list)  # from models that return output_ids (speculative_loop)
    finish_reason: str | None = None  # on the last chunk: "stop", "length", "eos" or "cancelled"
    # With return_log_probs / top_logprobs (models that return output_ids): per token id, its log
    # prob, and the likeliest top_logprobs (token id, log prob) pairs at its position.
    log_probs: list[float] = field(default_factory=list)
    top_log_probs: list[list[tuple[int, float]]] = field(default_factory=list)


@dataclass
class Generation:
    """A finished request: text, timestamps and the server's perf counters."""

    text: str
    send_time: float
    chunk_times: list[float]
    end_time: float
    perf: dict[str, float]
    token_ids: list[int] = field(default_factory=list)  # empty unless the model returns output_ids
    finish_reason: str | None = None
    log_probs: list[float] = field(default_factory=list)
    top_log_probs: list[list[tuple[int, float]]] = field(default_factory=list)

    @property
    def ttft_s(self) -> float:
        return (self.chunk_times[0] if self.chunk_times else self.end_time) - self.send_time

    @staticmethod
    def from_chunks(chunks, send_time: float) -> "Generation":
        """Fold streamed chunks (consumed now, or already collected) into a Generation."""
        texts, times, perf, ids, reason, log_probs, top = [], [], {}, [], None, [], []
        for chunk in chunks:
            if chunk.text:
                texts.append(chunk.text)
                times.append(chunk.time)
            perf.update(chunk.perf)
            ids += chunk.token_ids
            log_probs += chunk.log_probs
            top += chunk.top_log_probs
            reason = chunk.finish_reason or reason
        return Generation("".join(texts), send_time, times, time.perf_counter(), perf, ids, reason, log_probs, top)


@dataclass(frozen=True)
class GenerateRequest:
    prompt: str
    max_tokens: int = 128
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    method: str | None = None  # None = the server's default method
    num_draft_tokens: int | None = None  # 0 = plain decoding (the matched baseline)
    return_perf_metrics: bool = True
    # The perf outputs the caller reads (None: all of PERF_FIELDS); each one named is one more
    # tensor built, sent and parsed per streamed response.
    perf_outputs: tuple[str, ...] | None = None
    ignore_eos: bool | None = None
    apply_chat_template: bool | None = None
    # TensorRT-LLM's logits rules (None / empty = off)
    min_length: int | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    bad_words: tuple[str, ...] = ()
    # vLLM's min_p, and OpenAI's logit_bias as (token id, bias) pairs (TensorRT-LLM's embedding
    # bias, by token ids); None / empty = off
    min_p: float | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    # Structured output (TensorRT-LLM's guided decoding): "json", "json_schema", "regex" or
    # "ebnf_grammar", and the guide's text (none for "json").
    guide_type: str | None = None
    guide: str | None = None
    # Prefix-cache scope (vLLM's cache_salt): KV is shared only between requests of one salt.
    cache_salt: str | None = None
    # Log probs of the emitted tokens (TensorRT-LLM's return_log_probs; models that return
    # output_ids give them per token), vLLM's top_logprobs alternatives and logprobs_mode.
    return_log_probs: bool | None = None
    top_logprobs: int | None = None
    logprobs_mode: str | None = None
    # Sent always: TensorRT-LLM's default (false) puts the prompt before a non-streamed answer.
    exclude_input_in_output: bool = True

    def fields(self, stream: bool) -> dict[str, Any]:
        """Input name -> python value (None values are omitted)."""
        values = {
            P.TEXT_INPUT: self.prompt, P.MAX_TOKENS: self.max_tokens, P.STREAM: stream,
            P.TEMPERATURE: self.temperature, P.TOP_K: self.top_k, P.TOP_P: self.top_p,
            P.RANDOM_SEED: self.seed, P.SPECULATIVE_METHOD: self.method, P.NUM_DRAFT_TOKENS: self.num_draft_tokens,
            P.RETURN_PERF_METRICS: self.return_perf_metrics, P.IGNORE_EOS: self.ignore_eos,
            P.APPLY_CHAT_TEMPLATE: self.apply_chat_template, P.MIN_LENGTH: self.min_length,
            P.REPETITION_PENALTY: self.repetition_penalty, P.PRESENCE_PENALTY: self.presence_penalty,
            P.FREQUENCY_PENALTY: self.frequency_penalty, P.EXCLUDE_INPUT_IN_OUTPUT: self.exclude_input_in_output,
            P.GUIDED_DECODING_GUIDE_TYPE: self.guide_type, P.GUIDED_DECODING_GUIDE: self.guide,
            P.CACHE_SALT: self.cache_salt, P.MIN_P: self.min_p, P.RETURN_LOG_PROBS: self.return_log_probs,
            P.TOP_LOGPROBS: self.top_logprobs, P.LOGPROBS_MODE: self.logprobs_mode,
        }
        out = {k: v for k, v in values.items() if v is not None}
        if self.stop:
            out[P.STOP_WORDS] = list(self.stop)
        if self.bad_words:
            out[P.BAD_WORDS] = list(self.bad_words)
        if self.logit_bias:
            out[P.EMBEDDING_BIAS_TOKEN_IDS] = [int(token) for token, _ in self.logit_bias]
            out[P.EMBEDDING_BIAS_WEIGHTS] = [float(bias) for _, bias in self.logit_bias]
        return out


_NUMPY_TYPES = {"TYPE_STRING": np.object_, "TYPE_INT32": np.int32, "TYPE_FP32": np.float32, "TYPE_UINT64": np.uint64, "TYPE_BOOL": np.bool_}
_WIRE_TYPES = {"TYPE_STRING": "BYTES", "TYPE_INT32": "INT32", "TYPE_FP32": "FP32", "TYPE_UINT64": "UINT64", "TYPE_BOOL": "BOOL"}


def grpc_inputs(module, fields: dict[str, Any]) -> list:
    """tritonclient InferInput list with a batch dimension of one."""
    specs = P.MODELS["ensemble"][0]
    inputs = []
    for name, value in fields.items():
        spec = specs[name]
        values = value if isinstance(value, list) else [value]
        if spec.dtype == "TYPE_STRING":
            values = [v.encode("utf-8") for v in values]
        array = np.array([values], dtype=_NUMPY_TYPES[spec.dtype])
        tensor = module.InferInput(name, list(array.shape), _WIRE_TYPES[spec.dtype])
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


def requested_outputs(model: str, request: GenerateRequest) -> list[str] | None:
    """The outputs this client reads from `model`'s responses, named in the request so the
    server builds and sends no others (a response of every output is about ten tensors, each
    allocated, copied and serialized per streamed token); None for a model whose contract is
    not ours (a stock TensorRT-LLM ensemble): every output, as before."""
    if model not in P.MODELS:
        return None
    offered = P.MODELS[model][1]
    names = [P.TEXT_OUTPUT, P.FINISH_REASON, P.OUTPUT_IDS]
    if request.return_perf_metrics:
        names += PERF_FIELDS if request.perf_outputs is None else request.perf_outputs
    if request.return_log_probs or request.top_logprobs:
        names += [P.OUTPUT_LOG_PROBS, P.TOP_LOG_PROB_IDS, P.TOP_LOG_PROBS]
    return [name for name in dict.fromkeys(names) if name in offered]


def _requested(module, model: str, request: GenerateRequest, stock: bool) -> list | None:
    """tritonclient's requested outputs; none named for a stock ensemble (its inputs reshaped
    by shape_fields), which lacks some of ours."""
    names = None if stock else requested_outputs(model, request)
    return None if names is None else [module.InferRequestedOutput(name) for name in names]


def outputs_of(result) -> dict[str, np.ndarray]:
    """Every output a gRPC response carries, decoded in one pass (tritonclient's as_numpy scans
    the outputs per name: a dozen scans a streamed token for the names a chunk may hold)."""
    from tritonclient.utils import deserialize_bytes_tensor, triton_to_np_dtype

    response = result.get_response()
    raw = response.raw_output_contents
    out = {}
    for index, output in enumerate(response.outputs):
        if index < len(raw):
            array = deserialize_bytes_tensor(raw[index]) if output.datatype == "BYTES" \
                else np.frombuffer(raw[index], dtype=triton_to_np_dtype(output.datatype))
        elif output.contents.bytes_contents:
            array = np.array(output.contents.bytes_contents)
        else:
            array = np.empty(0, dtype=triton_to_np_dtype(output.datatype))
        out[output.name] = array.reshape(list(output.shape))
    return out


def _text_of(outputs: dict[str, np.ndarray], name: str = P.TEXT_OUTPUT) -> str:
    array = outputs.get(name)
    if array is None or array.size == 0:
        return ""
    value = array.reshape(-1)[0]
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def _perf_of(outputs: dict[str, np.ndarray]) -> dict[str, float]:
    return {name: float(outputs[name].reshape(-1)[0]) for name in PERF_FIELDS if name in outputs and outputs[name].size}


def _is_final(result) -> bool:
    params = result.get_response().parameters
    return "triton_final_response" in params and params["triton_final_response"].bool_param


def _array_of(outputs: dict[str, np.ndarray], name: str) -> list:
    """An output as a flat list ([] from a model without it, e.g. the ensemble's output_ids)."""
    array = outputs.get(name)
    return [] if array is None else array.reshape(-1).tolist()


def log_probs_of(ids: list[int], values: list, top_ids: list, top_values: list) -> tuple[list[float], list[list[tuple[int, float]]]]:
    """Per-token log probs and their alternatives from the flat tensors (empty when the
    response carries none: the server sends them with return_log_probs / top_logprobs)."""
    values = [float(v) for v in values][: len(ids)]
    width = len(top_ids) // len(ids) if ids and top_ids else 0
    top = [[(int(top_ids[i * width + j]), float(top_values[i * width + j])) for j in range(width)] for i in range(len(ids))] if width else []
    return values, top


def _chunk_of(result, arrived: float) -> tuple[Chunk | None, bool]:
    """(the chunk a gRPC stream response carries, or None for an empty one; is it the last)."""
    outputs = outputs_of(result)
    ids = [int(t) for t in _array_of(outputs, P.OUTPUT_IDS)]
    text, perf, reason = _text_of(outputs), _perf_of(outputs), _text_of(outputs, P.FINISH_REASON) or None
    log_probs, top = log_probs_of(ids, _array_of(outputs, P.OUTPUT_LOG_PROBS), _array_of(outputs, P.TOP_LOG_PROB_IDS),
                                  _array_of(outputs, P.TOP_LOG_PROBS))
    chunk = Chunk(text, arrived, perf, ids, reason, log_probs, top) if text or perf or ids or reason else None
    return chunk, _is_final(result)


def _admin_headers(grpc: bool = False) -> dict[str, str]:
    """The header Triton's restricted (admin) APIs ask for, when this process knows the key."""
    key = os.environ.get(P.ADMIN_KEY_ENV)
    return {P.ADMIN_KEY_GRPC_HEADER if grpc else P.ADMIN_KEY_HEADER: key} if key else {}


# What gRPC says when the server process goes away under an open stream (a crash or a
# restart): the request is lost, not refused; a retry after the server is back may succeed.
_CONNECTION_LOST = ("stream removed", "socket closed", "connection reset", "goaway", "rst_stream")


def _grpc_error(exc: Exception) -> Exception:
    text = str(exc)
    lowered = text.lower()
    if any(sign in lowered for sign in _CONNECTION_LOST):
        return ClientConnectionError(f"the server closed the connection mid-request (it stopped or restarted; "
                                     f"retry once it is live again): {text}")
    if "unavailable" in lowered or "failed to connect" in lowered or "connection refused" in lowered:
        return ClientConnectionError(text)
    # gRPC's own deadline ("Deadline Exceeded"); a server message that merely mentions a
    # timeout setting (e.g. admission_timeout_s) is the server's answer, not a client timeout.
    if "deadline exceeded" in text.lower() or "timed out" in text.lower():
        return RequestTimeoutError(text)
    return ServerError(text)


class SpecDecClient:
    """Synchronous client. url: host:port of gRPC (default 8001) or HTTP (8000)."""

    def __init__(self, url: str = "localhost:8001", protocol: str = "grpc", model: str = "ensemble", timeout_s: float | None = 600.0,
                 shape_fields: Callable[[dict[str, Any]], dict[str, Any]] | None = None):
        """shape_fields: rewrites each request's inputs before they are sent (a stock
        TensorRT-LLM ensemble takes only its own; specdec_client.endpoints.stock_fields)."""
        if protocol not in ("grpc", "http"):
            raise ValueError(f"protocol must be 'grpc' or 'http', got {protocol!r}")
        self.url, self.protocol, self.model, self.timeout_s = url, protocol, model, timeout_s
        self._shape_fields = shape_fields
        self._grpc = None

    # ---- health -----------------------------------------------------------------------
    def health(self) -> dict[str, Any]:
        """{'live': bool, 'ready': bool, 'models': [{'name', 'state'}]}; raises ClientConnectionError.
        The model list comes from the repository index, an admin API: with the admin key
        (SPECDEC_ADMIN_KEY) it lists every model; without it, the readiness of this
        project's models (health API, open to all)."""
        try:
            if self.protocol == "grpc":
                client = self._grpc_client()
                live, ready = client.is_server_live(), client.is_server_ready()
                try:
                    index = client.get_model_repository_index(headers=_admin_headers(grpc=True), as_json=True).get("models", [])
                except Exception:  # noqa: BLE001 - restricted without the key
                    index = [{"name": m, "state": "READY" if client.is_model_ready(m) else "UNAVAILABLE"} for m in P.MODELS]
            else:
                live = self._http_status("/v2/health/live") == 200
                ready = self._http_status("/v2/health/ready") == 200
                try:
                    index = json.loads(self._http_post("/v2/repository/index", {}, _admin_headers()).read() or b"[]")
                except ServerError:  # restricted without the key
                    index = [{"name": m, "state": "READY" if self._http_status(f"/v2/models/{m}/ready") == 200 else "UNAVAILABLE"}
                             for m in P.MODELS]
            return {"live": live, "ready": ready, "models": [{"name": m["name"], "state": m.get("state", "")} for m in index]}
        except (ClientConnectionError, ServerError):
            raise
        except Exception as exc:  # noqa: BLE001 - normalised into our exception types
            raise _grpc_error(exc) from exc

    def server_metadata(self) -> dict[str, Any]:
        """The server's metadata endpoint: {'name', 'version', 'extensions'}."""
        try:
            if self.protocol == "grpc":
                return dict(self._grpc_client().get_server_metadata(as_json=True))
            with urllib.request.urlopen(f"http://{self.url}/v2", timeout=self.timeout_s) as resp:
                return json.loads(resp.read())
        except (urllib.error.URLError, OSError) as exc:
            raise ClientConnectionError(f"{self.url}: {exc}") from exc
        except Exception as exc:  # noqa: BLE001 - normalised into our exception types
            raise _grpc_error(exc) from exc

    # ---- head promotion ---------------------------------------------------------------
    def promote_heads(self, heads: dict[str, str]) -> str:
        """Serve new drafting heads without a restart (kind -> a head directory as the server
        sees it; kinds: P.HEAD_PARAMETERS): an admin request (SPECDEC_ADMIN_KEY) to the model
        that hosts the engine, which builds the new drafters beside the running ones and swaps
        them in between two forwards. Running streams finish with the head they started with;
        the next ones draft with the new head. Returns the server's message once it serves.
        gRPC only (the engine's host is decoupled)."""
        unknown = set(heads) - set(P.HEAD_PARAMETERS)
        if unknown:
            raise ValueError(f"no head kind {sorted(unknown)[0]!r}; known: {', '.join(P.HEAD_PARAMETERS)}")
        if self.protocol != "grpc":
            raise ValueError("promote_heads speaks gRPC (the engine's host model is decoupled)")
        key = os.environ.get(P.ADMIN_KEY_ENV, "")
        import tritonclient.grpc as grpcclient

        inputs = []
        for name, value in ((P.PROMOTE_HEADS, json.dumps(heads)), (P.ADMIN_KEY, key)):
            tensor = grpcclient.InferInput(name, [1, 1], "BYTES")
            tensor.set_data_from_numpy(np.array([[value.encode()]], dtype=object))
            inputs.append(tensor)
        client = grpcclient.InferenceServerClient(self.url)
        results: queue.Queue = queue.Queue()
        try:
            client.start_stream(callback=lambda result, error: results.put((result, error)), stream_timeout=self.timeout_s)
            client.async_stream_infer(P.ENGINE_HOST_MODEL, inputs)
            try:
                result, error = results.get(timeout=self.timeout_s)
            except queue.Empty:
                raise RequestTimeoutError(f"no answer to the promotion within {self.timeout_s} s") from None
            if error is not None:
                raise _grpc_error(error)
            return _text_of(outputs_of(result))
        except (ClientConnectionError, ServerError, RequestTimeoutError):
            raise
        except Exception as exc:  # noqa: BLE001 - normalised into our exception types
            raise _grpc_error(exc) from exc
        finally:
            client.stop_stream()
            client.close()

    # ---- generation -------------------------------------------------------------------
    def stream(self, request: GenerateRequest) -> Iterator[Chunk]:
        """Yield chunks as they arrive. Closing the generator early cancels the request."""
        if self.protocol == "grpc":
            yield from self._grpc_stream(request, stream=True)
        else:
            yield from self._sse(request)

    def generate(self, request: GenerateRequest, stream: bool = True) -> Generation:
        """Run a request to completion (streamed or one response) and time it."""
        send = time.perf_counter()
        if stream:
            return Generation.from_chunks(self.stream(request), send)
        if self.protocol == "grpc":
            return Generation.from_chunks(self._grpc_stream(request, stream=False), send)
        body = json.loads(self._http_post(f"/v2/models/{self.model}/generate", request.fields(False)).read())
        now = time.perf_counter()
        perf = {k: float(body[k]) for k in PERF_FIELDS if k in body}
        return Generation(body.get(P.TEXT_OUTPUT, ""), send, [now], now, perf, finish_reason=body.get(P.FINISH_REASON) or None)

    def close(self) -> None:
        if self._grpc is not None:
            self._grpc.close()
            self._grpc = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---- gRPC -------------------------------------------------------------------------
    def _grpc_client(self):
        if self._grpc is None:
            import tritonclient.grpc as grpcclient

            self._grpc = grpcclient.InferenceServerClient(self.url)
        return self._grpc

    def _grpc_stream(self, request: GenerateRequest, stream: bool) -> Iterator[Chunk]:
        import tritonclient.grpc as grpcclient

        client = grpcclient.InferenceServerClient(self.url)  # one stream per client object
        results: queue.Queue = queue.Queue()
        finished = False
        try:
            client.start_stream(callback=lambda result, error: results.put((result, error, time.perf_counter())),
                                stream_timeout=self.timeout_s)
            client.async_stream_infer(self.model, grpc_inputs(grpcclient, request.fields(stream)),
                                      outputs=_requested(grpcclient, self.model, request, self._shape_fields is not None),
                                      enable_empty_final_response=True)
            while True:
                try:
                    result, error, arrived = results.get(timeout=self.timeout_s)
                except queue.Empty:
                    raise RequestTimeoutError(f"no response within {self.timeout_s} s") from None
                if error is not None:
                    finished = True
                    raise _grpc_error(error)
                chunk, final = _chunk_of(result, arrived)
                if chunk is not None:
                    yield chunk
                if final:
                    finished = True
                    return
        except grpcclient.InferenceServerException as exc:
            raise _grpc_error(exc) from exc
        finally:
            try:
                client.stop_stream(cancel_requests=not finished)
            finally:
                client.close()

    # ---- HTTP -------------------------------------------------------------------------
    def _http_status(self, path: str) -> int:
        try:
            with urllib.request.urlopen(f"http://{self.url}{path}", timeout=self.timeout_s) as resp:
                return resp.status
        except urllib.error.HTTPError as exc:
            return exc.code
        except (urllib.error.URLError, OSError) as exc:
            raise ClientConnectionError(f"{self.url}: {exc}") from exc

    def _http_post(self, path: str, body: dict, headers: dict[str, str] | None = None):
        data = json.dumps(body).encode()
        req = urllib.request.Request(f"http://{self.url}{path}", data=data, headers={"Content-Type": "application/json", **(headers or {})})
        try:
            return urllib.request.urlopen(req, timeout=self.timeout_s)
        except urllib.error.HTTPError as exc:
            raise ServerError(_http_error_text(exc.read())) from exc
        except TimeoutError as exc:
            raise RequestTimeoutError(str(exc)) from exc
        except (urllib.error.URLError, OSError) as exc:
            raise ClientConnectionError(f"{self.url}: {exc}") from exc

    def _sse(self, request: GenerateRequest) -> Iterator[Chunk]:
        response = self._http_post(f"/v2/models/{self.model}/generate_stream", request.fields(True))
        with response:  # closing the connection early cancels the request on the server
            for event in _sse_events(response):
                yield event


def _http_error_text(raw: bytes) -> str:
    try:
        return json.loads(raw).get("error", raw.decode())
    except (ValueError, AttributeError):
        return raw.decode("utf-8", "replace")


def _event_chunk(payload: dict) -> Chunk:
    if "error" in payload:
        raise ServerError(payload["error"])
    perf = {k: float(payload[k]) for k in PERF_FIELDS if k in payload}
    ids = [int(t) for t in _flat(payload.get(P.OUTPUT_IDS, []))]
    log_probs, top = log_probs_of(ids, _flat(payload.get(P.OUTPUT_LOG_PROBS, [])), _flat(payload.get(P.TOP_LOG_PROB_IDS, [])),
                                  _flat(payload.get(P.TOP_LOG_PROBS, [])))
    return Chunk(payload.get(P.TEXT_OUTPUT, ""), time.perf_counter(), perf, ids, payload.get(P.FINISH_REASON) or None, log_probs, top)


def _flat(value) -> list:
    """A JSON tensor (a scalar or nested lists) as a flat list."""
    if not isinstance(value, list):
        return [value]
    return [item for part in value for item in _flat(part)]


def _sse_events(lines) -> Iterator[Chunk]:
    # Triton's generate_stream sends each response as one `data:` line. No SSE library here:
    # httpx-sse reads httpx responses only, and this client's transports are urllib (sync)
    # and aiohttp (asyncio, chosen for the benchmark's many concurrent streams).
    for raw in lines:
        line = raw.decode("utf-8").strip()
        if line.startswith("data:"):
            yield _event_chunk(json.loads(line[5:]))


class AsyncSpecDecClient:
    """asyncio client: gRPC through tritonclient.grpc.aio, HTTP SSE through aiohttp.

    Used as `async with AsyncSpecDecClient(...) as client:` it keeps one gRPC channel /
    HTTP session for all requests (no connection set-up inside a timed request); used
    without `async with`, each request opens and closes its own connection.
    """

    def __init__(self, url: str = "localhost:8001", protocol: str = "grpc", model: str = "ensemble", timeout_s: float | None = 600.0,
                 shape_fields: Callable[[dict[str, Any]], dict[str, Any]] | None = None):
        """shape_fields: rewrites each request's inputs before they are sent (a stock
        TensorRT-LLM ensemble takes only its own; specdec_client.endpoints.stock_fields)."""
        if protocol not in ("grpc", "http"):
            raise ValueError(f"protocol must be 'grpc' or 'http', got {protocol!r}")
        self.url, self.protocol, self.model, self.timeout_s = url, protocol, model, timeout_s
        self._shape_fields = shape_fields
        self._session = None  # shared aiohttp session (inside `async with`)
        self._aio = None  # shared tritonclient.grpc.aio client (inside `async with`)

    async def __aenter__(self) -> "AsyncSpecDecClient":
        if self.protocol == "grpc":
            import tritonclient.grpc.aio as aioclient

            self._aio = aioclient.InferenceServerClient(self.url)
        else:
            import aiohttp

            # No connection cap: a benchmark's concurrency must not queue inside the client.
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_s),
                                                  connector=aiohttp.TCPConnector(limit=0))
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        if self._aio is not None:
            await self._aio.close()
            self._aio = None
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _fields(self, request: GenerateRequest, stream: bool) -> dict[str, Any]:
        fields = request.fields(stream)
        return fields if self._shape_fields is None else self._shape_fields(fields)

    async def stream(self, request: GenerateRequest) -> AsyncIterator[Chunk]:
        gen = self._grpc_stream(request, True) if self.protocol == "grpc" else self._sse(request)
        async for chunk in gen:
            yield chunk

    async def generate(self, request: GenerateRequest, stream: bool = True) -> Generation:
        send = time.perf_counter()
        gen = self.stream(request) if stream or self.protocol == "http" else self._grpc_stream(request, False)
        return Generation.from_chunks([chunk async for chunk in gen], send)

    async def _grpc_stream(self, request: GenerateRequest, stream: bool) -> AsyncIterator[Chunk]:
        import tritonclient.grpc as grpcclient
        import tritonclient.grpc.aio as aioclient

        owned = self._aio is None
        client = aioclient.InferenceServerClient(self.url) if owned else self._aio
        fields = self._fields(request, stream)

        async def requests():
            yield {"model_name": self.model, "inputs": grpc_inputs(grpcclient, fields),
                   "outputs": _requested(grpcclient, self.model, request, self._shape_fields is not None),
                   "enable_empty_final_response": True}

        finished = False
        responses = None
        try:
            responses = client.stream_infer(requests(), stream_timeout=self.timeout_s)
            async for result, error in responses:
                arrived = time.perf_counter()
                if error is not None:
                    finished = True  # the server ends a request with its error
                    raise _grpc_error(error)
                chunk, final = _chunk_of(result, arrived)
                if chunk is not None:
                    yield chunk
                if final:
                    finished = True
                    return
        except grpcclient.InferenceServerException as exc:
            raise _grpc_error(exc) from exc
        except grpc_aio_errors() as exc:
            raise _grpc_error(exc) from exc
        finally:
            if responses is not None and not finished:
                responses.cancel()  # cancels the unfinished request on the server
            if owned:
                await client.close()

    async def _sse(self, request: GenerateRequest) -> AsyncIterator[Chunk]:
        import aiohttp

        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        owned = self._session is None
        session = aiohttp.ClientSession(timeout=timeout) if owned else self._session
        try:
            # Leaving the response context early closes the connection: the server cancels.
            async with session.post(f"http://{self.url}/v2/models/{self.model}/generate_stream", json=self._fields(request, True)) as resp:
                if resp.status != 200:
                    raise ServerError(_http_error_text(await resp.read()))
                async for raw in resp.content:
                    line = raw.decode("utf-8").strip()
                    if line.startswith("data:"):
                        yield _event_chunk(json.loads(line[5:]))
        except aiohttp.ClientConnectionError as exc:
            raise ClientConnectionError(f"{self.url}: {exc}") from exc
        except TimeoutError as exc:
            raise RequestTimeoutError(str(exc)) from exc
        finally:
            if owned:
                await session.close()


def grpc_aio_errors() -> tuple[type[BaseException], ...]:
    """grpc.aio's own errors (e.g. UNAVAILABLE before any response), when grpc is loaded."""
    import grpc

    return (grpc.aio.AioRpcError,)
