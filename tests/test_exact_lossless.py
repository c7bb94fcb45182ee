"""Losslessness computed exactly, for every drafting path that ships.

tests/exact.py runs the real engine (its drafters, planner, verification and logits
processing) once per combination of its random outcomes and weighs each output by its
probability, so the output distribution of a step is known exactly, not sampled. One
request: its prefill (the first token sampled, the first tree drafted) and one speculative
step (the tree verified). Criterion: after every emitted prefix s, the next emitted token
is distributed as the target's processed distribution after prompt + s (computed with the
numpy processing of tests/test_speculative.py, not the engine's). That is exactly the
condition for the whole stream to be the target's: a token not emitted in this step comes
from a fresh step, itself drawn from the target.

Power: any deviation above TOLERANCE (1e-5 in probability; float32 rounding left at most
2.8e-7 on these cases) fails, deterministically: no seed, no sample size. The negative
controls below are the bugs a sampled test must catch and this one does: the hybrid merge
that shipped lossy, a 2% tilt of the residual after a rejection, and acceptance by argmax.
Each moves some conditional by more than 100x TOLERANCE.

The settings are model_repository/specdec.json's (every shipped method's scheme: chains
with draft probabilities, one-hot chains and trees, sampled trees stopping at mass 0.8, the
hybrid merge, the adaptive planner), with a per-request budget of at most 3 draft tokens
and a four-token vocabulary so the enumeration stays in the thousands of runs; the
verification code does not depend on the depth or the vocabulary. The adaptive methods plan
against a verification cost measured as a staircase (not a line), whose tokens-per-second
curve has two peaks. The hybrid merge's shared-node case occurs in the enumeration: the
old merge's control fails on it."""
from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import specdec.engine.acceptance as acceptance
from conftest import save_tiny_hf
from exact import conditionals, exact_outcomes
from test_speculative import reference_probs, reference_rules
from specdec.config import EngineConfig, SamplingParams
from specdec.engine.drafters.eagle3 import Eagle3Drafter
from specdec.engine.drafters.medusa import MedusaDrafter
from specdec.engine.drafters.ngram import NgramDrafter
from specdec.engine.drafters.suffix import SuffixCorpora, SuffixDrafter
from specdec.engine.models.eagle3_head import load_eagle3
from specdec.engine.models.llama import build_batch
from specdec.engine.models.loading import load_transformer
from specdec.engine.planner import VerifyCost
from specdec.engine.tree import ROOT, DraftTree
from specdec.serving.runtime import build_drafters, served_methods
from specdec.serving.spec_engine import SpecEngine

TOLERANCE = 1e-5
# Four tokens, every one of non-zero probability: every acceptance and rejection branch of
# every draft position carries weight (with a larger vocabulary cut by top-k, drafts outside
# the target's top-k are rejected with certainty and deep paths go untested).
VOCAB = 4
PROMPT = [1, 2, 3, 1, 2, 3, 1]  # repetitive, so prompt lookup (n-gram, hybrid) finds continuations
PARAMS = SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True)
TOP_P = SamplingParams(max_tokens=8, temperature=0.8, top_p=0.9, ignore_eos=True)
# TensorRT-LLM's logits rules on every tree node: penalties, min_length on the EOS (0),
# bad words ("2 after 1", which the prompt makes reachable at once).
RULES = SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True, repetition_penalty=1.3, presence_penalty=0.4,
                       frequency_penalty=0.3, min_length=3, end_ids=(0,), bad_word_ids=((1, 2),))
BUDGET = 3


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    """A 4-token target, an EAGLE-3 head, Medusa heads and a draft model sized for it."""
    from test_eagle3 import random_published_checkpoint
    from test_medusa import random_heads

    root = tmp_path_factory.mktemp("exact")
    shape = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, initializer_range=0.15, eos_token_id=0,
                 bos_token_id=0)
    target = load_transformer(save_tiny_hf(root / "target", num_hidden_layers=2, seed=11, **shape))
    sd = random_published_checkpoint(root / "head", hidden=32, inter=64, heads=4, kv=2, vocab=VOCAB,
                                     draft_vocab=VOCAB - 1, taps=(0, 1, 1))
    sd["lm_head.weight"] = sd["lm_head.weight"] * 12  # confident but not one-hot drafts
    save_file({k: v.contiguous() for k, v in sd.items()}, str(root / "head" / "model.safetensors"))
    draft_dir = save_tiny_hf(root / "draft", num_hidden_layers=1, seed=12, **shape)
    return dict(target=target, head=load_eagle3(root / "head", target.embed, target.cfg),
                medusa=random_heads(target.cfg, num_heads=3, draft_vocab=VOCAB - 1, sharpness=6.0, seed=4), draft_dir=draft_dir)


