"""One speculation step as one call: verify every sequence's tree in ONE batched target
forward, commit the accepted path, then draft each sequence's next tree with the drafters
that live beside the target (TensorRT-LLM's "one-model" EAGLE-3 layout).

Drafters that need the target's hidden taps (EAGLE-3 heads) get them here without leaving
the process, and drafters that cost nothing (n-gram lookup) need no call of their own. A
drafter that is a separate model (served apart) hands its tree in with the step instead
(`StepItem.tree`). The in-process engine (SpecEngine) and the Triton `verifier` model both
drive this class; neither knows which drafter runs.

The draft budget is decided here and nowhere else: a sequence starts with the request's
num_draft_tokens (its most per step); after every step this class, which sees the true
batch (every sequence holding a slot), applies the method's load controls
(draft_len_schedule, max_concurrency) and cuts to the room the sequence has left. That
budget sizes the co-located drafter's next tree, and is answered to the caller
(StepResult.num_draft_tokens) so a drafter served apart drafts no more; a tree handed in is
cut to it. For adaptive methods the planner (specdec/engine/planner.py) then decides, for
the whole batch, how deep to draft and which drafted nodes to verify, from costs it measures
here (a start-up microbenchmark, then every step).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Hashable, Mapping, Protocol, Sequence

from torch import Tensor

import specdec_wire as P

from specdec.config import METHOD_NONE, EngineConfig, SamplingParams, SpeculativeConfig
from specdec.engine.drafters.base import Drafter
from specdec.engine.drafters.service import DraftService, layer_columns, union_of_layers
from specdec.errors import InvalidRequestError
from specdec.engine.models.llama import Transformer
from specdec.engine.grammar import Grammars
from specdec.engine.logits_processing import TokenLogProbs
from specdec.engine.planner import BudgetPlanner, DraftCut, PlanItem
from specdec.engine.prefill_budget import PrefillBudget
from specdec.engine.sequences import draft_budget
from specdec.engine.sequences import KeyedSequences, SequenceRecord
from specdec.engine.tree import DraftTree
from specdec.engine.target import TargetPass


@dataclass(frozen=True)
class StartItem:
    seq_id: Hashable
    prompt_ids: Sequence[int]
    params: SamplingParams
    method: str = METHOD_NONE  # the served method (drafted beside the target or apart); none = plain
    num_draft_tokens: int = 0  # the request's most per step; 0 = plain decoding (the baseline)
    want_hidden: bool = False  # return the prompt's taps (for a drafter served apart)


@dataclass(frozen=True)
class StepItem:
    seq_id: Hashable
    tree: DraftTree | None = None  # drafted apart (cut to the budget); None = the co-located drafter's
    want_hidden: bool = False


@dataclass
class StepResult:
    emitted: list[int]  # accepted draft tokens + the bonus/recovered token (prefill: first token)
    accepted: int  # how many of `emitted` were draft tokens
    draft_depth: int = 0  # of the tree verified in this step
    draft_tokens: int = 0  # nodes of the tree verified in this step
    hidden: Tensor | None = None  # taps of the committed positions, when asked for
    verify_seconds: float = 0.0  # the batch's, shared by its sequences
    draft_seconds: float = 0.0
    log_probs: TokenLogProbs | None = None  # of `emitted`, when the request asked for them
    num_draft_tokens: int = 0  # the budget of the next tree (what a drafter served apart may draft)
    forced_accepted: int = 0  # of `accepted`, the tokens the request's grammar forced (not the drafter's)
    cached_tokens: int = 0  # prefill: prompt tokens whose KV came from the prefix cache
    dead_end: bool = False  # the request's grammar allows no next token: end it (grammar.UNPRODUCIBLE)


@dataclass(frozen=True)
class ScheduledBatch:
    """One target forward's work, as Speculator.schedule decided it."""
    prefilling: list[StartItem]  # prompts to continue or start, in the order chunks are taken
    decoding: list[StepItem]  # running sequences, each verifying its tree
    trees: list[DraftTree]  # decoding[i]'s tree
    want_hidden: bool  # the forward taps hidden states (a drafter needs them)
    prefill_tokens: int | None  # prompt tokens this forward at most (chunked prefill); None: whole prompts
    prompt_tokens: int = 0  # prompt tokens this forward runs (what prefill_tokens leaves of the prompts')
    decode_rows: int = 0  # rows of the decoding sequences' trees (root + nodes each)


