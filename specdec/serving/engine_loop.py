"""In-flight batching: one engine loop owns every live sequence and puts each ready one into
every target forward (prompt chunks, decode steps and verification trees together), as
TensorRT-LLM's `inflight_fused_batching`, vLLM and SGLang run.

A thread runs SpecEngine rounds back to back while any sequence lives: requests join at the
next round (their prompt prefilled, in chunks beside the running streams), cancellations
take effect before the next forward, and each round's tokens go to every sequence's sink as
soon as the round is done. No Triton here: the Triton `verifier` model hands requests in
and implements the sinks with response senders (specdec/triton_models/verifier_model.py);
tests drive it in process.

Drafters served apart (a separate model) are asked once per round, concurrently, for every
sequence of theirs that has a reply to hand over (serving/drafter_apart.py's DrafterApart keeps
their rules: merged replies, keep-alive), before the forward that verifies their trees.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable, Hashable, Protocol, Sequence

from specdec.config import SamplingParams
from specdec.engine.speculator import StepResult
from specdec.engine.tree import DraftTree
from specdec.serving.drafter_apart import DrafterApart
from specdec.serving.loop import LoopBackend
from specdec.serving.spec_engine import SpecEngine, StepOutput
from specdec.serving.state import RequestState

log = logging.getLogger(__name__)


def name_os_thread(name: str) -> None:
    """Give the calling thread its name in the OS too (/proc/<pid>/task/*/comm, top -H, perf),
    so a profile of a server process tells the scheduler from the event loop and from
    OpenMP's workers (Python names threads only for itself). Linux; elsewhere nothing."""
    try:
        libc = ctypes.CDLL(None)
        libc.prctl(15, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass


class Sink(Protocol):
    """Where one sequence's outputs go (a Triton response sender, a test's list)."""

    def emit(self, out: StepOutput) -> bool:
        """Deliver one round's output (finished: the last one). False: nobody listens any
        more, and the scheduler drops the sequence."""

    def fail(self, exc: BaseException) -> None:
        """The request ends with this error (its last message)."""


@dataclass(frozen=True)
class RoundInfo:
    """What one round did, for metrics: sequences in the forward (those still prefilling
    among them, and how many of those still had part of their prompt left after it), and
    its wall time."""

    sequences: int
    prefilling: int
    seconds: float
    prompts_left: int = 0

    @property
    def chunked(self) -> bool:
        """Part of a prompt went beside running sequences and the rest waits (chunked prefill)."""
        return self.prompts_left > 0 and self.sequences > self.prefilling


@dataclass(frozen=True)
class _Submit:
    req: RequestState  # validated, its words tokenized (validate_request), before it is posted
    sink: Sink


@dataclass(frozen=True)
class _BetweenRounds:
    change: Callable[[SpecEngine], None]  # run on the loop's thread, between two forwards
    done: concurrent.futures.Future


class EngineLoop:
    """The engine's busy loop: runs SpecEngine rounds on its own thread while any sequence
    lives (what the rounds schedule is the engine's: Speculator, TargetPass). submit() and
    cancel() may be called from any thread; everything that touches the engine (validation
    included: the tokenizer is not shared across threads) runs on the loop's thread, between
    forwards.

    apart_backend(request_id): the calls to the drafter served apart for that sequence
    (start_drafter / draft / release of a LoopBackend); apart_methods: the methods drafted
    there; hidden_methods: those of them that need the target's taps."""

    def __init__(
        self,
        engine: SpecEngine | Callable[[], SpecEngine],
        apart_backend: Callable[[str], LoopBackend] | None = None,
        apart_methods: frozenset[str] = frozenset(),
        hidden_methods: frozenset[str] = frozenset(),
        on_round: Callable[[RoundInfo], None] | None = None,
        on_live: Callable[[int], None] | None = None,
        drafter_keepalive_s: float = 60.0,
        blocking_calls: concurrent.futures.Executor | None = None,
    ):
        """engine: the engine, or a function that builds it, called on the scheduler's own
        thread (what the server does: see _start); on_round: after each forward, before its
        outputs go out; on_live(sequences holding a slot): whenever that may have changed
        (joins, ends, cancels); blocking_calls: the scheduler loop's default executor (the
        blocking half of a call to a drafter served apart), asyncio's own when None."""
        self.engine: SpecEngine | None = engine if isinstance(engine, SpecEngine) else None
        build = (lambda: engine) if isinstance(engine, SpecEngine) else engine
        self.apart_backend, self.apart_methods, self.hidden_methods = apart_backend, apart_methods, hidden_methods
        self.on_round, self.on_live = on_round, on_live
        self.keepalive_s = drafter_keepalive_s
        self._inbox: list[_Submit | str | _BetweenRounds] = []  # submits, cancels (request ids) and changes, in arrival order
        self._lock = threading.Lock()
        self._sinks: dict[str, Sink] = {}
        self._apart: dict[str, DrafterApart] = {}
        self._replies: dict[str, StepResult] = {}  # the last reply of a sequence drafted apart
        # Guided requests whose grammar compiles on the guide worker: they join when it is done.
        self._compiling: dict[str, tuple[RequestState, Sink, concurrent.futures.Future]] = {}
        self._loop = asyncio.new_event_loop()
        if blocking_calls is not None:
            self._loop.set_default_executor(blocking_calls)
        self._wake = asyncio.Event()
        self._stopping = False
        self._ready = threading.Event()
        self._build_error: BaseException | None = None
        self._thread = threading.Thread(target=self._start, args=(build,), name="specdec-scheduler", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._build_error is not None:
            raise self._build_error

    def _start(self, build: Callable[[], SpecEngine]) -> None:
        """Build the engine here, then run. Every forward runs on this thread, and so should
        every other parallel torch call: libgomp spins its idle workers only while the
        process's OpenMP threads fit the CPUs, and a second team (the stub's main thread
        calibrating the planner, say) halves that: the same rounds ran 30% slower (100 vs
        145 tok/s at 16 streams on 2 cores) on a thread other than the one that had
        built the engine."""
        try:
            self.engine = build()
            # After the build: OpenMP's workers, started by its first parallel region on this
            # thread, would inherit the name.
            name_os_thread("specdec-sched")
        except BaseException as exc:  # noqa: BLE001 - raised again in the constructor's thread
            self._build_error = exc
            return
        finally:
            self._ready.set()
        self._loop.run_until_complete(self._main())

    # ---- from any thread -----------------------------------------------------------------
    def submit(self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams, method: str,
               num_draft_tokens: int | None, sink: Sink, validated: bool = False) -> None:
        """The request joins the next round; a bad field is answered through sink.fail.
        Validated here (validate_request), on the caller's thread: the prompt checks and the
        stop and bad words' tokenizing cost what the client chose, so they stay off the thread
        that steps every sequence (as guides do). validated: the request was validated
        already (the Triton verifier's: by the loop in front of it), so only its record is made."""
        try:
            make = self.engine.record if validated else self.engine.prepare_request
            req = make(request_id, prompt_ids, params, method, num_draft_tokens)
        except Exception as exc:  # noqa: BLE001 - a bad request is answered alone
            sink.fail(exc)
            return
        self._post(_Submit(req, sink))

    def cancel(self, request_id: str) -> None:
        """The sequence ends before the next forward (its sink hears finish reason
        `cancelled`); unknown or finished ids are ignored."""
        self._post(request_id)

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop after the current round; live sequences end with an error."""
        self._stopping = True
        self._loop.call_soon_threadsafe(self._wake.set)
        self._thread.join(timeout_s)

    def between_rounds(self, change: Callable[[SpecEngine], None]) -> concurrent.futures.Future:
        """Run change(engine) on the loop's thread before the next forward (a promoted head
        swapped in); the future ends with its result."""
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._post(_BetweenRounds(change, done))
        return done

    def _post(self, item: _Submit | str | _BetweenRounds) -> None:
        with self._lock:
            self._inbox.append(item)
        self._loop.call_soon_threadsafe(self._wake.set)

    # ---- the scheduler's thread -----------------------------------------------------------
    async def _main(self) -> None:
        while not self._stopping:
            if not self._sinks and not self._inbox:
                await self._wake.wait()
            self._wake.clear()
            try:
                self._take_inbox()
                self._join_compiled()
                if self._sinks and not self._stopping:
                    await self._round()
                if self.on_live is not None:
                    self.on_live(len(self.engine.sequences))
            except Exception as exc:  # noqa: BLE001 - the scheduler outlives any one failure; its batch ends with it
                log.exception("a scheduler round failed; its sequences end with the error")
                for request_id in list(self._sinks):
                    self._end(request_id, error=exc)
            await asyncio.sleep(0)  # let finished releases of drafters served apart go out
        shutting_down = RuntimeError("the server is shutting down")
        for request_id in list(self._sinks):
            self._end(request_id, error=shutting_down)
        for _, sink, _ in self._compiling.values():
            sink.fail(shutting_down)
        self._compiling.clear()

    def _take_inbox(self) -> None:
        with self._lock:
            inbox, self._inbox = self._inbox, []
        for item in inbox:
            if isinstance(item, str):
                self._cancel(item)
                continue
            if isinstance(item, _BetweenRounds):
                try:
                    item.done.set_result(item.change(self.engine))
                except Exception as exc:  # noqa: BLE001 - the caller hears it; the loop goes on
                    item.done.set_exception(exc)
                continue
            req = item.req
            try:
                compiling = self.engine.prepare_guide(req)
            except Exception as exc:  # noqa: BLE001 - a bad request is answered alone
                item.sink.fail(exc)
                continue
            if compiling is not None and not compiling.done():
                self._compiling[req.request_id] = (req, item.sink, compiling)
                compiling.add_done_callback(lambda _: self._loop.call_soon_threadsafe(self._wake.set))
                continue
            self._join(req, item.sink, compiling)

    def _join_compiled(self) -> None:
        """Guided requests whose grammar is ready (or refused) join (or are answered)."""
        for request_id in [rid for rid, (_, _, future) in self._compiling.items() if future.done()]:
            req, sink, future = self._compiling.pop(request_id)
            self._join(req, sink, future)

    def _join(self, req: RequestState, sink: Sink, compiled: concurrent.futures.Future | None) -> None:
        try:
            if compiled is not None:
                compiled.result()  # a refused guide raises here, naming the field
            self.engine.add_state(req)
        except Exception as exc:  # noqa: BLE001 - a bad request is answered alone
            sink.fail(exc)
            return
        self._sinks[req.request_id] = sink
        if self.apart_backend is not None and req.speculative and req.method in self.apart_methods:
            self._apart[req.request_id] = DrafterApart(self.apart_backend(req.request_id), req, self.keepalive_s)

    def _cancel(self, request_id: str) -> None:
        waiting = self._compiling.pop(request_id, None)
        if waiting is not None:  # not joined yet: its compile goes on (cached for a repeat), unheard
            req, sink, _ = waiting
            sink.emit(self.engine.cancelled(req))
            return
        if request_id in self.engine.sequences:
            out = self.engine.cancel(request_id)
            self._deliver(out)

    async def _round(self) -> None:
        t0 = time.perf_counter()
        trees = await self._draft_apart()
        t1 = time.perf_counter()
        want_hidden = frozenset(rid for rid, req in self.engine.sequences.items() if req.method in self.hidden_methods)
        live = len(self.engine.sequences)
        self.engine.fit_threads_to_compiles()
        prefilling = sum(1 for req in self.engine.sequences.values() if not req.output_ids)
        outputs = self.engine.step(trees, want_hidden)  # a failure ends the batch (_main)
        if self.on_round is not None:
            left = sum(1 for req in self.engine.sequences.values() if not req.output_ids) if prefilling else 0
            self.on_round(RoundInfo(live, prefilling, time.perf_counter() - t0, left))
        for out in outputs:
            if out.step is not None and out.request_id in self._apart:
                out.step.draft_seconds = t1 - t0
            self._deliver(out)

    async def _draft_apart(self) -> dict[Hashable, DraftTree]:
        """Every sequence drafted apart that has a reply to hand over: its next tree, all
        asked at once (the drafter model batches them into one execute)."""
        ready = [(rid, reply) for rid, reply in self._replies.items() if rid in self._apart]
        self._replies.clear()
        if not ready:
            return {}
        trees = await asyncio.gather(*(self._apart[rid].tree(reply) for rid, reply in ready), return_exceptions=True)
        out = {}
        for (rid, _), tree in zip(ready, trees):
            if isinstance(tree, BaseException):
                self._end(rid, error=tree)
            else:
                out[rid] = tree
        return out

    def _deliver(self, out: StepOutput) -> None:
        sink = self._sinks.get(out.request_id)
        if sink is None:
            return
        try:
            listening = sink.emit(out)
        except Exception:  # noqa: BLE001 - a sink that raises is a listener gone
            log.exception("a sink failed; its sequence is dropped")
            listening = False
        if out.error is not None:  # released by the engine already
            self._end(out.request_id, error=out.error)
        elif out.finished:
            self._forget(out.request_id)
        elif not listening:
            self._end(out.request_id)
        elif out.request_id in self._apart and out.step is not None:
            self._replies[out.request_id] = out.step

    def _end(self, request_id: str, error: BaseException | None = None) -> None:
        """Drop a sequence (its slot freed), telling its sink the error if there is one."""
        sink = self._sinks.get(request_id)
        if request_id in self.engine.sequences:
            try:
                self.engine.cancel(request_id)
            except Exception:  # noqa: BLE001 - freeing what a failed round left behind
                log.exception("releasing %s", request_id)
        if error is not None and sink is not None:
            try:
                sink.fail(error)
            except Exception:  # noqa: BLE001
                log.exception("telling %s of its error", request_id)
        self._forget(request_id)

    def _forget(self, request_id: str) -> None:
        self._sinks.pop(request_id, None)
        self._replies.pop(request_id, None)
        separate = self._apart.pop(request_id, None)
        if separate is not None and separate.started:
            self._loop.create_task(self._release_apart(separate))

    @staticmethod
    async def _release_apart(separate: DrafterApart) -> None:
        try:
            await separate.backend.release(False, True)
        except Exception:  # noqa: BLE001 - the drafter's idle timeout frees it anyway
            log.exception("releasing a drafter served apart")

