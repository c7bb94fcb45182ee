"""Speculative decoding is lossless: greedy token-for-token, sampling in distribution."""
from __future__ import annotations

import dataclasses
import itertools
import random

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

import specdec.engine.target as verifier_module
from specdec.config import EngineConfig, SamplingParams, SpeculativeConfig
from specdec.engine.drafters.ngram import NgramDrafter, build_trie, find_continuations
from specdec.serving.spec_engine import SpecEngine
from specdec.errors import ConfigError, InvalidRequestError
from specdec.engine.models.llama import build_batch
from specdec.engine.models.loading import load_transformer
from specdec.engine.acceptance import VerifyResult

from conftest import save_tiny_hf
from toy import BigramDrafter, ScriptedDrafter, argmax_path

VOCAB = 96


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    # A larger init spread gives peaked, tie-free logits (greedy comparisons stay stable).
    return load_transformer(save_tiny_hf(tmp_path_factory.mktemp("spec"), initializer_range=0.3, seed=3))


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        motif = [rng.randrange(3, VOCAB) for _ in range(rng.randrange(2, 6))]
        noise = [rng.randrange(3, VOCAB) for _ in range(rng.randrange(1, 8))]
        out.append(noise + motif * rng.randrange(1, 4) + noise[:2])
    return out


def run_all(engine: SpecEngine, prompt_list, params, method, k, concurrent: int) -> list[list[int]]:
    """Run prompts with at most `concurrent` in flight; return output ids per prompt."""
    results: dict[int, list[int]] = {}
    todo = list(enumerate(prompt_list))
    while todo or engine.has_work():
        while todo and len(engine.sequences) < concurrent:
            i, p = todo.pop(0)
            engine.add_request(str(i), p, params, method, k)
            results[i] = []
        for out in engine.step():
            results[int(out.request_id)] += out.new_token_ids
    return [results[i] for i in range(len(prompt_list))]


def test_greedy_speculative_equals_plain_tiny(tiny_target):
    greedy_speculative_equals_plain(tiny_target)


def test_greedy_speculative_equals_plain_tiny_qwen3(tmp_path):
    """The same on a Qwen3 target (q/k norm before RoPE), issue 46."""
    greedy_speculative_equals_plain(load_transformer(save_tiny_hf(tmp_path, arch="qwen3", initializer_range=0.3, seed=3)))


def test_greedy_speculative_equals_plain_tiny_sliding_window(tmp_path):
    """The same on a sliding-window target (Mistral, a 6-token window: every sequence outgrows
    it), with chains and dynamic trees, alone and batched (issue 46)."""
    target = load_transformer(save_tiny_hf(tmp_path, arch="mistral", sliding_window=6, initializer_range=0.3, seed=3))
    assert target.cfg.sliding_window == 6
    greedy_speculative_equals_plain(target)


def test_greedy_speculative_equals_plain_tiny_gemma3(tmp_path):
    """The same on a Gemma 3 target: two local layers with a 6-token window (every sequence
    outgrows it) around a global one, chains and dynamic trees, alone and batched (issue 46)."""
    target = load_transformer(save_tiny_hf(tmp_path, arch="gemma3", sliding_window=6, tie_word_embeddings=True,
                                           initializer_range=0.3, seed=3))
    assert target.cfg.local_window == 6 and target.local_layers == {0, 2}
    greedy_speculative_equals_plain(target)


def test_greedy_with_logit_bias_and_min_p_equals_its_own_plain_decoding(tiny_target):
    """OpenAI's logit_bias moves greedy output (the control: it differs from unbiased), and
    speculation under it emits exactly what plain decoding under it emits (issue 47)."""
    ps = prompts(8, seed=5)
    cfg = EngineConfig(max_batch_size=8, max_seq_len=128, max_num_draft_tokens=8)
    unbiased = run_all(SpecEngine(tiny_target, cfg), ps, SamplingParams(max_tokens=16, ignore_eos=True), "none", 0, concurrent=8)
    params = SamplingParams(max_tokens=16, ignore_eos=True, min_p=0.3, logit_bias=((7, 4.0), (9, 2.5), (unbiased[0][0], -100.0)))
    plain = run_all(SpecEngine(tiny_target, cfg), ps, params, "none", 0, concurrent=8)
    assert plain != unbiased and plain[0][0] != unbiased[0][0]
    reference = {tuple(p): out for p, out in zip(ps, plain)}
    drafters = {"ngram": NgramDrafter(SpeculativeConfig(max_draft_len=5)), "tree": ScriptedDrafter(reference, VOCAB, tree=True)}
    engine = SpecEngine(tiny_target, cfg, drafters=drafters)
    for method in drafters:
        assert run_all(engine, ps, params, method, 6, concurrent=8) == plain, method
    assert engine.stats.accepted_tokens > 0


