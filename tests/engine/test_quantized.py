"""The quantized weight formats (issues 44, 59): the GGUF file's blocks decode to exactly what
gguf's reference de-quantizer gives, each format multiplies as its de-quantized weight does (with
the activations quantized per block of 32, as the int8 kernels take them), and the served model
in weight_format gguf holds the same weights as the dense conversion. The kernels' own
properties (bits, row invariance, every ISA path): test_int8_kernels.py."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from specdec.config import EngineConfig
from specdec.engine.kernels.int8 import Format
from specdec.engine.models import quantized as Q
from specdec.errors import ConfigError


def _close(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest difference relative to the output's scale (accumulation order is the kernel's)."""
    return float((got - want).abs().max() / want.abs().max())


def _as_the_kernel_sees(x: torch.Tensor) -> torch.Tensor:
    """x with each row quantized to int8 per block of 32 inputs (scale amax / 127), in float64."""
    blocks = x.double().view(*x.shape[:-1], -1, Q.GROUP)
    amax = blocks.abs().amax(-1, keepdim=True)
    codes = torch.round(blocks * torch.where(amax > 0, 127 / amax, 0)).clamp(-127, 127)
    return (codes * amax / 127).view(x.shape)


# With the activations as the kernel sees them, only float32 rounding of the block sums and
# scales remains (~1e-7 relative); a wrong code, scale, offset or block is off by far more.
KERNEL_ROUNDING = 1e-5
# Against the float activations: int8 activation blocks cost about 1% of the output's scale.
ACTIVATION_ROUNDING = 3e-2


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
def test_each_format_multiplies_as_its_dequantized_weight(rows):
    g = torch.Generator().manual_seed(rows)
    N, K = 96, 128
    x = torch.randn(rows, K, generator=g)
    seen = _as_the_kernel_sees(x)

    codes = torch.randint(0, 16, (N, K), generator=g, dtype=torch.int32)
    scale = (torch.rand(N, K // Q.GROUP, generator=g) * 0.02).half().float()  # float16 like the file's
    offset = (-torch.rand(N, K // Q.GROUP, generator=g) * 0.1).half().float()
    weight = (codes.double().view(N, -1, Q.GROUP) * scale.double()[..., None] + offset.double()[..., None]).view(N, K)
    q4_1 = Q.QuantizedLinear.q4_1(codes, scale, offset)
    out = q4_1(x)
    assert out.dtype == torch.float32
    assert _close(out.double(), seen @ weight.T) < KERNEL_ROUNDING
    assert _close(out.double(), x.double() @ weight.T) < ACTIVATION_ROUNDING

    codes8 = torch.randint(-127, 128, (N, K), generator=g, dtype=torch.int32).to(torch.int8)
    weight8 = (codes8.double().view(N, -1, Q.GROUP) * scale.double()[..., None]).view(N, K)
    assert _close(Q.QuantizedLinear.q8_0(codes8, scale)(x).double(), seen @ weight8.T) < KERNEL_ROUNDING

    dense = torch.randn(N, K, generator=g)
    row = Q.QuantizedLinear.per_row(dense)
    scale_row = dense.abs().amax(1).double() / 127
    own = torch.round(dense.double() / scale_row[:, None]).clamp(-127, 127) * scale_row[:, None]
    assert _close(row(x).double(), seen @ own.T) < KERNEL_ROUNDING  # its own weights
    assert _close(row(x), x @ dense.T) < ACTIVATION_ROUNDING  # and near the float ones: int8 is not the file's numbers
    block = Q.QuantizedLinear.per_block(dense)  # weight_format int8: one scale per 32 inputs of a row
    blocks = dense.double().view(N, -1, Q.GROUP)
    scale_block = blocks.abs().amax(-1, keepdim=True) / 127
    own = (torch.round(blocks / scale_block).clamp(-127, 127) * scale_block).view(N, K)
    assert _close(block(x).double(), seen @ own.T) < KERNEL_ROUNDING
    assert (own - dense.double()).abs().mean() < (torch.round(dense.double() / scale_row[:, None]) * scale_row[:, None]
                                                  - dense.double()).abs().mean()  # finer than one scale a row

    # A row's output does not depend on the rows beside it (verify rows equal decode rows)
    assert torch.equal(q4_1(x[:1]), out[:1])
    # Shapes: a [B, T, K] input comes back [B, T, N]
    assert q4_1(x.view(1, rows, K)).shape == (1, rows, N)


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
                assert _close(q(x).double(), _as_the_kernel_sees(x) @ d.weight.double().T) < KERNEL_ROUNDING, (i, name)
        x = torch.randn(4, dense.cfg.hidden_size, generator=g)
        assert isinstance(quant.lm_head, Q.QuantizedLinear) and quant.lm_head.weight.format == Format.Q8_0
        assert _close(quant.lm_head(x).double(), _as_the_kernel_sees(x) @ dense.lm_head.weight.double().T) < KERNEL_ROUNDING
    assert not any(isinstance(m, torch.nn.Linear) for m in quant.modules())  # no float copy left to stream


def test_weight_format_settings_are_checked_by_name():
    assert EngineConfig(weight_format="gguf").weight_format == "gguf"
    with pytest.raises(ConfigError, match="weight_format"):
        EngineConfig(weight_format="q4")
    with pytest.raises(ConfigError, match="weight_format"):
        EngineConfig(weight_format="int8", dtype="bfloat16")


def test_a_biased_layer_keeps_its_bias():
    """Qwen2's q/k/v (and Medusa's residual blocks) carry biases: the int8 copy adds them in float32."""
    g = torch.Generator().manual_seed(7)
    dense = torch.nn.Linear(64, 48, bias=True)
    with torch.no_grad():
        dense.bias.copy_(torch.randn(48, generator=g))
    x = torch.randn(3, 64, generator=g)
    q = Q.QuantizedLinear.of(dense)
    assert torch.equal(q(x), Q.QuantizedLinear.per_block(dense.weight)(x) + dense.bias.detach())
    assert _close(q(x), dense(x).detach()) < ACTIVATION_ROUNDING


def test_int8_draft_weights_quantize_a_heads_linears_and_are_checked_by_name(smol_model):
    """engine.draft_dtype int8: every linear of an EAGLE-3 head runs on the int8 kernels; the head's
    outputs stay near its float32 ones. Off CPU it is refused by name. (The served int8 draft model
    and Medusa heads run in test_acceptance_floor's greedy-beside-sampled test.)"""
    import copy

    from specdec.config import SpeculativeConfig
    from specdec.engine.models.eagle3_head import Eagle3Config, Eagle3Head, draft_weights

    head = Eagle3Head(Eagle3Config.for_target(smol_model.cfg, draft_vocab_size=256), smol_model.embed).eval()
    int8 = draft_weights(copy.deepcopy(head), "int8")
    assert not any(isinstance(m, torch.nn.Linear) for m in int8.modules())
    assert isinstance(int8.lm_head, Q.QuantizedLinear) and isinstance(int8.attn.wqkv, Q.QuantizedLinear)
    x = torch.randn(2, 3 * smol_model.cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        assert _close(int8.fc(x), head.fc(x)) < ACTIVATION_ROUNDING
    assert EngineConfig(draft_dtype="int8").draft_dtype == "int8"
    with pytest.raises(ConfigError, match="draft_dtype"):
        EngineConfig(draft_dtype="int8", device="cuda")
    with pytest.raises(ConfigError, match="draft_dtype"):
        EngineConfig(draft_dtype="int4")
    assert SpeculativeConfig(method="draft_model", draft_dtype="int8").draft_dtype == "int8"
