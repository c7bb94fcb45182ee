"""The speculative loop as a Triton model: a decoupled model that parses a request, admits
it to a sequence slot, hands it to the verifier (whose scheduler batches every live sequence
into each target forward and drafts beside it, or calls the drafter served apart) and turns
the rounds it hands back into the client's responses. Every request ends with exactly one
final response.

Served under three names (each model.py re-exports this class):
  * `ensemble`: the TensorRT-LLM ensemble's contract (text_input in, text_output and the
    perf outputs out). One decoupled model rather than Triton's ensemble scheduler, because
    that scheduler (<= 2.51) checks a client's cancellation only between its steps and
    never tells a running decoupled step: a cancelled stream would run to max_tokens.
    It hosts the verifier (verifier_model.Verifier, contract.ENGINE_HOST): its requests go
    to the scheduler in process (LocalStream), so a streamed token crosses one Python stub.
  * `speculative_loop`: the same, plus input_ids in and output_ids out (like TensorRT-LLM's
    tensorrt_llm_bls), and `ensemble_unary` (unary_model.py): these relay each generation to
    the host as ONE decoupled BLS request (VerifierStream, contract.ENGINE_WIRE).
"""
import asyncio
import concurrent.futures
import contextlib
import functools
import secrets
import threading
import time
from typing import AsyncIterator, Awaitable, Callable

import numpy as np
import triton_python_backend_utils as pb_utils

import specdec_wire as P
from specdec.triton_models import contract as C
from specdec.serving.spec_engine import StepOutput, eos_ids_of_config
from specdec.errors import CapacityError, SpecDecError
from specdec.serving.engine_loop import name_os_thread
from specdec.serving.loop import LoopUpdate, coalesced
from specdec.serving.request import TokenRules, parse_request, served_offer
from specdec.engine.models.loading import read_model_config
from specdec.config import resolve_model_dir
from specdec.serving.runtime import encode_prompt, load_tokenizer
from specdec.serving.state import RequestState
from specdec.engine.logits_processing import TokenLogProbs
from specdec.triton_models.bls import RetiredIterators, decoupled_responses
from specdec.triton_models.verifier_model import Verifier, round_stats
from specdec.triton_models.slots import SharedSlots
from specdec.triton_models.common import Metrics, batched, error_response, inputs_of, internal_key, load_settings, text_tensor

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
VERIFIER_OUT = [P.OUTPUT_IDS, P.TEXT_OUTPUT, P.FINISH_REASON, C.STEP_STATS, C.ROUND_TOKENS]
LOG_PROB_OUTPUTS = {name for name, *_ in P.LOG_PROB_OUTPUTS}
POLL_S = 0.25  # how often a generation waiting for the verifier checks whether its client left
PROBE_AFTER_S = 5.0  # a stream this long without a response asks whether the verifier is alive
RETIRED = RetiredIterators()  # this stub process's finished verifier streams, until a fence (bls.py)


def send(sender, response, flags) -> bool:
    """Send a response; False when the client is gone (the sender refuses)."""
    try:
        sender.send(response, flags=flags)
        return True
    except Exception:  # noqa: BLE001 - a closed stream raises; the caller stops generating
        return False


def received_log_probs(out: dict, top_n: int) -> TokenLogProbs | None:
    """The log probs a verifier response carries (with their alternatives when asked for)."""
    if P.OUTPUT_LOG_PROBS not in out:
        return None
    values = out[P.OUTPUT_LOG_PROBS].reshape(-1).tolist()
    if not top_n or P.TOP_LOG_PROB_IDS not in out:
        return TokenLogProbs(values)
    ids = out[P.TOP_LOG_PROB_IDS].reshape(-1, top_n).tolist()
    lps = out[P.TOP_LOG_PROBS].reshape(-1, top_n).tolist()
    return TokenLogProbs(values, [tuple(zip(i, p)) for i, p in zip(ids, lps)])


