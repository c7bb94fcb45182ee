"""Losslessness computed exactly (tests/support/exact.py) for a request's options on branching
trees, over two speculative steps: top-k, top-p and min_p; OpenAI's logit_bias; TensorRT-LLM's logits rules
(repetition, presence and frequency penalties, min_length on the end ids, bad words) with
the end id ending the request (a grammar's: tests/engine/test_exact_lossless.py). Each on trees whose
drafts are sampled from q (EAGLE-3 `sampled_tree`: the i.i.d. rule) and on trees drafted
as a function of the context (top-k, trie and frequency trees: the one-hot rule), so every
tree row is processed with its own path's context, not only a chain's.

The criterion is tests/engine/test_exact_lossless.py's: after every emitted prefix, the next token
(the end token included, when it ends the request) is distributed as the target's processed
distribution after prompt + prefix, from the numpy reference."""
from __future__ import annotations

import dataclasses

import pytest

from exact import PROMPT, flat_cost, one_request, toy, worst_deviation  # noqa: F401 - toy is a fixture
from specdec.config import SamplingParams
from test_exact_lossless import RULES, TOLERANCE, TOP_K_3, TOP_P

# the rules and top-k together: a sampled tree under the rules, two ways per draw
RULES_TOP_K = dataclasses.replace(RULES, top_k=2)
# the sampling options peers accept (issue 47): min_p truncation, and OpenAI's logit_bias
# raising one token and lowering another at every row
MIN_P_BIAS = SamplingParams(max_tokens=RULES.max_tokens, temperature=1.0, min_p=0.15, logit_bias=((1, 1.5), (3, -2.0)),
                            ignore_eos=True)

# method, params, budget (None: shipped), verify cost (adaptive methods)
CASES = [
    # top-k / top-p on trees sampled from q (the i.i.d. rule) and on deterministic trees (the
    # one-hot rule); test_exact_lossless has top-k 2 on eagle3-tree, top-k 3 on the EAGLE-2 and
    # suffix trees, top-p on the n-gram trie
    pytest.param("eagle3-tree", TOP_P, 2, None, id="sampled-tree-top_p"),
    pytest.param("eagle3-tree", TOP_P, 3, None, id="sampled-tree-top_p-3", marks=pytest.mark.slow),
    pytest.param("medusa-tree", TOP_K_3, None, None, id="topk-tree-top_k"),
    pytest.param("medusa-tree", TOP_P, None, None, id="topk-tree-top_p", marks=pytest.mark.slow),
    pytest.param("ngram-tree", TOP_K_3, None, None, id="trie-top_k"),
    pytest.param("suffix", TOP_P, None, flat_cost, id="suffix-tree-top_p", marks=pytest.mark.slow),
    # every logits rule, and the end id ending the request
    pytest.param("eagle3-tree", RULES_TOP_K, 3, None, id="sampled-tree-rules"),
    pytest.param("eagle3-tree-adaptive", RULES, None, flat_cost, id="eagle2-tree-rules"),
    pytest.param("ngram-tree", RULES, None, None, id="trie-rules"),
    pytest.param("suffix", RULES, None, flat_cost, id="suffix-tree-rules"),
    # min_p and logit_bias, on a sampled tree and on a trie
    pytest.param("eagle3-tree", MIN_P_BIAS, 2, None, id="sampled-tree-min_p-logit_bias"),
    pytest.param("ngram-tree", MIN_P_BIAS, None, None, id="trie-min_p-logit_bias"),
]


def bans_a_bad_word(tokens: tuple[int, ...], params: SamplingParams) -> bool:
    context = list(PROMPT) + list(tokens)
    return any(tuple(context[i - len(w) + 1 : i + 1]) == w for w in params.bad_word_ids
               for i in range(len(PROMPT), len(context)))


@pytest.mark.parametrize("method, params, budget, cost", CASES)
def test_request_options_on_trees_are_the_targets(toy, method, params, budget, cost):
    options = {} if cost is None else {"cost": cost}
    outcomes = one_request(toy, method, params, budget, **options)
    dist = outcomes.marginal()
    worst, where = worst_deviation(toy, dist, params)
    assert worst < TOLERANCE, f"{method}: P(next | {where}) deviates by {worst:.2e} from the target's"
    assert any(s[0].draft_tokens > s[0].depth for s in outcomes.steps()), f"{method}: no step verified a branching tree"
    assert outcomes.partially_accepted_then_drafted(), f"{method}: no run verified a second tree after a rejection"
    if params.end_ids:
        ended = [t for t in dist if t[-1] in params.end_ids]
        assert ended, f"{method}: the end id never ended the request"
        assert min(len(t) for t in ended) > params.min_length, "an end id before min_length"
        assert not any(bans_a_bad_word(t, params) for t in dist), "a bad word was emitted"
