"""The in-process multi-sequence speculative engine: request bookkeeping over a Speculator
(the same step the Triton `verifier` model serves).

Each `step()` is ONE batched target forward that
  1. prefills newly added sequences (in chunks while others decode), samples their first
     token and drafts their first trees;
  2. verifies every running sequence's tree, accepts per sequence (greedy or lossless
     sampling), commits the kept KV path and drafts the next trees (each drafter batched
     over its sequences);
  3. applies stop rules and returns the emitted tokens and final text per sequence.
num_draft_tokens == 0 is plain decoding through the same path: the matched baseline.
"""
from __future__ import annotations

import concurrent.futures

from dataclasses import dataclass
from typing import Hashable, Iterator, Mapping, Sequence

import specdec_wire as P

from specdec.config import METHOD_NONE, EngineConfig, ModelConfig, SamplingParams, SpeculativeConfig
from specdec.serving.detok import IncrementalDetokenizer
from specdec.engine.drafters.base import Drafter
from specdec.errors import CapacityError, InvalidRequestError, UnknownSequenceError
from specdec.serving.stats import SpecStats
from specdec.serving.request import ServedOffer, TokenRules, validate_request
from specdec.engine.models.llama import Transformer
from specdec.serving.state import FINISH_CANCELLED, RequestState
from specdec.engine.grammar import UNPRODUCIBLE, Grammars
from specdec.engine.logits_processing import TokenLogProbs
from specdec.engine.speculator import SequenceObserver, Speculator, StartItem, StepItem, StepResult
from specdec.engine.tree import DraftTree


@dataclass
class StepOutput:
    request_id: str
    new_token_ids: list[int]
    text_delta: str
    finished: bool
    finish_reason: str | None
    stats: SpecStats
    # The step that emitted these tokens (None for a cancel): its draft numbers, timings,
    # log probs and the next tree's budget (what a drafter served apart may draft).
    step: StepResult | None = None
    verified: bool = False  # False for the prompt's first token
    log_probs: TokenLogProbs | None = None  # of new_token_ids, with return_log_probs / top_logprobs
    # The request ends with this error after new_token_ids (its grammar allows no next token,
    # grammar.UNPRODUCIBLE); it is released already.
    error: InvalidRequestError | None = None


def eos_ids_of_config(target_cfg: ModelConfig, tokenizer) -> frozenset[int]:
    """EOS ids from the model config and the tokenizer (they sometimes disagree)."""
    eos = set(target_cfg.eos_token_ids)
    if tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
        eos.add(tokenizer.eos_token_id)
    return frozenset(eos)


