"""The GGUF's own quantized weights, multiplied as they are stored (issue 44).

The embedded target ships as a GGUF file whose linear weights are Q4_1 and whose tied
embedding / lm_head is Q8_0. Converting it to float32 (what `prepare` does for the dense
formats) makes every decode step stream 4-8x the bytes the file holds. Here the linear layers
keep the file's codes and multiply with PyTorch's CPU weight-only kernels:

- Q4_1 (32 weights share a float16 scale d and offset m; w = d * q + m, q in 0..15) maps onto
  `_weight_int4pack_mm_for_cpu`'s groups of 32, whose weight is (q - 8) * scale + zero:
  scale = d, zero = m + 8 * d.
- Q8_0 (32 weights share a float16 scale d; w = d * q, q in -128..127) has one scale per
  group, and PyTorch's int8 kernel (`_weight_int8pack_mm`) one per output row: one int8
  multiply per group of 32 columns, each with its group's scales as the row scales, summed
  (`Int8GroupLinear`).
- `int8` (from float weights, any checkpoint): one symmetric scale per output row
  (`Int8RowLinear`). Not the file's numbers: a new quantization of the float weights.

Where the file is not kept exactly: the codes are, but both kernels are fast on CPU only with
bfloat16 activations and scales (measured on the 2-core EPYC at one row: 22-27 us for the
3072 x 576 gate|up weight, against 528 us (int8) and 1,187 us (int4) with float32 ones, a naive
fallback at 0.7-3.3 GB/s). So each quantized layer rounds its input and the group scales and
offsets to bfloat16 (relative error at most 2^-9), accumulates in float32 inside the kernel, and
returns float32. llama.cpp rounds activations further (to 8-bit blocks, Q8_1) for the same
file. Whether the format's greedy output equals its own baseline under speculation is then a
measurement, unless every other part of the forward is row-invariant too: so a quantized target
attends with the batch-invariant kernel of engine/kernels, and then a token's logits are the same
bits however it is computed (decoded alone, verified in a tree, beside other sequences), and
greedy speculation equals the baseline by construction. Every method's verify path runs the
same kernels as the baseline.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

from specdec.config import QUANTIZED_WEIGHT_FORMATS

GROUP = 32  # Q4_1 and Q8_0 block size: weights per scale along the input dimension
KERNEL_DTYPE = torch.bfloat16  # the activations and scales PyTorch's CPU int4/int8 kernels are fast with (see above)


class Int4GroupLinear(nn.Module):
    """y = x W^T with W = scale * code + offset per group of 32 inputs (GGUF Q4_1)."""

    def __init__(self, codes: Tensor, scale: Tensor, offset: Tensor):
        """codes: [N, K] integers 0..15; scale, offset: [N, K / 32] float32."""
        super().__init__()
        self.out_features, self.in_features = codes.shape
        zero = offset + 8 * scale  # the kernel's weight is (code - 8) * scale + zero
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), 1))
        # [K / 32, N, 2]: (scale, zero) per group and output row, the kernel's layout
        self.register_buffer("scales_and_zeros", torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().to(KERNEL_DTYPE))

    def forward(self, x: Tensor) -> Tensor:
        rows = x.reshape(-1, self.in_features).to(KERNEL_DTYPE).contiguous()
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.packed, GROUP, self.scales_and_zeros)
        return y.float().view(*x.shape[:-1], self.out_features)


class Int8GroupLinear(nn.Module):
    """y = x W^T with W = scale * code per group of 32 inputs (GGUF Q8_0): one int8 multiply
    per group, that group's scales as the kernel's per-row scales, summed."""

    def __init__(self, codes: Tensor, scale: Tensor):
        """codes: [N, K] int8; scale: [N, K / 32] float32."""
        super().__init__()
        self.out_features, self.in_features = codes.shape
        groups = self.in_features // GROUP
        self.register_buffer("codes", codes.to(torch.int8).view(self.out_features, groups, GROUP).transpose(0, 1).contiguous())
        self.register_buffer("scale", scale.t().contiguous().to(KERNEL_DTYPE))  # [K / 32, N]

    def forward(self, x: Tensor) -> Tensor:
        rows = x.reshape(-1, self.in_features).to(KERNEL_DTYPE)
        y = None
        for g in range(self.codes.shape[0]):  # the group sums accumulate in float32
            part = torch.ops.aten._weight_int8pack_mm(rows[:, g * GROUP:(g + 1) * GROUP].contiguous(), self.codes[g], self.scale[g])
            y = part.float() if y is None else y.add_(part)
        return y.view(*x.shape[:-1], self.out_features)


class Int8RowLinear(nn.Module):
    """y = x W^T with W ~ scale[n] * code[n, k], one symmetric scale per output row (from float weights)."""

    def __init__(self, weight: Tensor):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        w = weight.detach().float()
        scale = w.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny) / 127.0
        self.register_buffer("codes", torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8).contiguous())
        self.register_buffer("scale", scale.contiguous().to(KERNEL_DTYPE))

    def forward(self, x: Tensor) -> Tensor:
        rows = x.reshape(-1, self.in_features).to(KERNEL_DTYPE).contiguous()
        return torch.ops.aten._weight_int8pack_mm(rows, self.codes, self.scale).float().view(*x.shape[:-1], self.out_features)


# ---- the GGUF file's blocks ------------------------------------------------------------------
def q4_1_parts(blocks: np.ndarray, rows: int, cols: int) -> tuple[Tensor, Tensor, Tensor]:
    """Codes [rows, cols], scale and offset [rows, cols / 32] of a Q4_1 tensor's raw bytes
    (per block: float16 d, float16 m, 16 bytes of codes, low nibbles first)."""
    b = np.ascontiguousarray(blocks).reshape(rows * cols // GROUP, 20)
    d = b[:, 0:2].copy().view(np.float16).astype(np.float32).reshape(rows, cols // GROUP)
    m = b[:, 2:4].copy().view(np.float16).astype(np.float32).reshape(rows, cols // GROUP)
    qs = b[:, 4:]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=1).reshape(rows, cols)
    return torch.from_numpy(codes.astype(np.int32)), torch.from_numpy(d), torch.from_numpy(m)


def q8_0_parts(blocks: np.ndarray, rows: int, cols: int) -> tuple[Tensor, Tensor]:
    """Codes [rows, cols] int8 and scale [rows, cols / 32] of a Q8_0 tensor's raw bytes
    (per block: float16 d, 32 int8 codes)."""
    b = np.ascontiguousarray(blocks).reshape(rows * cols // GROUP, 34)
    d = b[:, 0:2].copy().view(np.float16).astype(np.float32).reshape(rows, cols // GROUP)
    codes = b[:, 2:].copy().view(np.int8).reshape(rows, cols)
    return torch.from_numpy(codes), torch.from_numpy(d)


def _unpermute_rows(rows: int, heads: int) -> np.ndarray:
    """The row order that undoes llama.cpp's Q/K permutation (its converter interleaves each
    head's two RoPE halves; the engine uses Hugging Face's rotate-half layout): HF row i is
    GGUF row order[i]. Only rows move, so quantized blocks (along the input) move whole."""
    half = rows // heads // 2
    gguf_of_hf = np.arange(rows).reshape(heads, 2, half).swapaxes(1, 2).reshape(rows)  # llama.cpp's permute
    order = np.empty(rows, dtype=np.int64)
    order[gguf_of_hf] = np.arange(rows)
    return order


class GGUFWeights:
    """The quantized tensors of a GGUF file, by the engine's layer names."""

    def __init__(self, path: Path):
        from gguf import GGUFReader

        self.path = Path(path)
        self._reader = GGUFReader(str(path))
        self._tensors = {t.name: t for t in self._reader.tensors}
        field = self._reader.fields.get("general.architecture")
        self.arch = bytes(field.parts[field.data[0]]).decode() if field is not None else "llama"

    def _kv(self, key: str) -> int:
        field = self._reader.fields[f"{self.arch}.{key}"]
        return int(field.parts[field.data[0]][0])

    def linear(self, names: list[str], permute_heads: list[int | None] | None = None) -> nn.Module:
        """One layer from GGUF tensors stacked along the output (fused QKV, gate|up), each
        optionally unpermuted by its head count."""
        kinds, parts = set(), []
        for i, name in enumerate(names):
            t = self._tensors[name]
            cols, rows = (int(v) for v in t.shape)  # GGUF lists the input dimension first
            kind = t.tensor_type.name
            kinds.add(kind)
            if kind == "Q4_1":
                part = q4_1_parts(t.data, rows, cols)
            elif kind == "Q8_0":
                part = q8_0_parts(t.data, rows, cols)
            else:
                raise ValueError(f"{self.path.name}: {name} is {kind}; weight_format gguf takes Q4_1 and Q8_0 (use float32, bfloat16 or int8)")
            heads = (permute_heads or [None] * len(names))[i]
            if heads:
                order = torch.from_numpy(_unpermute_rows(rows, heads))
                part = tuple(p.index_select(0, order) for p in part)
            parts.append(part)
        if len(kinds) != 1:
            raise ValueError(f"{self.path.name}: {names} mix formats {sorted(kinds)}")
        stacked = [torch.cat(ps) for ps in zip(*parts)]
        return Int4GroupLinear(*stacked) if kinds == {"Q4_1"} else Int8GroupLinear(*stacked)

    def output_name(self) -> str:
        """The lm_head's tensor: `output.weight`, or the tied embedding."""
        return "output.weight" if "output.weight" in self._tensors else "token_embd.weight"


