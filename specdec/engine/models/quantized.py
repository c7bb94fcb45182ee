"""Quantized target weights, multiplied by our own row-invariant int8 kernels (issues 44, 59).

Three formats (engine.weight_format), one kernel (engine/kernels/int8.py, int8_linear.h):

- `int8` (the served default; from float weights, any checkpoint): one symmetric scale per 32
  inputs of each row, Q8_0's layout. Not the file's numbers: a new quantization of the float
  weights (for the embedded target, of its de-quantized Q4_1 weights).
- `gguf`: the embedded target's own file, whose linear weights are Q4_1 (32 weights share a
  float16 scale d and offset m; w = d * q + m, q in 0..15) and whose tied embedding / lm_head
  is Q8_0 (w = d * q per 32 weights). The codes and scales are kept exactly as stored.

Each activation row is quantized on its own to int8 in blocks of 32 inputs (as llama.cpp does
for the same file; per-row scales measured KL 0.040 against float32, blocks of 32 0.0074, the
bfloat16 activations PyTorch's kernels needed 0.0046: docs/results.md has the table), each block's
integer dot product is exact, and the float part runs in a fixed order. So a row's logits are the
same bits whether it is decoded alone, verified in a tree or beside other sequences, and, with
the batch-invariant attention of engine/kernels, greedy speculation equals the baseline by
construction. The cost is flat in rows at verification sizes: each call reads each weight once
for all its rows (PyTorch's weight-only kernels, used before, cost about linearly in rows).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

from specdec.config import QUANTIZED_WEIGHT_FORMATS
from specdec.engine.kernels.int8 import Format, PackedInt8, int8_linear

GROUP = 32  # Q4_1 and Q8_0 block size: weights per scale along the input dimension


class QuantizedLinear(nn.Module):
    """y = x W^T (+ b) with W held as int8 codes in the kernels' layout (no float copy); the bias,
    when there is one, stays float32."""

    def __init__(self, weight: PackedInt8, bias: Tensor | None = None):
        super().__init__()
        self.weight = weight
        self.out_features, self.in_features = weight.out_features, weight.in_features
        for name, tensor in weight.tensors().items():  # buffers: counted, saved and shown like any weight
            self.register_buffer(name, tensor)
        self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous())

    @classmethod
    def per_row(cls, weight: Tensor) -> "QuantizedLinear":
        """Per-output-row symmetric int8 of a float weight [N, K] (the kernels' ROW layout; no format
        serves it since int8 moved to per-block scales, which measured closer to float32)."""
        w = weight.detach().float()
        scale = w.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny) / 127.0
        codes = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
        return cls(PackedInt8.pack(codes, Format.ROW, column_scale=scale))

    @classmethod
    def per_block(cls, weight: Tensor, bias: Tensor | None = None) -> "QuantizedLinear":
        """Symmetric int8 of a float weight [N, K] with one scale per 32 inputs of a row (Q8_0's
        layout, weight_format int8): a row's outlier then coarsens only its own block."""
        w = weight.detach().float().view(weight.shape[0], -1, GROUP)
        scale = w.abs().amax(dim=2).clamp_min(torch.finfo(torch.float32).tiny) / 127.0  # [N, K / 32]
        codes = torch.round(w / scale[..., None]).clamp_(-127, 127).to(torch.int8).view(weight.shape)
        return cls(PackedInt8.pack(codes, Format.Q8_0, block_scale=scale), bias)

    @classmethod
    def of(cls, linear: nn.Linear) -> "QuantizedLinear":
        """per_block of a dense layer, its bias kept."""
        return cls.per_block(linear.weight, linear.bias)

    @classmethod
    def q8_0(cls, codes: Tensor, scale: Tensor) -> "QuantizedLinear":
        """GGUF Q8_0: codes [N, K] int8, scale [N, K / 32]."""
        return cls(PackedInt8.pack(codes, Format.Q8_0, block_scale=scale))

    @classmethod
    def q4_1(cls, codes: Tensor, scale: Tensor, offset: Tensor) -> "QuantizedLinear":
        """GGUF Q4_1: codes [N, K] in 0..15, scale and offset [N, K / 32]."""
        return cls(PackedInt8.pack(codes, Format.Q4_1, block_scale=scale, block_offset=offset))

    def forward(self, x: Tensor) -> Tensor:
        y = int8_linear(x, self.weight)
        return y if self.bias is None else y.add_(self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, format={self.weight.format}, bias={self.bias is not None}"


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
        return QuantizedLinear.q4_1(*stacked) if kinds == {"Q4_1"} else QuantizedLinear.q8_0(*stacked)

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
    """Replace the model's linear layers (and lm_head) by int8 copies of their weights, one scale
    per 32 inputs of a row (QuantizedLinear.per_block). Measured against float32 (make
    format-quality, same kernels and activations): one scale per row, KL 0.0077; per block, 0.0044,
    at the same forward time (the block scales cost one multiply a block)."""
    for layer in model.layers:
        layer.attn.wqkv = QuantizedLinear.of(layer.attn.wqkv)  # Qwen2's q/k/v biases stay float32
        layer.attn.wo = QuantizedLinear.of(layer.attn.wo)
        layer.mlp.w13 = QuantizedLinear.of(layer.mlp.w13)
        layer.mlp.w2 = QuantizedLinear.of(layer.mlp.w2)
    model.lm_head = QuantizedLinear.of(model.lm_head)
    return model


def quantize_linears(module: nn.Module) -> nn.Module:
    """Every dense linear layer inside `module` (a drafter's heads) as QuantizedLinear.per_block,
    in place. Layers whose input width is not a multiple of 32 keep their weights."""
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and child.in_features % GROUP == 0:
                setattr(parent, name, QuantizedLinear.of(child))
    return module


def quantize(model: nn.Module, weight_format: str | None, model_dir: Path) -> nn.Module:
    """The target in engine.weight_format: quantized in place for int8 and gguf (the GGUF file
    the model directory was prepared from), as loaded otherwise. A quantized target runs on the
    project's compiled kernels and attends with the batch-invariant one, so its whole forward is
    row-invariant; without the kernels it refuses to load, naming the setting."""
    if weight_format not in QUANTIZED_WEIGHT_FORMATS:
        return model
    from specdec.engine import kernels
    from specdec.errors import ConfigError

    if not kernels.available():
        raise ConfigError("weight_format", f"{weight_format} needs the project's compiled kernels, and "
                          f"{kernels.unavailable_reason()}; or serve weight_format float32")
    if weight_format == "int8":
        model = quantize_int8(model)
    else:
        source = gguf_source(model_dir)
        if source is None:
            raise ConfigError("weight_format", f"gguf needs the GGUF file {model_dir} was prepared from; none is recorded there")
        model = quantize_gguf(model, source)
    model.batch_invariant = True
    model.forget_native_plan()  # the linears were replaced
    return model