def staircase_cost() -> VerifyCost:
    """Verification seconds by tokens, shaped as measured on CPU (flat while the weights
    dominate, then a step as the next GEMM tile fills): 1-3 tokens 30 ms, 4 tokens 40 ms,
    5-8 tokens 41-42 ms. Expected tokens per second rises to 3 tokens, falls at 4 and can
    rise again after: two peaks, the case where keeping the best prefix of a sampled tree
    would depend on later draws (planner.select stops at the first peak for those)."""
    cost = VerifyCost()
    for tokens, seconds in {1: 0.030, 2: 0.030, 3: 0.030, 4: 0.040, 5: 0.041, 6: 0.041, 7: 0.042, 8: 0.042}.items():
        cost.observe(tokens, seconds, 1)
    cost.fit()
    return cost


def make_engine(toy, name: str) -> SpecEngine:
    spec = served_methods()[name]
    # No prefix caching: each replay must start from the same state, and a replay that reused
    # the last one's cached prompt would see logits that differ in the last bits (the cache's
    # own equality is tests/test_prefix_cache.py's)
    cfg = EngineConfig(max_batch_size=1, max_seq_len=48, max_num_draft_tokens=8, draft_dtype="float32",
                       enable_prefix_caching=False)
    # an earlier request of the same scope whose continuation of the prompt differs from the
    # prompt's own pattern: the suffix drafts (alone, and merged into the hybrid) branch off it
    corpora = SuffixCorpora(1000, 4)
    corpora.add(None, PROMPT + [0, 0, 2])
    corpora.add = lambda salt, ids: None  # every replay starts from this corpus (cancelled runs teach nothing)
    if spec.method == "eagle3":
        drafter = Eagle3Drafter(toy["head"], spec, 1, 48, corpora if spec.hybrid_suffix else None)
    elif spec.method == "suffix":
        drafter = SuffixDrafter(spec, corpora)
    elif spec.method == "medusa":
        drafter = MedusaDrafter(toy["medusa"], spec)
    elif spec.method == "ngram":
        drafter = NgramDrafter(spec)
    else:  # the draft model, drafted beside the target (served apart it drafts the same trees)
        spec = dataclasses.replace(spec, speculative_model=str(toy["draft_dir"]), colocated=True)
        drafter = build_drafters(toy["target"].cfg, {name: spec}, cfg)[name]
    engine = SpecEngine(toy["target"], cfg, drafters={name: drafter})
    engine.speculator.planner.verify_cost = staircase_cost()
    engine.speculator.planner.step_extra_seconds = 0.0
    return engine


def step_outcomes(engine: SpecEngine, method: str, params: SamplingParams, budget: int = BUDGET) -> dict:
    """Emitted tokens -> probability, over a request's prefill and first speculative step.
    Each replay starts from the engine's state before the first (planner estimates too)."""
    speculator = engine.speculator
    planner, last_verify = copy.deepcopy(speculator.planner), speculator._last_verify
    verified = []  # nodes verified per run (so a case that never drafted fails)

    def run() -> tuple[int, ...]:
        speculator.planner, speculator._last_verify = copy.deepcopy(planner), last_verify
        engine.add_request("r", PROMPT, params, method, budget)
        emitted, drafted = [], 0
        for step in range(2):
            if step:  # the next tree (drafted after verification) plays no part in this step's output
                speculator._draft_next = lambda *args, **kwargs: None
            for out in engine.step():
                emitted += out.new_token_ids
                if out.verified:
                    drafted = out.step.draft_tokens
        del speculator._draft_next
        engine.cancel("r")
        verified.append(drafted)
        return tuple(emitted)

    dist = exact_outcomes(run)
    assert max(verified) > 0, f"{method}: no run verified a draft"
    return dist


def target_conditionals(target, params: SamplingParams, prefixes) -> dict[tuple[int, ...], np.ndarray]:
    """The target's processed next-token distribution after PROMPT + each prefix."""
    prefixes = list(prefixes)
    cache = target.new_cache(len(prefixes), len(PROMPT) + 8, 4)
    slots = [cache.allocate() for _ in prefixes]
    rows = [PROMPT + list(p) for p in prefixes]
    logits = target(build_batch(slots, [0] * len(rows), rows), cache, last_only=True).logits[:, 0]
    return {p: reference_probs(reference_rules(logits[i].double().numpy(), params, p, PROMPT), params)
            for i, p in enumerate(prefixes)}


