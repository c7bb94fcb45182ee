"""Losslessness computed exactly, for every drafting method that ships, over two steps.

tests/support/exact.py runs the real engine (its drafters, planner, verification and logits
processing) once per combination of its random outcomes and weighs each output by its
probability, so the output distribution is known exactly, not sampled. One request: its
prefill (the first token sampled, the first tree drafted) and TWO speculative steps, the
second verifying a tree drafted from the state the first left behind (the KV cache
compacted to the accepted path, EAGLE-3's pending pairs of taps and tokens, the draft
model's KV committed in place, Medusa's last tap, the logits rules' context, the planner's
updated estimates). Criterion: after every emitted prefix s, the next emitted token is
distributed as the target's processed distribution after prompt + s (computed with the
numpy processing of tests/engine/test_speculative.py, not the engine's). That is exactly the
condition for the whole stream to be the target's: a token not emitted in these steps
comes from a fresh step, itself drawn from the target.

Power: any deviation above TOLERANCE (1e-5 in probability; float32 rounding leaves at most
about 4e-7 here) fails, deterministically: no seed, no sample size. The negative controls
below are bugs a sampled test must be lucky to catch, and each moves some conditional by
more than 100x TOLERANCE: the hybrid merge that shipped lossy
(test_the_hybrid_merge_that_shipped_lossy_is_caught), a 2% tilt of the residual after a
rejection (test_a_two_percent_tilt_of_the_residual_is_caught), acceptance by argmax
(test_acceptance_by_argmax_is_caught), a planner that keeps sampled drafts by their own
confidence (test_a_planner_that_keeps_sampled_drafts_by_their_own_confidence_is_caught), a
drafter whose random stream is the verifier's
(test_a_drafter_sharing_the_verifiers_random_stream_is_caught), and a reference without the
sliding window (test_the_window_left_out_of_the_reference_fails).

Budgets (model_repository/specdec.json): drafting that is a function of the context
(EAGLE-2 top-k trees, Medusa trees, n-gram, suffix) runs at the shipped budget, the
adaptive methods both cut by the planner (a two-peak staircase cost) and whole (a flat
cost: every drafted node verified). Drafts sampled from q branch over every token each
draw, so the enumeration grows as the vocabulary to the power of the budget, per step:
those run two steps at reduced budgets (3 under top_k = 2, 2 over the full vocabulary) and
one step at the shipped budget; docs/methods.md argues why the reduction loses nothing.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

import numpy as np
import pytest
import torch

import specdec.engine.acceptance as acceptance
import specdec.engine.drafters.service as draft_service
import specdec.engine.planner as planner
from toy import argmax_path
from exact import (build_toy, END, MAX_TOKENS, VOCAB, Outcomes, Request, exact_outcomes, flat_cost, make_engine, request_outcomes,
                   staircase_cost, toy, worst_deviation)  # noqa: F401 - toy is a fixture
from specdec.config import SamplingParams
from specdec.engine.planner import VerifyCost
from specdec.engine.tree import ROOT, DraftTree
from specdec.serving.runtime import served_methods

TOLERANCE = 1e-5
PARAMS = SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, ignore_eos=True)
# top-k 2 of 4: a draw branches two ways, so sampled drafting goes deeper in the same runs;
# seeded, so the drafter's random stream and the verifier's are both the seed's (they must differ)
TOP_K = dataclasses.replace(PARAMS, top_k=2, seed=7)
TOP_K_3 = dataclasses.replace(PARAMS, top_k=3)
TOP_P = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, top_p=0.9, ignore_eos=True)
# TensorRT-LLM's logits rules on every tree node: penalties, min_length on the end id (0),
# which ends the request once allowed, and a bad word ("2 after 1", reachable at once).
RULES = SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, repetition_penalty=1.3, presence_penalty=0.4,
                       frequency_penalty=0.3, min_length=3, end_ids=(0,), bad_word_ids=((1, 2),))


@dataclass(frozen=True)
class Case:
    params: SamplingParams
    budget: int | None = None  # num_draft_tokens; None: the method's shipped budget
    cost: Callable[[], VerifyCost] = staircase_cost  # the planner's verify cost (adaptive methods)
    max_runs: int = 20_000


# Every method that ships, by model_repository/specdec.json's name, over two steps:
TWO_STEPS = {
    # drafts that are a function of the context: the shipped budget
    "eagle3-tree-adaptive": Case(TOP_K_3, cost=flat_cost),  # EAGLE-2 top-k tree, 16 nodes, one-hot rule
    "medusa-tree": Case(RULES),  # top-k product tree, 12 nodes, penalties, bad words, end id
    "ngram": Case(RULES),  # one-hot chain of 4
    "ngram-tree": Case(TOP_P),  # trie of continuations, 8 nodes
    "ngram-adaptive": Case(PARAMS, cost=flat_cost),  # chain of 8, planned
    "suffix": Case(TOP_K_3, cost=flat_cost),  # frequency tree from an earlier request, 16 nodes, planned
    # drafts sampled from q (SpecInfer's min(1, p/q)): reduced budgets, see the docstring
    "eagle3": Case(TOP_K),  # sampled chain, the shipped 2 whole
    "eagle3-tree": Case(TOP_K, 3),  # sampled tree, children drawn until they cover mass 0.8 (shipped 6)
    "eagle3-adaptive": Case(TOP_P),  # planned chain, confidence-cut drafting (shipped 6)
    "eagle3-hybrid": Case(TOP_K, cost=flat_cost),  # sampled chain, n-gram and suffix continuations merged in (6)
    "medusa": Case(TOP_K, 3),  # sampled chain, each head's q independent of the draws before it (shipped 4)
    "draft_model": Case(TOP_K),  # sampled chain with the draft LM's q (shipped 3)
    "draft_model-adaptive": Case(TOP_K),  # planned (shipped 6)
}

def linear_cost() -> VerifyCost:
    """10 ms per verified token on top of 30 ms: every node must earn its price, so what a
    planner keeps depends on what it believes of each node."""
    cost = VerifyCost()
    for tokens in range(1, 20):
        cost.observe(tokens, 0.030 + 0.010 * (tokens - 1), 1)
    cost.fit()
    return cost


# The planned methods with sampled drafts again, under costs where the planner cuts them: what
# it keeps must not depend on the draws' own values. The planner then drafts no second tree
# (the second step is plain decoding, enumerated too).
PLANNER_CUTS = {
    "eagle3-hybrid": Case(TOP_K),  # the staircase
    "eagle3-adaptive": Case(TOP_P, cost=linear_cost),
}
SHIPPED = ([pytest.param(method, case, True, id=method) for method, case in TWO_STEPS.items()]
           + [pytest.param(method, case, False, id=f"{method}-planner-cut") for method, case in PLANNER_CUTS.items()])

# The same two steps over the full vocabulary, sampled drafts at budget 2 (slow).
FULL_VOCABULARY = {
    "eagle3": Case(PARAMS, 2),
    "eagle3-tree": Case(PARAMS, 2),
    "medusa": Case(PARAMS, 2),
    "draft_model": Case(PARAMS, 2, max_runs=40_000),  # four ways per draw: 32,416 runs
    "eagle3-hybrid": Case(PARAMS),
    "eagle3-tree-adaptive": Case(PARAMS, cost=flat_cost),
    "medusa-tree": Case(PARAMS),
}

# Sampled drafting at the shipped budget, one step (the slow ones: thousands of runs each).
ONE_STEP_SHIPPED = [
    pytest.param("eagle3", Case(TOP_K), id="eagle3"),  # chain of 2
    pytest.param("medusa", Case(PARAMS), id="medusa"),  # chain of 4
    pytest.param("draft_model", Case(PARAMS), id="draft_model"),  # chain of 3
    pytest.param("eagle3-tree", Case(TOP_K), id="eagle3-tree", marks=pytest.mark.slow),  # sampled tree of 6
    pytest.param("eagle3", Case(PARAMS), id="eagle3-full-vocabulary", marks=pytest.mark.slow),
]


def test_every_shipped_method_is_covered():
    """A method added to specdec.json must join TWO_STEPS (draft_model-colocated drafts
    exactly what draft_model does: the same drafter; tests/serving/test_exact_apart.py runs
    draft_model served apart, as it ships)."""
    assert set(served_methods()) - {"draft_model-colocated"} == set(TWO_STEPS)


def check(toy, method: str, case: Case, steps: int = 2) -> Outcomes:
    engine = make_engine(toy, [method], cost=case.cost)
    outcomes = request_outcomes(engine, [Request(method, case.params, case.budget)], steps, case.max_runs)
    worst, where = worst_deviation(toy, outcomes.marginal(), case.params)
    assert worst < TOLERANCE, f"{method}: P(next | {where}) deviates by {worst:.2e} from the target's"
    assert max(len(t) for t in outcomes.marginal()) > steps + 1, f"{method}: no run accepted a draft"
    assert max(s[0].draft_tokens for s in outcomes.steps()) > 0, f"{method}: no run verified a draft"
    return outcomes


@pytest.mark.parametrize("method, case, resumes", SHIPPED)
def test_the_exact_output_distribution_is_the_targets(toy, method, case, resumes):
    """Two steps of every shipped method (resumes: some run verifies a second tree after a
    partial acceptance)."""
    outcomes = check(toy, method, case)
    if resumes:
        assert outcomes.partially_accepted_then_drafted(), f"{method}: no run verified a second tree after a rejection"
    spec = served_methods()[method]
    if case.budget is None and case.cost is flat_cost:  # the shipped budget whole, in each step
        assert max(s[1].draft_tokens for s in outcomes.steps() if len(s) > 1) == spec.max_total_draft_tokens


@pytest.fixture(scope="module", params=["qwen3", "mistral-window-4", "gemma3-window-4"])
def family_toy(request, tmp_path_factory):
    """The toy in another decoder family: Qwen3 (q/k norm), Mistral with a 4-token sliding
    window (the 7-token prompt and every later position outgrow it), Gemma 3 with a 4-token
    window on its local layer beside a global one, issue 46."""
    arch, family, model_type = {
        "qwen3": ("qwen3", {}, "qwen3"), "mistral-window-4": ("mistral", {"sliding_window": 4}, "mistral"),
        "gemma3-window-4": ("gemma3", {"sliding_window": 4, "tie_word_embeddings": True}, "gemma3_text"),
    }[request.param]
    toy = build_toy(tmp_path_factory.mktemp(request.param), arch=arch, **family)
    assert toy.target.cfg.model_type == model_type
    return toy


@pytest.mark.parametrize("method", ["eagle3-tree", "ngram-tree", "eagle3-hybrid"])
def test_other_decoder_families_keep_the_exact_distribution(family_toy, method):
    """Sampled chains and dynamic trees (a sliding window included) over two steps."""
    check(family_toy, method, TWO_STEPS[method])


def test_the_window_left_out_of_the_reference_fails(tmp_path_factory, monkeypatch):
    """Control for the sliding-window cases above: the same sampled EAGLE-3 trees on the
    Mistral toy with a 4-token window, against a reference that attends to the whole prefix,
    deviate far past the tolerance (so the windowed cases do test the window)."""
    import exact

    toy = build_toy(tmp_path_factory.mktemp("mistral-window-4"), arch="mistral", sliding_window=4)
    case = TWO_STEPS["eagle3-tree"]
    outcomes = request_outcomes(make_engine(toy, ["eagle3-tree"], cost=case.cost),
                                [Request("eagle3-tree", case.params, case.budget)], 2, case.max_runs)
    assert worst_deviation(toy, outcomes.marginal(), case.params)[0] < TOLERANCE
    real = exact.build_batch
    monkeypatch.setattr(exact, "build_batch", lambda *args, sliding_window=None, **kw: real(*args, **kw))
    assert worst_deviation(toy, outcomes.marginal(), case.params)[0] > 100 * TOLERANCE


@pytest.mark.slow
@pytest.mark.parametrize("method", list(FULL_VOCABULARY))
def test_two_steps_over_the_full_vocabulary_are_the_targets(toy, method):
    check(toy, method, FULL_VOCABULARY[method])


@pytest.mark.parametrize("method, case", ONE_STEP_SHIPPED)
def test_sampled_drafts_at_the_shipped_budget_are_the_targets(toy, method, case):
    outcomes = check(toy, method, case, steps=1)
    assert max(s[0].draft_tokens for s in outcomes.steps()) == served_methods()[method].max_total_draft_tokens


# ---- negative controls: lossy code the proof must catch ---------------------------------
def deviation(toy, method: str, params: SamplingParams = PARAMS, budget: int | None = 3, steps: int = 1,
              cost: Callable[[], VerifyCost] = staircase_cost, streams: bool = True) -> float:
    outcomes = request_outcomes(make_engine(toy, [method], cost=cost), [Request(method, params, budget)], steps,
                                streams=streams)
    return worst_deviation(toy, outcomes.marginal(), params)[0]


def test_the_hybrid_merge_that_shipped_lossy_is_caught(toy, monkeypatch):
    """The merge before the fix: a sampled draw equal to the continuation's token at the
    same parent was folded into the continuation's node, losing its rejection step."""

    def old_merge(self, continuation, confidence=float("nan")):
        V = self.draft_probs.shape[-1]
        tokens, parents, rows, child = [], [], [], {}
        node = ROOT
        for tok in continuation:
            child[(node, tok)] = len(tokens)
            tokens.append(tok)
            parents.append(node)
            rows.append(None)
            node = len(tokens) - 1
        mapped = []
        for i, (tok, parent) in enumerate(zip(self.tokens, self.parents)):
            at = ROOT if parent == ROOT else mapped[parent]
            shared = child.get((at, tok))
            if shared is not None:  # the bug: no leaf for the sampled draw's rejection
                mapped.append(shared)
                continue
            mapped.append(len(tokens))
            tokens.append(tok)
            parents.append(at)
            rows.append(i)
        probs = torch.zeros(len(tokens), V, dtype=self.draft_probs.dtype)
        for n, (tok, row) in enumerate(zip(tokens, rows)):
            if row is None:
                probs[n, tok] = 1.0
            else:
                probs[n] = self.draft_probs[row]
        return DraftTree(tokens, parents, probs, self.scheme, None)

    monkeypatch.setattr(DraftTree, "_merged_sampled", old_merge)
    assert deviation(toy, "eagle3-hybrid") > 100 * TOLERANCE