class SequenceObserver(Protocol):
    """Watches chosen sequences' committed tokens and hidden taps without changing them
    (served-traffic capture, specdec/serving/traffic_capture.py). Its sequences' forwards tap its
    layers; nothing it is told feeds back into drafting, verification or the output."""

    tap_layers: tuple[int, ...]

    def wants(self, record: SequenceRecord) -> bool:
        """At admission: watch this sequence?"""

    def on_prefill(self, record: SequenceRecord, hidden: Tensor) -> None:
        """The prompt's taps [prompt_len, layers * H] (record.output_ids == [first token])."""

    def on_verified(self, seq_id: Hashable, hidden: Tensor) -> None:
        """The taps [1 + accepted, layers * H] of the positions a step committed."""

    def on_release(self, record: SequenceRecord) -> None:
        """The sequence is gone (finished, cancelled or failed): its record holds every token."""

    def close(self) -> None:
        """The server stops: finish what is pending."""


@dataclass
class _Sequence:
    record: SequenceRecord  # held by the target pass and the drafter beside it too: one record
    budget: int = 0  # decided for the next tree
    next_tree: DraftTree = field(default_factory=DraftTree)
    start: StartItem | None = None  # until the prompt is prefilled (its first token sampled)
    observed: bool = False  # the observer (served-traffic capture) watches it

    @property
    def method(self) -> str:
        return self.record.method


