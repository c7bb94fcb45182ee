"""Losslessness computed exactly (tests/support/exact.py) for a batch of two sequences with the
prefix cache on, one of them a prefix hit.

Sequence A starts alone and verifies its first tree; B joins in the step after, while A
verifies its second, with a prompt that is A's followed by three tokens A may have emitted:
B's prompt starts from A's KV and hidden taps, copied from A's live slot (the prefix cache's
hit on a slot in use; taps held beside the KV because both methods draft from the target's
hidden states). How far the hit reaches depends on what A emitted: A's prompt alone, or also
A's first token and its first accepted draft, whose KV (moved to the accepted path) and taps
A's verification committed. Then both verify in the same forwards. The
enumeration covers both sequences' randomness jointly: each output must be the target's
after its own prompt, and the two must be independent (no draw of one may move the other's).

What this proves of the reused state: the KV (a wrong column moves B's target distribution).
The taps only steer B's drafts, so a wrong tap would cost acceptance, not losslessness; their
equality with a full prefill is tests/engine/test_prefix_eviction.py's.

The methods are EAGLE-3 ones: a sampled chain (A) and the adaptive EAGLE-2 top-k tree (B,
planned beside a batch mate that is not)."""
from __future__ import annotations

import dataclasses

from exact import PROMPT, Request, flat_cost, make_engine, request_outcomes, toy, worst_deviation  # noqa: F401 - toy is a fixture
from test_exact_lossless import TOLERANCE, TOP_K

A = Request("eagle3", dataclasses.replace(TOP_K, seed=1), 2)
# A's prompt, then tokens A emits in some runs (top-k 2 after this prompt: 0 or 3 first)
B = Request("eagle3-tree-adaptive", dataclasses.replace(TOP_K, temperature=0.8, seed=2), 3, prompt=PROMPT + (0, 0, 3), join=2)


def test_a_batch_of_two_with_a_prefix_hit_is_the_targets(toy):
    engine = make_engine(toy, [A.method, B.method], prefix_cache=True, max_batch_size=2, cost=flat_cost)
    outcomes = request_outcomes(engine, [A, B])
    for i, req in enumerate((A, B)):
        worst, where = worst_deviation(toy, outcomes.marginal(i), req.params, req.prompt)
        assert worst < TOLERANCE, f"sequence {i}: P(next | {where}) deviates by {worst:.2e} from the target's"
        assert outcomes.partially_accepted_then_drafted(i), f"sequence {i}: no second tree after a rejection"
    # the hit: A's prompt (7), with A's first token (8), and its first accepted draft (9)
    assert {s[0].cached_tokens for s in outcomes.steps(1)} == {7, 8, 9}
    assert {s[0].cached_tokens for s in outcomes.steps(0)} == {0}
    a, b = outcomes.marginal(0), outcomes.marginal(1)
    assert len(outcomes.joint) == len(a) * len(b), "some pairs of outputs never occur together"
    dependence = max(abs(p - a[x] * b[y]) for (x, y), p in outcomes.joint.items())
    assert dependence < TOLERANCE, f"the two sequences' outputs are not independent ({dependence:.2e})"


# n > 1 (the OpenAI front end's n): siblings of one prompt, the second started once the first's
# prompt is prefilled, so its prompt's KV is the prefix cache's; each with its own seed.
SIBLING_A = Request("ngram", dataclasses.replace(TOP_K, seed=3), 2)
SIBLING_B = Request("ngram", dataclasses.replace(TOP_K, seed=4), 2, join=1)


def test_n_siblings_of_one_prompt_are_each_the_targets_and_independent(toy):
    engine = make_engine(toy, [SIBLING_A.method], prefix_cache=True, max_batch_size=2, cost=flat_cost)
    outcomes = request_outcomes(engine, [SIBLING_A, SIBLING_B])
    for i, req in enumerate((SIBLING_A, SIBLING_B)):
        worst, where = worst_deviation(toy, outcomes.marginal(i), req.params, req.prompt)
        assert worst < TOLERANCE, f"sibling {i}: P(next | {where}) deviates by {worst:.2e} from the target's"
    assert {s[0].cached_tokens for s in outcomes.steps(1)} >= {len(PROMPT) - 1}  # the sibling's prompt came from the cache
    a, b = outcomes.marginal(0), outcomes.marginal(1)
    dependence = max(abs(p - a[x] * b[y]) for (x, y), p in outcomes.joint.items())
    assert len(outcomes.joint) == len(a) * len(b) and dependence < TOLERANCE, f"siblings not independent ({dependence:.2e})"
