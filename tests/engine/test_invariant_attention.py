"""The batch-invariant attention (specdec/engine/kernels) and what it buys (issues 44, 59): on a
quantized target a token's logits are the same bits however the token is computed (decoded
alone, verified in a chain or a tree, beside another sequence, in a served batch of 16 x 17 rows
beside a prompt chunk, after a chunked prefill), so greedy speculation equals the baseline by
construction, for every method. The same checks run on the same weights with PyTorch's SDPA,
and fail there: their negative control (test_the_same_checks_catch_a_forward_that_is_not_invariant)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specdec.config import EngineConfig, SamplingParams
from specdec.engine import kernels
from specdec.engine.models.llama import build_batch

def _random_case(seed: int, B=2, H=6, KVH=2, N=5, C=40, D=64):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, N, D, generator=g)
    k, v = torch.randn(B, KVH, C, D, generator=g), torch.randn(B, KVH, C, D, generator=g)
    allowed = torch.rand(B, N, C, generator=g) < 0.6
    allowed[..., 0] = True  # no row without a column (SDPA would give NaN)
    return q, k, v, allowed


@pytest.mark.parametrize("seed", [0, 1])
def test_the_kernel_computes_attention(seed):
    q, k, v, allowed = _random_case(seed)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed[:, None], enable_gqa=True)
    got = kernels.invariant_attention(q, k, v, allowed)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)
    # views of a larger cache (what the engine passes) read the same numbers
    k_big = torch.zeros(3, 2, 64, 64)
    k_big[1:3, :, :40] = k
    v_big = torch.zeros(3, 2, 64, 64)
    v_big[1:3, :, :40] = v
    assert torch.equal(kernels.invariant_attention(q, k_big[1:3, :, :40], v_big[1:3, :, :40], allowed), got)


def test_a_rows_output_does_not_depend_on_the_rows_or_columns_beside_it():
    """A token three deep in a draft tree (its ancestors at tree columns, siblings masked in
    between, other rows and trailing columns in the call) gets bitwise what it gets decoded
    alone after its ancestors were committed to consecutive columns, and what SDPA computes up
    to rounding (the model-level tests below fail with SDPA: their control,
    test_the_same_checks_catch_a_forward_that_is_not_invariant)."""
    g = torch.Generator().manual_seed(5)
    H, KVH, D, L = 9, 3, 64, 37
    prefix_k, prefix_v = torch.randn(KVH, L, D, generator=g), torch.randn(KVH, L, D, generator=g)
    nodes_k, nodes_v = torch.randn(KVH, 7, D, generator=g), torch.randn(KVH, 7, D, generator=g)
    path = [0, 2, 5]  # the accepted root-to-leaf path among 7 tree nodes
    q = torch.randn(1, H, 1, D, generator=g)

    alone_k = torch.cat([prefix_k, nodes_k[:, path]], dim=1)[None]  # decoded: [1, KVH, L + 3, D]
    alone_v = torch.cat([prefix_v, nodes_v[:, path]], dim=1)[None]
    alone = kernels.invariant_attention(q, alone_k, alone_v, torch.ones(1, 1, L + 3, dtype=torch.bool))

    tree_k = torch.cat([prefix_k, nodes_k, torch.randn(KVH, 9, D, generator=g)], dim=1)[None]  # 9 columns past the tree
    tree_v = torch.cat([prefix_v, nodes_v, torch.randn(KVH, 9, D, generator=g)], dim=1)[None]
    rows = torch.randn(1, H, 4, D, generator=g)
    rows[:, :, 2] = q[:, :, 0]  # the token is row 2 of 4
    allowed = torch.zeros(1, 4, L + 16, dtype=torch.bool)
    allowed[:, :, :L] = True
    allowed[0, 2, [L + i for i in path]] = True
    allowed[0, [0, 1, 3], L] = True
    verified = kernels.invariant_attention(rows, tree_k, tree_v, allowed)
    assert torch.equal(verified[:, :, 2], alone[:, :, 0])

    sdpa_alone = F.scaled_dot_product_attention(q, alone_k, alone_v, enable_gqa=True)
    sdpa_verified = F.scaled_dot_product_attention(rows, tree_k, tree_v, attn_mask=allowed[:, None], enable_gqa=True)
    assert torch.allclose(sdpa_verified[:, :, 2], sdpa_alone[:, :, 0], atol=1e-5)  # same attention
    assert torch.equal(verified[:, :, 2], kernels.invariant_attention(rows, tree_k, tree_v, allowed)[:, :, 2])  # deterministic


@pytest.fixture(scope="module", params=["gguf", "int8", "gemma3-toy-int8"])
def quantized_target(request, tmp_path_factory):
    """SmolLM2 in each quantized format, and a tiny Gemma 3 in int8: its local layers attend
    through an 8-token window (the 45-token prompt outgrows it) beside a global layer."""
    from specdec.serving.runtime import load_target

    if request.param == "gemma3-toy-int8":
        from conftest import save_tiny_hf
        from specdec.engine.models.loading import load_transformer
        from specdec.engine.models.quantized import quantize

        path = save_tiny_hf(tmp_path_factory.mktemp("gemma3"), arch="gemma3", tie_word_embeddings=True, vocab_size=1024)
        model = quantize(load_transformer(path), "int8", path)
        assert model.cfg.local_window == 8 and model.local_layers
    else:
        model = load_target(None, EngineConfig(weight_format=request.param))
    assert model.batch_invariant
    return model


def _tree(parents: list[int]) -> torch.Tensor:
    from conftest import ancestor_mask

    return ancestor_mask(parents)


def _prefilled(model, cache, tokens: list[int]) -> int:
    slot = cache.allocate()
    model(build_batch([slot], [0], [tokens], sliding_window=model.cfg.sliding_window), cache, last_only=True)
    cache.commit(slot, range(len(tokens)))
    return slot


def _how_a_token_is_computed_changes_its_bits(model) -> list[str]:
    """The cases where a token's logits are not the same bits as when it is decoded alone, one
    token a step (the baseline): [] for an invariant forward."""
    prompt = [(7 * j) % 1000 + 10 for j in range(45)]
    other = [(11 * j) % 900 + 20 for j in range(23)]
    new = [11, 12, 13, 14]
    broken = []

    cache = model.new_cache(2, 128, 16)
    slot = _prefilled(model, cache, prompt)
    decoded = torch.stack([model(build_batch([slot], [len(prompt) + i], [[token]], sliding_window=model.cfg.sliding_window), cache).logits[0, 0]
                           for i, token in enumerate(new)])

    cache = model.new_cache(2, 128, 16)
    slot = _prefilled(model, cache, prompt)
    if not torch.equal(model(build_batch([slot], [len(prompt)], [new], sliding_window=model.cfg.sliding_window), cache).logits[0], decoded):
        broken.append("chain")

    # a tree: new[0] -> {99, new[1]}, new[1] -> {new[2], 98}, new[2] -> new[3]; nodes in
    # breadth-first order, the accepted path at nodes 0, 2, 3, 5; beside another sequence
    tokens = [new[0], 99, new[1], new[2], 98, new[3]]
    cache = model.new_cache(2, 128, 16)
    slot = _prefilled(model, cache, prompt)
    other_slot = _prefilled(model, cache, other)
    out = model(build_batch([slot, other_slot], [len(prompt), len(other)], [tokens, [5]], depths=[[0, 1, 1, 2, 2, 3], None],
                            tree_masks=[_tree([-1, 0, 0, 2, 2, 3]), None], sliding_window=model.cfg.sliding_window), cache).logits
    if not torch.equal(out[0, [0, 2, 3, 5]], decoded):
        broken.append("tree beside another sequence")

    # a served batch's shape: 16 sequences, each a 17-node draft tree (ours holds the accepted
    # path at nodes 0, 2, 3, 5, as above), beside a prompt chunk
    parents = [-1, 0, 0, 2, 2, 3, 1, 1, 4, 5, 5, 6, 8, 9, 9, 12, 13]
    depths = [0] * len(parents)
    for j, p in enumerate(parents):
        depths[j] = 0 if p < 0 else depths[p] + 1
    cache = model.new_cache(18, 128, 40)
    slots = [_prefilled(model, cache, prompt if b == 0 else [(b * 13 + j) % 800 + 30 for j in range(20 + b)])
             for b in range(16)]
    chunk_slot = cache.allocate()
    rows = [tokens + [(b + j) % 500 + 40 for j in range(11)] for b in range(16)]
    chunk = [(5 * j) % 700 + 9 for j in range(33)]
    out = model(build_batch(slots + [chunk_slot], [int(cache.lengths[s]) for s in slots] + [0], rows + [chunk],
                            depths=[depths] * 16 + [None], tree_masks=[_tree(parents)] * 16 + [None],
                            sliding_window=model.cfg.sliding_window), cache).logits
    if not torch.equal(out[0, [0, 2, 3, 5]], decoded):
        broken.append("16 sequences of 17 rows and a prompt chunk")

    # the prompt in two chunks (chunked prefill; the second attends to the first from the cache,
    # as a prefix-cache hit does), then the same decode steps
    cache = model.new_cache(2, 128, 16)
    slot = cache.allocate()
    model(build_batch([slot], [0], [prompt[:29]], sliding_window=model.cfg.sliding_window), cache, last_only=True)
    cache.commit(slot, range(29))
    model(build_batch([slot], [29], [prompt[29:]], sliding_window=model.cfg.sliding_window), cache, last_only=True)
    cache.commit(slot, range(len(prompt) - 29))  # kept: the step's own positions
    chunked = torch.stack([model(build_batch([slot], [len(prompt) + i], [[token]], sliding_window=model.cfg.sliding_window), cache).logits[0, 0]
                           for i, token in enumerate(new)])
    if not torch.equal(chunked, decoded):
        broken.append("chunked prefill / cached prefix")
    return broken


def test_a_quantized_targets_logits_are_the_same_bits_however_a_token_is_computed(quantized_target):
    assert _how_a_token_is_computed_changes_its_bits(quantized_target) == []


IDENTITY_CASES = ("chain", "tree beside another sequence", "16 sequences of 17 rows and a prompt chunk",
                  "chunked prefill / cached prefix")


@pytest.mark.parametrize("case", IDENTITY_CASES)
def test_the_same_checks_catch_a_forward_that_is_not_invariant(quantized_target, case):
    """Negative control, one identity case at a time: the same weights with PyTorch's SDPA for
    attention (and its norms) break each of them, so each check above can fail."""
    quantized_target.batch_invariant = False
    try:
        broken = _how_a_token_is_computed_changes_its_bits(quantized_target)
    finally:
        quantized_target.batch_invariant = True
    assert set(broken) <= set(IDENTITY_CASES)
    assert case in broken, f"under SDPA the {case!r} case kept its bits: that check cannot fail"


@pytest.mark.parametrize("weight_format", ["int8", "gguf"])  # int8: the served default
def test_greedy_speculation_equals_the_baseline_on_the_quantized_target_for_every_method(weight_format):
    """Every served method, c=1 and two sequences at once, on ShareGPT-like chat prompts, on the
    weights that ship (int8) and the GGUF file's own."""
    from specdec.serving.runtime import build_engine, encode_prompt
    from specdec.bench.engine_runs import run_requests

    engine = build_engine(config=EngineConfig(max_batch_size=2, max_seq_len=512, weight_format=weight_format))
    speculator = engine.speculator
    assert speculator.target_pass.target.batch_invariant
    methods = list(dict.fromkeys([*speculator.drafts.drafters, *speculator.methods]))
    assert len(methods) >= 10  # every served method
    prompts = [encode_prompt(engine.tokenizer, text) for text in (
        "List three prime numbers and explain why each is prime.",
        "Write a Python function that reverses a string, then show it on 'hello world'.",
        "What is speculative decoding? Answer in two sentences.",
        "Repeat this sentence exactly: the quick brown fox jumps over the lazy dog.")]
    greedy = SamplingParams(max_tokens=24, ignore_eos=True)
    baseline: dict[str, list[int]] = {}
    run_requests(engine, prompts, greedy, "none", 0, 1, token_ids=baseline)
    for method in methods:
        for concurrency in (1, 2):
            got: dict[str, list[int]] = {}
            run_requests(engine, prompts, greedy, method, None, concurrency, token_ids=got)
            assert got == baseline, (method, concurrency)