def run_log_probs(engine: SpecEngine, prompt_list, params, method, k) -> list[tuple[list[float], list]]:
    """One at a time: per prompt, the emitted tokens' log probs and their alternatives."""
    out = []
    for i, p in enumerate(prompt_list):
        engine.add_request(str(i), p, params, method, k)
        values, top = [], []
        while engine.has_work():
            for step in engine.step():
                values += step.log_probs.values
                top += step.log_probs.top
        out.append((values, top))
    return out


@pytest.mark.parametrize("mode", ["processed_logprobs", "raw_logprobs"])
def test_log_probs_of_speculation_equal_plain_decodings(tiny_target, mode):
    """The emitted tokens' log probs and top alternatives, read from the verification rows,
    are plain decoding's (issue 47): under a presence penalty, so raw and processed differ,
    each mode is checked against its own kind."""
    ps = prompts(6, seed=8)
    cfg = EngineConfig(max_batch_size=4, max_seq_len=128, max_num_draft_tokens=8)
    params = SamplingParams(max_tokens=12, ignore_eos=True, presence_penalty=1.5, top_logprobs=3, logprobs_mode=mode)
    plain = run_log_probs(SpecEngine(tiny_target, cfg), ps, params, "none", 0)
    outputs = run_all(SpecEngine(tiny_target, cfg), ps, params, "none", 0, concurrent=1)
    reference = {tuple(p): out for p, out in zip(ps, outputs)}
    drafters = {"ngram": NgramDrafter(SpeculativeConfig(max_draft_len=5)), "tree": ScriptedDrafter(reference, VOCAB, tree=True)}
    engine = SpecEngine(tiny_target, cfg, drafters=drafters)
    for method in drafters:
        got = run_log_probs(engine, ps, params, method, 6)
        for (values, top), (want_values, want_top) in zip(got, plain):
            assert np.allclose(values, want_values, atol=1e-4), (method, mode)
            assert [t for row in top for t, _ in row] == [t for row in want_top for t, _ in row], (method, mode)
            assert np.allclose([lp for row in top for _, lp in row], [lp for row in want_top for _, lp in row], atol=1e-4)
    assert engine.stats.accepted_tokens > 0
    raw = run_log_probs(SpecEngine(tiny_target, cfg), ps[:1], dataclasses.replace(params, logprobs_mode="raw_logprobs"), "none", 0)
    processed = run_log_probs(SpecEngine(tiny_target, cfg), ps[:1], dataclasses.replace(params, logprobs_mode="processed_logprobs"), "none", 0)
    assert not np.allclose(raw[0][0], processed[0][0])  # the control: the penalty moves the processed values


def greedy_speculative_equals_plain(tiny_target):
    ps = prompts(24)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    cfg = EngineConfig(max_batch_size=8, max_seq_len=128, max_num_draft_tokens=8)
    plain = run_all(SpecEngine(tiny_target, cfg), ps, params, "none", 0, concurrent=1)
    reference = {tuple(p): out for p, out in zip(ps, plain)}
    drafters = {
        "ngram": NgramDrafter(SpeculativeConfig(max_draft_len=5)),
        "ngram-tree": NgramDrafter(SpeculativeConfig(max_draft_len=4, use_dynamic_tree=True, dynamic_tree_max_topK=3)),
        "chain": ScriptedDrafter(reference, VOCAB, tree=False),
        "tree": ScriptedDrafter(reference, VOCAB, tree=True),
        # The planner chooses each step's drafts and verified nodes (specdec/engine/planner.py).
        "ngram-adaptive": NgramDrafter(SpeculativeConfig(max_draft_len=6, adaptive=True)),
        "tree-adaptive": ScriptedDrafter(reference, VOCAB, tree=True, adaptive=True),
    }
    engine = SpecEngine(tiny_target, cfg, drafters=drafters)
    for method in drafters:
        for concurrent in (1, 8):
            got = run_all(engine, ps, params, method, 6, concurrent)
            assert got == plain, (method, concurrent)
    assert engine.stats.accepted_tokens > 0 and engine.cache.num_free == 8
    # The scripted drafts were right often enough to exercise deep accepted paths.
    assert len(engine.stats.accepted_per_position) >= 5 and engine.stats.accepted_per_position[4] > 0