def gguf_source(model_dir: Path) -> Path | None:
    """The GGUF file a prepared model directory was converted from (its manifest says), if any."""
    from specdec.engine.models.loading import MANIFEST

    manifest = Path(model_dir) / MANIFEST
    if not manifest.is_file():
        return None
    source = json.loads(manifest.read_text()).get("source")
    return Path(source) if source and Path(source).is_file() else None


def quantize_gguf(model: nn.Module, gguf_path: Path) -> nn.Module:
    """Replace the model's linear layers (and lm_head) by the GGUF file's own quantized
    weights; the float copies go. The embedding stays a float lookup (one row per token)."""
    weights = GGUFWeights(gguf_path)
    cfg = model.cfg
    if cfg.qkv_bias or cfg.o_bias:
        raise ValueError(f"{Path(gguf_path).name}: weight_format gguf serves models without linear biases")
    for i, layer in enumerate(model.layers):
        b = f"blk.{i}."
        layer.attn.wqkv = weights.linear([b + "attn_q.weight", b + "attn_k.weight", b + "attn_v.weight"],
                                         [cfg.num_heads, cfg.num_kv_heads, None])
        layer.attn.wo = weights.linear([b + "attn_output.weight"])
        layer.mlp.w13 = weights.linear([b + "ffn_gate.weight", b + "ffn_up.weight"])
        layer.mlp.w2 = weights.linear([b + "ffn_down.weight"])
    model.lm_head = weights.linear([weights.output_name()])
    return model


