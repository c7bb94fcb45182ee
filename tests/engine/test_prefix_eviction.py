"""The prefix cache's three ways of handing a hit to a new sequence that nothing else
exercised (issue 43, section 5), in process with the real target, each run twice on the same
schedule (cache on, cache off):

1. a free slot holding MORE than the match, the only free slot: adopted anyway (truncated
   to the match, no copy);
2. a free slot holding more than the match while another slot is free: copied into the other
   slot, so the source keeps its longer content for its own next turn;
3. a slot in use (a live sequence with the same prefix): its KV columns and its hidden taps
   copied, so an EAGLE-3 drafter reads the same taps a full prefill makes.

Each test checks that the path was taken (a spy on KVCache.claim / copy_prefix and the taps)
and that every token, and with EAGLE-3 every step's drafted and accepted counts, equal the
cache-off run's.
"""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from specdec.config import EngineConfig, SamplingParams

FIRST, SECOND = "Name three colors.", "Name three animals."  # the chat template's system prompt and "Name three" shared
OTHER = "Write a haiku about autumn leaves."


@pytest.fixture(scope="module", params=[None, "int8"], ids=["float32", "int8"])
def engines(request):
    """Cache on and off, on float32 and on the int8 weights that ship (issue 61)."""
    from specdec.serving.runtime import build_engine, served_methods

    methods = {"eagle3": served_methods()["eagle3"]}  # a drafter that reads the target's taps
    return {cached: build_engine(config=EngineConfig(max_batch_size=2, max_seq_len=512, enable_prefix_caching=cached,
                                                     weight_format=request.param),
                                 speculative=methods) for cached in (True, False)}


@dataclass
class Claim:
    found_slot: int | None
    found_tokens: int
    found_holds: int  # what the found slot held (tokens) before the claim
    free: tuple[int, ...]  # free slots before the claim
    slot: int  # the slot the sequence got
    copied_from: int | None = None  # copy_prefix's source, if it copied
    taps_equal: bool | None = None  # the new slot's taps equal the source's over the reused prefix


class Spy:
    """Records every claim of the engine's KV cache: what was found, what was free, where the
    sequence went, whether the prefix and the taps were copied."""

    def __init__(self, engine, monkeypatch):
        self.claims: list[Claim] = []
        target_pass, cache = engine.target_pass, engine.cache
        claim, copy_prefix, claim_slot = cache.claim, cache.copy_prefix, target_pass._claim_slot

        def spied_claim(tokens, salt, found):
            before = Claim(found and found.slot, found.tokens if found else 0, cache.prefix.holds(found.slot) if found else 0,
                           tuple(sorted(cache._free)), -1)
            self.claims.append(before)
            before.slot = claim(tokens, salt, found)
            return before.slot

        def spied_copy(source, slot):
            self.claims[-1].copied_from = source.slot
            copy_prefix(source, slot)

        def spied_claim_slot(prompt, salt, needs_taps):
            slot, reused = claim_slot(prompt, salt, needs_taps)
            last = self.claims[-1]
            if reused and last.copied_from is not None and target_pass.taps is not None:
                last.taps_equal = torch.equal(target_pass.taps[slot, :reused], target_pass.taps[last.copied_from, :reused])
            return slot, reused

        monkeypatch.setattr(cache, "claim", spied_claim)
        monkeypatch.setattr(cache, "copy_prefix", spied_copy)
        monkeypatch.setattr(target_pass, "_claim_slot", spied_claim_slot)