def round_update(req: RequestState, stats: C.RoundStats, tokens: list[int], log_probs: TokenLogProbs | None, text: str,
                 reason: str, error: str | None, seconds: float) -> LoopUpdate:
    """One round of the verifier's, recorded on the loop's record of the request (its ids, log
    probs, stats, end) and returned as the update the client hears; reason: the finish reason
    when this round ends the sequence ("" otherwise), error: the error it ends with."""
    req.output_ids.extend(tokens)
    if log_probs is not None:
        req.log_probs.extend(log_probs)
    if stats.verified:
        req.stats.draft_seconds += stats.draft_seconds
        req.stats.verify_seconds += stats.verify_seconds
        req.stats.record_step(stats.draft_depth, stats.draft_tokens, stats.accepted, len(tokens), stats.forced_accepted)
    elif tokens:  # the prompt's first token
        req.stats.cached_prompt_tokens = stats.cached_tokens
    finished = bool(reason) and error is None
    if finished:
        req.finish(reason)
    return LoopUpdate(tokens, text, finished, reason if finished else None, stats.verified, stats.draft_depth,
                      stats.draft_tokens, stats.accepted, stats.draft_seconds, stats.verify_seconds, seconds, log_probs, error)


class RoundPost:
    """Rounds from the scheduler's thread to the coroutines on this process's event loop, with
    one wake-up for all that arrive together: a round of sixteen sequences writes the loop's
    self-pipe once, not sixteen times (each write can preempt a thread of the next forward)."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._items: list[tuple[asyncio.Queue, tuple]] = []
        self._lock = threading.Lock()
        self._wake_pending = False

    def put(self, queue: asyncio.Queue, item: tuple) -> bool:
        with self._lock:
            self._items.append((queue, item))
            if self._wake_pending:
                return True
            self._wake_pending = True
        try:
            self.loop.call_soon_threadsafe(self._hand_out)
            return True
        except RuntimeError:  # the event loop is closed: the model is shutting down
            return False

    def _hand_out(self) -> None:
        with self._lock:
            items, self._items = self._items, []
            self._wake_pending = False
        for queue, item in items:
            queue.put_nowait(item)


class QueueSink:
    """A sequence's rounds handed from the scheduler's thread to the coroutine serving its
    request (engine_loop.Sink): the scheduler goes on to the next forward while the event
    loop's thread builds and sends the client's response."""

    def __init__(self, post: RoundPost, batch_sequences: Callable[[], int]):
        self.post, self.batch_sequences = post, batch_sequences
        self.queue: asyncio.Queue = asyncio.Queue()
        self.listening = True

    def emit(self, out: StepOutput) -> bool:
        return self.listening and self.post.put(self.queue, (out, round_stats(out, self.batch_sequences()), time.perf_counter()))

    def fail(self, exc: BaseException) -> None:
        self.post.put(self.queue, (exc, None, time.perf_counter()))


class LocalStream:
    """One sequence on the verifier this process hosts: submitted to its scheduler, its rounds
    read from a QueueSink. The same interface as VerifierStream, without the BLS hop."""

    def __init__(self, verifier: Verifier, post: RoundPost, req: RequestState):
        self.verifier, self.post, self.req = verifier, post, req
        self.sink: QueueSink | None = None

    def ready(self) -> bool:
        """Another round is already here (the scheduler ran ahead of the responses)."""
        return self.sink is not None and not self.sink.queue.empty()

    async def updates(self, is_cancelled: Callable[[], bool]) -> AsyncIterator[LoopUpdate]:
        """The sequence's updates until it finishes; a client gone (asked at most every POLL_S,
        a round trip to the server each) stops it, and the stream ends `cancelled`."""
        req, loop = self.req, asyncio.get_running_loop()
        sink = self.sink = QueueSink(self.post, lambda: self.verifier.batch_sequences)
        self.verifier.scheduler.submit(req.request_id, req.prompt_ids, req.params, req.method, req.num_draft_tokens, sink,
                                       validated=True)
        stopping, asked, last = False, time.monotonic(), time.perf_counter()
        try:
            while True:
                if not stopping and time.monotonic() - asked >= POLL_S:
                    asked = time.monotonic()
                    if await loop.run_in_executor(None, is_cancelled):
                        stopping = True
                        await self.stop()
                if sink.queue.empty():
                    try:
                        item, stats, at = await asyncio.wait_for(sink.queue.get(), POLL_S)
                    except asyncio.TimeoutError:
                        continue
                else:
                    item, stats, at = sink.queue.get_nowait()
                if isinstance(item, BaseException):
                    raise SpecDecError(str(item))
                out: StepOutput = item
                error = None if out.error is None else str(out.error)
                reason = (out.finish_reason or "") if out.finished else ""
                update = round_update(req, stats, out.new_token_ids, out.log_probs, out.text_delta, reason, error, at - last)
                last = at
                if error is not None:  # its tokens first, then the error
                    if update.token_ids or update.text:
                        yield update
                    raise SpecDecError(error)
                yield update
                if update.finished:
                    return
        finally:
            sink.listening = False  # the scheduler drops a sequence nobody reads any more

    async def stop(self) -> None:
        """End the sequence before the verifier's next forward."""
        self.verifier.scheduler.cancel(self.req.request_id)


