"""The verifier: the target model, the drafters that live beside it (EAGLE-3 heads, Medusa,
n-gram lookup) and the one scheduler that owns every live sequence (in-flight batching,
specdec.serving.engine_loop), hosted inside the `ensemble` model (loop_model.py), the model
a client talks to: a streamed token crosses one Python stub, not two (issue 60: the relay
stub and its per-round BLS responses cost a third of the served throughput at 16 streams).

Two ways in. The ensemble's own requests are handed to the scheduler in process
(LocalStream in loop_model.py). The other served names (`speculative_loop`,
`ensemble_unary`) relay through the internal wire, like TensorRT-LLM's BLS in front of its
decoupled `tensorrt_llm` model: ONE decoupled request per sequence, carrying the internal
key, answered round by round (ids, text, stats) through its response sender, the last one
with the final flag (serve_internal). No step of a sequence crosses Triton's scheduler.

A STOP request (same correlation id) ends a live sequence before the next forward (a client
that cancelled or went away). Drafters served apart (the `drafter` model) are called by the
scheduler, once per round for all of their sequences.
"""
import dataclasses
import json
import threading
import time
from typing import Callable

import numpy as np
import torch
import triton_python_backend_utils as pb_utils

import specdec_wire as P
from specdec.config import METHOD_NONE, ServingConfig, resolve_model_dir, team_size
from specdec.engine.models.loading import read_model_config
from specdec.engine.models.native_forward import engine_info
from specdec.errors import InvalidRequestError
from specdec.engine.logits_processing import TokenLogProbs
from specdec.serving.heap import HeapTrimmer
from specdec.serving.placement import built_on_the_forwards_cores, pool_on
from specdec.serving.runtime import build_colocated_speculator, build_drafters, colocated_methods, load_tokenizer, tap_layers_of
from specdec.serving.engine_loop import EngineLoop, RoundInfo
from specdec.serving.spec_engine import SpecEngine, StepOutput
from specdec.triton_models import contract as C
from specdec.triton_models.common import (
    Metrics, array, batched, core_split, error_response, from_an_admin, from_the_loop, internal_key, refused, scalar,
    strings, text_tensor,
)
from specdec.triton_models.drafter_calls import DrafterCalls

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


def round_stats(out: StepOutput, batch_sequences: int) -> C.RoundStats:
    """The verifier's numbers for one round of one sequence."""
    step = out.step
    of_step = {} if step is None else dict(
        accepted=step.accepted, draft_depth=step.draft_depth, draft_tokens=step.draft_tokens, verify_seconds=step.verify_seconds,
        draft_seconds=step.draft_seconds, num_draft_tokens=step.num_draft_tokens, forced_accepted=step.forced_accepted,
        cached_tokens=step.cached_tokens)
    return C.RoundStats(verified=out.verified, batch_sequences=batch_sequences, **of_step)