def worst_deviation(toy, dist: dict, params: SamplingParams) -> tuple[float, tuple[int, ...]]:
    """The largest |P(next = x | emitted prefix) - target(x | prefix)| over prefixes and x."""
    cond = conditionals(dist)
    reference = target_conditionals(toy["target"], params, cond)
    worst, where = 0.0, ()
    for prefix, nxt in cond.items():
        got = np.zeros(VOCAB)
        for token, p in nxt.items():
            got[token] = p
        deviation = float(np.abs(got - reference[prefix]).max())
        if deviation > worst:
            worst, where = deviation, prefix
    return worst, where


# Every method that ships, by model_repository/specdec.json's name; the scheme each draws:
SHIPPED = {
    "eagle3": PARAMS,  # sampled chain with draft probabilities (SpecInfer's min(1, p/q))
    "eagle3-tree": PARAMS,  # sampled tree, children drawn until they cover mass 0.8
    "eagle3-adaptive": TOP_P,  # planned chain: confidence-cut drafting, nodes kept by gain
    "eagle3-tree-adaptive": PARAMS,  # EAGLE-2 tree (top-k children, one-hot rule), planned
    "eagle3-hybrid": PARAMS,  # planned sampled chain with the n-gram and suffix continuations merged in
    "medusa": PARAMS,  # sampled chain, each head's q independent of the draws before it
    "medusa-tree": RULES,  # top-k tree, one-hot rule, with penalties and bad words
    "ngram": RULES,  # one-hot chain
    "ngram-tree": PARAMS,  # one-hot tree of continuations
    "ngram-adaptive": TOP_P,
    "suffix": PARAMS,  # one-hot frequency tree from an earlier request and the prompt, planned
    "draft_model": PARAMS,  # sampled chain with the draft LM's q
    "draft_model-adaptive": PARAMS,
}


def test_every_shipped_method_is_covered():
    """A method added to specdec.json must join SHIPPED (draft_model-colocated drafts
    exactly what draft_model does: the same drafter, beside the target)."""
    assert set(served_methods()) - {"draft_model-colocated"} == set(SHIPPED)


@pytest.mark.parametrize("method", list(SHIPPED))
def test_the_exact_output_distribution_is_the_targets(toy, method):
    params = SHIPPED[method]
    engine = make_engine(toy, method)
    dist = step_outcomes(engine, method, params)
    worst, where = worst_deviation(toy, dist, params)
    assert worst < TOLERANCE, f"{method}: P(next | {where}) deviates by {worst:.2e} from the target's"
    assert max(len(t) for t in dist) > 2, f"{method}: no run accepted a draft"  # the accepting paths ran too


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
    worst, _ = worst_deviation(toy, step_outcomes(make_engine(toy, "eagle3-hybrid"), "eagle3-hybrid", PARAMS), PARAMS)
    assert worst > 100 * TOLERANCE, worst


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
    worst, _ = worst_deviation(toy, step_outcomes(make_engine(toy, method), method, PARAMS), PARAMS)
    assert worst > 100 * TOLERANCE, worst


def test_acceptance_by_argmax_is_caught(toy, monkeypatch):
    """Accepting a draft whenever it is the target's argmax (a common shortcut) is lossy."""
    def argmax_accept(tree, target_probs, generator):
        row, path = 0, []
        kids = tree.children()
        while kids[row]:
            best = int(target_probs[row].argmax())
            match = next((c for c in kids[row] if tree.tokens[c] == best), None)
            if match is None:
                break
            path.append(match)
            row = match + 1
        nxt = acceptance.sample(target_probs[row], generator)
        return acceptance.VerifyResult(path, [tree.tokens[i] for i in path], nxt, not kids[row])

    import specdec.engine.target as target_module

    monkeypatch.setattr(target_module, "verify_sampled", argmax_accept)
    # medusa-tree: top-k children, so the argmax is among the drafts
    worst, _ = worst_deviation(toy, step_outcomes(make_engine(toy, "medusa-tree"), "medusa-tree", PARAMS), PARAMS)
    assert worst > 100 * TOLERANCE, worst


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


