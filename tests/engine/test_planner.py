"""The budget planner (specdec/engine/planner.py): measured costs, acceptance estimates, and the
per-step choice of what to verify. Losslessness with planning on is tested with the other
speculative tests (test_speculative.py: greedy identity and chi-square cases `adaptive_*`)."""
from __future__ import annotations

import pytest

from specdec.config import SpeculativeConfig
from specdec.errors import ConfigError
from specdec.engine.planner import EXPLORE_EVERY, BudgetPlanner, DraftCost, DraftCut, PlanItem, VerifyCost, _isotonic
from specdec.engine.tree import IID_SAMPLED, ROOT, DraftTree


def test_isotonic_pools_violators():
    assert list(_isotonic([1.0, 3.0, 2.0, 4.0], [1, 1, 1, 1])) == [1.0, 2.5, 2.5, 4.0]
    assert list(_isotonic([5.0, 1.0], [3, 1])) == [4.0, 4.0]


def test_verify_cost_is_a_monotone_table_extrapolated_along_its_steepest_slope():
    cost = VerifyCost(refit_every=1)
    for tokens, seconds in [(1, 0.030), (4, 0.029), (8, 0.040), (16, 0.056)]:
        cost.observe(tokens, seconds)
    assert cost.seconds_for(4) == pytest.approx(cost.seconds_for(1), abs=1e-5)  # the dip is pooled away
    assert cost.seconds_for(12) == pytest.approx(0.048, abs=1e-4)  # interpolated
    assert cost.seconds_for(24) == pytest.approx(0.056 + 8 * 0.002625, abs=1e-4)  # steepest: 4 -> 8
    assert cost.marginal(2) < cost.marginal(10)  # flat below the knee, rising above it


def test_verify_cost_is_kept_per_batch_size_and_borrowed_for_unseen_ones():
    cost = VerifyCost(refit_every=1)
    for tokens, seconds in [(4, 0.030), (8, 0.034), (16, 0.050)]:
        cost.observe(tokens, seconds, sequences=4)
    cost.observe(16, 0.150, sequences=16)  # sixteen sequences' attention: dearer at the same tokens
    assert cost.seconds_for(16, 16) == pytest.approx(0.150, abs=1e-4)
    assert cost.seconds_for(16, 16) > cost.seconds_for(16, 4)
    # Batch 8 not measured: batch 4's table moved by four extra sequences' tokens.
    assert cost.seconds_for(12, 8) == pytest.approx(cost.seconds_for(8, 4) + 4 * cost.slope, abs=1e-4)


def chain(n: int, confidence: list[float] | None = None) -> DraftTree:
    return DraftTree.chain(list(range(10, 10 + n)), confidence=confidence)


def planner_with(costs: dict[int, float], sequences: int = 1) -> BudgetPlanner:
    planner = BudgetPlanner()
    for tokens, seconds in costs.items():
        planner.observe_verify(tokens, sequences, seconds)
    planner.verify_cost.fit()
    return planner


def test_free_tokens_are_verified_and_expensive_ones_are_not():
    flat = planner_with({1: 0.03, 9: 0.0301})  # a weight-bound forward: extra tokens cost ~nothing
    steep = planner_with({1: 0.03, 9: 0.27})  # every token costs as much as a whole step
    tree = chain(8, [0.9] * 8)
    assert len(flat.select([PlanItem("a", "m", tree, adaptive=True)])[0]) == 8
    assert len(steep.select([PlanItem("a", "m", tree, adaptive=True)])[0]) == 0  # the baseline step


def test_selection_keeps_whole_paths_by_gain_and_leaves_fixed_items_alone():
    planner = planner_with({5: 0.03, 7: 0.0301, 8: 0.06, 15: 0.2}, sequences=2)  # a fixed chain of 3 + a root
    # root -> a (0.9) -> b (0.9); root -> c (0.05): c's path is the least likely.
    tree = DraftTree([1, 2, 3], [ROOT, 0, ROOT], confidence=[0.95, 0.95, 0.02])
    fixed = chain(3)
    kept, untouched = planner.select([PlanItem("a", "m", tree, True), PlanItem("b", "m", fixed, False)])
    assert kept.tokens == [1, 2] and kept.parents == [ROOT, 0]
    assert untouched is fixed


def test_sampled_draws_are_planned_by_position_not_by_their_own_confidence():
    """A sampled node kept only when its own draw looks likely would bias min(1, p/q)."""
    planner = planner_with({1: 0.03, 3: 0.0301, 4: 0.2})
    import torch

    probs = torch.full((2, 4), 0.25)
    confident = DraftTree([1, 2], [ROOT, 0], probs, IID_SAMPLED, confidence=[0.99, 0.99])
    doubtful = DraftTree([1, 2], [ROOT, 0], probs, IID_SAMPLED, confidence=[0.01, 0.01])
    a = planner.select([PlanItem("a", "m", confident, True)])[0]
    b = planner.select([PlanItem("b", "m", doubtful, True)])[0]
    assert len(a) == len(b)


