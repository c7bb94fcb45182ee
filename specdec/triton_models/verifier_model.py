"""verifier: the target model, the drafters that live beside it (EAGLE-3 heads, Medusa,
n-gram lookup) and the one scheduler that owns every live sequence (in-flight batching,
specdec.serving.scheduler). Decoupled, like TensorRT-LLM's `tensorrt_llm` model: the
speculative loop sends ONE request per sequence; execute() only hands it to the scheduler,
whose thread puts every ready sequence into each target forward (prompt chunks, decode
steps and verification trees together) and streams each sequence's tokens and text round
by round through its response sender, the last one with the final flag. No step of a
sequence crosses Triton's scheduler.

A STOP request (same correlation id) ends a live sequence before the next forward (a client
that cancelled or went away). Drafters served apart (the `drafter` model) are called by the
scheduler, once per round for all of their sequences.
"""
import queue
import threading
import time
from typing import Callable

import numpy as np
import triton_python_backend_utils as pb_utils

import specdec_wire as P
from specdec.config import METHOD_NONE, resolve_model_dir
from specdec.engine.models.loading import read_model_config
from specdec.errors import InvalidRequestError
from specdec.serving.runtime import build_colocated_speculator, colocated_methods, load_tokenizer, tap_layers_of
from specdec.serving.scheduler import BatchScheduler, RoundInfo
from specdec.serving.spec_engine import SpecEngine, StepOutput
from specdec.triton_models import contract as C
from specdec.triton_models.common import (
    HeapTrimmer, Metrics, array, batched, check_max_batch_size, error_response, from_the_loop, internal_key, load_settings,
    refused, scalar, strings, text_tensor,
)
from specdec.triton_models.drafter_calls import DrafterCalls

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class ResponseThread:
    """Sends every sequence's responses from one thread, in order. A send waits for the
    server process to take the response (milliseconds each); sixteen of them a round,
    sent from the scheduler's thread, held every stream for a round's worth of sends
    before the next forward. Here they overlap with it."""

    def __init__(self):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="specdec-responses", daemon=True)
        self._thread.start()

    def put(self, sink: "SenderSink", response, flags: int) -> None:
        self._queue.put((sink, response, flags))

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            sink, response, flags = item
            if not sink.gone:
                try:
                    sink.sender.send(response, flags=flags)
                except Exception:  # noqa: BLE001 - a closed stream: the caller is gone
                    sink.gone = True

    def close(self, timeout_s: float = 10.0) -> None:
        self._queue.put(None)
        self._thread.join(timeout_s)


class SenderSink:
    """A sequence's outputs as responses on its request's sender, through the response
    thread. emit() answers False once a send has failed (the caller is gone): the scheduler
    then drops the sequence, at most a round later."""

    def __init__(self, sender, log_probs: bool, batch_sequences: Callable[[], int], responses: ResponseThread):
        self.sender, self.log_probs, self.responses = sender, log_probs, responses
        self.batch_sequences = batch_sequences  # of the round being delivered
        self.gone = False

    def emit(self, out: StepOutput) -> bool:
        step = out.step
        stats = [float(out.verified), 0, 0, 0, 0, 0, 0, self.batch_sequences()]
        if step is not None:
            stats[1:7] = [step.accepted, step.draft_depth, step.draft_tokens, step.verify_seconds, step.draft_seconds,
                          step.num_draft_tokens]
        outputs = [
            batched(P.OUTPUT_IDS, np.asarray(out.new_token_ids, dtype=np.int32)),
            text_tensor(P.TEXT_OUTPUT, out.text_delta),
            text_tensor(P.FINISH_REASON, out.finish_reason or ""),
            batched(C.STEP_STATS, np.float32(stats)),
        ]
        if self.log_probs:
            outputs.append(batched(P.OUTPUT_LOG_PROBS, np.float32(out.log_probs or [0.0] * len(out.new_token_ids))))
        self.responses.put(self, pb_utils.InferenceResponse(outputs), FINAL if out.finished else 0)
        return not self.gone

    def fail(self, exc: BaseException) -> None:
        self.responses.put(self, error_response(exc), FINAL)