class SenderSink:
    """A sequence's outputs as responses on its request's sender. Sent from the scheduler's
    thread, which also makes the background work's other calls into Triton (metrics), so one
    thread talks to the server. (A sender thread of its own, overlapping sends with the next
    forward, measured within noise, and `make test` hung one request with it; the cause was
    not found, so it was not kept.)"""

    def __init__(self, sender, log_probs: bool, batch_sequences: Callable[[], int], rounds: bool = True, top_logprobs: int = 0):
        """rounds: a response per round (streamed); False: one final response with every round;
        top_logprobs: how many alternatives each token's log prob comes with (0: none)."""
        self.sender, self.log_probs, self.rounds, self.top_logprobs = sender, log_probs, rounds, top_logprobs
        self.batch_sequences = batch_sequences  # of the round being delivered
        self._held: list[tuple[StepOutput, list[float]]] = []  # rounds not sent yet (rounds=False)
        self._sent = False  # a response went out: an error must then ride in a normal one (C.FINISH_ERROR_PREFIX)
        self._closed = False

    def emit(self, out: StepOutput) -> bool:
        self._held.append((out, round_stats(out, self.batch_sequences()).to_row()))
        final = out.finished or out.error is not None
        if not (self.rounds or final):
            return True
        held, self._held = self._held, []
        reason = out.finish_reason or "" if out.error is None else C.FINISH_ERROR_PREFIX + str(out.error)
        try:
            self.sender.send(self._response(held, reason), flags=FINAL if final else 0)
            self._sent, self._closed = True, final
            return True
        except Exception:  # noqa: BLE001 - a closed stream: the caller is gone
            return False

    def _response(self, held: list[tuple[StepOutput, list[float]]], reason: str) -> "pb_utils.InferenceResponse":
        """One response carrying the held rounds (none: an end alone) and the finish reason."""
        ids = [t for o, _ in held for t in o.new_token_ids]
        outputs = [
            batched(P.OUTPUT_IDS, np.asarray(ids, dtype=np.int32)),
            text_tensor(P.TEXT_OUTPUT, "".join(o.text_delta for o, _ in held)),
            text_tensor(P.FINISH_REASON, reason),
            batched(C.STEP_STATS, np.float32([row for _, row in held]).reshape(-1, len(C.STEP_STATS_FIELDS))),
            batched(C.ROUND_TOKENS, np.int32([len(o.new_token_ids) for o, _ in held])),
        ]
        if self.log_probs:
            log_probs = TokenLogProbs.joined([o.log_probs for o, _ in held], [len(o.new_token_ids) for o, _ in held], self.top_logprobs)
            # In the ensemble's shapes (C.ENGINE_WIRE: the wire shares the host's tensor names).
            outputs.append(batched(P.OUTPUT_LOG_PROBS, np.float32(log_probs.values)[None]))
            if self.top_logprobs:
                ids, values = log_probs.top_tables(self.top_logprobs)
                outputs += [batched(P.TOP_LOG_PROB_IDS, ids[None]), batched(P.TOP_LOG_PROBS, values[None])]
        return pb_utils.InferenceResponse(outputs)

    def fail(self, exc: BaseException) -> None:
        """The sequence ends with exc: an error response, or after rounds went out a final
        round that carries it (C.FINISH_ERROR_PREFIX); nothing when emit already ended it so."""
        if self._closed:
            return
        try:
            if self._sent:
                self.sender.send(self._response([], C.FINISH_ERROR_PREFIX + str(exc)), flags=FINAL)
            else:
                self.sender.send(error_response(exc), flags=FINAL)
            self._closed = True
        except Exception:  # noqa: BLE001 - nobody to tell
            pass