# ---- under a grammar (specdec/engine/grammar.py): the target masked at every tree node, the
# drafts it forbids pruned, its forced tokens drafted in front, sampled drafts' q masked ----
# The toy vocabulary as text: 0 ends the sequence, 1 2 3 are "a" "b" "c". The regex (ab|c)+
# forbids something at every position and forces "b" after "a" (a forced draft).
TOY_TEXT = ["<eos>", "a", "b", "c"]
REGEX = "(ab|c)+"
# min_length keeps the end token out of this step (the grammar allows it after "b" or "c"),
# so every emitted prefix is followed by a token.
GUIDED = SamplingParams(max_tokens=8, temperature=1.0, min_length=8, end_ids=(0,), guide_type="regex", guide=REGEX)


def toy_grammars():
    import xgrammar as xgr
    from specdec.engine.grammar import Grammars

    info = xgr.TokenizerInfo(TOY_TEXT, vocab_type=xgr.VocabType.RAW, vocab_size=VOCAB, stop_token_ids=[0])
    return Grammars(lambda: (info, lambda text: [TOY_TEXT.index(ch) for ch in text]))


def regex_allows(prefix: tuple[int, ...]) -> np.ndarray:
    """(ab|c)+ by hand: after "a" only "b"; else "a" or "c" (and the end, once non-empty)."""
    allowed = np.zeros(VOCAB, dtype=bool)
    if prefix and prefix[-1] == 1:
        allowed[2] = True
    else:
        allowed[[1, 3]] = True
        allowed[0] = bool(prefix)
    return allowed


def guided_deviation(toy, dist: dict, params: SamplingParams) -> float:
    cond = conditionals(dist)
    prefixes = list(cond)
    cache = toy["target"].new_cache(len(prefixes), len(PROMPT) + 8, 4)
    slots = [cache.allocate() for _ in prefixes]
    logits = toy["target"](build_batch(slots, [0] * len(prefixes), [PROMPT + list(p) for p in prefixes]), cache,
                           last_only=True).logits[:, 0]
    worst = 0.0
    for i, prefix in enumerate(prefixes):
        ruled = reference_rules(logits[i].double().numpy(), params, prefix, PROMPT)
        ruled[~regex_allows(prefix)] = -np.inf
        got = np.zeros(VOCAB)
        for token, p in cond[prefix].items():
            got[token] = p
        worst = max(worst, float(np.abs(got - reference_probs(ruled, params)).max()))
    return worst


def guided_engine(toy, method: str) -> SpecEngine:
    engine = make_engine(toy, method)
    engine.speculator.target_pass.grammars = toy_grammars()
    return engine


def forced_runs(engine: SpecEngine) -> list[int]:
    """Record the forced nodes of every verified tree (so a case that never forced fails)."""
    seen = []
    real = engine.speculator.target_pass.guided_draft

    def recording(*args, **kwargs):
        tree = real(*args, **kwargs)
        seen.append(tree.forced)
        return tree

    engine.speculator.target_pass.guided_draft = recording
    return seen


# chain and tree (sampled, with q masked), the hybrid (sampled + merged one-hot), one-hot chain
GUIDED_METHODS = ["eagle3", "eagle3-tree", "eagle3-hybrid", "ngram", "medusa", "medusa-tree", "draft_model"]


@pytest.mark.parametrize("method", GUIDED_METHODS)
def test_under_a_grammar_the_exact_distribution_is_the_masked_targets(toy, method):
    engine = guided_engine(toy, method)
    forced = forced_runs(engine)
    dist = step_outcomes(engine, method, GUIDED)
    assert all(regex_allows(t[:i])[t[i]] for t in dist for i in range(len(t))), "an output the grammar forbids"
    worst = guided_deviation(toy, dist, GUIDED)
    assert worst < TOLERANCE, f"{method}: deviates by {worst:.2e} from the masked target's"
    assert max(forced) >= 1, f"{method}: no step drafted the grammar's forced token"


@pytest.mark.parametrize("method", ["medusa", "draft_model"])
def test_under_a_grammar_unmasked_draft_probabilities_are_caught(toy, monkeypatch, method):
    """A sampled draft the grammar forbids is pruned, so the survivors were drawn from the
    masked q: accepting them with min(1, p/q) for the unmasked q is lossy. (The toy EAGLE
    head's q, sharpened, puts almost no mass where the grammar forbids, so its control would
    not move; Medusa's and the draft model's do.)"""
    import specdec.engine.target as target_module

    monkeypatch.setattr(target_module, "masked_draft_probs", lambda tree, bitmask: tree)
    worst = guided_deviation(toy, step_outcomes(guided_engine(toy, method), method, GUIDED), GUIDED)
    assert worst > 100 * TOLERANCE, worst
