"""The decoder against transformers, and the ragged / tree-masked / cached forward against itself."""
from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from specdec.engine.models.llama import build_batch
from specdec.engine.models.loading import load_transformer
from specdec.engine.tree import ROOT, DraftTree

from conftest import save_tiny_hf


def hf_logits(model_dir, ids):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


def our_prefill_logits(model, ids):
    cache = model.new_cache(2, 256, 16)
    slot = cache.allocate()
    return model(build_batch([slot], [0], [ids], sliding_window=model.cfg.sliding_window), cache).logits[0]


def test_smollm2_logits_match_transformers(smol_dir, smol_model):
    ids = [1, 28120, 905, 314, 253, 1345, 2000, 77, 4096, 12]
    ours = our_prefill_logits(smol_model, ids)
    assert torch.allclose(ours, hf_logits(smol_dir, ids), atol=1e-4)


@pytest.mark.parametrize(
    "arch,overrides",
    [
        ("qwen2", {}),  # GQA + q/k/v bias
        ("qwen3", {}),  # q/k norm per head before RoPE
        ("mistral", {"sliding_window": 8}),  # sliding-window attention, the 37-token prompt 4.6 windows long
        ("qwen3", {"attention_bias": True, "head_dim": 24}),  # biases, a head_dim apart from hidden / heads
        ("llama", {"attention_bias": True}),  # Llama bias also on o_proj
        ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}),
        ("llama", {"tie_word_embeddings": True, "num_key_value_heads": 1}),
        # Gemma 3: two local layers (8-token window, their own RoPE base) around a global one,
        # the 37-token prompt past the window; tied embeddings, as Gemma ships them
        ("gemma3", {"tie_word_embeddings": True}),
        ("gemma3", {"tie_word_embeddings": True, "sliding_window": 5, "num_hidden_layers": 2}),
    ],
)
def test_tiny_configs_match_transformers(tmp_path, arch, overrides):
    model_dir = save_tiny_hf(tmp_path, arch=arch, **overrides)
    ids = list(range(3, 40))
    ours = our_prefill_logits(load_transformer(model_dir), ids)
    assert torch.allclose(ours, hf_logits(model_dir, ids), atol=1e-4)


def random_tree(rng: random.Random, n: int, vocab: int) -> DraftTree:
    parents = [ROOT] + [rng.randrange(-1, i) for i in range(1, n)]
    return DraftTree([rng.randrange(vocab) for _ in range(n)], parents)


def tree_paths_that_differ_from_their_prefill(model, tree_window) -> list[tuple[int, int]]:
    """(trial, leaf) of every root-to-leaf path of random 9-node trees over an 11-token prefix
    whose tree-forward logits differ from a prefill of that path (the model's own window); the
    tree forward gets `tree_window`."""
    window = model.cfg.sliding_window
    rng = random.Random(0)
    prefix = [rng.randrange(96) for _ in range(11)]
    differ = []
    for trial in range(4):
        tree = random_tree(rng, 9, 96)
        cache = model.new_cache(2, 128, 16)
        slot = cache.allocate()
        model(build_batch([slot], [0], [prefix], sliding_window=window), cache)
        cache.commit(slot, range(len(prefix)))
        tokens, depths, mask = tree.input_rows(root_token=5)
        tree_logits = model(build_batch([slot], [len(prefix)], [tokens], [depths], [mask], sliding_window=tree_window),
                            cache).logits[0]
        for leaf in range(len(tree)):
            path = tree.path_to(leaf)
            seq = prefix + [5] + [tree.tokens[i] for i in path]
            ref = our_prefill_logits(model, seq)
            rows = [0] + [i + 1 for i in path]
            if not torch.allclose(tree_logits[rows], ref[len(prefix):], atol=1e-5):
                differ.append((trial, leaf))
    return differ


@pytest.mark.parametrize("window", [None, 6])
def test_tree_forward_equals_sequential_paths(tiny_llama_dir, tmp_path, window):
    """Every root-to-leaf path of a draft tree gets the logits a prefill of that path gets. With
    a sliding window shorter than the prefix (issue 46), each node attends to the window
    relative to its own position over the committed context and its ancestors only: siblings
    share positions, and what lies past a node's window, or on another branch, is never read."""
    model = load_transformer(tiny_llama_dir if window is None else save_tiny_hf(tmp_path, arch="mistral", sliding_window=window))
    assert model.cfg.sliding_window == window
    assert tree_paths_that_differ_from_their_prefill(model, tree_window=window) == []