class Verifier:
    """The engine and its scheduler inside the model that hosts them (loop_model.py)."""

    def __init__(self, settings: ServingConfig):
        self.settings = settings
        model_dir = resolve_model_dir(settings.model_dir)
        target_cfg = read_model_config(model_dir)
        split = core_split()
        threads = team_size(settings.threads, C.VERIFIER_THREADS, torch.get_num_threads())
        if split is not None:  # the team the cores were split for
            threads = len(split.forward)

        def build_engine():  # on the scheduler's thread, where every forward will run
            def build() -> SpecEngine:
                if threads:  # OpenMP's team size is per thread: this one runs the forwards
                    torch.set_num_threads(int(threads))
                return SpecEngine(None, settings.engine, tokenizer=load_tokenizer(model_dir),
                                  speculator=build_colocated_speculator(settings))

            return build() if split is None else built_on_the_forwards_cores(split, build)

        apart = colocated_methods(settings, False)
        key = internal_key()
        self.key = key
        self.heap = HeapTrimmer()
        self.metrics = Metrics(P.VERIFIER_METRICS)
        self._batch_sequences = 0  # in the last round's forward
        self.scheduler = EngineLoop(
            build_engine,
            apart_backend=(lambda rid: DrafterCalls(int(rid), key, target_cfg.vocab_size, settings.engine.max_num_draft_tokens))
            if apart else None,
            apart_methods=frozenset(apart),
            hidden_methods=frozenset(m for m, spec in apart.items() if tap_layers_of(spec, target_cfg)),
            on_round=self._on_round,
            on_live=self._on_live,
            drafter_keepalive_s=settings.idle_timeout_s / 4,
            # started by the scheduler's thread, on the forward's cores, unless told where
            blocking_calls=None if split is None else pool_on(split.rest, "specdec-sched-io"),
        )
        self.engine = self.scheduler.engine
        self._planner_published = 0.0
        self._prefix_published = (0, 0, 0)  # prefix-cache counters already published
        self.metrics.set(P.ACTIVE_SEQUENCES, 0, model="verifier")
        target = self.engine.speculator.target_pass.target
        self.metrics.set(P.ENGINE_INFO, 1, **engine_info(target, settings.engine.weight_format))

    @property
    def batch_sequences(self) -> int:
        """Sequences in the last round's forward."""
        return self._batch_sequences

    def serve_internal(self, requests) -> None:
        """Requests of the internal wire (C.ENGINE_WIRE), from the relays in front."""
        for request in requests:
            sender = request.get_response_sender()
            if array(request, P.PROMOTE_HEADS) is not None:  # an admin's, not the loop's
                self._promote_request(request, sender)
                continue
            if not from_the_loop(request, self.key):  # refused without touching any sequence
                sender.send(refused(), flags=FINAL)
                continue
            try:
                request_id = str(request.correlation_id())
                if scalar(request, C.STOP, False, bool):
                    self.scheduler.cancel(request_id)
                    sender.send(pb_utils.InferenceResponse([]), flags=FINAL)
                    continue
                # The loop validated this request (validate_request) and only the loop holds
                # the key: what is read here is the wire's form, not the request's fields.
                params = C.decode_generation(array(request, C.GENERATION))
                prompt = array(request, P.INPUT_IDS)
                if prompt is None or prompt.size == 0:
                    raise InvalidRequestError(P.INPUT_IDS, "is required")
                method = (strings(request, P.SPECULATIVE_METHOD) or [METHOD_NONE])[0] or METHOD_NONE
                budget = scalar(request, C.NUM_DRAFT_TOKENS, 0, int)
                sink = SenderSink(sender, params.wants_log_probs, lambda: self._batch_sequences, scalar(request, C.ROUNDS, True, bool),
                                  params.top_logprobs)
                self.scheduler.submit(request_id, prompt.reshape(-1).tolist(), params, method, budget, sink, validated=True)
            except Exception as exc:  # noqa: BLE001 - every request ends with a final response
                sender.send(error_response(exc), flags=FINAL)

    def promote(self, heads: dict[str, str], timeout_s: float = 120.0) -> str:
        """Serve new heads (kind -> directory) without a restart: build their drafters beside
        the running engine (this thread), then swap them in between two forwards. Sequences
        already running finish with the head they started with; the next ones draft with the
        new one. Methods drafted apart (the `drafter` model) keep theirs."""
        settings = self.settings.with_heads(heads)
        changed = {name: spec for name, spec in colocated_methods(settings).items() if spec != self.settings.methods[name]}
        if not changed:
            raise InvalidRequestError(P.PROMOTE_HEADS, f"no method drafted beside the target uses a {', '.join(heads)} head")
        target = self.engine.speculator.target_pass.target
        try:
            drafters = build_drafters(target.cfg, changed, settings.engine, resolve_model_dir(settings.model_dir), embed=target.embed)
        except Exception as exc:  # noqa: BLE001 - a head that does not load is the request's fault, named
            raise InvalidRequestError(", ".join(P.HEAD_PARAMETERS[k] for k in heads), f"the head does not load: {exc}") from exc
        self.scheduler.between_rounds(lambda engine: engine.speculator.drafts.replace(drafters)).result(timeout_s)
        self.settings = dataclasses.replace(self.settings, methods={**self.settings.methods, **changed})
        message = f"promoted {', '.join(f'{k} {v}' for k, v in heads.items())} for {', '.join(changed)}"
        print(f"{C.ENGINE_HOST}: {message}", flush=True)  # the server's log
        return message

    def _promote_request(self, request, sender) -> None:
        """An admin's promotion (P.PROMOTE_HEADS, with P.ADMIN_KEY): answered when the new
        heads serve, from a thread of its own (building them takes seconds)."""
        if not from_an_admin(request):
            sender.send(error_response(PermissionError(f"{P.PROMOTE_HEADS} needs the server's admin key in {P.ADMIN_KEY}")),
                        flags=FINAL)
            return
        try:
            heads = json.loads((strings(request, P.PROMOTE_HEADS) or [""])[0])
            if not isinstance(heads, dict) or not heads or not all(isinstance(v, str) for v in heads.values()):
                raise ValueError
        except ValueError:
            sender.send(error_response(InvalidRequestError(P.PROMOTE_HEADS, "must be a JSON object: head kind -> directory")),
                        flags=FINAL)
            return

        def work() -> None:
            try:
                sender.send(pb_utils.InferenceResponse([text_tensor(P.TEXT_OUTPUT, self.promote(heads))]), flags=FINAL)
            except Exception as exc:  # noqa: BLE001 - the admin hears why; serving goes on
                sender.send(error_response(exc), flags=FINAL)

        threading.Thread(target=work, name="specdec-promote", daemon=True).start()

    def _on_round(self, info: RoundInfo) -> None:
        """Scheduler thread, after each forward: the batch-size histogram and gauges."""
        self._batch_sequences = info.sequences
        self.metrics.observe(P.BATCH_SEQUENCES, info.sequences)
        if info.chunked:
            self.metrics.inc(P.PREFILL_CHUNKED_ROUNDS_TOTAL)
        self.heap.maybe_trim()
        self._publish_prefix_cache()
        speculator = self.engine.speculator
        if speculator.adaptive and info.seconds and self._planner_due():
            planner = speculator.planner
            for method in speculator.adaptive:
                depth = self.settings.methods[method].max_draft_len
                for position, rate in enumerate(planner.position_estimates(method, depth), start=1):
                    self.metrics.set(P.ACCEPTANCE_ESTIMATE, round(rate, 4), method=method, position=str(position))
            self.metrics.set(P.PLANNED_TOKENS_PER_SECOND, round(planner.tokens_per_second, 2))

    def _publish_prefix_cache(self) -> None:
        """The prefix cache's counters, as increments since the last round."""
        counters = self.engine.target_pass.prefix_cache_counters
        if counters is None:
            return
        now = (counters.queried_tokens, counters.reused_tokens, counters.hit_requests)
        for name, value, before in zip((P.PREFIX_CACHE_QUERIES_TOTAL, P.PREFIX_CACHE_HITS_TOTAL, P.PREFIX_CACHE_HIT_REQUESTS_TOTAL),
                                       now, self._prefix_published):
            if value > before:
                self.metrics.inc(name, value - before)
        self._prefix_published = now

    def _on_live(self, live: int) -> None:
        self.metrics.set(P.ACTIVE_SEQUENCES, live, model="verifier")
        if not live:  # idle: what the last rounds observed goes out now
            self.metrics.flush()

    def _planner_due(self) -> bool:
        if time.monotonic() - self._planner_published > 1.0:  # beliefs move slowly
            self._planner_published = time.monotonic()
            return True
        return False

    def close(self) -> None:
        self.scheduler.close()
        engine = self.scheduler.engine
        if engine is not None and engine.speculator.observer is not None:  # served-traffic capture: write what is pending
            engine.speculator.observer.close()
        self.metrics.close()