class Run:
    """Requests added and stepped by hand, so the cache-on and cache-off engines run the same schedule."""

    def __init__(self, engine):
        self.engine, self.outs = engine, {}

    def add(self, rid: str, question: str, salt: str, method: str = "none", max_tokens: int = 12, ignore_eos: bool = False):
        ids = self.engine.tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                                        tokenize=True)
        self.engine.add_request(rid, ids, SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos, cache_salt=salt), method)
        self.outs[rid] = []
        return len(ids)

    def until(self, done) -> None:
        for _ in range(200):
            if done():
                return
            for out in self.engine.step():
                self.outs[out.request_id].append(out)
        raise AssertionError("the schedule never got there")

    def started(self, rid: str) -> bool:
        return bool(self.outs[rid])

    def finished(self, rid: str) -> bool:
        return bool(self.outs[rid]) and self.outs[rid][-1].finished

    def result(self, rid: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Tokens, and every verified step's (accepted, drafted)."""
        outs = self.outs[rid]
        return [t for o in outs for t in o.new_token_ids], [(o.step.accepted, o.step.draft_tokens) for o in outs if o.verified]

    def cached(self, rid: str) -> int:
        return self.outs[rid][-1].stats.cached_prompt_tokens


def scrub(engine) -> None:
    """Every slot forgets what it held and its memory turns to noise: a column a claim fails
    to copy (KV or taps) is read as noise, not as the same system prompt an earlier test left
    at the same position."""
    generator = torch.Generator().manual_seed(0)
    cache, target_pass = engine.cache, engine.target_pass
    for tensor in (cache.k, cache.v, target_pass.taps):
        tensor.copy_(torch.randn(tensor.shape, generator=generator, dtype=tensor.dtype) * 10)
    for slot in range(cache.max_slots):
        cache.prefix.reset(slot, None)
        target_pass.taps_len[slot] = 0


def both(engines, monkeypatch, schedule) -> tuple[Run, Run, Spy]:
    """The schedule on the cache-on engine (scrubbed, spied) and on the cache-off one; every
    request's tokens and steps equal."""
    scrub(engines[True])
    spy = Spy(engines[True], monkeypatch)
    on, off = Run(engines[True]), Run(engines[False])
    schedule(on)
    schedule(off)
    for rid in on.outs:
        assert on.result(rid) == off.result(rid), rid
        assert off.cached(rid) == 0
    return on, off, spy


def test_the_only_free_slot_is_adopted_though_it_holds_more_than_the_match(engines, monkeypatch):
    salt = "adopt-only-free"

    def schedule(run):
        run.add("a", FIRST, salt)
        run.until(lambda: run.finished("a"))
        run.add("live", OTHER, salt + "-other", max_tokens=24, ignore_eos=True)  # takes the other slot
        run.until(lambda: run.started("live"))
        run.add("b", SECOND, salt)
        run.until(lambda: run.finished("b"))
        run.add("c", FIRST, salt)  # a's prompt again: its slot now holds b's turn past the shared prefix
        run.until(lambda: run.finished("c") and run.finished("live"))

    on, _, spy = both(engines, monkeypatch, schedule)
    a, live, b = spy.claims[:3]
    assert b.found_slot == a.slot and b.free == (a.slot,) and live.slot != a.slot
    assert 16 <= b.found_tokens < b.found_holds  # a's slot held its whole turn, more than b shares
    assert b.slot == a.slot and b.copied_from is None  # adopted, not copied
    assert on.cached("b") == b.found_tokens


def test_a_free_slot_holding_more_than_the_match_is_copied_while_another_is_free(engines, monkeypatch):
    salt = "copy-from-free"
    prompt_len = {}

    def schedule(run):
        prompt_len["a"] = run.add("a", FIRST, salt)
        run.until(lambda: run.finished("a"))
        run.add("b", SECOND, salt)
        run.until(lambda: run.finished("b"))
        run.add("c", FIRST, salt)  # a's next turn finds a's slot as a left it
        run.until(lambda: run.finished("c"))

    on, _, spy = both(engines, monkeypatch, schedule)
    a, b, c = spy.claims[:3]
    assert b.found_slot == a.slot and len(b.free) == 2 and 16 <= b.found_tokens < b.found_holds
    assert b.slot != a.slot and b.copied_from == a.slot  # copied; the source keeps its content
    assert on.cached("b") == b.found_tokens
    assert c.found_slot == a.slot and on.cached("c") == prompt_len["a"] - 1  # all of a's prompt but the last token


def test_a_live_slots_prefix_and_taps_are_copied(engines, monkeypatch):
    salt = "copy-from-live"

    def schedule(run):
        run.add("live", FIRST, salt, method="eagle3", max_tokens=24, ignore_eos=True)
        run.until(lambda: run.started("live"))
        run.add("b", SECOND, salt, method="eagle3", max_tokens=16)
        run.until(lambda: run.finished("b") and run.finished("live"))

    on, _, spy = both(engines, monkeypatch, schedule)
    live, b = spy.claims[:2]
    assert b.found_slot == live.slot and live.slot not in b.free  # found in a slot in use
    assert b.slot != live.slot and b.copied_from == live.slot and b.found_tokens >= 16
    assert b.taps_equal is True  # the drafter's taps came with the KV
    assert on.cached("b") == b.found_tokens
    assert sum(drafted for _, drafted in on.result("b")[1]) > 0  # it drafted from those taps