def test_a_sampled_node_is_kept_or_cut_without_looking_at_later_draws():
    """A cost curve with two rate peaks (1 token 30 ms, 2 and 3 tokens 46 ms; gain .5 a
    node): the best prefix of two sampled nodes keeps both, of one keeps none, so the first
    node's fate would hang on whether a second was drawn, which under sampled_tree depends
    on the first draw's value (q = (.9, .1), mass .8, p = (.5, .5) emits B 55% of the time).
    Sampled trees stop at the first peak; deterministic ones take the best prefix."""
    import torch

    planner = planner_with({1: 0.030, 2: 0.046, 3: 0.046})
    planner.node_gains = lambda method, seq_id, tree, per_sequence=True: [0.5] * len(tree)
    probs = torch.full((2, 4), 0.25)
    one = DraftTree([1], [ROOT], probs[:1], IID_SAMPLED)
    two = DraftTree([1, 2], [ROOT, ROOT], probs, IID_SAMPLED)
    assert len(planner.select([PlanItem("a", "m", one, True)])[0]) == 0
    assert len(planner.select([PlanItem("a", "m", two, True)])[0]) == 0
    assert len(planner.select([PlanItem("a", "m", DraftTree([1, 2], [ROOT, ROOT]), True)])[0]) == 2


def test_estimates_follow_what_verification_kept():
    planner = planner_with({1: 0.03, 9: 0.031})
    tree = chain(4)  # no confidences: by position
    before = planner.position_estimates("m", 2)
    for _ in range(200):
        planner.observe_accepts("m", "a", tree, [0])  # first node always, second never
    after = planner.position_estimates("m", 2)
    assert after[0] > before[0] and after[0] > 0.9
    assert after[1] < before[1] and after[1] < 0.1
    gains = planner.node_gains("m", "a", tree)
    assert gains[0] > 0.9 and gains[1] < 0.1 and gains == sorted(gains, reverse=True)


def test_a_sequence_that_never_pays_still_explores_now_and_then():
    planner = planner_with({1: 0.03, 2: 0.3})  # a node costs ten steps: never worth it
    tree = chain(2, [0.5, 0.5])
    kept = [len(planner.select([PlanItem("a", "m", tree, True)])[0]) for _ in range(2 * EXPLORE_EVERY + 2)]
    assert kept.count(0) >= 2 * EXPLORE_EVERY and 1 <= sum(kept) <= 2
    assert planner.to_draft("m", ["a", "fresh"]) in ([], ["a"])


def test_draft_cut_stops_when_the_next_pass_does_not_pay():
    planner = planner_with({1: 0.03, 9: 0.0301})
    planner.select([PlanItem("a", "m", chain(1, [0.9]), True)])  # sets the price of a second
    planner.draft_costs["m"] = cost = DraftCost()
    cost.observe((1.0, 1.0, 1.0), 0.001)
    cost.observe((1.0, 2.0, 1.0), 0.002)
    cut = DraftCut(planner, "m", ["a"])
    assert cut(1, [0.9])  # a likely path: draft deeper
    assert not cut(5, [1e-6])  # hopeless: stop
    cut.finish(0.004)
    assert cut.passes == 2


def test_adaptive_excludes_static_load_controls():
    with pytest.raises(ConfigError, match="adaptive"):
        SpeculativeConfig(adaptive=True, max_concurrency=4)
    with pytest.raises(ConfigError, match="adaptive.*colocated"):  # the planner lives beside the target
        SpeculativeConfig(method="draft_model", adaptive=True, colocated=False)
    assert SpeculativeConfig(adaptive=True).scheduled_draft_tokens(5, 64) == 5


def test_exploration_is_per_method_not_per_sequence():
    """Sixteen sequences of a method that never pays explore one node per EXPLORE_EVERY
    steps between them, not one each (a full batch would otherwise draft every step)."""
    planner = planner_with({16: 0.1, 17: 1.0}, sequences=16)
    items = [PlanItem(f"s{i}", "m", chain(2, [0.5, 0.5]), True) for i in range(16)]
    verified = sum(len(t) for _ in range(2 * EXPLORE_EVERY) for t in planner.select(items))
    assert 1 <= verified <= 2
    assert len(planner.to_draft("m", [i.seq_id for i in items])) <= 1