class Speculator(KeyedSequences[_Sequence]):
    """Target + co-located drafters, keyed by sequence id."""

    where = "verifier"

    def __init__(self, target: Transformer, config: EngineConfig, drafters: Mapping[str, Drafter] | None = None,
                 apart_tap_layers: Sequence[int] = (), methods: Mapping[str, SpeculativeConfig] | None = None,
                 grammars: Grammars | None = None, observer: SequenceObserver | None = None):
        """drafters: the co-located ones (their configs carry their load controls); methods:
        every served method's config, those drafted apart included (for theirs);
        apart_tap_layers: target layers a drafter served apart needs (returned on request);
        one forward taps the union of theirs and the co-located drafters'; grammars: compiles
        structured-output guides (None: guided requests are refused); observer: watches the
        sequences it chooses (served-traffic capture)."""
        super().__init__()
        self.config = config
        drafters = drafters or {}
        self.observer = observer
        taps = union_of_layers([apart_tap_layers, observer.tap_layers if observer else ()] +
                               [d.tap_layers for d in drafters.values()])
        self.drafts = DraftService(drafters, hidden_layers=taps)
        self.methods = dict(methods or {})
        self.target_pass = TargetPass(target, config, tap_layers=taps, grammars=grammars)
        self.adaptive = {m for m, d in self.drafts.drafters.items() if d.config is not None and d.config.adaptive}
        self.planner = BudgetPlanner()
        self.prefill_budget = PrefillBudget(config.prefill_chunk_tokens, config.prefill_max_slowdown)
        self._last_verify: tuple[float, float] | None = None  # (start, seconds) of the last verification
        if self.adaptive:
            self._calibrate()

    def _calibrate(self, prompt_len: int = 64) -> None:
        """The planner's first verify-cost table: a short microbenchmark of the real
        verification (dummy ids): one sequence with 0 to max draft tokens, then a few
        sequences (larger batches' token counts). Skipped where the context is too short to
        hold it (the table is then learnt from served steps alone)."""
        width = self.config.max_num_draft_tokens
        batch = min(4, self.config.max_batch_size, self.target_pass.cache.num_free)
        params = SamplingParams(max_tokens=1)
        vocab = self.target_pass.target.cfg.vocab_size
        for sequences, widths in ((1, range(width + 1)), (batch, sorted({0, width // 4, width // 2, width}))):
            room = self.config.max_seq_len - sum(w + 1 for w in widths) - 1  # each verification commits <= w + 1
            if room < 1:
                return
            ids = [("calibration", n) for n in range(sequences)]
            for repeat in range(2):  # the first round warms up
                self.target_pass.prefill([SequenceRecord(i, [(7 * j + 11) % vocab for j in range(min(prompt_len, room))], params)
                                          for i in ids])
                try:
                    for w in widths:
                        tree = DraftTree.chain([(13 * j + 5) % vocab for j in range(w)])
                        t0 = time.perf_counter()
                        self.target_pass.verify([(i, tree) for i in ids])
                        if repeat:
                            self.planner.observe_verify(sequences * (1 + w), sequences, time.perf_counter() - t0)
                finally:
                    for i in ids:
                        self.target_pass.release(i)
        self.planner.verify_cost.fit()
        self.target_pass.reset_prefix_counters()  # the dummy prompts are not traffic

    def check_method(self, method: str) -> None:
        """For internal callers (the request parsers check clients): a method this target serves."""
        if method != METHOD_NONE and method not in self.drafts.drafters and method not in self.methods:
            available = ", ".join(dict.fromkeys([*self.drafts.drafters, *self.methods])) or "none"
            raise InvalidRequestError(P.SPECULATIVE_METHOD, f"no method {method!r} here; available: {available}")

    def _decide_budget(self, seq: _Sequence) -> int:
        """The next tree's draft tokens: the request's, under its method's load controls at
        the true batch (every sequence holding a slot), cut to the room the sequence has left."""
        drafter = self.drafts.drafters.get(seq.method)
        spec = drafter.config if drafter is not None and drafter.config is not None else self.methods.get(seq.method)
        record = seq.record
        wanted = record.num_draft_tokens if spec is None else spec.scheduled_draft_tokens(record.num_draft_tokens, self.active)
        seq.budget = draft_budget(wanted, record.params.max_tokens, self.config.max_seq_len, len(record.prompt_ids),
                                  len(record.output_ids))
        return seq.budget

    # ---- the calls ---------------------------------------------------------------------------
    def prefill(self, items: Sequence[StartItem]) -> list[StepResult]:
        """Start sequences: prefill their prompts in one forward, sample the first token, and
        draft the first tree of those with a co-located drafter. Nothing changes on error.
        Methods are the caller's to check (check_method)."""
        return self.run(items, [], whole_prompts=True)[0]

    def step(self, items: Sequence[StepItem]) -> list[StepResult]:
        """Verify every item's tree in one batched forward, commit, then draft the next trees."""
        return self.run([], items)[1]

    def run(self, starts: Sequence[StartItem], steps: Sequence[StepItem],
            whole_prompts: bool = False) -> tuple[list[StepResult], list[StepResult]]:
        """Everything ready in ONE target forward: the new sequences' prompts, the prompts
        still being prefilled (a step of a sequence that has no first token yet continues
        its prompt), and every running sequence's tree. Prompts go in chunks, oldest first
        (chunked prefill, as vLLM and Sarathi-Serve schedule it): at most
        engine.prefill_chunk_tokens per call (with nothing decoding, the oldest prompt whole),
        and beside running sequences no more than keeps the forward within
        engine.prefill_max_slowdown of the step they decode at once every held sequence decodes
        (PrefillBudget), so running streams keep emitting during a wave of prompts and a
        wave's first prompts start before its last is prefilled. whole_prompts: this call
        prefills every prompt whole (prefill(): its callers get first tokens). A prompt not
        finished in this call answers no tokens (StepResult.emitted == []): its caller sends
        another step. New sequences are all or nothing: on error none of them holds a slot
        anywhere."""
        records = []
        for item in starts:
            speculative = item.method != METHOD_NONE and item.num_draft_tokens > 0
            records.append(SequenceRecord(item.seq_id, list(item.prompt_ids), item.params, item.method if speculative else METHOD_NONE,
                                          item.num_draft_tokens if speculative else 0))
        observed = frozenset(r.seq_id for r in records if self.observer is not None and self.observer.wants(r))
        self.target_pass.admit(records, frozenset(i.seq_id for i in starts if i.want_hidden or self.drafts.needs_hidden(i.method))
                               | observed)
        for item, record in zip(starts, records):
            self._seqs[item.seq_id] = _Sequence(record, start=item, observed=item.seq_id in observed)
        try:
            return self._run(starts, steps, whole_prompts)
        except Exception:
            for item in starts:
                self._drop(item.seq_id)
            raise

    def schedule(self, starts: Sequence[StartItem], steps: Sequence[StepItem], whole_prompts: bool = False) -> ScheduledBatch:
        """What the next target forward runs (vLLM's Scheduler.schedule, TensorRT-LLM's
        ScheduledRequests): each decoding sequence's tree (cut to its budget, its grammar's
        forced tokens first, then chosen by the planner for the adaptive methods), the prompts
        to prefill (those continuing first, then the new ones; TargetPass.run takes them in
        this order, at most `prefill_tokens` in all: the budget left beside the trees), and
        whether the forward must tap hidden states."""
        continuing = [i for i in steps if self._get(i.seq_id).start is not None]
        decoding = [i for i in steps if self._get(i.seq_id).start is None]
        prefilling = [self._get(i.seq_id).start for i in continuing] + list(starts)
        seqs = [self._get(i.seq_id) for i in decoding]
        trees = []
        for item, seq in zip(decoding, seqs):
            tree = item.tree if item.tree is not None else seq.next_tree
            # under a grammar: its forced tokens drafted first (speculative methods only; the
            # baseline stays one token per forward), the drafts it forbids never verified
            trees.append(self.target_pass.guided_draft(item.seq_id, tree.truncated(seq.budget), seq.budget,
                                                       forced=seq.method != METHOD_NONE))
            seq.next_tree = DraftTree()
        if self.adaptive and decoding:
            trees = self.planner.select([PlanItem(i.seq_id, s.method, t, s.method in self.adaptive)
                                         for i, s, t in zip(decoding, seqs, trees)])
        want_hidden = any(self.drafts.needs_hidden(s.method) or i.want_hidden for i, s in zip(decoding, seqs)) or any(
            self.drafts.needs_hidden(i.method) or i.want_hidden for i in prefilling) or any(
            self._get(i.seq_id).observed for i in [*decoding, *prefilling])
        decode_rows = sum(1 + len(tree) for tree in trees)
        left = [self.target_pass.unprefilled(i.seq_id) for i in prefilling]
        # the budget only where a prompt waits: a decode-only step refits nothing
        chunk = None if whole_prompts or not left else self.prefill_budget.tokens(decode_rows, len(left), left[0])
        return ScheduledBatch(prefilling, decoding, trees, want_hidden, chunk,
                              sum(left) if chunk is None else min(chunk, sum(left)), decode_rows)

    def _run(self, starts: Sequence[StartItem], steps: Sequence[StepItem],
             whole_prompts: bool = False) -> tuple[list[StepResult], list[StepResult]]:
        batch = self.schedule(starts, steps, whole_prompts)
        prefilling, decoding, trees = batch.prefilling, batch.decoding, batch.trees
        seqs = [self._get(i.seq_id) for i in decoding]
        t0 = time.perf_counter()
        prefilled, outs = self.target_pass.run([i.seq_id for i in prefilling], [(i.seq_id, t) for i, t in zip(decoding, trees)],
                                               batch.want_hidden, batch.prefill_tokens)
        t1 = time.perf_counter()
        self.prefill_budget.observe(batch.prompt_tokens, batch.decode_rows, t1 - t0)
        if self.adaptive and decoding and not prefilling:
            self._observe_timing(sum(1 + len(t) for t in trees), len(decoding), t0, t1)
        by_id: dict[Hashable, StepResult] = {}
        first_items, first_results = [], []
        for item in prefilling:
            out = prefilled.get(item.seq_id)
            if out is None:  # its prompt goes on in the next call
                by_id[item.seq_id] = StepResult([], 0, verify_seconds=t1 - t0)
                continue
            seq = self._seqs[item.seq_id]
            seq.start = None
            if seq.method != METHOD_NONE and seq.method in self.drafts.drafters:
                self.drafts.start(seq.record, out.hidden, appends_tokens=False)  # the target pass appends them
            if seq.observed:
                self.observer.on_prefill(seq.record, self._observer_columns(out.hidden))
            result = StepResult([out.first_token], 0, hidden=out.hidden if item.want_hidden else None,
                                verify_seconds=t1 - t0, log_probs=out.log_probs, cached_tokens=out.cached_tokens)
            by_id[item.seq_id] = result
            first_items.append(item)
            first_results.append(result)
        self._draft_next(first_items, first_results, first=True)
        results = []
        for item, seq, tree, out in zip(decoding, seqs, trees, outs):
            emitted, accepted = out.emitted, len(out.result.accepted_nodes)
            if seq.method in self.adaptive:
                self.planner.observe_accepts(seq.method, item.seq_id, tree, out.result.accepted_nodes)
            if item.seq_id in self.drafts and not out.dead_end:  # every step, drafting or not: the drafter sees every token once
                # (a dead end's sequence ends now: its taps hold one row more than its tokens)
                self.drafts.advance(item.seq_id, emitted, accepted, out.hidden)
            if seq.observed and not out.dead_end:
                self.observer.on_verified(item.seq_id, self._observer_columns(out.hidden))
            result = StepResult(
                emitted, accepted, max(tree.depths(), default=0), len(tree),
                hidden=out.hidden if item.want_hidden else None, verify_seconds=t1 - t0, log_probs=out.log_probs,
                forced_accepted=sum(1 for node in out.result.accepted_nodes if node < tree.forced), dead_end=out.dead_end,
            )
            by_id[item.seq_id] = result
            results.append(result)
        self._draft_next(decoding, results)
        return [by_id[i.seq_id] for i in starts], [by_id[i.seq_id] for i in steps]

    def _observe_timing(self, tokens: int, sequences: int, t0: float, t1: float) -> None:
        """The verification's seconds, and (when steps run back to back: a busy server) the
        time since the previous one that was not verification."""
        self.planner.observe_verify(tokens, sequences, t1 - t0)
        last = self._last_verify
        if last is not None and t0 - last[0] < 4 * last[1] + 0.05:
            self.planner.observe_step_extra(t0 - last[0] - last[1])
        self._last_verify = (t0, t1 - t0)

    def _draft_next(self, items: Sequence[StartItem | StepItem], results: list[StepResult], first: bool = False) -> None:
        """Decide every sequence's next budget, then one batched propose per co-located
        drafter (one head pass per draft depth for all sequences). first: the sequences'
        first drafts (the drafter catches up on whole prompts, which says nothing about a
        step's drafting cost)."""
        wanted = []
        for n, (item, result) in enumerate(zip(items, results)):
            seq = self._seqs[item.seq_id]
            result.num_draft_tokens = budget = self._decide_budget(seq)
            if budget > 0 and item.seq_id in self.drafts and not result.dead_end:
                wanted.append((n, item.seq_id, budget))
        wanted = self._worth_drafting(wanted)
        if not wanted:
            return
        t0 = time.perf_counter()
        cut_for = (lambda method, seq_ids: self._draft_cut(method, seq_ids, record=not first))
        trees = self.drafts.propose([(seq_id, budget) for _, seq_id, budget in wanted], cut_for)
        seconds = time.perf_counter() - t0
        for (_, seq_id, _), tree in zip(wanted, trees):
            self._seqs[seq_id].next_tree = tree
        for result in results:
            result.draft_seconds = seconds

    def _worth_drafting(self, wanted: list[tuple[int, Hashable, int]]) -> list[tuple[int, Hashable, int]]:
        """Adaptive methods draft only where the planner expects the draft to pay this step."""
        if not self.adaptive:
            return wanted
        by_method: dict[str, list[Hashable]] = {}
        for _, seq_id, _ in wanted:
            method = self._seqs[seq_id].method
            if method in self.adaptive:
                by_method.setdefault(method, []).append(seq_id)
        drafting = {s for m, ids in by_method.items() for s in self.planner.to_draft(m, ids)}
        return [w for w in wanted if self._seqs[w[1]].method not in self.adaptive or w[1] in drafting]

    def _draft_cut(self, method: str, seq_ids: Sequence[Hashable], record: bool) -> DraftCut | None:
        return DraftCut(self.planner, method, seq_ids, record) if method in self.adaptive else None

    # ---- life cycle -------------------------------------------------------------------------
    def release(self, seq_id: Hashable) -> None:
        self._get(seq_id)
        self._drop(seq_id)

    def _observer_columns(self, hidden: Tensor) -> Tensor:
        return layer_columns(hidden, self.target_pass.tap_layers, self.observer.tap_layers)

    def _drop(self, seq_id: Hashable) -> None:
        seq = self._seqs.pop(seq_id, None)
        if seq is not None and seq.observed:
            self.observer.on_release(seq.record)
        self.planner.forget(seq_id)
        if seq_id in self.target_pass:
            self.target_pass.release(seq_id)
        if seq_id in self.drafts:
            self.drafts.release(seq_id)

