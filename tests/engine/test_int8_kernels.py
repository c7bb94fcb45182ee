"""The int8 linear kernels (specdec/engine/kernels/int8.py, int8_linear*.c), issue 59.

- Every SIMD path this CPU runs gives the plain C reference's bits, for every format.
- The integer part is exact: checked against torch._int_mm (oneDNN's int8 x int8 -> int32) on
  the same activation codes, block by block.
- Row invariance: a row's output bits are the same alone and in any batch of 1..64 rows, at any
  position in it, on every path. The same harness catches PyTorch's float32 linear, which is not
  row-invariant (its negative control, run here, so the harness is known to see a break:
  test_the_harness_catches_a_linear_that_is_not_row_invariant).
- A missing library is refused by name, never silent.
"""
from __future__ import annotations

import platform
import random

import pytest
import torch

from specdec.config import EngineConfig
from specdec.engine import kernels
from specdec.engine.kernels.int8 import ISA, QBLOCK, Format, PackedInt8, int8_linear, isa_supported
from specdec.errors import ConfigError

PATHS = [isa for isa in ISA.NAMES if isa_supported(isa)]
FORMATS = {"row": Format.ROW, "q8_0": Format.Q8_0, "q4_1": Format.Q4_1}


def _weight(fmt: int, n: int, k: int, seed: int, isa: int) -> tuple[PackedInt8, torch.Tensor]:
    """A random packed weight and its de-quantized float64 copy [n, k]."""
    g = torch.Generator().manual_seed(seed)
    blocks = k // QBLOCK
    if fmt == Format.Q4_1:
        codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.int32)
        scale, offset = torch.rand(n, blocks, generator=g) * 0.02, -torch.rand(n, blocks, generator=g) * 0.1
        dense = codes.double().view(n, blocks, QBLOCK) * scale.double()[..., None] + offset.double()[..., None]
        return PackedInt8.pack(codes, fmt, block_scale=scale, block_offset=offset, isa=isa), dense.view(n, k)
    codes = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int32).to(torch.int8)
    if fmt == Format.Q8_0:
        scale = torch.rand(n, blocks, generator=g) * 0.02
        dense = codes.double().view(n, blocks, QBLOCK) * scale.double()[..., None]
        return PackedInt8.pack(codes, fmt, block_scale=scale, isa=isa), dense.view(n, k)
    scale = torch.rand(n, generator=g) * 0.02
    return PackedInt8.pack(codes, fmt, column_scale=scale, isa=isa), codes.double() * scale.double()[:, None]


