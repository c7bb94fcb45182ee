"""The prefill budget (specdec/engine/prefill_budget.py): the prompt tokens a forward carries
beside running sequences, from a fit of the forwards served so far; fed forwards that cost a
known line, it learns the line and cuts chunks so the forward stays within the slowdown asked
for of a running stream's usual step."""
from __future__ import annotations

import pytest

from specdec.config import ConfigError, EngineConfig
from specdec.engine.prefill_budget import PrefillBudget

A, PER_PROMPT, PER_DECODE = 0.005, 0.0006, 0.0017  # seconds: about SmolLM2 int8 on 2 cores


def cost(prompt: int, decode: int) -> float:
    return A + PER_PROMPT * prompt + PER_DECODE * decode


def served(budget: PrefillBudget, forwards: list[tuple[int, int]]) -> None:
    for prompt, decode in forwards:
        budget.observe(prompt, decode, cost(prompt, decode))


MIXED = [(256, 0), (200, 0), (0, 16), (0, 4), (48, 16), (32, 4), (0, 1), (16, 1)]


def test_the_fit_recovers_the_cost_line_and_sizes_chunks_to_the_slowdown():
    budget = PrefillBudget(most_tokens=256, max_slowdown=2.5)
    served(budget, MIXED)
    assert budget.fit() == pytest.approx((A, PER_PROMPT, PER_DECODE), rel=1e-6)
    sizes = {}
    for decode_rows in (1, 4, 16, 64):
        n = sizes[decode_rows] = budget.tokens(decode_rows)
        if 16 < n < 256:  # the forward with the chunk costs the slowdown asked for, to a token
            assert cost(n, decode_rows) <= 2.5 * cost(0, decode_rows) < cost(n + 1, decode_rows)
    assert 16 < sizes[4] < sizes[16] < sizes[64]  # more running rows: a longer step, a larger chunk within its slowdown
    # 12 prompts still waiting beside 4 decoding rows: the step is the one all 16 will decode at,
    # not the 4 rows' short one (a wave's first streams would otherwise shrink its chunks)
    wave = budget.tokens(4, waiting=12)
    assert wave > sizes[4]
    assert cost(wave, 4) <= 2.5 * cost(0, 16) < cost(wave + 1, 4)


def test_at_a_steady_load_the_decode_rows_alone_still_give_the_budget():
    """Every forward with 16 decode rows: a and b_decode cannot be told apart, and need not be."""
    budget = PrefillBudget(most_tokens=256, max_slowdown=2.5)
    served(budget, [(0, 16)] * 50 + [(40, 16), (80, 16), (60, 16)])
    a, prompt, decode = budget.fit()
    assert prompt == pytest.approx(PER_PROMPT) and a + 16 * decode == pytest.approx(cost(0, 16))
    assert budget.tokens(16) == int(1.5 * cost(0, 16) / PER_PROMPT)


def test_nothing_decoding_or_off_or_unlearnt_gives_whole_chunks():
    budget = PrefillBudget(most_tokens=256, max_slowdown=2.5)
    assert budget.tokens(16) == 256  # nothing seen: chunks of most_tokens
    served(budget, [(0, 16)] * 10)
    assert budget.fit() is None and budget.tokens(16) == 256  # no prompt seen: its cost unknown
    served(budget, MIXED)
    assert budget.tokens(0) == 256  # nobody waits but the prompts: the oldest ones up to the cap
    assert budget.tokens(0, waiting=1, oldest=1000) == 1000  # a long prompt alone goes whole
    served(budget, [(0, 16)] * 300)  # a long stretch of decoding alone keeps what a prompt token costs
    assert budget.fit()[1] == pytest.approx(PER_PROMPT) and budget.tokens(16) < 256
    off = PrefillBudget(most_tokens=256, max_slowdown=0)
    served(off, MIXED)
    assert off.tokens(16) == 256
    whole = PrefillBudget(most_tokens=0, max_slowdown=2.5)
    assert whole.tokens(16) is None and whole.tokens(0) is None


def test_a_prompt_always_advances_and_never_past_the_cap():
    budget = PrefillBudget(most_tokens=256, max_slowdown=1.01)  # almost no slowdown allowed
    served(budget, MIXED)
    assert budget.tokens(64) == 16  # 1% of a 64-row step buys no prompt token: the floor
    capped = PrefillBudget(most_tokens=8, max_slowdown=1.01)
    served(capped, MIXED)
    assert capped.tokens(64) == 8  # the floor is never above the cap
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