class TritonPythonModel:
    def initialize(self, args):
        settings = load_settings(args)
        check_max_batch_size(args, settings)
        self.settings = settings
        model_dir = resolve_model_dir(settings.model_dir)
        target_cfg = read_model_config(model_dir)

        def build_engine():  # on the scheduler's thread, where every forward will run
            return SpecEngine(None, settings.engine, tokenizer=load_tokenizer(model_dir),
                              speculator=build_colocated_speculator(settings))

        apart = colocated_methods(settings, False)
        key = internal_key()
        self.key = key
        self.heap = HeapTrimmer()
        self.metrics = Metrics(P.VERIFIER_METRICS)
        self._batch_sequences = 0  # in the last round's forward
        self.responses = ResponseThread()
        self.scheduler = BatchScheduler(
            build_engine,
            apart_backend=(lambda rid: DrafterCalls(int(rid), key, target_cfg.vocab_size, settings.engine.max_num_draft_tokens))
            if apart else None,
            apart_methods=frozenset(apart),
            hidden_methods=frozenset(m for m, spec in apart.items() if tap_layers_of(spec, target_cfg)),
            on_round=self._on_round,
            on_live=self._on_live,
            drafter_keepalive_s=settings.idle_timeout_s / 4,
        )
        self.engine = self.scheduler.engine
        self._planner_published = 0.0
        self.metrics.set(P.ACTIVE_SEQUENCES, 0, model="verifier")

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            if not from_the_loop(request, self.key):  # refused without touching any sequence
                sender.send(refused(), flags=FINAL)
                continue
            try:
                request_id = str(request.correlation_id())
                if scalar(request, C.STOP, False, bool):
                    self.scheduler.cancel(request_id)
                    sender.send(pb_utils.InferenceResponse([]), flags=FINAL)
                    continue
                params = C.decode_generation(array(request, C.GENERATION))
                prompt = array(request, P.INPUT_IDS)
                if prompt is None or prompt.size == 0:
                    raise InvalidRequestError(P.INPUT_IDS, "the prompt is empty")
                method = (strings(request, P.SPECULATIVE_METHOD) or [METHOD_NONE])[0] or METHOD_NONE
                budget = scalar(request, C.NUM_DRAFT_TOKENS, None, int)
                self.scheduler.submit(request_id, prompt.reshape(-1).tolist(), params, method, budget,
                                      SenderSink(sender, params.return_log_probs, lambda: self._batch_sequences,
                                                 self.responses))
            except Exception as exc:  # noqa: BLE001 - every request ends with a final response
                sender.send(error_response(exc), flags=FINAL)
        return None

    def _on_round(self, info: RoundInfo) -> None:
        """Scheduler thread, after each forward: the batch-size histogram and gauges."""
        self._batch_sequences = info.sequences
        self.metrics.observe(P.BATCH_SEQUENCES, info.sequences)
        self.heap.maybe_trim()
        speculator = self.engine.speculator
        if speculator.adaptive and info.seconds and self._planner_due():
            planner = speculator.planner
            for method in speculator.adaptive:
                depth = self.settings.methods[method].max_draft_len
                for position, rate in enumerate(planner.position_estimates(method, depth), start=1):
                    self.metrics.set(P.ACCEPTANCE_ESTIMATE, round(rate, 4), method=method, position=str(position))
            self.metrics.set(P.PLANNED_TOKENS_PER_SECOND, round(planner.tokens_per_second, 2))

    def _on_live(self, live: int) -> None:
        self.metrics.set(P.ACTIVE_SEQUENCES, live, model="verifier")
        if not live:  # idle: what the last rounds observed goes out now
            self.metrics.flush()

    def _planner_due(self) -> bool:
        if time.monotonic() - self._planner_published > 1.0:  # beliefs move slowly
            self._planner_published = time.monotonic()
            return True
        return False

    def finalize(self):
        self.scheduler.close()
        self.responses.close()
        self.metrics.flush()