def test_greedy_speculative_equals_plain_smollm2(smol_model, smol_tokenizer):
    from specdec.serving.runtime import encode_prompt

    texts = ["Repeat after me: the quick brown fox jumps over the lazy dog. The quick brown",
             "List the numbers from 1 to 20 separated by commas.",
             "Write a Python function that adds two numbers.",
             "What is the capital of France? Answer in one sentence."]
    ps = [encode_prompt(smol_tokenizer, t) for t in texts]
    params = SamplingParams(max_tokens=32)
    cfg = EngineConfig(max_batch_size=4, max_seq_len=256, max_num_draft_tokens=8)
    drafters = {
        "ngram": NgramDrafter(SpeculativeConfig(max_draft_len=4)),
        "ngram-tree": NgramDrafter(SpeculativeConfig(max_draft_len=4, use_dynamic_tree=True, dynamic_tree_max_topK=2)),
    }
    engine = SpecEngine(smol_model, cfg, tokenizer=smol_tokenizer, drafters=drafters)
    plain = run_all(engine, ps, params, "none", 0, concurrent=1)
    for method in drafters:
        assert run_all(engine, ps, params, method, 6, concurrent=4) == plain, method
    assert engine.stats.accepted_tokens > 0


# ---- statistical losslessness on a toy pair with a 12-token vocabulary ----------------
TOY_VOCAB = 12
TOY_PROMPT = [3, 7, 1]
NUM_SAMPLES = 20_000


@pytest.fixture(scope="module")
def toy_pair(tmp_path_factory):
    target = load_transformer(
        save_tiny_hf(tmp_path_factory.mktemp("toy"), vocab_size=TOY_VOCAB, hidden_size=32, intermediate_size=64,
                     num_hidden_layers=2, initializer_range=0.15, seed=11, eos_token_id=0, bos_token_id=0)
    )
    gen = torch.Generator().manual_seed(5)
    table = torch.randn(TOY_VOCAB, TOY_VOCAB, generator=gen) * 1.5  # draft logits given the last token
    return target, table


