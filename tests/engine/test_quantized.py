"""The GGUF's own quantized weights (issue 44): the file's blocks decode to exactly what gguf's
reference de-quantizer gives, each kernel multiplies as its de-quantized weight does (with the
bfloat16 rounding of inputs and scales the fast kernels take), and the served model in
weight_format gguf holds the same weights as the dense conversion."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from specdec.config import EngineConfig
from specdec.engine.models import quantized as Q
from specdec.errors import ConfigError


def _close(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest difference relative to the output's scale (accumulation order is the kernel's)."""
    return float((got - want).abs().max() / want.abs().max())


def _kernel(t: torch.Tensor) -> torch.Tensor:
    """t as the quantized kernels see it: rounded to their dtype (bfloat16; see quantized.py)."""
    return t.to(Q.KERNEL_DTYPE).double()


# The kernels' outputs are bfloat16 (8 significant bits): within 2^-8 of the exact product of
# what they were given, relative to the output's scale, and a wrong code, scale or group is off
# by far more (tests/engine/test_quantized.py's dense comparison below sees 1e-2 from int8 rounding).
BF16_OUTPUT = 2 ** -8


@pytest.fixture(scope="module")
def gguf_tensors():
    from gguf import GGUFReader

    from specdec.engine.models.loading import default_gguf_path

    reader = GGUFReader(str(default_gguf_path()))
    return {t.name: t for t in reader.tensors}


def test_the_files_blocks_decode_as_ggufs_reference(gguf_tensors):
    from gguf import quants

    t = gguf_tensors["blk.0.ffn_gate.weight"]
    assert t.tensor_type.name == "Q4_1"
    cols, rows = (int(v) for v in t.shape)
    codes, scale, offset = Q.q4_1_parts(t.data, rows, cols)
    assert int(codes.min()) >= 0 and int(codes.max()) <= 15
    mine = (codes.float().view(rows, -1, Q.GROUP) * scale[..., None] + offset[..., None]).view(rows, cols)
    assert np.array_equal(mine.numpy(), quants.dequantize(t.data, t.tensor_type).reshape(rows, cols))

    t = gguf_tensors["token_embd.weight"]
    assert t.tensor_type.name == "Q8_0"
    cols, rows = (int(v) for v in t.shape)
    codes, scale = Q.q8_0_parts(t.data, rows, cols)
    mine = (codes.float().view(rows, -1, Q.GROUP) * scale[..., None]).view(rows, cols)
    assert np.array_equal(mine.numpy(), quants.dequantize(t.data, t.tensor_type).reshape(rows, cols))


@pytest.mark.parametrize("rows", [1, 5, 16])
def test_each_kernel_multiplies_as_its_dequantized_weight(rows):
    g = torch.Generator().manual_seed(rows)
    N, K = 96, 128
    x = torch.randn(rows, K, generator=g)

    codes = torch.randint(0, 16, (N, K), generator=g, dtype=torch.int32)
    scale = (torch.rand(N, K // Q.GROUP, generator=g) * 0.02).half().float()  # float16 like the file's
    offset = (-torch.rand(N, K // Q.GROUP, generator=g) * 0.1).half().float()
    zero = _kernel(offset + 8 * scale)  # the kernel's weight is (code - 8) * scale + zero
    weight = ((codes.double() - 8).view(N, -1, Q.GROUP) * _kernel(scale)[..., None] + zero[..., None]).view(N, K)
    int4 = Q.Int4GroupLinear(codes, scale, offset)(x)
    assert int4.dtype == torch.float32
    assert _close(int4.double(), _kernel(x) @ weight.T) < BF16_OUTPUT

    codes8 = torch.randint(-128, 128, (N, K), generator=g, dtype=torch.int32).to(torch.int8)
    weight8 = (codes8.double().view(N, -1, Q.GROUP) * _kernel(scale)[..., None]).view(N, K)
    assert _close(Q.Int8GroupLinear(codes8, scale)(x).double(), _kernel(x) @ weight8.T) < BF16_OUTPUT

    dense = torch.randn(N, K, generator=g)
    row = Q.Int8RowLinear(dense)
    assert _close(row(x).double(), _kernel(x) @ (row.codes.double() * row.scale.double()[:, None]).T) < BF16_OUTPUT  # its own weights
    assert _close(row(x), x @ dense.T) < 2e-2  # and near the float ones: int8 is not the file's numbers

    # A row's output does not depend on the rows beside it (verify rows equal decode rows)
    assert torch.equal(Q.Int4GroupLinear(codes, scale, offset)(x[:1]), int4[:1])
    # Shapes: a [B, T, K] input comes back [B, T, N]
    assert Q.Int4GroupLinear(codes, scale, offset)(x.view(1, rows, K)).shape == (1, rows, N)


def test_the_served_gguf_format_holds_the_dense_conversions_weights():
    """transformers' conversion de-quantizes (and un-permutes Q and K); the gguf format keeps
    the codes. Same weights, so every layer multiplies alike, and the logits agree."""
    from specdec.serving.runtime import load_target

    dense = load_target(None, EngineConfig())
    quant = load_target(None, EngineConfig(weight_format="gguf"))
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for i in (0, len(dense.layers) - 1):
            for name in ("attn.wqkv", "attn.wo", "mlp.w13", "mlp.w2"):
                d, q = dense.layers[i].get_submodule(name), quant.layers[i].get_submodule(name)
                x = torch.randn(4, d.weight.shape[1], generator=g)
                assert _close(q(x), x @ d.weight.T) < 4 * BF16_OUTPUT, (i, name)  # bf16 inputs, scales, outputs
        x = torch.randn(4, dense.cfg.hidden_size, generator=g)
        assert isinstance(quant.lm_head, Q.Int8GroupLinear)
        assert _close(quant.lm_head(x), x @ dense.lm_head.weight.T) < 4 * BF16_OUTPUT
    assert not any(isinstance(m, torch.nn.Linear) for m in quant.modules())  # no float copy left to stream


def test_weight_format_settings_are_checked_by_name():
    assert EngineConfig(weight_format="gguf").weight_format == "gguf"
    with pytest.raises(ConfigError, match="weight_format"):
        EngineConfig(weight_format="q4")
    with pytest.raises(ConfigError, match="weight_format"):
        EngineConfig(weight_format="int8", dtype="bfloat16")