def test_the_same_tree_without_the_window_fails(tmp_path):
    """Control for the windowed case above: the tree forward on a 6-token-window model, its
    mask built without the window, differs from the windowed prefills on most paths."""
    model = load_transformer(save_tiny_hf(tmp_path, arch="mistral", sliding_window=6))
    differ = tree_paths_that_differ_from_their_prefill(model, tree_window=None)
    assert len(differ) > 4 * 9 // 2, differ


def test_batched_ragged_equals_solo(tiny_llama_dir):
    model = load_transformer(tiny_llama_dir)
    rng = random.Random(1)
    prompts = [[rng.randrange(96) for _ in range(n)] for n in (3, 17, 9, 30)]
    news = [[rng.randrange(96) for _ in range(n)] for n in (1, 5, 3, 2)]
    cache = model.new_cache(6, 128, 16)
    # Non-contiguous slots exercise the gathered (copying) path; contiguous the view path.
    for slots in ([0, 1, 2, 3], [4, 0, 2, 5]):
        cache = model.new_cache(6, 128, 16)
        for s in range(6):
            cache.allocate()
        pre = model(build_batch(slots, [0] * 4, prompts), cache, last_only=True).logits
        for s, p in zip(slots, prompts):
            cache.commit(s, range(len(p)))
        step = model(build_batch(slots, [len(p) for p in prompts], news), cache).logits
        for b, (p, n) in enumerate(zip(prompts, news)):
            solo = our_prefill_logits(model, p + n)
            assert torch.allclose(pre[b, 0], solo[len(p) - 1], atol=1e-5)
            assert torch.allclose(step[b, : len(n)], solo[len(p):], atol=1e-5)


def test_commit_equals_fresh_prefill_of_kept_tokens(tiny_llama_dir):
    model = load_transformer(tiny_llama_dir)
    prefix = list(range(10, 22))
    tree = DraftTree([40, 41, 42, 43, 44], [ROOT, ROOT, 1, 2, 1])  # path 1 -> 2 -> 3 kept
    cache = model.new_cache(2, 128, 16)
    slot = cache.allocate()
    model(build_batch([slot], [0], [prefix]), cache)
    cache.commit(slot, range(len(prefix)))
    tokens, depths, mask = tree.input_rows(root_token=7)
    model(build_batch([slot], [len(prefix)], [tokens], [depths], [mask]), cache)
    cache.commit(slot, [0, 2, 3, 4])  # root, nodes 1, 2, 3
    kept = prefix + [7, 41, 42, 43]
    fresh = model.new_cache(2, 128, 16)
    fslot = fresh.allocate()
    model(build_batch([fslot], [0], [kept]), fresh)
    fresh.commit(fslot, range(len(kept)))
    n = len(kept)
    assert cache.lengths[slot] == n
    assert torch.allclose(cache.k[:, slot, :, :n], fresh.k[:, fslot, :, :n], atol=1e-5)
    assert torch.allclose(cache.v[:, slot, :, :n], fresh.v[:, fslot, :, :n], atol=1e-5)
    # ...and the next forward sees the same context.
    a = model(build_batch([slot], [n], [[9]]), cache).logits
    b = model(build_batch([fslot], [n], [[9]]), fresh).logits
    assert torch.allclose(a, b, atol=1e-5)