def reference_probs(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Temperature, then min_p (tokens below min_p x the likeliest dropped), then top-k, then
    top-p (the smallest most-likely prefix whose mass
    reaches top_p), written here in numpy so that the reference does not share the
    engine's sampling code."""
    z = logits.astype(np.float64) / params.temperature
    if params.min_p > 0:
        soft = np.exp(z - z.max())
        soft /= soft.sum()
        z = np.where(soft < params.min_p * soft.max(), -np.inf, z)
    if params.top_k and params.top_k < len(z):
        z = np.where(z < np.sort(z)[-params.top_k], -np.inf, z)
    p = np.exp(z - z.max())
    p /= p.sum()
    if params.top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        mass_before = np.cumsum(p[order]) - p[order]
        keep = np.zeros_like(p, dtype=bool)
        keep[order[mass_before < params.top_p]] = True
        p = np.where(keep, p, 0.0)
        p /= p.sum()
    return p


def reference_rules(logits: np.ndarray, params: SamplingParams, prefix: tuple[int, ...],
                    prompt: list[int] = TOY_PROMPT) -> np.ndarray:
    """The logits rules for the row after prompt + prefix, written out per token (not
    the engine's vectorised per-tree code): CTRL repetition over prompt and output,
    presence / frequency over the output, logit_bias, end ids banned before min_length, bad words."""
    z = logits.astype(np.float64).copy()
    context = list(prompt) + list(prefix)
    for token in range(len(z)):
        count = list(prefix).count(token)
        if token in context and params.repetition_penalty != 1.0:
            z[token] = z[token] / params.repetition_penalty if z[token] > 0 else z[token] * params.repetition_penalty
        z[token] -= params.presence_penalty * (count > 0) + params.frequency_penalty * count
    for token, bias in params.logit_bias:
        z[token] += bias
    if len(prefix) < params.min_length:
        z[list(params.end_ids)] = -np.inf
    for word in params.bad_word_ids:
        if len(word) == 1 or tuple(context[-(len(word) - 1):]) == tuple(word[:-1]):
            z[word[-1]] = -np.inf
    return z


def exact_first3(target, params: SamplingParams) -> np.ndarray:
    """P(t1, t2, t3 | prompt) under the target, from an independent implementation of the
    logits processing."""
    prefixes = [()] + [(a,) for a in range(TOY_VOCAB)] + list(itertools.product(range(TOY_VOCAB), repeat=2))
    cache = target.new_cache(len(prefixes), 16, 4)
    slots = [cache.allocate() for _ in prefixes]
    rows = [TOY_PROMPT + list(p) for p in prefixes]
    logits = target(build_batch(slots, [0] * len(rows), rows), cache, last_only=True).logits[:, 0]
    probs = {p: reference_probs(reference_rules(logits[i].double().numpy(), params, p), params) for i, p in enumerate(prefixes)}
    joint = np.zeros((TOY_VOCAB,) * 3)
    for a, b in itertools.product(range(TOY_VOCAB), repeat=2):
        joint[a, b] = probs[()][a] * probs[(a,)][b] * probs[(a, b)]
    return joint.ravel()


class PricedTokens:
    """A verify cost that makes nodes expensive enough for the planner to keep some and
    drop others (the toy target's real forward is nearly free): planning is exercised."""

    def seconds_for(self, tokens: int, sequences: int = 1) -> float:
        return 100.0 + 0.1 * tokens

    def marginal(self, tokens: int, sequences: int = 1) -> float:
        return 0.1

    def observe(self, tokens: int, seconds: float, sequences: int = 1) -> None:
        pass


def sample_first3(target, drafter, params: SamplingParams, seed0: int, n: int = NUM_SAMPLES) -> np.ndarray:
    cfg = EngineConfig(max_batch_size=500, max_seq_len=32, max_num_draft_tokens=8)
    engine = SpecEngine(target, cfg, drafters={"toy": drafter})
    engine.speculator.planner.verify_cost = PricedTokens()
    counts = np.zeros(TOY_VOCAB**3)
    issued = 0
    outputs: dict[str, list[int]] = {}
    while issued < n or engine.has_work():
        while issued < n and len(engine.sequences) < cfg.max_batch_size:
            rid = str(issued)
            engine.add_request(rid, TOY_PROMPT, SamplingParams(**{**params.__dict__, "seed": seed0 + issued}), "toy", 6)
            outputs[rid] = []
            issued += 1
        for out in engine.step():
            outputs[out.request_id] += out.new_token_ids
            toks = outputs[out.request_id]
            if len(toks) >= 3 and not out.finished:
                engine.cancel(out.request_id)  # only the first three tokens are scored
            if len(toks) >= 3:
                a, b, c = toks[:3]
                counts[(a * TOY_VOCAB + b) * TOY_VOCAB + c] += 1
                del outputs[out.request_id]
    assert counts.sum() == n
    if drafter.config is not None and drafter.config.adaptive:  # the planner verified some nodes, not all
        assert 0 < engine.stats.draft_tokens < drafter.proposed, (engine.stats.draft_tokens, drafter.proposed)
    return counts


def chi_square_p(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = probs * counts.sum()
    if counts[expected == 0].sum():  # a sequence the target cannot produce (e.g. outside top_p)
        return 0.0
    big = expected >= 5  # pool the sparse cells so the chi-square approximation holds
    small = ~big & (expected > 0)
    obs, exp = counts[big], expected[big]
    if expected[small].sum() > 0:
        obs, exp = np.append(obs, counts[small].sum()), np.append(exp, expected[small].sum())
    return float(chisquare(obs, exp * obs.sum() / exp.sum()).pvalue)


CASES = {
    "chain_with_draft_probs": dict(iid=True, branches=1, depth=4),
    "chain_one_hot": dict(iid=False, branches=1, depth=4),
    "tree_with_draft_probs": dict(iid=True, branches=2, depth=2),
    "tree_one_hot": dict(iid=False, branches=3, depth=2),
    # Planned: confidence-cut drafting and per-step node selection (by position for sampled
    # draws, by confidence for deterministic ones).
    "adaptive_chain_with_draft_probs": dict(iid=True, branches=1, depth=4, adaptive=True),
    "adaptive_tree_one_hot": dict(iid=False, branches=3, depth=3, adaptive=True),
    "adaptive_hybrid_tree_one_hot": dict(iid=False, branches=2, depth=2, adaptive=True, merge=True),
}
PARAMS = SamplingParams(max_tokens=8, temperature=0.9, top_k=10, ignore_eos=True)
CASES["tree_with_draft_probs_top_p"] = dict(CASES["tree_with_draft_probs"], params=SamplingParams(
    max_tokens=8, temperature=0.8, top_p=0.8, ignore_eos=True))
CASES["adaptive_chain_one_hot_top_p"] = dict(iid=False, branches=1, depth=4, adaptive=True, params=SamplingParams(
    max_tokens=8, temperature=1.1, top_k=8, top_p=0.9, ignore_eos=True))

# TensorRT-LLM's logits rules, applied per tree node (specdec/engine/logits_processing.py): every
# penalty, min_length on the toy's EOS (0; ignore_eos keeps going after it), a one-token and
# a two-token bad word ("2 after 7": the second token of the prompt, and reachable after t1 = 7).
RULES = SamplingParams(max_tokens=8, temperature=0.9, ignore_eos=True, repetition_penalty=1.4, presence_penalty=0.5,
                       frequency_penalty=0.3, min_length=2, end_ids=(0,), bad_word_ids=((5,), (7, 2)))
CASES["tree_with_draft_probs_logits_rules"] = dict(CASES["tree_with_draft_probs"], params=RULES)
CASES["chain_one_hot_logits_rules"] = dict(CASES["chain_one_hot"], params=dataclasses.replace(RULES, top_p=0.9))


# These chi-square checks run in make test-all (slow): make test proves the same schemes
# (draft probabilities and one-hot, chains and trees, logits rules, top-p, the draft model)
# exactly at every shipped method's settings in tests/engine/test_exact_lossless.py, which
# enumerates the engine's random outcomes instead of sampling them.
@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_sampling_is_lossless(toy_pair, case):
    target, table = toy_pair
    drafter_args = dict(CASES[case])
    params = drafter_args.pop("params", PARAMS)
    counts = sample_first3(target, BigramDrafter(table, **drafter_args), params, seed0=1000)
    p = chi_square_p(counts, exact_first3(target, params))
    assert p > 1e-3, f"{case}: chi-square p={p:.2e}"


@pytest.fixture(scope="module")
def toy_draft_dir(tmp_path_factory):
    """An independent one-layer draft LM with the toy target's vocabulary."""
    return save_tiny_hf(tmp_path_factory.mktemp("toy_draft"), vocab_size=TOY_VOCAB, hidden_size=32, intermediate_size=64,
                        num_hidden_layers=1, initializer_range=0.15, seed=12, eos_token_id=0, bos_token_id=0)


@pytest.mark.slow  # chi-square; exact in make test (tests/engine/test_exact_lossless.py, draft_model)
@pytest.mark.parametrize("tree", [pytest.param(False, id="chain_with_draft_probs"), pytest.param(True, id="tree_one_hot")])
def test_sampling_with_a_draft_model_is_lossless(toy_pair, toy_draft_dir, tree):
    """method draft_model: sampled chains carry the draft LM's processed distribution q
    (min(1, p/q)); trees are its top-k children (one-hot rule)."""
    from specdec.serving.runtime import build_drafters

    target, _ = toy_pair
    spec = SpeculativeConfig(method="draft_model", speculative_model=str(toy_draft_dir), max_draft_len=3,
                             use_dynamic_tree=tree, dynamic_tree_max_topK=2 if tree else 4)
    cfg = EngineConfig(max_batch_size=500, max_seq_len=32, max_num_draft_tokens=8, draft_dtype="float32")
    drafter = build_drafters(target.cfg, {"toy": spec}, cfg)["toy"]
    counts = sample_first3(target, drafter, PARAMS, seed0=1000)
    p = chi_square_p(counts, exact_first3(target, PARAMS))
    assert p > 1e-3, f"chi-square p={p:.2e}"


@pytest.mark.slow  # the chi-square harness's own negative control runs with the harness (make test-all)
def test_chi_square_detects_a_wrong_rule(toy_pair, monkeypatch):
    """Accepting a sampled draft whenever it equals the target argmax is not lossless;
    the same test must reject it."""
    target, table = toy_pair

    def wrong_verify(tree, target_probs, generator):
        path, row = argmax_path(tree, target_probs)
        nxt = int(torch.multinomial(target_probs[row], 1, generator=generator))
        return VerifyResult(path, [tree.tokens[i] for i in path], nxt, not tree.children()[row])

    monkeypatch.setattr(verifier_module, "verify_sampled", wrong_verify)
    counts = sample_first3(target, BigramDrafter(table, iid=False, branches=1, depth=4), PARAMS, seed0=1000)
    assert chi_square_p(counts, exact_first3(target, PARAMS)) < 1e-3


def test_seeds_reproduce_speculative_sampling(toy_pair):
    target, table = toy_pair
    drafter = BigramDrafter(table, iid=True, branches=2, depth=2)
    a = sample_first3(target, drafter, PARAMS, seed0=7, n=300)
    b = sample_first3(target, drafter, PARAMS, seed0=7, n=300)
    c = sample_first3(target, drafter, PARAMS, seed0=8, n=300)
    assert (a == b).all() and not (a == c).all()


# ---- n-gram drafter, config validation, bad requests -----------------------------------
def test_ngram_continuations_and_trie():
    hist = np.array([5, 1, 2, 3, 9, 1, 2, 4, 8, 1, 2])
    conts = find_continuations(hist, 2, 3, max_matches=4)
    assert [c.tolist() for c in conts] == [[4, 8, 1], [3, 9, 1]]  # most recent first
    tree = build_trie(conts, max_nodes=5, max_branches=2)
    assert tree.tokens == [4, 8, 1, 3, 9] and tree.parents == [-1, 0, 1, -1, 3]


def test_speculative_config_rules():
    assert SpeculativeConfig(max_draft_len=4, use_dynamic_tree=True, dynamic_tree_max_topK=3).max_total_draft_tokens == 12
    with pytest.raises(ConfigError, match="max_draft_len"):
        SpeculativeConfig(max_draft_len=0)
    with pytest.raises(ConfigError, match="max_total_draft_tokens"):
        SpeculativeConfig(max_draft_len=4, use_dynamic_tree=True, dynamic_tree_max_topK=2, max_total_draft_tokens=9)
    with pytest.raises(ConfigError, match="max_total_draft_tokens"):
        SpeculativeConfig(max_draft_len=4, use_dynamic_tree=True, max_total_draft_tokens=3)
    with pytest.raises(ConfigError, match="method"):
        SpeculativeConfig(method="lookahead")
    from specdec.config import ModelConfig

    base = dict(model_type="mistral", vocab_size=10, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                num_attention_heads=2)
    swa = ModelConfig.from_hf_dict({**base, "sliding_window": 4096})
    with pytest.raises(ConfigError, match="use_dynamic_tree.*TensorRT-LLM.*sliding"):
        SpeculativeConfig(use_dynamic_tree=True).check_target(swa, trtllm=True)
    SpeculativeConfig(use_dynamic_tree=False).check_target(swa, trtllm=True)  # linear drafting is fine there
    SpeculativeConfig(use_dynamic_tree=True).check_target(swa)  # our engine serves trees on a window
    mla = ModelConfig.from_hf_dict({**base, "model_type": "llama", "kv_lora_rank": 512})
    with pytest.raises(ConfigError, match="MLA"):
        SpeculativeConfig(use_dynamic_tree=True).check_target(mla)
    with pytest.raises(ConfigError, match="model_type"):
        ModelConfig.from_hf_dict({**base, "model_type": "gpt2"})


def test_bad_speculative_requests_leave_others_running(tiny_target):
    engine = SpecEngine(tiny_target, EngineConfig(max_batch_size=4, max_seq_len=64, max_num_draft_tokens=8),
                        drafters={"ngram": NgramDrafter(SpeculativeConfig())})
    engine.add_request("ok", [5, 6, 7, 5, 6], SamplingParams(max_tokens=10, ignore_eos=True), "ngram", 4)
    engine.step()
    for method, k, field in (("lookahead", 4, "speculative_method"), ("ngram", -1, "num_draft_tokens"), ("ngram", 9, "num_draft_tokens")):
        with pytest.raises(InvalidRequestError) as err:
            engine.add_request("bad", [5, 6], SamplingParams(max_tokens=4), method, k)
        assert err.value.field == field
    out = []
    while engine.has_work():
        out += [t for o in engine.step() for t in o.new_token_ids]
    assert len(out) == 9 and engine.cache.num_free == 4


def test_a_method_named_without_a_budget_drafts_its_configured_one(tiny_target):
    """In process as through the server: no budget = the method's configured one; 0 = the baseline."""
    engine = SpecEngine(tiny_target, EngineConfig(max_batch_size=4, max_seq_len=64, max_num_draft_tokens=8),
                        drafters={"ngram": NgramDrafter(SpeculativeConfig(max_draft_len=3))})
    assert engine.add_request("named", [5, 6, 7, 5, 6], SamplingParams(max_tokens=4), "ngram").num_draft_tokens == 3
    baseline = engine.add_request("zero", [5, 6, 7, 5, 6], SamplingParams(max_tokens=4), "ngram", 0)
    assert (baseline.method, baseline.num_draft_tokens) == ("none", 0)
    assert engine.add_request("plain", [5, 6], SamplingParams(max_tokens=4)).num_draft_tokens == 0


def test_a_failed_start_holds_no_slot(tiny_target):
    """Prefill is all or nothing: a drafter that fails to start leaves every slot free."""
    from specdec.engine.drafters.base import Drafter
    from specdec.engine.speculator import Speculator, StartItem

    class Broken(Drafter):
        def propose(self, seqs, budgets):
            raise AssertionError("never reached")

        def on_prefill(self, seq, hidden):
            raise RuntimeError("head failed to load its state")

    speculator = Speculator(tiny_target, EngineConfig(max_batch_size=4, max_seq_len=64), {"broken": Broken(), "ngram": NgramDrafter(SpeculativeConfig())})
    items = [StartItem("a", [5, 6, 7], SamplingParams(max_tokens=8), "ngram", 4), StartItem("b", [5, 6], SamplingParams(max_tokens=8), "broken", 4)]
    with pytest.raises(RuntimeError):
        speculator.prefill(items)
    assert speculator.active == 0 and speculator.target_pass.cache.num_free == 4 and speculator.drafts.active == 0
    assert len(speculator.prefill(items[:1])) == 1 and speculator.target_pass.cache.num_free == 3


def test_greedy_margin_compares_each_emitted_token_with_the_decode_row_behind_it(tiny_target):
    """specdec greedy-margin's bookkeeping: one logits row per emitted token, each the row
    whose argmax is that token, for the baseline and for trees alike; the verify rows of an
    identical output sit within float32 noise of the decode rows."""
    from specdec.bench.greedy_margin import decode, margins

    cfg = EngineConfig(max_batch_size=2, max_seq_len=128, max_num_draft_tokens=8, enable_prefix_caching=False)
    plain = SpecEngine(tiny_target, cfg)
    reference = {tuple(p): out for p, out in zip(prompts(2), run_all(plain, prompts(2), SamplingParams(max_tokens=20, ignore_eos=True), "none", 0, 1))}
    engine = SpecEngine(tiny_target, cfg, drafters={"tree": ScriptedDrafter(reference, VOCAB, tree=True)})
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    for prompt in prompts(2):
        base_ids, base_rows, base_steps = decode(engine, prompt, params, "none")
        ids, rows, steps = decode(engine, prompt, params, "tree", num_draft_tokens=6)
        assert ids == base_ids and len(rows) == len(ids) == 20
        assert rows.argmax(-1).tolist() == ids and base_rows.argmax(-1).tolist() == base_ids
        assert steps < base_steps  # drafts were accepted: rows came from several tree positions per step
        assert float((rows - base_rows).abs().max()) < 1e-3 < float(margins(base_rows).min())
