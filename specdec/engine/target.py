"""The target pass: KV-cache slots per sequence, batched prefill, batched tree verification
(the acceptance rules themselves are specdec.engine.acceptance's).

Keyed by sequence id so it runs inside the Triton `verifier` model or in process beside
the drafters (SpecEngine). It remembers each sequence's root token (the
last emitted token, not yet in the cache), its sampling settings and its generator.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Hashable, Sequence

import torch
from torch import Tensor

from specdec.config import EngineConfig, SamplingParams
from specdec.errors import CapacityError, InvalidRequestError
from specdec.engine.logits_processing import apply_rules, token_log_probs
from specdec.engine.models.llama import Transformer, build_batch
from specdec.engine.sequences import check_prompt_ids
from specdec.engine.sampling import logits_to_probs, make_generator, sample
from specdec.engine.sequences import KeyedSequences
from specdec.engine.tree import DraftTree
from specdec.engine.acceptance import VerifyResult, verify_greedy, verify_sampled


@dataclass
class _TargetSequence:
    slot: int
    params: SamplingParams
    generator: torch.Generator
    prompt_len: int = 0
    root_token: int = -1
    last_used: float = 0.0
    # prompt + every emitted token (the root last), kept only when the request's logits
    # rules need the context (specdec/engine/logits_processing.py)
    context: list[int] | None = None

    def processed(self, logits: Tensor, tree: DraftTree | None = None) -> Tensor:
        if self.context is None:
            return logits
        return apply_rules(logits, self.params, self.prompt_len, self.context, tree)

    def emitted(self, tokens: list[int]) -> None:
        self.root_token = tokens[-1]
        if self.context is not None:
            self.context.extend(tokens)


@dataclass
class PrefillOutput:
    first_token: int
    hidden: Tensor | None  # [prompt_len, taps * H] when taps were asked for
    log_probs: list[float] | None = None  # of first_token, with return_log_probs


@dataclass
class VerifyOutput:
    result: VerifyResult
    hidden: Tensor | None  # [1 + accepted, taps * H]: root + accepted path, when asked for
    log_probs: list[float] | None = None  # of result.emitted, with return_log_probs


class TargetPass(KeyedSequences[_TargetSequence]):
    where = "verifier"  # the Triton model it serves in (named in errors)

    def __init__(self, target: Transformer, config: EngineConfig, tap_layers: Sequence[int] = ()):
        super().__init__()
        self.target = target
        self.config = config
        self.tap_layers = tuple(tap_layers)
        self.device = target.embed.weight.device
        self.cache = target.new_cache(config.max_batch_size, config.max_seq_len, config.max_num_draft_tokens + 1)

    def context_len(self, seq_id: Hashable) -> int:
        return self.cache.lengths[self._get(seq_id).slot]

    def check_prompt(self, prompt_ids: Sequence[int]) -> None:
        check_prompt_ids(prompt_ids, self.config.max_seq_len, self.target.cfg.vocab_size)

    def prefill(
        self, items: Sequence[tuple[Hashable, Sequence[int], SamplingParams]], want_hidden: bool = False
    ) -> list[PrefillOutput]:
        """Start sequences: take a slot each, run their prompts in one forward, sample the
        first token. Prompts were checked at the trust boundary (check_prompt: the request
        parser in process, the verifier's START in Triton). Raises before changing anything
        if a sequence id is taken or slots run out."""
        for seq_id, _, _ in items:
            if seq_id in self._seqs:
                raise InvalidRequestError("sequence_id", f"sequence {seq_id!r} is already running")
        if len(items) > self.cache.num_free:
            raise CapacityError(f"no free KV-cache slot: {self.cache.max_slots} slots (max_batch_size) in use")
        now = time.monotonic()
        started = []
        for seq_id, prompt, params in items:
            seq = _TargetSequence(self.cache.allocate(), params, make_generator(params.seed), len(prompt), last_used=now,
                                  context=list(prompt) if params.shapes_logits else None)
            self._seqs[seq_id] = seq
            started.append(seq)
        prompts = [list(p) for _, p, _ in items]
        batch = build_batch(
            [s.slot for s in started], [0] * len(items), prompts,
            sliding_window=self.target.cfg.sliding_window, device=self.device,
        )
        taps = self.tap_layers if want_hidden else ()
        out = self.target(batch, self.cache, tap_layers=taps, last_only=True)
        results = []
        for b, (seq, prompt) in enumerate(zip(started, prompts)):
            self.cache.commit(seq.slot, range(len(prompt)))
            logits = seq.processed(out.logits[b, :1])[0]
            first = int(logits.argmax()) if seq.params.greedy else sample(logits_to_probs(logits, seq.params), seq.generator)
            seq.emitted([first])
            hidden = out.hidden_taps[b, : len(prompt)] if out.hidden_taps is not None else None
            log_probs = token_log_probs(logits[None], seq.params, [0], [first]) if seq.params.return_log_probs else None
            results.append(PrefillOutput(first, hidden, log_probs))
        return results

    def verify(self, items: Sequence[tuple[Hashable, DraftTree]], want_hidden: bool = False) -> list[VerifyOutput]:
        """One batched target forward over [root] + tree for every sequence; accept each
        tree (greedy or lossless sampling) and commit the kept path's KV."""
        seqs = [self._get(seq_id) for seq_id, _ in items]
        trees = [tree for _, tree in items]
        # Contiguous slots let the cache be a view: run the rows in slot order.
        order = sorted(range(len(seqs)), key=lambda i: seqs[i].slot)
        rows = [trees[i].input_rows(seqs[i].root_token) for i in order]
        batch = build_batch(
            [seqs[i].slot for i in order], [self.cache.lengths[seqs[i].slot] for i in order],
            [r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows],
            sliding_window=self.target.cfg.sliding_window, device=self.device,
        )
        taps = self.tap_layers if want_hidden else ()
        out = self.target(batch, self.cache, tap_layers=taps)
        now = time.monotonic()
        results: list[VerifyOutput | None] = [None] * len(seqs)
        for b, i in enumerate(order):
            seq, tree = seqs[i], trees[i]
            logits = seq.processed(out.logits[b, : len(tree) + 1], tree)  # [n+1, V]: row 0 = root, row j+1 = node j
            if seq.params.greedy:
                result = verify_greedy(tree, logits)
            else:
                result = verify_sampled(tree, logits_to_probs(logits, seq.params), seq.generator)
            kept = [0] + [node + 1 for node in result.accepted_nodes]
            self.cache.commit(seq.slot, kept)
            seq.emitted(result.emitted)
            seq.last_used = now
            hidden = out.hidden_taps[b, kept] if out.hidden_taps is not None else None
            log_probs = token_log_probs(logits, seq.params, kept, result.emitted) if seq.params.return_log_probs else None
            results[i] = VerifyOutput(result, hidden, log_probs)
        return results  # type: ignore[return-value]

    def release(self, seq_id: Hashable) -> None:
        seq = self._get(seq_id)
        del self._seqs[seq_id]
        self.cache.release(seq.slot)
