"""Losslessness computed exactly (tests/exact.py) for a batch of two sequences with the
prefix cache on, one of them a prefix hit.

Sequence A starts alone; B joins in the next step, with a prompt that shares A's first six
tokens, while A verifies its first tree: B's prefill (its last token) and A's tree go in one
forward, and B's prompt starts from A's KV and hidden taps, copied from A's live slot (the
prefix cache's hit on a slot in use; taps held beside the KV, since both methods draft from
the target's hidden states). Then both verify in the same forwards, two steps each. The
enumeration covers both sequences' randomness jointly: each one's output must be the
target's after its own prompt, and the two must be independent (no draw of one may move the
other's).

The methods are EAGLE-3 ones, whose drafters read the taps: a sampled chain (A) and the
adaptive EAGLE-2 top-k tree (B, planned beside a batch mate that is not)."""
from __future__ import annotations

import dataclasses

from exact import PROMPT, Request, flat_cost, make_engine, request_outcomes, toy, worst_deviation  # noqa: F401 - toy is a fixture
from test_exact_lossless import TOLERANCE, TOP_K

PROMPT_B = PROMPT[:6] + (2,)  # the first six tokens are A's: a hit on A's live slot
A = Request("eagle3", TOP_K, 2)
B = Request("eagle3-tree-adaptive", dataclasses.replace(TOP_K, temperature=0.8), 3, prompt=PROMPT_B, join=1)


def test_a_batch_of_two_with_a_prefix_hit_is_the_targets(toy):
    engine = make_engine(toy, [A.method, B.method], prefix_cache=True, max_batch_size=2, cost=flat_cost)
    outcomes = request_outcomes(engine, [A, B])
    for i, req in enumerate((A, B)):
        worst, where = worst_deviation(toy, outcomes.marginal(i), req.params, req.prompt)
        assert worst < TOLERANCE, f"sequence {i}: P(next | {where}) deviates by {worst:.2e} from the target's"
        assert outcomes.partially_accepted_then_drafted(i), f"sequence {i}: no second tree after a rejection"
    assert {s[0].cached_tokens for s in outcomes.steps(1)} == {6}, "B did not start from A's cached prefix"
    assert {s[0].cached_tokens for s in outcomes.steps(0)} == {0}
    a, b = outcomes.marginal(0), outcomes.marginal(1)
    assert len(outcomes.joint) == len(a) * len(b), "some pairs of outputs never occur together"
    dependence = max(abs(p - a[x] * b[y]) for (x, y), p in outcomes.joint.items())
    assert dependence < TOLERANCE, f"the two sequences' outputs are not independent ({dependence:.2e})"