@pytest.mark.parametrize("method", ["eagle3", "ngram"])
def test_a_two_percent_tilt_of_the_residual_is_caught(toy, monkeypatch, method):
    """After a rejection, the next draw comes from a residual 2% off: the token ids in the
    upper half of the vocabulary weighted 1.02."""
    real = acceptance.residual_after_rejection

    def tilted(p, x, q):
        r = real(p, x, q)
        r = r * torch.where(torch.arange(r.shape[-1]) >= r.shape[-1] // 2, 1.02, 1.0)
        return r / r.sum()

    monkeypatch.setattr(acceptance, "residual_after_rejection", tilted)
    assert deviation(toy, method) > 100 * TOLERANCE


def test_acceptance_by_argmax_is_caught(toy, monkeypatch):
    """Accepting a draft whenever it is the target's argmax (a common shortcut) is lossy."""
    def argmax_accept(tree, target_probs, generator):
        path, row = argmax_path(tree, target_probs)
        nxt = acceptance.sample(target_probs[row], generator)
        return acceptance.VerifyResult(path, [tree.tokens[i] for i in path], nxt, not tree.children()[row])

    import specdec.engine.target as target_module

    monkeypatch.setattr(target_module, "verify_sampled", argmax_accept)
    # medusa-tree at its shipped 12 nodes: the top-k children include the target's argmax
    assert deviation(toy, "medusa-tree", budget=None) > 100 * TOLERANCE


def test_a_planner_that_keeps_sampled_drafts_by_their_own_confidence_is_caught(toy, monkeypatch):
    """The planner prices a node by the drafter's confidence in it, except for sampled
    drafts (planner._usable_confidence): keeping a draw from q only when q gave it a high
    probability conditions the draw on its own value, and min(1, p/q) then accepts the
    wrong distribution. Without that exception, under a cost that makes nodes pay their
    way, the proof fails; with it, the same case passes."""
    assert deviation(toy, "eagle3-adaptive", budget=2, cost=linear_cost) < TOLERANCE
    monkeypatch.setattr(planner, "_usable_confidence", lambda tree: tree.confidence)
    assert deviation(toy, "eagle3-adaptive", budget=2, cost=linear_cost) > 100 * TOLERANCE


@pytest.mark.parametrize("method", ["draft_model", "eagle3"])
def test_a_drafter_sharing_the_verifiers_random_stream_is_caught(toy, monkeypatch, method):
    """A seeded request's drafter draws from its own stream (seed + an offset,
    specdec/engine/drafters/service.py). With no offset, its draws are the verifier's: the
    first draft token is drawn with the very number that drew the first token, and the
    second with the one that accepts or rejects the first. The enumeration honours streams
    (tests/support/exact.py), so the proof fails; the enumeration before it (every draw independent)
    passed the same bug. Seeded with the offset, the same case passes."""
    seeded = dataclasses.replace(PARAMS, seed=7)
    assert deviation(toy, method, seeded, budget=2) < TOLERANCE
    monkeypatch.setattr(draft_service, "_DRAFT_SEED_OFFSET", 0)
    assert deviation(toy, method, seeded, budget=2) > 100 * TOLERANCE
    assert deviation(toy, method, seeded, budget=2, streams=False) < TOLERANCE  # what the old fake saw


# ---- the enumerator itself -------------------------------------------------------------
def test_the_enumeration_is_exact_on_a_hand_computed_case():
    """verify_sampled on a one-node tree, p = (.2, .5, .3), one-hot draft 1: emits 1 then a
    bonus from p1 with prob .5, else 0 or 2 with .2 / .5 and .3 / .5 of the rest."""
    p = torch.tensor([[0.2, 0.5, 0.3], [0.6, 0.4, 0.0]])
    tree = DraftTree.chain([1])

    def run():
        return tuple(acceptance.verify_sampled(tree, p, None).emitted)

    dist = exact_outcomes(run)
    expected = {(1, 0): 0.5 * 0.6, (1, 1): 0.5 * 0.4, (0,): 0.2, (2,): 0.3}
    assert dist.keys() == expected.keys() and all(abs(dist[k] - v) < 1e-7 for k, v in expected.items()), dist


def test_resuming_from_checkpoints_changes_nothing(toy):
    """Replays resume from a copy of the engine after the steps whose draws they share
    (exact.staged_outcomes): the distribution is the one replaying every run from the start
    gives, to the last bit."""
    engine = make_engine(toy, ["ngram-tree"])
    request = Request("ngram-tree", RULES)
    assert request_outcomes(engine, [request]).joint == request_outcomes(engine, [request], checkpoints=False).joint


def test_draws_from_streams_seeded_alike_are_the_same_number():
    """Two generators with one seed give the same draws in the same order (as torch's do);
    another seed, or the next draw, is independent. Here: two samples of p = (.5, .5) from
    generators seeded alike always agree; from different seeds they agree half the time."""
    p = torch.tensor([0.5, 0.5])

    def pair(seed_a: int, seed_b: int):
        a, b = torch.Generator().manual_seed(seed_a), torch.Generator().manual_seed(seed_b)
        return acceptance.sample(p, a), acceptance.sample(p, b), acceptance.sample(p, a)

    same = exact_outcomes(lambda: pair(3, 3))
    assert same == pytest.approx({(0, 0, 0): 0.25, (0, 0, 1): 0.25, (1, 1, 0): 0.25, (1, 1, 1): 0.25})
    assert exact_outcomes(lambda: pair(3, 4)) == pytest.approx({k: 0.125 for k in
                                                                 [(a, b, c) for a in (0, 1) for b in (0, 1) for c in (0, 1)]})
    # one number, two uses: a comparison u < .3 and then a sample of (.5, .5) by u
    gen = lambda: torch.Generator().manual_seed(5)  # noqa: E731

    def shared():
        return bool(acceptance.uniform(gen()) < 0.3), acceptance.sample(p, gen())

    assert exact_outcomes(shared) == pytest.approx({(True, 0): 0.3, (False, 0): 0.2, (False, 1): 0.5})


# ---- under a grammar (specdec/engine/grammar.py): the target masked at every tree node, the
# drafts it forbids pruned, its forced tokens drafted in front, sampled drafts' q masked ----
# The toy vocabulary as text: 0 ends the sequence, 1 2 3 are "a" "b" "c". The regex (ab|c)+
# forbids something at every position and forces "b" after "a" (a forced draft).
TOY_TEXT = ["<eos>", "a", "b", "c"]
REGEX = "(ab|c)+"
# min_length keeps the end token out (the grammar allows it after "b" or "c"), so every
# emitted prefix is followed by a token.
GUIDED = SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, min_length=MAX_TOKENS, end_ids=(END,), guide_type="regex",
                        guide=REGEX)