class SpecEngine:
    """A thin driver over the Speculator: request bookkeeping (stop rules, text, stats); the
    step itself (verify, commit, decide the budgets, draft the next trees) is the
    Speculator's, exactly as the Triton verifier runs it."""

    def __init__(
        self,
        target: Transformer | None,
        config: EngineConfig,
        tokenizer=None,
        drafters: Mapping[str, Drafter] | None = None,
        methods: Mapping[str, SpeculativeConfig] | None = None,
        apart_tap_layers: Sequence[int] = (),
        speculator: Speculator | None = None,
        observer: SequenceObserver | None = None,
    ):
        """drafters: the co-located ones; methods: every served method (those drafted apart
        included: their trees come with step(trees=...)); speculator: an already built one
        (the Triton verifier's), instead of target + drafters; observer: watches chosen
        sequences (served-traffic capture, specdec/serving/traffic_capture.py)."""
        self.config = config
        self.tokenizer = tokenizer
        grammars = None
        if tokenizer is not None and target is not None:
            grammars = Grammars.for_tokenizer(lambda: tokenizer, target.cfg.vocab_size, config.guide_compile_timeout_s)
        self.speculator = speculator or Speculator(target, config, drafters, apart_tap_layers, methods=methods,
                                                   grammars=grammars, observer=observer)
        self.eos_token_ids = eos_ids_of_config(self.speculator.target_pass.target.cfg, tokenizer)
        self.sequences: dict[str, RequestState] = {}
        self._pending: list[RequestState] = []  # added, not yet given to the speculator
        self._admitted: set[str] = set()  # holding a slot in the speculator
        self.stats = SpecStats()  # aggregate over every request
        self._threads: int | None = None  # the forward's threads (fit_threads_to_compiles)
        self._narrowed = False  # running on one thread fewer while a guide compiles

    @property
    def drafts(self):
        return self.speculator.drafts

    @property
    def target_pass(self):
        return self.speculator.target_pass

    @property
    def cache(self):
        return self.target_pass.cache

    @property
    def offer(self) -> ServedOffer:
        """A method named without a budget drafts its configured one (as the server does);
        a budget of 0, or no method, is the baseline."""
        methods = {name: spec.max_total_draft_tokens for name, spec in self.speculator.methods.items()}
        methods.update({name: d.config.max_total_draft_tokens if d.config is not None else 0 for name, d in self.drafts.drafters.items()})
        tokenizer = self.tokenizer
        tokens = TokenRules(self.target_pass.target.cfg.vocab_size, self.eos_token_ids,
                            None if tokenizer is None else (lambda word: tokenizer.encode(word, add_special_tokens=False)))
        return ServedOffer(methods, METHOD_NONE, self.config.max_num_draft_tokens, self.config.max_tokens_limit,
                           max_guide_bytes=self.config.max_guide_bytes, max_seq_len=self.config.max_seq_len, tokens=tokens)

    def add_request(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        method: str = METHOD_NONE,
        num_draft_tokens: int | None = None,
    ) -> RequestState:
        """Validate and queue; the prompt is prefilled by the next step. On error nothing changes."""
        return self.add_state(self.prepare_request(request_id, prompt_ids, params, method, num_draft_tokens))

    def prepare_request(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        method: str = METHOD_NONE,
        num_draft_tokens: int | None = None,
    ) -> RequestState:
        """Validate a request (validate_request, the one place) into its record without
        changing the engine; add_state queues it. A bad field raises, naming it."""
        prompt_ids = [int(t) for t in prompt_ids]
        params, method, num_draft_tokens = validate_request(prompt_ids, params, method, num_draft_tokens, self.offer)
        return self.record(request_id, prompt_ids, params, method, num_draft_tokens)

    def record(self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams, method: str,
               num_draft_tokens: int) -> RequestState:
        """The record of a request validated already (validate_request: its token-level rules
        resolved, params.end_ids set): what the Triton verifier makes of the loop's request."""
        return RequestState(
            request_id=request_id, prompt_ids=[int(t) for t in prompt_ids], params=params,
            method=method, num_draft_tokens=num_draft_tokens,
            max_seq_len=self.config.max_seq_len, eos_token_ids=frozenset(params.end_ids),
            detok=IncrementalDetokenizer(self.tokenizer, params.stop) if self.tokenizer is not None else None,
        )

    def add_state(self, req: RequestState) -> RequestState:
        """Queue a prepared request (its prompt is prefilled by the next step)."""
        if req.request_id in self.sequences:
            raise InvalidRequestError("request_id", f"{req.request_id!r} is already running")
        if len(self.sequences) >= self.config.max_batch_size:
            raise CapacityError(f"no free KV-cache slot: all {self.config.max_batch_size} slots (max_batch_size) are in use")
        self.sequences[req.request_id] = req
        self._pending.append(req)
        return req

    def cancel(self, request_id: str) -> StepOutput:
        req = self.sequences.get(request_id)
        if req is None:
            raise UnknownSequenceError("request_id", f"no running request {request_id!r}")
        self._release(req)
        return self.cancelled(req)

    @staticmethod
    def cancelled(req: RequestState) -> StepOutput:
        """The last output of a request cancelled (joined or not)."""
        req.finish(FINISH_CANCELLED)
        return StepOutput(req.request_id, [], "", True, FINISH_CANCELLED, req.stats)

    def prepare_guide(self, req: RequestState) -> concurrent.futures.Future | None:
        """A guided request's grammar, compiled off the caller's thread (None: no guide).
        The scheduler adds the request when the future is done, so nothing a client sends
        compiles on the thread that steps every sequence."""
        if not req.params.guided:
            return None
        grammars = self.speculator.target_pass.grammars
        if grammars is None:
            raise InvalidRequestError(P.GUIDED_DECODING_GUIDE_TYPE, "this engine was built without a tokenizer for grammars")
        return grammars.prepare(req.params.guide_type, req.params.guide)

    def fit_threads_to_compiles(self) -> None:
        """Before a forward, on the thread that runs them: while a guide compiles, the forward
        runs on one thread fewer, so the compile has a core of its own.

        Why not just a low priority for the compile: the forward's OpenMP threads spin at
        a barrier after every op, and a compile that takes a core (even at nice 19 or
        SCHED_IDLE, on Linux 6.18) leaves the kernel stacking both forward threads on the
        other one, where each spins out its 4 ms tick while the other waits. Measured
        through Triton on 2 cores with a busy process beside the server: a plain stream's
        median gap stayed 19 ms but 46 of its gaps took 1.2 s. One thread fewer for the
        duration of a compile costs that stream some speed for those seconds and no stall."""
        grammars = self.speculator.target_pass.grammars
        compiling = grammars is not None and grammars.compiling
        if compiling == self._narrowed:
            return
        import torch

        if self._threads is None:
            self._threads = torch.get_num_threads()  # per thread under OpenMP: this thread's
        if self._threads > 1:
            torch.set_num_threads(self._threads - 1 if compiling else self._threads)
        self._narrowed = compiling

    def has_work(self) -> bool:
        return bool(self.sequences)

    def step(self, trees: Mapping[Hashable, DraftTree] | None = None, want_hidden: frozenset = frozenset()) -> list[StepOutput]:
        """One Speculator call: new requests join (their prompts prefilled, in chunks while
        others decode), prompts still being prefilled go on, running requests verify.
        trees: the trees drafted apart (by request id) for this step; want_hidden: request
        ids whose step must return the target's taps (a drafter served apart needs them)."""
        trees = trees or {}
        new, self._pending = self._pending, []
        running = [r for r in self.sequences.values() if r.request_id in self._admitted]
        starts = [StartItem(r.request_id, r.prompt_ids, r.params, r.method, r.num_draft_tokens, r.request_id in want_hidden)
                  for r in new]
        for r in new:
            self._admitted.add(r.request_id)
        try:
            first, results = self.speculator.run(
                starts, [StepItem(r.request_id, trees.get(r.request_id), r.request_id in want_hidden) for r in running])
        except Exception:
            self._admitted.difference_update(r.request_id for r in new)
            raise
        outputs = [self._emit(req, res) for req, res in zip(new, first) if res.emitted]
        decoded = [(req, res) for req, res in zip(running, results) if req.output_ids or res.emitted]
        for req, res in decoded:
            if not req.output_ids:  # its prompt's last chunk: the first token
                outputs.append(self._emit(req, res))
                continue
            req.stats.draft_seconds += res.draft_seconds
            req.stats.verify_seconds += res.verify_seconds
            for stats in (req.stats, self.stats):
                stats.record_step(res.draft_depth, res.draft_tokens, res.accepted, len(res.emitted), res.forced_accepted)
            outputs.append(self._emit(req, res, verified=True))
        if results:
            self.stats.draft_seconds += results[0].draft_seconds
            self.stats.verify_seconds += results[0].verify_seconds
        return outputs

    def _emit(self, req: RequestState, res: StepResult, verified: bool = False) -> StepOutput:
        if not verified:  # the prompt's first token
            req.stats.cached_prompt_tokens = res.cached_tokens
        kept, text = req.accept(res.emitted, res.log_probs)
        error = InvalidRequestError(P.GUIDED_DECODING_GUIDE, UNPRODUCIBLE) if res.dead_end and not req.finished else None
        if req.finished or error is not None:
            self._release(req)
        log_probs = None if res.log_probs is None else res.log_probs[: len(kept)]
        return StepOutput(req.request_id, kept, text, req.finished, req.finish_reason, req.stats, res, verified, log_probs,
                          error)

    def _release(self, req: RequestState) -> None:
        self.sequences.pop(req.request_id, None)
        self._pending = [r for r in self._pending if r.request_id != req.request_id]
        if req.request_id in self._admitted:
            self._admitted.discard(req.request_id)
            self.speculator.release(req.request_id)

    def generate(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        method: str = METHOD_NONE,
        num_draft_tokens: int | None = None,
        request_id: str = "generate",
    ) -> Iterator[StepOutput]:
        """Run one request to completion (other running requests advance too)."""
        self.add_request(request_id, prompt_ids, params, method, num_draft_tokens)
        try:
            while True:
                for out in self.step():
                    if out.request_id == request_id:
                        yield out
                        if out.error is not None:
                            raise out.error
                        if out.finished:
                            return
        finally:
            if request_id in self.sequences:
                self.cancel(request_id)
