"""The multi-sequence speculative engine.

Each `step()`:
  1. prefills newly added sequences (one batched forward) and samples their first token;
  2. drafts a tree for every running sequence (each drafter batched over its sequences);
  3. verifies all trees in ONE batched target forward ([root] + nodes per row, tree mask);
  4. accepts per sequence (greedy or lossless sampling), commits the kept KV path, and
     returns the emitted tokens (accepted + bonus/recovered) and final text per sequence.
num_draft_tokens == 0 is plain decoding through the same path: the matched baseline.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Iterator, Mapping, Sequence

import torch
from torch import Tensor

from .config import METHOD_NONE, EngineConfig, SamplingParams
from .detok import IncrementalDetokenizer
from .drafters.base import Drafter
from .errors import InvalidRequestError, UnknownSequenceError
from .metrics import SpecStats
from .models.llama import Transformer, build_batch
from .sampling import logits_to_probs, make_generator, sample
from .sequence import FINISH_CANCELLED, FINISH_EOS, FINISH_LENGTH, FINISH_STOP, SequenceState
from .tree import DraftTree
from .verify import VerifyResult, verify_greedy, verify_sampled

log = logging.getLogger(__name__)


@dataclass
class StepOutput:
    request_id: str
    new_token_ids: list[int]
    text_delta: str
    finished: bool
    finish_reason: str | None
    stats: SpecStats


class SpecEngine:
    def __init__(
        self,
        target: Transformer,
        config: EngineConfig,
        tokenizer=None,
        drafters: Mapping[str, Drafter] | None = None,
    ):
        self.target = target
        self.config = config
        self.tokenizer = tokenizer
        self.drafters: dict[str, Drafter] = dict(drafters or {})
        self.device = target.embed.weight.device
        self.cache = target.new_cache(config.max_batch_size, config.max_seq_len, config.max_num_draft_tokens + 1)
        eos = set(target.cfg.eos_token_ids)
        if tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
            eos.add(tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)
        self.sequences: dict[str, SequenceState] = {}
        self._pending: list[SequenceState] = []
        self.stats = SpecStats()  # aggregate over all finished and running sequences

    # ---- requests -------------------------------------------------------------------
    @property
    def methods(self) -> tuple[str, ...]:
        return (METHOD_NONE, *self.drafters)

    def add_request(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        method: str = METHOD_NONE,
        num_draft_tokens: int = 0,
    ) -> SequenceState:
        """Validate, then take a KV slot. On any error nothing is changed."""
        if request_id in self.sequences:
            raise InvalidRequestError("request_id", f"{request_id!r} is already running")
        prompt_ids = [int(t) for t in prompt_ids]
        if not prompt_ids:
            raise InvalidRequestError("prompt", "the prompt is empty")
        if len(prompt_ids) >= self.config.max_seq_len:
            raise InvalidRequestError(
                "prompt", f"the prompt has {len(prompt_ids)} tokens; the context holds {self.config.max_seq_len} (max_seq_len)"
            )
        vocab = self.target.cfg.vocab_size
        if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
            raise InvalidRequestError("prompt", f"token ids must be in [0, {vocab})")
        params.validate(self.config.max_tokens_limit)
        if method not in self.methods:
            raise InvalidRequestError("method", f"unknown method {method!r}; this engine serves: {', '.join(self.methods)}")
        limit = self.config.max_num_draft_tokens
        if not isinstance(num_draft_tokens, int) or not 0 <= num_draft_tokens <= limit:
            raise InvalidRequestError("num_draft_tokens", f"must be an integer in [0, {limit}], got {num_draft_tokens!r}")
        if method == METHOD_NONE:
            num_draft_tokens = 0
        slot = self.cache.allocate()  # CapacityError leaves everything unchanged
        detok = IncrementalDetokenizer(self.tokenizer, params.stop) if self.tokenizer is not None else None
        seq = SequenceState(
            request_id=request_id,
            slot=slot,
            prompt_ids=prompt_ids,
            params=params,
            method=method if num_draft_tokens else METHOD_NONE,
            num_draft_tokens=num_draft_tokens,
            generator=make_generator(params.seed),
            detok=detok,
            arrival_time=time.perf_counter(),
        )
        self.sequences[request_id] = seq
        self._pending.append(seq)
        return seq

    def cancel(self, request_id: str) -> StepOutput:
        seq = self.sequences.get(request_id)
        if seq is None:
            raise UnknownSequenceError("request_id", f"no running request {request_id!r}")
        self._finish(seq, FINISH_CANCELLED)
        return StepOutput(request_id, [], "", True, FINISH_CANCELLED, seq.stats)

    def has_work(self) -> bool:
        return bool(self.sequences)

    # ---- the step -------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        running = [s for s in self.sequences.values() if s.output_ids and not s.finished]
        outputs: list[StepOutput] = []
        if self._pending:
            outputs += self._prefill(self._pending)
            self._pending = []
        if running:
            outputs += self._decode(running)
        return outputs

    def _taps_for(self, seqs: Sequence[SequenceState]) -> tuple[int, ...]:
        layers: set[int] = set()
        for seq in seqs:
            drafter = self.drafters.get(seq.method)
            if drafter is not None:
                layers.update(drafter.tap_layers)
        return tuple(sorted(layers))

    def _prefill(self, seqs: list[SequenceState]) -> list[StepOutput]:
        taps = self._taps_for(seqs)
        batch = build_batch(
            [s.slot for s in seqs], [0] * len(seqs), [s.prompt_ids for s in seqs],
            sliding_window=self.target.cfg.sliding_window, device=self.device,
        )
        out = self.target(batch, self.cache, tap_layers=taps, last_only=True)
        outputs = []
        for b, seq in enumerate(seqs):
            self.cache.commit(seq.slot, range(len(seq.prompt_ids)))
            token = self._sample_one(out.logits[b, 0], seq)
            seq.first_token_time = time.perf_counter()
            drafter = self.drafters.get(seq.method)
            if drafter is not None:
                hidden = out.hidden_taps[b, : len(seq.prompt_ids)] if out.hidden_taps is not None else None
                drafter.on_prefill(seq, hidden)
            outputs.append(self._emit(seq, [token]))
        return outputs

    def _sample_one(self, logits: Tensor, seq: SequenceState) -> int:
        if seq.params.greedy:
            return int(logits.argmax())
        return sample(logits_to_probs(logits, seq.params), seq.generator)

    def _budget(self, seq: SequenceState) -> int:
        """Draft no more than could be emitted: leave room for the bonus token."""
        left = min(
            seq.params.max_tokens - len(seq.output_ids),
            self.config.max_seq_len - self.cache.lengths[seq.slot] - 1,
        )
        return max(0, min(seq.num_draft_tokens, left - 1))

    def _draft(self, seqs: list[SequenceState]) -> tuple[list[DraftTree], float]:
        t0 = time.perf_counter()
        trees: list[DraftTree] = [DraftTree() for _ in seqs]
        by_method: dict[str, list[int]] = {}
        for i, seq in enumerate(seqs):
            if seq.speculative:
                by_method.setdefault(seq.method, []).append(i)
        for method, idx in by_method.items():
            group = [seqs[i] for i in idx]
            proposed = self.drafters[method].propose(group, [self._budget(s) for s in group])
            for i, tree in zip(idx, proposed):
                trees[i] = tree.truncated(self._budget(seqs[i]))
        return trees, time.perf_counter() - t0

    def _decode(self, seqs: list[SequenceState]) -> list[StepOutput]:
        seqs = sorted(seqs, key=lambda s: s.slot)  # contiguous slots let the cache be a view
        trees, draft_s = self._draft(seqs)
        t0 = time.perf_counter()
        rows = [tree.input_rows(seq.root_token) for seq, tree in zip(seqs, trees)]
        batch = build_batch(
            [s.slot for s in seqs], [self.cache.lengths[s.slot] for s in seqs],
            [r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows],
            sliding_window=self.target.cfg.sliding_window, device=self.device,
        )
        taps = self._taps_for(seqs)
        out = self.target(batch, self.cache, tap_layers=taps)
        results = []
        for b, (seq, tree) in enumerate(zip(seqs, trees)):
            logits = out.logits[b, : len(tree) + 1]  # [n+1, V]
            if seq.params.greedy:
                result = verify_greedy(tree, logits)
            else:
                result = verify_sampled(tree, logits_to_probs(logits, seq.params), seq.generator)
            kept = [0] + [node + 1 for node in result.accepted_nodes]
            self.cache.commit(seq.slot, kept)
            results.append((result, kept))
        verify_s = time.perf_counter() - t0
        self.stats.draft_seconds += draft_s
        self.stats.verify_seconds += verify_s
        outputs = []
        for b, (seq, tree, (result, kept)) in enumerate(zip(seqs, trees, results)):
            seq.stats.draft_seconds += draft_s
            seq.stats.verify_seconds += verify_s
            depth = max(tree.depths(), default=0)
            for stats in (seq.stats, self.stats):
                stats.record_step(depth, len(tree), len(result.accepted_nodes), len(result.emitted))
            drafter = self.drafters.get(seq.method)
            if drafter is not None:
                hidden = out.hidden_taps[b, kept] if out.hidden_taps is not None else None
                drafter.on_verified(seq, result, hidden)
            outputs.append(self._emit(seq, result.emitted))
        return outputs

    def _emit(self, seq: SequenceState, tokens: list[int]) -> StepOutput:
        """Apply stop conditions to newly emitted tokens and record them."""
        reason = None
        if not seq.params.ignore_eos:
            for i, tok in enumerate(tokens):
                if tok in self.eos_token_ids:
                    tokens, reason = tokens[:i], FINISH_EOS
                    break
        room = min(seq.params.max_tokens - len(seq.output_ids), self.config.max_seq_len - len(seq.prompt_ids) - len(seq.output_ids))
        if len(tokens) >= room and reason is None:
            tokens, reason = tokens[:room], FINISH_LENGTH
        seq.output_ids.extend(tokens)
        text = ""
        if seq.detok is not None:
            text = seq.detok.add(tokens)
            if seq.detok.stopped:
                reason = FINISH_STOP
            elif reason is not None:
                text += seq.detok.flush()
        if reason is not None:
            self._finish(seq, reason)
        return StepOutput(seq.request_id, tokens, text, reason is not None, reason, seq.stats)

    def _finish(self, seq: SequenceState, reason: str) -> None:
        seq.finished, seq.finish_reason = True, reason
        drafter = self.drafters.get(seq.method)
        if drafter is not None:
            drafter.on_finish(seq)
        self.cache.release(seq.slot)
        self.sequences.pop(seq.request_id, None)
        if seq in self._pending:
            self._pending.remove(seq)

    # ---- convenience ----------------------------------------------------------------
    def generate(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        method: str = METHOD_NONE,
        num_draft_tokens: int = 0,
        request_id: str = "generate",
    ) -> Iterator[StepOutput]:
        """Run one request to completion (other running requests advance too)."""
        self.add_request(request_id, prompt_ids, params, method, num_draft_tokens)
        try:
            while True:
                for out in self.step():
                    if out.request_id == request_id:
                        yield out
                        if out.finished:
                            return
        finally:
            if request_id in self.sequences:
                self.cancel(request_id)
