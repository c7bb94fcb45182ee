"""Behaviour no other `make test` test held, found by mutants that survived it (`make
mutants`, tests/support/mutants/ names the mutant each test kills).

Seeds: a seeded request draws from a stream of its own (alone or batched), and its drafter
from another. top-k and top-p keep exactly the reference set. Stop strings: several
completing in one token, the earliest start wins. The prefix cache's eviction paths: an
empty slot is taken before a retained one, adopting the only free slot forgets what it held
past the match, copying a prefix copies values as well as keys, a prompt held whole still
computes its last token. Taps reuse: a drafter that needs the target's taps gets exactly
the taps a full prefill makes, from a prompt first served without taps and from a slot in
use.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from specdec.config import EngineConfig, SamplingParams, SpeculativeConfig
from specdec.engine.drafters.eagle3 import Eagle3Drafter
from specdec.engine.drafters.ngram import NgramDrafter
from specdec.engine.kv_cache import KVCache
from specdec.engine.models.eagle3_head import load_eagle3
from specdec.engine.sampling import logits_to_probs, make_generator
from specdec.serving.detok import IncrementalDetokenizer
from specdec.serving.spec_engine import SpecEngine

from test_eagle3 import save_tiny_target_and_head
from test_speculative import reference_probs

PROMPT = [5, 9, 14, 5, 9, 22, 31, 5, 9, 14, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49]  # more than a block (16)
SAMPLED = SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True)
GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny target and a random EAGLE-3 head for it (a drafter that reads the target's taps)."""
    target, head_dir, _ = save_tiny_target_and_head(tmp_path_factory.mktemp("gaps"))
    return target, load_eagle3(head_dir, target.embed, target.cfg)


def engine_of(tiny, prefix_caching: bool = True, max_batch: int = 4) -> SpecEngine:
    target, head = tiny
    cfg = EngineConfig(max_batch_size=max_batch, max_seq_len=96, max_num_draft_tokens=8,
                       enable_prefix_caching=prefix_caching)
    drafters = {"eagle3": Eagle3Drafter(head, SpeculativeConfig(method="eagle3", max_draft_len=4), max_batch, 96),
                "ngram": NgramDrafter(SpeculativeConfig(max_draft_len=4))}
    return SpecEngine(target, cfg, drafters=drafters)


def run_together(engine: SpecEngine, requests, max_steps: int = 200) -> dict[str, list[int]]:
    """(request id, prompt, params, method, k) added at once, stepped until all finish."""
    tokens = {}
    for rid, prompt, params, method, k in requests:
        engine.add_request(rid, prompt, params, method, k)
        tokens[rid] = []
    for _ in range(max_steps):
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        if not engine.has_work():
            return tokens
    raise AssertionError(f"not finished within {max_steps} steps: {sorted(engine.sequences)}")


# ---- seeds ------------------------------------------------------------------------------------
@pytest.mark.parametrize("method,k", [("none", 0), ("ngram", 4)])
def test_a_seeded_request_samples_the_same_alone_and_batched(tiny, method, k):
    """make_generator: "a seeded request reproduces exactly, alone or batched". One stream
    shared by every request would pass a test that repeats a request alone."""
    seeded = SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True, seed=5)
    alone = run_together(engine_of(tiny), [("x", PROMPT, seeded, method, k)])["x"]
    batched = run_together(engine_of(tiny), [
        ("x", PROMPT, seeded, method, k),
        ("y", PROMPT[3:], SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True, seed=6), method, k),
        ("z", PROMPT[5:], SAMPLED, method, k),
    ])["x"]
    assert batched == alone


def test_the_drafter_does_not_draw_from_the_stream_the_target_starts_from(tiny):
    """Acceptance compares the target's uniforms with draws the drafter made: the same
    numbers on both sides would correlate them (the proof needs them independent)."""
    engine = engine_of(tiny)
    seed = 1234
    engine.add_request("x", PROMPT, SamplingParams(max_tokens=8, temperature=1.0, seed=seed), "ngram", 4)
    engine.step()
    drafter_stream = engine.speculator.drafts._get("x").generator.get_state()
    assert not torch.equal(drafter_stream, make_generator(seed).get_state())


# ---- top-k and top-p ------------------------------------------------------------------------------
@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.7, top_k=5),
    SamplingParams(temperature=1.0, top_k=1),
    SamplingParams(temperature=1.3, top_k=20, top_p=0.8),
    SamplingParams(temperature=0.9, top_p=0.5),
], ids=["top_k", "top_k_1", "top_k_top_p", "top_p"])
def test_top_k_and_top_p_keep_the_reference_set(params):
    """The engine's processing against tests/engine/test_speculative.py's numpy reference."""
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0)) * 3
    ours = logits_to_probs(logits, params).double().numpy()
    for row in range(len(logits)):
        reference = reference_probs(logits[row].double().numpy(), params)
        assert np.count_nonzero(ours[row]) == np.count_nonzero(reference)
        assert np.allclose(ours[row], reference, atol=1e-6)


# ---- stop strings -----------------------------------------------------------------------------------
def test_stops_completing_in_one_token_the_earliest_start_wins(smol_tokenizer):
    """"Hello" is one token holding both stops; "el" starts before "llo", which is listed first."""
    ids = smol_tokenizer.encode("Hello", add_special_tokens=False)
    assert len(ids) == 1, ids  # the case needs one token that completes both
    detok = IncrementalDetokenizer(smol_tokenizer, ("llo", "el"))
    assert detok.add(ids[0]) and detok.stopped == "el" and detok.release() == "H"


