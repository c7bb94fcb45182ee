"""The native forward (kernels/forward_plan.c, engine/models/native_forward.py) equals the per-op
forward, its oracle, bit for bit: logits, hidden taps and the KV cache it writes, for every batch
shape the engine makes (decode, a chain, a tree beside other sequences, 16 sequences of 17 rows
beside a prompt chunk, a chunked prefill, a prefix-cache hit), on both quantized formats and every
family they serve: Llama, Qwen2's biases, Mistral's sliding window, Qwen3's query/key norms, and
Gemma 3's sandwich norms, GELU gate, scaled embedding and local layers (an 8-token window the
prompts outgrow). Weights that are not quantized keep the per-op path."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from specdec.config import EngineConfig
from specdec.engine.models import native_forward
from specdec.engine.models.llama import build_batch

TAPS = (0, 2)  # the toy models' last layer among them: a forward with taps and one without end differently


def _tiny(tmp_path_factory, arch: str, **overrides):
    from conftest import save_tiny_hf
    from specdec.engine.models.loading import load_transformer
    from specdec.engine.models.quantized import quantize

    path = save_tiny_hf(tmp_path_factory.mktemp(arch), arch=arch, vocab_size=1024, **overrides)
    return quantize(load_transformer(path), "int8", path)


@pytest.fixture(scope="module", params=["smollm2-int8", "smollm2-gguf", "llama-toy", "qwen2-toy-bias", "mistral-toy-window",
                                        "qwen3-toy-qk-norm", "gemma3-toy-local"])
def model(request, tmp_path_factory):
    from specdec.serving.runtime import load_target

    if request.param.startswith("smollm2"):
        target = load_target(None, EngineConfig(weight_format=request.param.split("-")[1]))
    elif request.param == "qwen2-toy-bias":
        target = _tiny(tmp_path_factory, "qwen2")
        assert target.cfg.qkv_bias
    elif request.param == "mistral-toy-window":
        target = _tiny(tmp_path_factory, "mistral", sliding_window=12)
        assert target.cfg.sliding_window == 12
    elif request.param == "qwen3-toy-qk-norm":
        target = _tiny(tmp_path_factory, "qwen3")
        assert target.cfg.qk_norm
    elif request.param == "gemma3-toy-local":
        target = _tiny(tmp_path_factory, "gemma3", tie_word_embeddings=True)
        assert target.cfg.local_window == 8 and target.local_layers and target.cfg.sandwich_norms
    else:
        target = _tiny(tmp_path_factory, "llama")
    assert native_forward.unsupported_reason(target) is None and target.native_plan() is not None
    return target


def _tree(parents: list[int]) -> torch.Tensor:
    from conftest import ancestor_mask

    return ancestor_mask(parents)


def _steps(model, native: bool) -> list[torch.Tensor]:
    """Every output of a fixed sequence of forwards (and each cache they leave), on one path."""
    model.native_forward = native
    window = model.cfg.sliding_window
    vocab = model.cfg.vocab_size
    tok = lambda i: (7 * i + 3) % (vocab - 10) + 5  # noqa: E731
    out: list[torch.Tensor] = []

    calls = [0]

    def run(cache, slots, prefix, rows, **kw):
        logits_rows = kw.pop("logits_rows", None)
        taps = TAPS if calls[0] % 2 == 0 else ()  # every other forward without taps (drafters that read none)
        calls[0] += 1
        o = model(build_batch(slots, prefix, rows, sliding_window=window, **kw), cache, tap_layers=taps,
                  logits_rows=logits_rows)
        out.extend([o.logits] + ([o.hidden_taps] if taps else []))
        return o

    # 16 prompts of different lengths in one wave (a packed prefill), then each commits
    cache = model.new_cache(18, 160, 40, prefix_block_tokens=8)
    slots = [cache.allocate() for _ in range(16)]
    prompts = [[tok(b * 31 + j) for j in range(9 + 3 * b)] for b in range(16)]
    run(cache, slots, [0] * 16, prompts, logits_rows=[1] * 16)
    for s, p in zip(slots, prompts):
        cache.commit(s, range(len(p)), p)
    # decode one sequence, then all sixteen
    run(cache, slots[:1], [len(prompts[0])], [[tok(900)]])
    run(cache, slots, [len(p) for p in prompts], [[tok(901 + b)] for b in range(16)])
    # a chain, and a tree beside another sequence's decode row
    parents = [-1, 0, 0, 2, 2, 3]
    depths = [0, 1, 1, 2, 2, 3]
    run(cache, slots[1:2], [len(prompts[1])], [[tok(j) for j in range(5)]])
    run(cache, slots[2:4], [len(prompts[2]), len(prompts[3])], [[tok(40 + j) for j in range(6)], [tok(50)]],
        depths=[depths, None], tree_masks=[_tree(parents), None], logits_rows=[6, 1])
    # 16 sequences of 17-node trees beside a prompt chunk (the served batch's shape)
    wide = [-1, 0, 0, 2, 2, 3, 1, 1, 4, 5, 5, 6, 8, 9, 9, 12, 13]
    wide_depths = [0] * len(wide)
    for j, p in enumerate(wide):
        wide_depths[j] = 0 if p < 0 else wide_depths[p] + 1
    chunk_slot = cache.allocate()
    chunk = [tok(300 + j) for j in range(33)]
    run(cache, slots + [chunk_slot], [len(p) for p in prompts] + [0], [[tok(b + j) for j in range(17)] for b in range(16)] + [chunk],
        depths=[wide_depths] * 16 + [None], tree_masks=[_tree(wide)] * 16 + [None])
    # a chunked prefill: the rest of the chunk's prompt attends to its first part in the cache
    cache.commit(chunk_slot, range(33), chunk)
    rest = [tok(400 + j) for j in range(20)]
    run(cache, [chunk_slot], [33], [rest], logits_rows=[1])
    cache.commit(chunk_slot, range(20), rest)
    # a prefix-cache hit: a new sequence claims a copy of the chunked prompt's cached prefix
    cache.release(slots[5])
    prompt = chunk + rest[:12] + [tok(999)]
    found = cache.lookup(prompt, None, len(prompt) - 1)
    assert found is not None
    hit = cache.claim(prompt, None, found)
    reused = cache.lengths[hit]
    assert reused > 0
    run(cache, [hit], [reused], [prompt[reused:]], logits_rows=[1])
    out.extend([cache.k, cache.v])
    return out


def test_the_native_forward_equals_the_per_op_forward_bit_for_bit(model):
    try:
        oracle = _steps(model, native=False)
        native = _steps(model, native=True)
    finally:
        model.native_forward = True
    assert len(oracle) == len(native)
    for i, (want, got) in enumerate(zip(oracle, native)):
        assert want.shape == got.shape, i
        assert torch.equal(want, got), f"output {i}: max difference {(want - got).abs().max().item()}"


def test_the_comparison_sees_a_forward_that_differs(model):
    """Negative control: one layer's weights changed in the native path's view of them (its
    norm scaled by one ulp) changes its outputs, so equality above is not vacuous."""
    norm = model.layers[0].attn_norm.weight
    saved = norm.detach().clone()
    try:
        oracle = _steps(model, native=False)
        with torch.no_grad():
            norm.copy_(torch.nextafter(saved, torch.full_like(saved, 2.0)))
        native = _steps(model, native=True)
    finally:
        with torch.no_grad():
            norm.copy_(saved)
        model.native_forward = True
    assert any(not torch.equal(a, b) for a, b in zip(oracle[:-2], native[:-2]))


def test_weights_that_are_not_quantized_keep_the_per_op_path(tmp_path_factory):
    from conftest import save_tiny_hf
    from specdec.engine.models.loading import load_transformer

    target = load_transformer(save_tiny_hf(tmp_path_factory.mktemp("float"), vocab_size=1024))
    assert native_forward.unsupported_reason(target) == "not a quantized weight format" and target.native_plan() is None
    cache = target.new_cache(1, 64, 8)
    slot = cache.allocate()
    logits = target(build_batch([slot], [0], [[5, 6, 7]]), cache, last_only=True).logits
    assert logits.shape == (1, 1, target.cfg.vocab_size) and torch.isfinite(logits).all()


def test_the_switch_turns_the_native_forward_off(model, monkeypatch):
    monkeypatch.setenv(native_forward.NATIVE_ENV, "0")
    assert model.native_plan() is None


def test_the_rope_table_gives_each_position_the_same_bits_however_it_grows():
    from specdec.engine.models.llama import rope_inv_freq, rope_tables
    from specdec.config import ModelConfig

    cfg = ModelConfig("llama", 100, 64, 128, 1, 4, 2, 16, 1e-5, 10000.0, 4096, False, False)
    small, big = native_forward.RopeTable(rope_inv_freq(cfg)), native_forward.RopeTable(rope_inv_freq(cfg))
    small.cover(10)
    big.cover(3000)
    assert torch.equal(small.cos, big.cos[: small.cos.shape[0]]) and torch.equal(small.sin, big.sin[: small.sin.shape[0]])
    small.cover(2500)  # grown: the positions it had keep their bits
    assert torch.equal(small.cos, big.cos) and torch.equal(small.sin, big.sin)
    cos, sin = rope_tables(torch.arange(5, 9)[None], rope_inv_freq(cfg), torch.float32)
    assert torch.allclose(big.lookup(torch.arange(5, 9)[None])[0], cos) and torch.allclose(big.lookup(torch.arange(5, 9)[None])[1], sin)


def test_one_openmp_runtime_serves_torch_and_the_kernels():
    """Two OpenMP teams spinning on two cores collapse: the kernels must bind to the runtime torch
    loaded (libgomp's soname is shared), not start a second one."""
    code = ("import os, torch\nfrom specdec.engine import kernels\nkernels.native()\n"
            "print(sorted({l.split()[-1] for l in open(f'/proc/{os.getpid()}/maps') if 'omp' in l.rsplit('/', 1)[-1]}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=os.environ).stdout
    runtimes = eval(out)  # noqa: S307 (our own printed list)
    assert len(runtimes) == 1, runtimes
