"""In-flight batching (specdec.serving.engine_loop.EngineLoop), in process: every live
sequence shares each target forward, requests join and leave between rounds, a cancel takes
effect before the next forward, a bad request or a gone listener touches nobody else, and a
drafter served apart is asked once per round; greedy output equals plain decoding alone."""
from __future__ import annotations

import dataclasses
import threading

import pytest

from specdec.config import EngineConfig, SamplingParams, SpeculativeConfig
from specdec.engine.drafters.service import DraftService
from specdec.engine.models.loading import load_transformer
from specdec.errors import InvalidRequestError
from specdec.serving.inprocess import InProcessBackend
from specdec.serving.runtime import build_drafters
from specdec.serving.engine_loop import EngineLoop, RoundInfo
from specdec.serving.spec_engine import SpecEngine

from conftest import save_tiny_hf
from test_speculative import prompts, run_all

CONFIG = EngineConfig(max_batch_size=8, max_seq_len=128, max_num_draft_tokens=8, prefill_chunk_tokens=8)
NGRAM = SpeculativeConfig(method="ngram", max_draft_len=4, prompt_lookup_min=1, prompt_lookup_max=3)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return save_tiny_hf(tmp_path_factory.mktemp("sched"), initializer_range=0.3, seed=3)


def engine_of(target_dir, methods=None, apart=None) -> SpecEngine:
    target = load_transformer(target_dir)
    drafters = build_drafters(target.cfg, methods or {"ngram": NGRAM}, CONFIG, target_dir)
    return SpecEngine(target, CONFIG, drafters=drafters, methods={**(methods or {"ngram": NGRAM}), **(apart or {})})


class ListSink:
    """Collects one sequence's outputs; `listening` False plays a client gone."""

    def __init__(self, done: threading.Event | None = None, listening: bool = True):
        self.outputs, self.error, self.listening = [], None, listening
        self.done = done or threading.Event()

    def emit(self, out):
        self.outputs.append(out)
        if out.finished or not self.listening:
            self.done.set()
        return self.listening

    def fail(self, exc):
        self.error = exc
        self.done.set()

    @property
    def ids(self):
        return [t for out in self.outputs for t in out.new_token_ids]


def run(scheduler, items, timeout_s=120.0):
    """Submit (request id, prompt, params, method, k) items at once; wait for every sink."""
    sinks = {}
    for rid, prompt, params, method, k in items:
        sinks[rid] = ListSink()
        scheduler.submit(rid, prompt, params, method, k, sinks[rid])
    for sink in sinks.values():
        assert sink.done.wait(timeout_s)
    return sinks