def toy_grammars():
    import xgrammar as xgr
    from specdec.engine.grammar import Grammars

    info = xgr.TokenizerInfo(TOY_TEXT, vocab_type=xgr.VocabType.RAW, vocab_size=VOCAB, stop_token_ids=[END])
    return Grammars(lambda: (info, lambda text: [TOY_TEXT.index(ch) for ch in text]))


def regex_allows(prefix: tuple[int, ...]) -> np.ndarray:
    """(ab|c)+ by hand: after "a" only "b"; else "a" or "c" (and the end, once non-empty)."""
    allowed = np.zeros(VOCAB, dtype=bool)
    if prefix and prefix[-1] == 1:
        allowed[2] = True
    else:
        allowed[[1, 3]] = True
        allowed[END] = bool(prefix)
    return allowed


def guided_engine(toy, method: str):
    engine = make_engine(toy, [method], cost=flat_cost)  # adaptive: every drafted node verified
    engine.speculator.target_pass.grammars = toy_grammars()
    return engine


def forced_runs(engine) -> list[int]:
    """Record the forced nodes of every verified tree (so a case that never forced fails).
    The engine is copied for each replay, and the copy keeps this wrapper's list."""
    seen = []
    real = engine.speculator.target_pass.guided_draft.__func__

    def recording(self, *args, **kwargs):
        tree = real(self, *args, **kwargs)
        seen.append(tree.forced)
        return tree

    engine.speculator.target_pass.guided_draft = recording.__get__(engine.speculator.target_pass)
    return seen