class VerifierStream:
    """One sequence on the verifier: ONE decoupled BLS request whose responses are the
    sequence's rounds (ids, text, stats), and a STOP request when it must end early. The
    verifier's scheduler does the rest (in-flight batching); nothing here runs per step
    but relaying."""

    def __init__(self, cid: int, key: bytes | None, req: RequestState, rounds: bool = True):
        """req: the loop's record of the request, validated (its ids, settings, log probs,
        stats, end); rounds: a response per round (a streamed request), else one with every round."""
        self.cid, self.req, self.rounds = cid, req, rounds
        # Always sent, empty without a key: Triton counts a request's inputs against the host's
        # required ones (text_input, max_tokens) and refuses a STOP that carries only `stop`.
        self.key = np.array([key or b""], dtype=np.object_)
        wanted = [P.OUTPUT_LOG_PROBS] if req.params.wants_log_probs else []
        wanted += [P.TOP_LOG_PROB_IDS, P.TOP_LOG_PROBS] if req.params.top_logprobs else []
        self.outputs = VERIFIER_OUT + wanted

    @staticmethod
    def ready() -> bool:
        """Rounds come one BLS response at a time: none is known to wait."""
        return False

    def _request(self, inputs, outputs, correlation_id: int | None = None):
        inputs = {**inputs, C.INTERNAL_KEY: self.key}
        return pb_utils.InferenceRequest(
            model_name=C.ENGINE_HOST, inputs=[batched(k, v) for k, v in inputs.items()], requested_output_names=outputs,
            correlation_id=self.cid if correlation_id is None else correlation_id,
        )

    @staticmethod
    async def _responses(request, while_waiting: Callable[[], Awaitable[None]] | None = None):
        """The responses of a decoupled BLS call (specdec.triton_models.bls: each awaited off
        the event loop, the iterator retired safely); while_waiting runs every POLL_S meanwhile."""
        async for response in decoupled_responses(request, RETIRED, POLL_S, while_waiting):
            if response.has_error():
                raise SpecDecError(response.error().message())
            yield response

    async def updates(self, is_cancelled: Callable[[], bool]) -> AsyncIterator[LoopUpdate]:
        """The sequence's updates until it finishes; a cancelled client stops it (STOP) and
        hears the `cancelled` end."""
        req = self.req
        inputs = {P.INPUT_IDS: np.int32(req.prompt_ids), C.GENERATION: C.encode_generation(req.params),
                  P.SPECULATIVE_METHOD: np.array([req.method.encode()], dtype=np.object_),
                  C.NUM_DRAFT_TOKENS: np.int32([req.num_draft_tokens]), C.ROUNDS: np.bool_([self.rounds])}
        stopping, quiet_since = False, time.monotonic()

        async def stop_if_cancelled():  # a client gone mid-generation stops it before the next forward
            nonlocal stopping, quiet_since
            # The one place this request's is_cancelled() is asked, one call at a time: each
            # answer is also the fence that lets finished BLS iterators go (bls.py).
            if not stopping and await RETIRED.fence(is_cancelled):
                stopping = True
                await self.stop()
            if time.monotonic() - quiet_since > PROBE_AFTER_S:
                # A verifier that died mid-stream never answers this stream again (Triton
                # does not end it): a probe tells a dead one (an error) from a busy one.
                quiet_since = time.monotonic()
                await self.stop(correlation_id=0)

        last = time.perf_counter()
        final: list[LoopUpdate] = []
        async with contextlib.aclosing(self._responses(self._request(inputs, self.outputs), stop_if_cancelled)) as responses:
            async for response in responses:
                out = {name: t.as_numpy()[0] for name in self.outputs if (t := pb_utils.get_output_tensor_by_name(response, name)) is not None}
                if C.STEP_STATS not in out:  # an empty final response
                    continue
                now = time.perf_counter()
                quiet_since = time.monotonic()
                rounds = self._updates(out, now - last)
                last = now
                if rounds and rounds[-1].error is not None:  # its tokens first, then the error (C.FINISH_ERROR_PREFIX)
                    for update in rounds:
                        if update.token_ids or update.text:
                            yield update
                    raise SpecDecError(rounds[-1].error)
                if rounds[-1].finished:  # read on to the stream's end, so its iterator is retired
                    final = rounds
                    continue
                for update in rounds:
                    yield update
                await stop_if_cancelled()
        if final:
            # Before the client hears its end (after that the server may release the request,
            # and is_cancelled() would ask about freed memory): the fence for this stream.
            await RETIRED.fence(is_cancelled)
        for update in final:
            yield update

    def _updates(self, out, seconds) -> list[LoopUpdate]:
        """One update per round the response carries (one when streamed)."""
        req = self.req
        rows = out[C.STEP_STATS].reshape(-1, len(C.STEP_STATS_FIELDS)).tolist()
        counts = out[C.ROUND_TOKENS].reshape(-1).tolist()
        ids = out[P.OUTPUT_IDS].reshape(-1).tolist()
        reason, text = (bytes(out[name].reshape(-1)[0]).decode("utf-8") for name in (P.FINISH_REASON, P.TEXT_OUTPUT))
        all_log_probs = received_log_probs(out, req.params.top_logprobs)
        error = reason[len(C.FINISH_ERROR_PREFIX):] if reason.startswith(C.FINISH_ERROR_PREFIX) else None
        updates, start = [], 0
        for n, (row, count) in enumerate(zip(rows, counts)):
            last = n == len(rows) - 1
            log_probs = None if all_log_probs is None else all_log_probs[start : start + count]
            updates.append(round_update(req, C.RoundStats.from_row(row), ids[start : start + count], log_probs,
                                        text if last else "", reason if last else "", error if last else None,
                                        seconds / len(rows)))
            start += count
        if not rows and error is not None:  # an end with no round in it
            updates.append(LoopUpdate([], "", False, None, error=error))
        return updates

    async def stop(self, correlation_id: int | None = None) -> None:
        """End the sequence before the verifier's next forward. With correlation_id 0, which no
        sequence has, a probe: it raises only if the verifier is gone."""
        async for _ in self._responses(self._request({C.STOP: np.bool_([True])}, [], correlation_id)):
            pass