def _activations(m: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * 4
    x[:, 5] *= 40  # an outlier channel, as real hidden states have
    x[0, :QBLOCK] = 0.0  # an all-zero block (scale 0)
    return x


@pytest.mark.parametrize("fmt", FORMATS.values(), ids=FORMATS.keys())
@pytest.mark.parametrize("shape", [(16, 32), (40, 96), (96, 576), (200, 1536)])
def test_every_path_gives_the_references_bits(fmt, shape):
    n, k = shape
    x = _activations(37, k, seed=n + k)
    outputs = {ISA.NAMES[isa]: int8_linear(x, _weight(fmt, n, k, seed=k, isa=isa)[0]) for isa in PATHS}
    reference = outputs["reference"]
    if platform.machine() == "x86_64":
        assert "avx2" in outputs  # every x86-64 machine this project runs on has it: a SIMD path was compared
    for name, out in outputs.items():
        assert torch.equal(out, reference), name
    assert torch.isfinite(reference).all()


def _block_codes(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernels' activation codes [m, k] int8 and scales [m, k / 32], computed apart."""
    blocks = x.view(x.shape[0], -1, QBLOCK)
    amax = blocks.abs().amax(-1, keepdim=True)
    inverse = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    codes = torch.round(blocks * inverse).clamp(-127, 127).to(torch.int8)
    return codes.view_as(x), (amax / 127.0).squeeze(-1)


def test_the_integer_dot_products_equal_onednns_int_mm():
    """ROW format: y = sum_b a_s[b] * dot_b * w_s, with every dot_b from torch._int_mm."""
    n, k, m = 64, 256, 17  # _int_mm wants more than 16 rows
    x = _activations(m, k, seed=3)
    g = torch.Generator().manual_seed(4)
    codes = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int32).to(torch.int8)
    scale = torch.rand(n, generator=g) * 0.02
    got = int8_linear(x, PackedInt8.pack(codes, Format.ROW, column_scale=scale))
    a_codes, a_scale = _block_codes(x)
    want = torch.zeros(m, n, dtype=torch.float64)
    for b in range(k // QBLOCK):
        cols = slice(b * QBLOCK, (b + 1) * QBLOCK)
        dots = torch._int_mm(a_codes[:, cols].contiguous(), codes[:, cols].t().contiguous())  # exact int32
        want += dots.double() * a_scale[:, b : b + 1].double()
    want *= scale.double()[None, :]
    assert float((got.double() - want).abs().max() / want.abs().max()) < 1e-6  # float32 rounding only


def _row_invariance_breaks(linear, k: int, seed: int, trials: int = 12) -> list[tuple[int, int]]:
    """(batch size, position) pairs where a row's output differs from the same row alone."""
    rng = random.Random(seed)
    rows = _activations(64, k, seed=seed)
    alone = torch.cat([linear(rows[i : i + 1]) for i in range(64)])
    breaks = []
    for _ in range(trials):
        m = rng.randint(1, 64)
        picked = rng.sample(range(64), m)  # any rows, in any order: row j lands at position j
        out = linear(rows[picked])
        breaks += [(m, j) for j, i in enumerate(picked) if not torch.equal(out[j], alone[i])]
    for m in (1, 2, 3, 7, 8, 9, 16, 17, 63, 64):  # the micro-kernels' edges
        out = linear(rows[:m])
        breaks += [(m, j) for j in range(m) if not torch.equal(out[j], alone[j])]
    return breaks


@pytest.mark.parametrize("isa", PATHS, ids=[ISA.NAMES[i] for i in PATHS])
@pytest.mark.parametrize("fmt", FORMATS.values(), ids=FORMATS.keys())
def test_a_rows_bits_do_not_depend_on_the_rows_beside_it(fmt, isa):
    n, k = 200, 576  # 13 column tiles, the last one partial
    weight, _ = _weight(fmt, n, k, seed=11, isa=isa)
    assert _row_invariance_breaks(lambda x: int8_linear(x, weight), k, seed=fmt * 7 + isa) == []
    for threads in (1, 3):  # nor on the threads that share the columns
        assert _row_invariance_breaks(lambda x: int8_linear(x, weight, threads=threads), k, seed=5, trials=3) == []


def test_the_harness_catches_a_linear_that_is_not_row_invariant():
    """Negative control: PyTorch's float32 linear (MKL's GEMM) picks its blocking from the batch,
    so the same harness finds rows whose bits change with the rows beside them."""
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(1536, 576, generator=g) * 0.05
    with torch.inference_mode():
        assert _row_invariance_breaks(lambda x: torch.nn.functional.linear(x, weight), 576, seed=1) != []


def test_a_quantized_format_without_the_kernels_is_refused_by_name(monkeypatch):
    from specdec.serving.runtime import load_target

    monkeypatch.setenv(kernels.LIBRARY_ENV, "none")
    kernels.reset()
    try:
        assert not kernels.available()
        assert "make setup" in kernels.unavailable_reason()
        for weight_format in ("int8", "gguf"):
            with pytest.raises(ConfigError, match="weight_format") as refused:
                load_target(None, EngineConfig(weight_format=weight_format))
            assert "compiled kernels" in str(refused.value)
        assert not load_target(None, EngineConfig(weight_format="float32")).batch_invariant  # float32 still serves
    finally:
        monkeypatch.delenv(kernels.LIBRARY_ENV)
        kernels.reset()
    assert kernels.available()


def test_a_library_that_does_not_load_says_which_file(monkeypatch, tmp_path):
    broken = tmp_path / "_native.so"
    broken.write_bytes(b"not an ELF file")
    monkeypatch.setenv(kernels.LIBRARY_ENV, str(broken))
    kernels.reset()
    try:
        assert not kernels.available()
        assert str(broken) in kernels.unavailable_reason()
    finally:
        monkeypatch.delenv(kernels.LIBRARY_ENV)
        kernels.reset()


def test_the_path_can_be_capped_to_emulate_a_smaller_cpu_and_a_wrong_name_is_refused(monkeypatch):
    """SPECDEC_INT8_PATH: what a CPU without AMX or VNNI runs, measured where they exist (the
    bits are the same on every path: test_every_path_gives_the_references_bits)."""
    from specdec.engine.kernels.int8 import PATH_ENV, best_isa

    monkeypatch.setenv(PATH_ENV, "reference")
    assert best_isa() == ISA.REFERENCE
    codes = torch.randint(-127, 128, (48, 64), dtype=torch.int8)
    packed = PackedInt8.pack(codes, Format.ROW, column_scale=torch.rand(48) + 0.5)
    assert packed.isa == ISA.REFERENCE
    monkeypatch.setenv(PATH_ENV, "neon")
    with pytest.raises(ConfigError) as err:
        best_isa()
    assert err.value.field == PATH_ENV


def _quantized(picked: bool, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    k = x.shape[-1]
    codes = torch.empty(k, dtype=torch.int8)
    scale, offset = torch.empty(k // QBLOCK), torch.empty(k // QBLOCK)
    total = torch.empty(k // QBLOCK, dtype=torch.int32)
    assert kernels.native().int8_quantize_row(int(picked), x.data_ptr(), k, codes.data_ptr(), scale.data_ptr(),
                                              total.data_ptr(), offset.data_ptr()) == 0
    return codes, scale, total, offset


def test_the_vectorized_activation_quantizer_gives_the_references_codes_and_scales():
    """The quantizer every call uses (hand-written AVX-512 where the CPU has it, else the widest
    compiled width) against the plain C reference: rows of every magnitude, ties at .5 after the
    scaling, zeros, a block of one value, a block of -0.0 and denormals."""
    g = torch.Generator().manual_seed(3)
    rows = [torch.randn(1536, generator=g) * scale for scale in (1e-30, 1e-3, 1.0, 7.5, 1e4)]
    ties = torch.arange(-64, 64, dtype=torch.float32) / 2.0  # amax 31.75: x * (127 / amax) lands near halves
    special = torch.cat([torch.zeros(32), torch.full((32,), 3.25), -torch.zeros(32), torch.full((32,), 1e-40)])
    for x in rows + [ties, special, torch.rand(64, generator=g) - 0.5]:
        x = x.contiguous()
        for want, got in zip(_quantized(False, x), _quantized(True, x)):
            assert torch.equal(want, got)


def test_the_quantizer_comparison_sees_a_different_code():
    """Negative control: one input moved by one scaled step changes the codes compared above."""
    x = torch.linspace(-1, 1, 64)
    moved = x.clone()
    moved[5] += 2.0 / 127
    assert not torch.equal(_quantized(True, x)[0], _quantized(False, moved)[0])