# chain and tree (sampled, with q masked), the hybrid (sampled + merged one-hot), one-hot
# chain and tree, the draft model
GUIDED_METHODS = {"eagle3": 2, "eagle3-tree": 2, "eagle3-hybrid": None, "ngram": None, "medusa": 2, "medusa-tree": None,
                  "draft_model": 2}


@pytest.mark.parametrize("method", list(GUIDED_METHODS))
def test_under_a_grammar_the_exact_distribution_is_the_masked_targets(toy, method):
    engine = guided_engine(toy, method)
    forced = forced_runs(engine)
    outcomes = request_outcomes(engine, [Request(method, GUIDED, GUIDED_METHODS[method])])
    dist = outcomes.marginal()
    assert all(regex_allows(t[:i])[t[i]] for t in dist for i in range(len(t))), "an output the grammar forbids"
    worst, where = worst_deviation(toy, dist, GUIDED, allowed=regex_allows)
    assert worst < TOLERANCE, f"{method}: P(next | {where}) deviates by {worst:.2e} from the masked target's"
    assert max(forced) >= 1, f"{method}: no step drafted the grammar's forced token"
    assert outcomes.partially_accepted_then_drafted(), f"{method}: no run verified a second tree after a rejection"


@pytest.mark.parametrize("method", ["medusa", "draft_model"])
def test_under_a_grammar_unmasked_draft_probabilities_are_caught(toy, monkeypatch, method):
    """A sampled draft the grammar forbids is pruned, so the survivors were drawn from the
    masked q: accepting them with min(1, p/q) for the unmasked q is lossy. (The toy EAGLE
    head's q, sharpened, puts almost no mass where the grammar forbids, so its control would
    not move; Medusa's and the draft model's do.)"""
    import specdec.engine.target as target_module

    monkeypatch.setattr(target_module, "masked_draft_probs", lambda tree, bitmask: tree)
    outcomes = request_outcomes(guided_engine(toy, method), [Request(method, GUIDED, 3)], steps=1)
    assert worst_deviation(toy, outcomes.marginal(), GUIDED, allowed=regex_allows)[0] > 100 * TOLERANCE
