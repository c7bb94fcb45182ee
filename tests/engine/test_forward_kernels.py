"""The invariant forward's other kernels (specdec/engine/kernels, issue 59) against PyTorch's own
operators: RMSNorm with the residual add, RoPE with the KV cache write, silu(gate) * up, and the
attention kernel reading each row's slot in the cache itself. Their bits differ from PyTorch's
(their own fixed order, their own exponential), so these compare within float32 rounding; their
invariance is proven at the model level (test_invariant_attention.py)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from specdec.engine import kernels
from specdec.engine.models.llama import apply_rope, rope_tables


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_rms_norm_and_the_residual_add():
    g = _gen(0)
    x, delta, weight = torch.randn(7, 576, generator=g) * 3, torch.randn(7, 576, generator=g), torch.rand(576, generator=g)
    want = F.rms_norm(x, (576,), weight, 1e-5)
    assert torch.allclose(kernels.rms_norm(x.clone(), weight, 1e-5), want, rtol=1e-5, atol=1e-6)
    stream = x.clone()
    normed = kernels.rms_norm(stream, weight, 1e-5, residual=delta)
    assert torch.equal(stream, x + delta)  # the residual stream, updated in place
    assert torch.allclose(normed, F.rms_norm(x + delta, (576,), weight, 1e-5), rtol=1e-5, atol=1e-6)


def test_silu_times_up_from_the_fused_projection():
    g = _gen(1)
    gate_up = torch.randn(5, 2 * 1536, generator=g) * 6  # past exp's range on both sides
    gate_up[0, :4] = torch.tensor([0.0, -100.0, 100.0, -0.0])
    gate, up = gate_up.chunk(2, dim=-1)
    got = kernels.silu_mul(gate_up)
    assert torch.allclose(got, F.silu(gate) * up, rtol=1e-6, atol=1e-6)
    assert torch.isfinite(got).all()


def test_rope_and_the_cache_write():
    g = _gen(2)
    heads, kv_heads, hd, T = 9, 3, 64, 6
    qkv = torch.randn(T, (heads + 2 * kv_heads) * hd, generator=g)
    positions = torch.tensor([[40, 41, 41, 42, 7, 8]])
    cos, sin = rope_tables(positions, 1.0 / (10000 ** (torch.arange(0, hd, 2).double() / hd)).float(), torch.float32)
    k_cache, v_cache = torch.full((4, kv_heads, 64, hd), 7.0), torch.full((4, kv_heads, 64, hd), 7.0)
    slot = torch.tensor([2, 2, 2, 2, 0, 0])
    column = torch.tensor([40, 41, 42, 43, 7, 8])
    q = kernels.rope_and_cache(qkv, cos.reshape(T, hd), sin.reshape(T, hd), heads, kv_heads, k_cache, v_cache, slot, column)
    rows = qkv.view(1, T, heads + 2 * kv_heads, hd)
    want = apply_rope(rows[:, :, : heads + kv_heads], cos, sin)[0]  # [T, heads + kv_heads, hd]
    assert torch.allclose(q.view(T, heads, hd), want[:, :heads], rtol=1e-5, atol=1e-6)
    for t in range(T):
        assert torch.allclose(k_cache[slot[t], :, column[t]], want[t, heads:], rtol=1e-5, atol=1e-6)
        assert torch.equal(v_cache[slot[t], :, column[t]], rows[0, t, heads + kv_heads:])
    written = torch.zeros(4, 64, dtype=torch.bool)
    written[slot, column] = True
    assert (k_cache.permute(0, 2, 1, 3)[~written] == 7.0).all()  # nothing else touched
    assert (v_cache.permute(0, 2, 1, 3)[~written] == 7.0).all()


def test_attention_reads_each_rows_slot_in_the_cache_itself():
    g = _gen(3)
    cache_k, cache_v = torch.randn(5, 2, 48, 64, generator=g), torch.randn(5, 2, 48, 64, generator=g)
    q = torch.randn(3, 6, 4, 64, generator=g)
    allowed = torch.rand(3, 4, 48, generator=g) < 0.7
    allowed[..., 0] = True
    slots = torch.tensor([4, 1, 3])
    gathered = kernels.invariant_attention(q, cache_k[slots, :, :40], cache_v[slots, :, :40], allowed)
    in_place = kernels.invariant_attention(q, cache_k, cache_v, allowed, slots=slots, columns=40)
    assert torch.equal(in_place, gathered)
    want = F.scaled_dot_product_attention(q, cache_k[slots, :, :40], cache_v[slots, :, :40], attn_mask=allowed[:, None, :, :40],
                                          enable_gqa=True)
    assert torch.allclose(in_place, want, atol=1e-5)