def test_every_live_stream_shares_each_forward_and_greedy_equals_plain(target_dir):
    ps = prompts(8, seed=5)
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    plain = run_all(engine_of(target_dir), ps, params, "none", 0, concurrent=1)
    rounds: list[RoundInfo] = []
    scheduler = EngineLoop(engine_of(target_dir), on_round=rounds.append)
    try:
        items = [(str(i), p, params, "ngram" if i % 2 else "none", 4 if i % 2 else 0) for i, p in enumerate(ps)]
        sinks = run(scheduler, items)
    finally:
        scheduler.close()
    assert [sinks[str(i)].ids for i in range(len(ps))] == plain
    assert all(s.outputs[-1].finish_reason == "length" for s in sinks.values())
    # Submitted together, they join within a round or two and then decode together.
    assert max(r.sequences for r in rounds) == 8
    decoding = [r.sequences for r in rounds if not r.prefilling]
    assert sorted(decoding)[len(decoding) // 2] >= 6  # the median round carries most of the live streams
    assert any(o.verified and o.step.draft_tokens for s in sinks.values() for o in s.outputs)  # ngram drafted


def test_cancel_takes_effect_before_the_next_forward_and_frees_the_slot(target_dir):
    engine = engine_of(target_dir)
    cancelled_at: list[int] = []

    class CancelAfterFirst(ListSink):
        def emit(self, out):
            if not cancelled_at:
                cancelled_at.append(len(rounds))
                scheduler.cancel("long")
            return super().emit(out)

    rounds: list[RoundInfo] = []
    scheduler = EngineLoop(engine, on_round=rounds.append)
    try:
        sink = CancelAfterFirst()
        scheduler.submit("long", prompts(1)[0], SamplingParams(max_tokens=100, ignore_eos=True), "ngram", 4, sink)
        assert sink.done.wait(60)
    finally:
        scheduler.close()
    assert sink.outputs[-1].finish_reason == "cancelled" and len(sink.outputs) == 2
    assert len(rounds) == cancelled_at[0]  # no forward ran after the cancel
    assert not engine.sequences and engine.cache.num_free == engine.cache.max_slots


def test_a_bad_request_or_a_gone_listener_touches_nobody_else(target_dir):
    engine = engine_of(target_dir)
    scheduler = EngineLoop(engine)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    try:
        gone = ListSink(listening=False)
        scheduler.submit("gone", prompts(1, seed=1)[0], SamplingParams(max_tokens=100, ignore_eos=True), "ngram", 4, gone)
        sinks = run(scheduler, [("ok", prompts(1, seed=2)[0], params, "ngram", 4),
                                ("bad-k", prompts(1, seed=3)[0], params, "ngram", 99),
                                ("bad-method", prompts(1, seed=3)[0], params, "lookahead", 2),
                                ("bad-prompt", [10**6], params, "none", 0)])
        assert gone.done.wait(60)
    finally:
        scheduler.close()
    for rid, field in (("bad-k", "num_draft_tokens"), ("bad-method", "speculative_method"), ("bad-prompt", "input_ids")):
        assert isinstance(sinks[rid].error, InvalidRequestError) and sinks[rid].error.field == field, rid
    assert len(sinks["ok"].ids) == 12 and sinks["ok"].error is None
    assert len(gone.outputs) == 1  # dropped after the first output nobody heard
    assert not engine.sequences and engine.cache.num_free == engine.cache.max_slots


def test_a_request_is_validated_on_the_submitters_thread(target_dir):
    """Prompt checks and the stop and bad words' tokenizing cost what the client chose: they
    are done (and refused) inside submit(), before the scheduler's thread sees the request;
    too many words are refused by name."""
    from specdec.config import MAX_WORD_RULE_CHARS, MAX_WORD_RULES

    scheduler = EngineLoop(engine_of(target_dir))
    try:
        for field, params in (("stop_words", SamplingParams(max_tokens=4, stop=tuple(f"w{i}" for i in range(MAX_WORD_RULES + 1)))),
                              ("bad_words", SamplingParams(max_tokens=4, bad_words=("x" * (MAX_WORD_RULE_CHARS + 1),))),
                              ("max_tokens", SamplingParams(max_tokens=0))):
            sink = ListSink()
            scheduler.submit(field, prompts(1, seed=1)[0], params, "none", 0, sink)
            assert sink.done.is_set() and isinstance(sink.error, InvalidRequestError) and sink.error.field == field
    finally:
        scheduler.close()


def test_a_drafter_served_apart_is_asked_once_per_round_for_all_its_sequences(target_dir):
    apart = {"ngram-apart": SpeculativeConfig(method="ngram", max_draft_len=4, prompt_lookup_min=1, prompt_lookup_max=3,
                                              colocated=False)}
    engine = engine_of(target_dir, apart=apart)
    target = engine.speculator.target_pass.target
    beside = {name: dataclasses.replace(spec, colocated=True) for name, spec in apart.items()}  # the same drafter, here
    drafts = DraftService(build_drafters(target.cfg, beside, CONFIG, target_dir))
    calls_per_round: dict[int, int] = {}
    rounds: list[RoundInfo] = []

    class Counting(InProcessBackend):
        async def draft(self, last, num_draft_tokens):
            calls_per_round[len(rounds)] = calls_per_round.get(len(rounds), 0) + 1
            return await super().draft(last, num_draft_tokens)

    scheduler = EngineLoop(engine, apart_backend=lambda rid: Counting(engine.speculator, rid, drafts),
                               apart_methods=frozenset(apart), on_round=rounds.append)
    ps = prompts(4, seed=9)
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    try:
        sinks = run(scheduler, [(str(i), p, params, "ngram-apart", 4) for i, p in enumerate(ps)])
    finally:
        scheduler.close()
    plain = run_all(engine_of(target_dir), ps, params, "none", 0, concurrent=1)
    assert [sinks[str(i)].ids for i in range(len(ps))] == plain
    assert calls_per_round and max(calls_per_round.values()) == 4  # all four asked in the same round
    assert any(o.step.draft_tokens for s in sinks.values() for o in s.outputs if o.verified)
    assert drafts.active == 0  # every drafter sequence released at its end


def test_a_failing_round_ends_every_stream_in_it_with_the_error_and_frees_every_slot(target_dir):
    """Issue 43: no test made a round fail. A round that raises ends every sequence in its
    batch with that error (each sink hears it once), frees every slot, and the scheduler
    serves the next request as if nothing happened."""
    engine = engine_of(target_dir)
    step, failures = engine.step, []

    def failing_step(*args, **kwargs):
        if engine.sequences and len(next(iter(engine.sequences.values())).output_ids) >= 3 and not failures:
            failures.append(RuntimeError("a forward failed"))
            raise failures[0]
        return step(*args, **kwargs)

    engine.step = failing_step
    scheduler = EngineLoop(engine)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    try:
        sinks = run(scheduler, [(f"s{i}", p, params, "ngram", 4) for i, p in enumerate(prompts(3, seed=5))])
        assert failures, "the round never failed"
        for rid, sink in sinks.items():
            assert sink.error is failures[0], rid
            assert not sink.outputs or not sink.outputs[-1].finished, rid  # no end besides the error
        assert not engine.sequences and engine.cache.num_free == engine.cache.max_slots
        after = run(scheduler, [("after", prompts(1, seed=6)[0], SamplingParams(max_tokens=12, ignore_eos=True), "ngram", 4)])
        assert after["after"].error is None and len(after["after"].ids) == 12
    finally:
        scheduler.close()