# ---- the prefix cache's eviction paths ----------------------------------------------------------------
def small_cache(slots: int) -> KVCache:
    return KVCache(num_layers=1, max_slots=slots, num_kv_heads=1, max_seq_len=32, head_dim=2, max_new_per_step=4,
                   prefix_block_tokens=4)


def fill(cache: KVCache, slot: int, tokens: list[int]) -> None:
    """Write distinct keys and values for `tokens` at the slot's newest positions and commit them."""
    start, n = cache.lengths[slot], len(tokens)
    values = torch.arange(start, start + n, dtype=torch.float32)[None, :, None].expand(1, n, 2)
    cache.k[:, slot, :, start : start + n] = values + 100 * slot
    cache.v[:, slot, :, start : start + n] = -values - 100 * slot
    cache.commit(slot, range(n), tokens)


def test_an_empty_slot_is_taken_before_a_retained_one():
    """Even when the empty slot was used more recently (a request that ended before its
    prompt was committed): the retained prefix stays reusable."""
    cache = small_cache(2)
    held = cache.allocate("s")
    fill(cache, held, list(range(10, 18)))
    cache.release(held)
    empty = cache.allocate("s")
    cache.release(empty)  # nothing committed: empty, and used after `held`
    assert cache.allocate("t") == empty
    assert cache.lookup(list(range(10, 18)) + [1], "s", 8).tokens == 8


def test_adopting_the_only_free_slot_forgets_what_it_held_past_the_match():
    """The adopted slot is rewritten past the match: a later lookup must not find the old
    tokens there."""
    cache = small_cache(2)
    old = list(range(10, 22))
    slot = cache.allocate("s")
    fill(cache, slot, old)
    cache.release(slot)
    cache.allocate("s")  # the other slot in use: the retained one is the only free slot
    prompt = old[:6] + [99, 98]
    adopted = cache.claim(prompt, "s", cache.lookup(prompt, "s", len(prompt) - 1))
    assert adopted == slot and cache.lengths[slot] == 6
    fill(cache, slot, [99, 98])
    assert cache.lookup(old + [1], "s", len(old)).tokens == 6


def test_copying_a_prefix_from_a_slot_in_use_copies_keys_and_values():
    cache = small_cache(2)
    live = cache.allocate("s")
    fill(cache, live, list(range(10, 18)))
    prompt = list(range(10, 16)) + [7]
    copy = cache.claim(prompt, "s", cache.lookup(prompt, "s", len(prompt) - 1))
    assert copy != live and cache.lengths[copy] == 6
    assert torch.equal(cache.k[:, copy, :, :6], cache.k[:, live, :, :6])
    assert torch.equal(cache.v[:, copy, :, :6], cache.v[:, live, :, :6])


def test_a_prompt_the_cache_holds_whole_still_computes_its_last_token(tiny):
    """Its logits sample the first token: a hit is at most the prompt less one token."""
    engine = engine_of(tiny)
    first = run_together(engine, [("a", PROMPT, GREEDY, "none", 0)])["a"]
    again = run_together(engine, [("b", PROMPT, GREEDY, "none", 0)], max_steps=20)["b"]
    assert again == first and engine.target_pass.prefix_cache_counters.reused_tokens == len(PROMPT) - 1


# ---- taps reuse ---------------------------------------------------------------------------------------
def prompt_taps(engine: SpecEngine) -> dict[str, torch.Tensor]:
    """The prompt taps each sequence's drafter starts from, recorded as they are handed over."""
    seen: dict[str, torch.Tensor] = {}
    drafts = engine.speculator.drafts
    start = drafts.start

    def recording(record, hidden=None, **kwargs):
        seen[record.seq_id] = hidden
        return start(record, hidden, **kwargs)

    drafts.start = recording
    return seen


def same_taps(got: torch.Tensor, expected: torch.Tensor) -> bool:
    """Equal up to float32 noise: the prompt's last position is computed in another batch."""
    return got.shape == expected.shape and torch.allclose(got, expected, rtol=1e-4, atol=1e-4)


def full_prefill_taps(tiny) -> torch.Tensor:
    engine = engine_of(tiny, prefix_caching=False)
    seen = prompt_taps(engine)
    run_together(engine, [("x", PROMPT, GREEDY, "eagle3", 4)])
    return seen["x"]


def test_a_prompt_first_served_without_taps_is_prefilled_again_for_a_drafter_that_needs_them(tiny):
    """The baseline's forward keeps no taps; the cached KV alone would leave EAGLE without them."""
    engine = engine_of(tiny)
    seen = prompt_taps(engine)
    run_together(engine, [("plain", PROMPT, GREEDY, "none", 0)])
    run_together(engine, [("x", PROMPT, GREEDY, "eagle3", 4)])
    expected = full_prefill_taps(tiny)
    assert same_taps(seen["x"], expected)


def test_a_hit_on_a_slot_in_use_copies_its_taps(tiny):
    engine = engine_of(tiny)
    seen = prompt_taps(engine)
    engine.add_request("live", PROMPT, SamplingParams(max_tokens=40, ignore_eos=True), "eagle3", 4)
    for _ in range(3):
        engine.step()
    reused = engine.target_pass.prefix_cache_counters.reused_tokens
    run_together(engine, [("x", PROMPT, GREEDY, "eagle3", 4)])
    assert engine.target_pass.prefix_cache_counters.reused_tokens - reused == len(PROMPT) - 1  # from the live slot
    expected = full_prefill_taps(tiny)
    assert same_taps(seen["x"], expected)
