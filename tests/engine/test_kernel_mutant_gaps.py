"""Kernel and weight-format behaviour no other `make test` test held, found by mutants that
survived it (`make mutants`; tests/support/mutants/kernels_and_formats.toml names the mutant
each test kills).

RMSNorm over a width that is not a multiple of its 16 lanes sums the tail too. The attention
kernel's two schedules (by column blocks then rows, when the (sequence, kv head) groups are too
few for the threads; by row chunks, cut at the last column any of their rows may attend to)
both compute attention: the last allowed column of a causal chunk counts, and scores far past
exp's range (the max is subtracted) stay finite. The served int8 format holds one scale per 32
inputs of every linear weight, the lm_head included, and no float linear is left.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specdec.engine import kernels
from specdec.engine.kernels.int8 import Format


def test_rms_norm_sums_the_columns_past_the_last_full_lane_block():
    """576 (the served hidden size) is 36 x 16 lanes; a width with a tail must sum it too."""
    g = torch.Generator().manual_seed(7)
    n = 16 * 6 + 5
    x, delta, weight = torch.randn(3, n, generator=g), torch.randn(3, n, generator=g), torch.rand(n, generator=g) + 0.5
    x[:, -5:] *= 30  # the tail carries most of the energy
    want = F.rms_norm(x, (n,), weight, 1e-5)
    assert torch.allclose(kernels.rms_norm(x.clone(), weight, 1e-5), want, rtol=1e-5, atol=1e-6)
    stream = x.clone()
    got = kernels.rms_norm(stream, weight, 1e-5, residual=delta)
    assert torch.allclose(got, F.rms_norm(x + delta, (n,), weight, 1e-5), rtol=1e-5, atol=1e-6)


SCHEDULES = ["column-blocks-then-rows", "row-chunks"]


def _causal_case(schedule: str, seed: int, q_scale: float = 1.0):
    """A prompt chunk of N rows after L cached columns, causal, in a cache with spare columns
    past it (never allowed). Shapes pick the schedule for this process's thread count:
    two phases when B * KVH < 2 * threads (one group always is), row chunks otherwise."""
    threads = torch.get_num_threads()
    B, KVH = (1, 1) if schedule == SCHEDULES[0] else (2 * threads, 1)
    H, N, L, spare, D = 2, 5, 27, 6, 64
    C = L + N + spare
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, N, D, generator=g) * q_scale
    k, v = torch.randn(B, KVH, C, D, generator=g), torch.randn(B, KVH, C, D, generator=g)
    allowed = torch.zeros(B, N, C, dtype=torch.bool)
    for n in range(N):
        allowed[:, n, : L + n + 1] = True  # row n sees the prefix and itself: the last row, column L + N - 1
    return q, k, v, allowed


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_attention_on_both_schedules_counts_the_last_allowed_column(schedule):
    q, k, v, allowed = _causal_case(schedule, seed=1)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed[:, None], enable_gqa=True)
    got = kernels.invariant_attention(q, k, v, allowed)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_attention_scores_past_exps_range_stay_finite(schedule):
    """Scores near +-400 (a sharp head): softmax is exact only with the row's max subtracted
    before the exponential (e^88 already overflows float32)."""
    q, k, v, allowed = _causal_case(schedule, seed=2, q_scale=50.0)
    got = kernels.invariant_attention(q, k, v, allowed)
    assert torch.isfinite(got).all()
    want = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=allowed[:, None], enable_gqa=True)
    assert torch.allclose(got.double(), want, atol=1e-3, rtol=1e-3)


def test_the_served_int8_format_holds_per_block_int8_of_every_weight_lm_head_included(smol_model, smol_int8_model):
    """weight_format int8 (what ships): every linear layer and the lm_head are the kernels' Q8_0
    layout of the float weights, one scale per 32 inputs of a row; no float linear is left."""
    from specdec.engine.models.quantized import GROUP, QuantizedLinear

    def as_the_kernel_sees(x: torch.Tensor) -> torch.Tensor:
        blocks = x.double().view(*x.shape[:-1], -1, GROUP)
        amax = blocks.abs().amax(-1, keepdim=True)
        return (torch.round(blocks * torch.where(amax > 0, 127 / amax, 0)).clamp(-127, 127) * amax / 127).view(x.shape)

    def per_block(w: torch.Tensor) -> torch.Tensor:
        """Written apart, in float32 as the format quantizes: the served weights are de-quantized
        Q4_1 values, a grid on which w / scale often lands on a half, where float64 rounds otherwise."""
        blocks = w.detach().float().view(w.shape[0], -1, GROUP)
        scale = blocks.abs().amax(-1, keepdim=True) / 127
        return (torch.round(blocks / scale).clamp(-127, 127).double() * scale.double()).view(w.shape)

    dense, quant = smol_model, smol_int8_model
    g = torch.Generator().manual_seed(3)
    pairs = [(d.get_submodule(name), q.get_submodule(name)) for i in (0, len(dense.layers) - 1)
             for d, q in [(dense.layers[i], quant.layers[i])] for name in ("attn.wqkv", "attn.wo", "mlp.w13", "mlp.w2")]
    pairs.append((dense.lm_head, quant.lm_head))
    with torch.inference_mode():
        for d, q in pairs:
            assert isinstance(q, QuantizedLinear) and q.weight.format == Format.Q8_0
            x = torch.randn(3, d.weight.shape[1], generator=g)
            want = as_the_kernel_sees(x) @ per_block(d.weight).T
            assert float((q(x).double() - want).abs().max() / want.abs().max()) < 1e-5
    assert not any(isinstance(m, torch.nn.Linear) for m in quant.modules())


@pytest.mark.parametrize("fmt", [Format.ROW, Format.Q8_0, Format.Q4_1], ids=["row", "q8_0", "q4_1"])
def test_a_partial_last_column_tile_multiplies_as_the_dequantized_weight_on_every_path(fmt):
    """200 output columns: 12 tiles of 16 and a last one of 8. The paths are compared with the
    reference bit for bit elsewhere (test_int8_kernels.py); here every path's every column,
    the partial tile's included, against the de-quantized weight itself."""
    from test_int8_kernels import PATHS, _activations, _weight
    from test_quantized import KERNEL_ROUNDING, _as_the_kernel_sees

    from specdec.engine.kernels.int8 import int8_linear

    n, k = 200, 96
    for isa in PATHS:
        weight, dense = _weight(fmt, n, k, seed=13, isa=isa)
        for rows in (3, 37):  # the AVX-512 micro-kernel's rows and AMX's
            x = _activations(rows, k, seed=rows)
            got = int8_linear(x, weight).double()
            want = _as_the_kernel_sees(x) @ dense.T
            per_column = (got - want).abs().amax(0) / want.abs().max()
            assert float(per_column.max()) < KERNEL_ROUNDING, (isa, rows, per_column.argmax().item())


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_a_masked_column_with_the_highest_score_changes_no_bit(schedule):
    """A column a row may not attend to takes no part in its softmax, not even in the max that is
    subtracted before the exponential: giving it the highest score of all changes no bit. (The
    full mutation run found this unseen at one thread: the invariance tests' masked siblings
    never outscored the allowed columns there.)"""
    q, k, v, allowed = _causal_case(schedule, seed=3)
    allowed[:, :, 3] = False  # inside every row's causal range, masked
    loud = k.clone()
    loud[:, :, 3] = 40.0 * q[:, 0, 0].mean(dim=0)  # aligned with the queries: the largest score by far
    base = kernels.invariant_attention(q, k, v, allowed)
    assert torch.equal(kernels.invariant_attention(q, loud, v, allowed), base)