def test_packed_rows_equal_padded_rows(tiny_llama_dir):
    """Rows of different lengths run their matmuls on the real tokens only (Packing); the
    logits and hidden taps at every real position equal those of the padded forward."""
    model = load_transformer(tiny_llama_dir)
    rng = random.Random(2)
    prompts = [[rng.randrange(96) for _ in range(n)] for n in (3, 17, 9)]
    news = [[rng.randrange(96) for _ in range(n)] for n in (1, 4, 2)]

    def run(pack: bool):
        cache = model.new_cache(3, 64, 8)
        slots = [cache.allocate() for _ in range(3)]
        pre = model(build_batch(slots, [0] * 3, prompts), cache, tap_layers=(0, 1), last_only=True, pack=pack)
        for s, p in zip(slots, prompts):
            cache.commit(s, range(len(p)))
        step = model(build_batch(slots, [len(p) for p in prompts], news), cache, tap_layers=(1,), pack=pack)
        return pre, step

    (pre_packed, step_packed), (pre_padded, step_padded) = run(True), run(False)
    assert torch.allclose(pre_packed.logits, pre_padded.logits, atol=1e-5)
    for b, (p, n) in enumerate(zip(prompts, news)):
        assert torch.allclose(pre_packed.hidden_taps[b, : len(p)], pre_padded.hidden_taps[b, : len(p)], atol=1e-5)
        assert torch.allclose(step_packed.logits[b, : len(n)], step_padded.logits[b, : len(n)], atol=1e-5)
        assert torch.allclose(step_packed.hidden_taps[b, : len(n)], step_padded.hidden_taps[b, : len(n)], atol=1e-5)


@pytest.mark.parametrize("slot_order", ["contiguous", "scattered"])
def test_a_few_long_rows_beside_decode_rows_attend_apart_and_equal_padded_rows(tiny_llama_dir, slot_order):
    """Most rows decode one token, two bring more (a draft tree, a prompt chunk): the first
    token of every row attends as a decode row does and the long rows' later tokens apart
    (Attention._split); logits and taps equal the padded forward's, and a decode row's
    logits equal those it gets in a batch where every row decodes one token."""
    model = load_transformer(tiny_llama_dir)
    rng = random.Random(5)
    prompts = [[rng.randrange(96) for _ in range(n)] for n in (5, 12, 7, 3, 9, 6)]
    news = [[rng.randrange(96) for _ in range(n)] for n in (1, 4, 1, 1, 6, 1)]
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)  # row 1: a tree
    depths = [None, [0, 1, 1, 2], None, None, None, None]
    masks = [None, tree, None, None, None, None]

    def run(pack: bool, rows):
        cache = model.new_cache(8, 64, 8)
        slots = [cache.allocate() for _ in range(8)]
        slots = slots[:6] if slot_order == "contiguous" else [slots[i] for i in (7, 2, 5, 0, 3, 6)]
        model(build_batch(slots, [0] * 6, prompts), cache, last_only=True, pack=pack)
        for s, p in zip(slots, prompts):
            cache.commit(s, range(len(p)))
        return model(build_batch(slots, [len(p) for p in prompts], rows, [depths[b] if len(r) > 1 else None for b, r in
                                                                          enumerate(rows)],
                                 [masks[b] if len(r) > 1 else None for b, r in enumerate(rows)]), cache, tap_layers=(1,), pack=pack)

    split, padded = run(True, news), run(False, news)
    decode_only = run(False, [n[:1] for n in news])
    for b, n in enumerate(news):
        assert torch.allclose(split.logits[b, : len(n)], padded.logits[b, : len(n)], atol=1e-5)
        assert torch.allclose(split.hidden_taps[b, : len(n)], padded.hidden_taps[b, : len(n)], atol=1e-5)
        assert torch.allclose(split.logits[b, 0], decode_only.logits[b, 0], atol=1e-5)


@pytest.mark.gemma
def test_gemma3_270m_logits_match_transformers_past_its_window(gemma_dir):
    """The real Gemma 3 270M (opt-in download): 700 tokens, past its 512-token sliding window,
    equal to transformers' Gemma3ForCausalLM on the same prepared weights."""
    from transformers import AutoTokenizer

    text = (Path(__file__).resolve().parents[2] / "docs" / "methods.md").read_text()
    ids = AutoTokenizer.from_pretrained(str(gemma_dir))(text).input_ids[:700]
    assert len(ids) == 700
    model = load_transformer(gemma_dir)
    cache = model.new_cache(1, 1024, 16)
    ours = model(build_batch([cache.allocate()], [0], [ids], sliding_window=model.cfg.sliding_window), cache).logits[0]
    ref = hf_logits(gemma_dir, ids)
    assert torch.allclose(ours, ref, atol=1e-3) and torch.equal(ours.argmax(-1), ref.argmax(-1))