class TritonPythonModel:
    def initialize(self, args):
        self.inputs, outputs = P.MODELS[args["model_name"]]  # the served name's contract
        self.public_outputs = frozenset(outputs)  # what a client hears (the host's config has the wire's too)
        # A step whose text is all held back (it may start a stop string) still streams its
        # ids where ids are served, so a client's ids are complete; text-only clients hear
        # only text (and the end).
        self.streams_ids = P.OUTPUT_IDS in outputs
        self.settings = load_settings(args)
        model_dir = resolve_model_dir(self.settings.model_dir)
        self.tokenizer = load_tokenizer(model_dir)
        target_cfg = read_model_config(model_dir)
        eos_ids = eos_ids_of_config(target_cfg, self.tokenizer)
        self.offer = served_offer(self.settings, TokenRules(target_cfg.vocab_size, eos_ids, self._tokenize_word))
        self.key = internal_key()
        self.metrics = Metrics(P.LOOP_METRICS)
        self.name = args["model_name"]
        self._waiting = 0  # requests of this process waiting for a slot
        self._live_cids: set[int] = set()
        self._executor_set = False
        # The engine's host serves the wire too: a request carrying any input only the wire has.
        self.verifier = Verifier(self.settings) if self.name == C.ENGINE_HOST else None
        self._wire_only = frozenset(C.ENGINE_WIRE[0]) - frozenset(self.inputs)

    async def execute(self, requests):
        if not self._executor_set:  # each in-flight BLS call holds a pool thread; the default pool is tiny
            asyncio.get_running_loop().set_default_executor(concurrent.futures.ThreadPoolExecutor(max_workers=256))
            # One permit per KV-cache slot, shared with the other served name's process.
            self._slots = SharedSlots(self.settings.engine.max_batch_size)
            self._slot_gauges()  # the series exist from the start (an autoscaler reads 0, not nothing)
            self._post = RoundPost(asyncio.get_running_loop())
            name_os_thread("specdec-loop")
            self._executor_set = True
        if self.verifier is not None:
            on_wire = [any(pb_utils.get_input_tensor_by_name(r, n) is not None for n in self._wire_only) for r in requests]
            self.verifier.serve_internal([r for r, wire in zip(requests, on_wire) if wire])  # hands them over; never waits
            requests = [r for r, wire in zip(requests, on_wire) if not wire]
        # One request's failure must never take the others (or the stub) down with it.
        await asyncio.gather(*(self._serve(request) for request in requests), return_exceptions=True)
        return None

    def finalize(self):
        if self.verifier is not None:
            self.verifier.close()
        self.metrics.close()

    def _parse(self, request):
        """The one request parser (specdec.serving.request): the request validated, its
        prompt tokenized and its token-level rules resolved, once; the verifier takes it as is."""
        req = parse_request(inputs_of(request, self.inputs), self.offer,
                            encode=lambda text, chat: encode_prompt(self.tokenizer, text, chat=chat))
        state = RequestState(
            request_id=str(self._new_cid()), prompt_ids=list(req.prompt_ids), params=req.params, method=req.method,
            num_draft_tokens=req.num_draft_tokens, max_seq_len=self.settings.engine.max_seq_len,
            eos_token_ids=frozenset(req.params.end_ids),
        )
        return req, state

    def _tokenize_word(self, word):
        return self.tokenizer.encode(word, add_special_tokens=False)

    async def _serve(self, request):
        sender = request.get_response_sender()
        try:
            parsed, req = self._parse(request)
        except Exception as exc:  # noqa: BLE001 - every request ends with a final response
            send(sender, error_response(exc), FINAL)
            return
        try:
            slot = await self._admit(sender, req)
            if slot is None:
                return
            try:
                await self._generate(request, sender, parsed, req)
            finally:
                self._slots.release(slot)
                self._slot_gauges()
        finally:
            self._live_cids.discard(int(req.request_id))

    def _new_cid(self):
        """A random 63-bit correlation id, unique among live requests: ids cannot be guessed,
        so no client can aim a request (or an END) at someone else's sequence."""
        while True:
            cid = secrets.randbits(63) or 1
            if cid not in self._live_cids:
                self._live_cids.add(cid)
                return cid

    async def _admit(self, sender, req):
        """Wait (bounded) for a free sequence slot (its permit); refuse as busy, None, when
        none frees in time. The wait happens here, inside the decoupled model, where Triton's
        queue metrics never see it: the slot metrics are the autoscaling signal."""
        timeout = self.settings.admission_timeout_s
        started = time.monotonic()
        slot = None if self._slots.waiting else self._slots.try_acquire()  # no barging past earlier waiters
        if slot is None:
            self._waiting += 1
            self._slot_gauges()
            try:
                slot = await self._slots.acquire(timeout)
            finally:
                self._waiting -= 1
        self.metrics.observe(P.SLOT_WAIT_SECONDS, time.monotonic() - started, model=self.name)
        self._slot_gauges()
        if slot is None:
            self.metrics.inc(P.REQUESTS_TOTAL, reason="busy", method=req.method)
            self.metrics.flush()
            limit = self.settings.engine.max_batch_size
            busy = CapacityError(f"server busy: all {limit} sequence slots are in use; waited {timeout:g} s (admission_timeout_s)")
            send(sender, error_response(busy), FINAL)
        return slot

    def _slot_gauges(self):
        self.metrics.set(P.SLOT_OCCUPANCY, self._slots.held / self._slots.count, model=self.name)
        self.metrics.set(P.SLOT_WAITING, self._waiting, model=self.name)

    async def _generate(self, request, sender, parsed, req):
        stream = parsed.stream
        pieces = []
        verifier = (LocalStream(self.verifier, self._post, req) if self.verifier is not None
                    else VerifierStream(int(req.request_id), self.key, req, rounds=stream))
        finished = False
        # A counted stream hears held-back steps too, so its num_output_tokens add up.
        carries_ids = self.streams_ids or parsed.return_num_output_tokens
        try:
            updates = verifier.updates(request.is_cancelled)
            runs = coalesced(updates, verifier.ready)
            try:
                async for run in runs:
                    for update in run:
                        self._record(req.method, update)
                        pieces.append(update.text)
                    finished = run[-1].finished
                    if finished:  # counters are current before the client hears the end
                        self.metrics.inc(P.REQUESTS_TOTAL, reason=run[-1].finish_reason, method=req.method)
                        self.metrics.flush()
                    text, ids = "".join(u.text for u in run), [t for u in run for t in u.token_ids]
                    if stream and (text or finished or (carries_ids and ids)):
                        log_probs = TokenLogProbs.joined([u.log_probs for u in run], [len(u.token_ids) for u in run],
                                                         req.params.top_logprobs) if req.params.wants_log_probs else None
                        if not send(sender, self._response(request, req, text, ids, log_probs, parsed), FINAL if finished else 0):
                            self.metrics.inc(P.REQUESTS_TOTAL, reason="disconnected", method=req.method)
                            return  # nobody is listening any more: stop generating (finally)
            finally:
                await runs.aclose()
                await updates.aclose()
                if not finished:  # an error or a client gone: the verifier must not run on
                    await self._stop_quietly(verifier)
            if not stream:
                text, ids = "".join(pieces), req.output_ids
                if not parsed.exclude_input_in_output:  # TensorRT-LLM's default: the prompt, then the answer
                    prompt_text = self.tokenizer.decode(req.prompt_ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
                    text, ids = prompt_text + text, req.prompt_ids + ids
                send(sender, self._response(request, req, text, ids, req.log_probs, parsed), FINAL)
        except Exception as exc:  # noqa: BLE001 - every request must end with a final response
            send(sender, error_response(exc), FINAL)
        finally:
            self.metrics.flush()

    @staticmethod
    async def _stop_quietly(verifier: VerifierStream | LocalStream) -> None:
        try:
            await verifier.stop()
        except Exception:  # noqa: BLE001 - the verifier gone too: nothing left to stop
            pass

    def _response(self, request, req, text, token_ids, log_probs, parsed):
        """Only the outputs the caller asked for (the ensemble asks for its own six); the
        log-prob outputs, when nothing in particular was asked for, only with return_log_probs
        (asked for without it they are zeros, as TensorRT-LLM's are); the token counts only
        with their return_num_* flag (TensorRT-LLM's rule; num_output_tokens counts the ids
        this response carries, so a non-streamed echo of the prompt counts it too, as there)."""
        stats = req.stats
        wanted = set(request.requested_output_names()) & self.public_outputs
        with_log_probs = req.params.wants_log_probs
        top_n = req.params.top_logprobs
        flagged = {P.NUM_INPUT_TOKENS: parsed.return_num_input_tokens, P.NUM_OUTPUT_TOKENS: parsed.return_num_output_tokens,
                   P.TOP_LOG_PROB_IDS: top_n > 0, P.TOP_LOG_PROBS: top_n > 0}
        joined = functools.cache(lambda: TokenLogProbs.joined([log_probs if with_log_probs else None], [len(token_ids)], top_n))
        tables = functools.cache(lambda: joined().top_tables(top_n))
        values = {
            P.TEXT_OUTPUT: lambda: text_tensor(P.TEXT_OUTPUT, text),
            P.OUTPUT_IDS: lambda: batched(P.OUTPUT_IDS, np.asarray(token_ids, dtype=np.int32)),
            P.ACCEPTANCE_RATE: lambda: batched(P.ACCEPTANCE_RATE, np.float32([stats.acceptance_rate])),
            P.TOTAL_ACCEPTED_DRAFT_TOKENS: lambda: batched(P.TOTAL_ACCEPTED_DRAFT_TOKENS, np.int32([stats.accepted_tokens])),
            P.TOTAL_DRAFT_TOKENS: lambda: batched(P.TOTAL_DRAFT_TOKENS, np.int32([stats.draft_tokens])),
            P.TOTAL_ACCEPTED_FORCED_TOKENS: lambda: batched(P.TOTAL_ACCEPTED_FORCED_TOKENS, np.int32([stats.forced_accepted_tokens])),
            P.VERIFICATION_STEPS: lambda: batched(P.VERIFICATION_STEPS, np.int32([stats.steps])),
            P.OUTPUT_TOKENS: lambda: batched(P.OUTPUT_TOKENS, np.int32([len(req.output_ids)])),
            P.NUM_CACHED_TOKENS: lambda: batched(P.NUM_CACHED_TOKENS, np.int32([stats.cached_prompt_tokens])),
            P.FINISH_REASON: lambda: text_tensor(P.FINISH_REASON, req.finish_reason or ""),
            P.CUM_LOG_PROBS: lambda: batched(P.CUM_LOG_PROBS, np.float32([sum(req.log_probs.values)])),
            P.OUTPUT_LOG_PROBS: lambda: batched(P.OUTPUT_LOG_PROBS, np.float32([joined().values]).reshape(1, -1)),
            P.TOP_LOG_PROB_IDS: lambda: batched(P.TOP_LOG_PROB_IDS, tables()[0][None]),
            P.TOP_LOG_PROBS: lambda: batched(P.TOP_LOG_PROBS, tables()[1][None]),
            P.NUM_INPUT_TOKENS: lambda: batched(P.NUM_INPUT_TOKENS, np.int32([len(req.prompt_ids)])),
            P.NUM_OUTPUT_TOKENS: lambda: batched(P.NUM_OUTPUT_TOKENS, np.int32([len(token_ids)])),
        }
        return pb_utils.InferenceResponse([
            make() for name, make in values.items()
            if name in self.public_outputs and flagged.get(name, True)
            and (name in wanted or (not wanted and (with_log_probs or name not in LOG_PROB_OUTPUTS)))
        ])

    def _record(self, method, update):
        if not update.verified:
            return
        m = self.metrics
        m.inc(P.DRAFT_SECONDS_TOTAL, update.draft_seconds, method=method)
        m.inc(P.VERIFY_SECONDS_TOTAL, update.verify_seconds, method=method)
        m.inc(P.STEP_SECONDS_TOTAL, update.step_seconds, method=method)
        m.inc(P.DRAFT_TOKENS_TOTAL, update.draft_tokens, method=method)
        m.inc(P.ACCEPTED_TOKENS_TOTAL, update.accepted, method=method)
        m.inc(P.EMITTED_TOKENS_TOTAL, len(update.token_ids), method=method)
        m.inc(P.VERIFICATION_STEPS_TOTAL, 1, method=method)
        m.observe(P.ACCEPTANCE_LENGTH, update.accepted + 1, method=method)
        for position in range(update.draft_depth):
            m.inc(P.DRAFTED_PER_POSITION_TOTAL, 1, method=method, position=str(position))
        for position in range(update.accepted):
            m.inc(P.ACCEPTED_PER_POSITION_TOTAL, 1, method=method, position=str(position))