def quantize_int8(model: nn.Module) -> nn.Module:
    """Replace the model's linear layers (and lm_head) by per-row int8 copies of their weights."""
    for layer in model.layers:
        layer.attn.wqkv = Int8RowLinear(layer.attn.wqkv.weight)
        layer.attn.wo = Int8RowLinear(layer.attn.wo.weight)
        layer.mlp.w13 = Int8RowLinear(layer.mlp.w13.weight)
        layer.mlp.w2 = Int8RowLinear(layer.mlp.w2.weight)
    model.lm_head = Int8RowLinear(model.lm_head.weight)
    return model


def quantize(model: nn.Module, weight_format: str | None, model_dir: Path) -> nn.Module:
    """The target in engine.weight_format: quantized in place for int8 and gguf (the GGUF file
    the model directory was prepared from), as loaded otherwise. A quantized target attends with
    the batch-invariant kernel (engine/kernels), so its whole forward is row-invariant."""
    if weight_format not in QUANTIZED_WEIGHT_FORMATS:
        return model
    if weight_format == "int8":
        model = quantize_int8(model)
    else:
        source = gguf_source(model_dir)
        if source is None:
            from specdec.errors import ConfigError

            raise ConfigError("weight_format", f"gguf needs the GGUF file {model_dir} was prepared from; none is recorded there")
        model = quantize_gguf(model, source)
    from specdec.engine import kernels

    model.batch_invariant = kernels.available()  # else SDPA: identity is then a measurement only (logged)
    return model
