"""The prefill budget (specdec/engine/prefill_budget.py): the prompt tokens a forward carries
beside running sequences, from a fit of the forwards served so far; fed forwards that cost a
known line, it learns the line and cuts chunks to the slowdown asked for."""
from __future__ import annotations

import pytest

from specdec.config import ConfigError, EngineConfig
from specdec.engine.prefill_budget import PrefillBudget

A, PER_PROMPT, PER_DECODE = 0.005, 0.0006, 0.0017  # seconds: about SmolLM2 int8 on 2 cores


def served(budget: PrefillBudget, forwards: list[tuple[int, int]]) -> None:
    for prompt, decode in forwards:
        budget.observe(prompt, decode, A + PER_PROMPT * prompt + PER_DECODE * decode)


MIXED = [(256, 0), (200, 0), (0, 16), (0, 4), (48, 16), (32, 4), (0, 1), (16, 1)]


def test_the_fit_recovers_the_cost_line_and_sizes_chunks_from_it():
    budget = PrefillBudget(most_tokens=256, max_slowdown=2.5)
    served(budget, MIXED)
    assert budget.fit() == pytest.approx((A, PER_PROMPT, PER_DECODE), rel=1e-6)
    for decode_rows in (1, 4, 16, 64):
        without = A + PER_DECODE * decode_rows
        n = budget.tokens(decode_rows)
        expected = max(16, min(256, int(1.5 * without / PER_PROMPT)))
        assert n == expected
        if 16 < n < 256:  # the forward with the chunk costs the slowdown asked for, to a token
            assert A + PER_PROMPT * n + PER_DECODE * decode_rows <= 2.5 * without < A + PER_PROMPT * (n + 1) + PER_DECODE * decode_rows
    assert budget.tokens(4) < budget.tokens(16)  # fewer running rows: a dearer chunk relative to their step


def test_nothing_decoding_or_off_or_unlearnt_gives_whole_chunks():
    budget = PrefillBudget(most_tokens=256, max_slowdown=2.5)
    assert budget.tokens(16) == 256  # nothing seen: chunks of most_tokens
    served(budget, [(256, 0), (0, 16), (0, 16), (0, 16)])  # two kinds, two sizes: a line not yet told apart
    assert budget.fit() is None and budget.tokens(16) == 256
    served(budget, MIXED)
    assert budget.tokens(0) == 256  # nobody waits but the prompts
    off = PrefillBudget(most_tokens=256, max_slowdown=0)
    served(off, MIXED)
    assert off.tokens(16) == 256
    whole = PrefillBudget(most_tokens=0, max_slowdown=2.5)
    assert whole.tokens(16) is None and whole.tokens(0) is None


def test_a_prompt_always_advances_and_never_past_the_cap():
    budget = PrefillBudget(most_tokens=256, max_slowdown=1.01)  # almost no slowdown allowed
    served(budget, MIXED)
    assert budget.tokens(1) == 16
    capped = PrefillBudget(most_tokens=8, max_slowdown=1.01)
    served(capped, MIXED)
    assert capped.tokens(1) == 8  # the floor is never above the cap
    generous = PrefillBudget(most_tokens=256, max_slowdown=50)
    served(generous, MIXED)
    assert generous.tokens(16) == 256


def test_a_fit_that_makes_no_sense_is_not_used():
    """Noise that makes prompt tokens free (or negative) leaves chunks at the cap."""
    budget = PrefillBudget(most_tokens=256, max_slowdown=2.5)
    for prompt, decode in MIXED:
        budget.observe(prompt, decode, A + PER_DECODE * decode - 1e-5 * prompt)
    assert budget.fit() is None and budget.tokens(16) == 256


@pytest.mark.parametrize("value", [-1.0, 0.5, 1.0, float("inf"), float("nan")])
def test_the_setting_names_itself_when_wrong(value):
    with pytest.raises(ConfigError, match="prefill_max_slowdown"):
        EngineConfig(prefill_max_slowdown=value)
