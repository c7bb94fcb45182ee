"""Weight-only int8 linear layers, row-invariant and flat in rows (int8_linear.h has the numerics).

Three weight layouts share one kernel: one scale per output column (ROW), and the GGUF block
layouts Q8_0 (also what `int8`, the served default, quantizes float weights into) and Q4_1 (`gguf`). Each activation row is quantized on its own to
int8 in blocks of 32 (as llama.cpp does), the block dot products are exact int32 and the float
part runs in a fixed order, so a row's output bits are the same alone or among 64 rows, on any
path (the AVX2, AVX-512 VNNI and AMX paths equal the plain C reference bit for bit).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import Tensor

from specdec.engine import kernels
from specdec.errors import ConfigError

QBLOCK = 32  # activation (and GGUF weight) block: inputs per scale
TILE_N = 16  # output columns per packed tile


class Format:
    ROW, Q8_0, Q4_1 = 0, 1, 2


class ISA:
    REFERENCE, AVX2, AVX512_VNNI, AMX = 0, 1, 2, 3
    NAMES = {0: "reference", 1: "avx2", 2: "avx512_vnni", 3: "amx"}


# Caps the path (reference, avx2, avx512_vnni, amx): what a CPU without AMX or VNNI would run,
# measured on one that has them (the same bits on every path; only the speed differs).
PATH_ENV = "SPECDEC_INT8_PATH"


def best_isa() -> int:
    """The fastest path this CPU runs (picked by the library from the CPU's flags), or the one
    SPECDEC_INT8_PATH names."""
    forced = os.environ.get(PATH_ENV)
    if forced:
        isa = {name: isa for isa, name in ISA.NAMES.items()}.get(forced)
        if isa is None or not isa_supported(isa):
            raise ConfigError(PATH_ENV, f"{forced!r} is not a path this CPU runs (one of "
                                        f"{', '.join(n for i, n in ISA.NAMES.items() if isa_supported(i))})")
        return isa
    return int(kernels.native().int8_best_isa())


def isa_supported(isa: int) -> bool:
    return bool(kernels.native().int8_isa_supported(isa))


def _tiled(per_column: Tensor, n: int) -> Tensor:
    """[N, G] float -> [tiles, G, 16] (the kernels' per-block scale layout), zero-padded columns."""
    tiles = -(-n // TILE_N)
    padded = torch.zeros(tiles * TILE_N, per_column.shape[1], dtype=torch.float32)
    padded[:n] = per_column.float()
    return padded.view(tiles, TILE_N, -1).transpose(1, 2).contiguous()


@dataclass(frozen=True)
class PackedInt8:
    """One layer's weight in the kernels' layout, for one ISA path (its byte bias differs)."""

    format: int
    out_features: int
    in_features: int
    isa: int
    packed: Tensor  # uint8 [tiles, K / 4, 16, 4]; Q4_1 [tiles, K / 8, 16, 4] (nibbles)
    column_scale: Tensor | None  # ROW: float32 [tiles * 16]
    block_scale: Tensor | None  # Q8_0, Q4_1: float32 [tiles, K / 32, 16]
    block_offset: Tensor | None  # Q4_1: float32 [tiles, K / 32, 16]

    @classmethod
    def pack(cls, codes: Tensor, fmt: int, column_scale: Tensor | None = None, block_scale: Tensor | None = None,
             block_offset: Tensor | None = None, isa: int | None = None) -> "PackedInt8":
        """codes [N, K]: int8 (ROW, Q8_0) or 0..15 (Q4_1); column_scale [N]; block_scale,
        block_offset [N, K / 32] (w = block_scale * code + block_offset for Q4_1)."""
        n, k = codes.shape
        if k % QBLOCK:
            raise ValueError(f"int8 kernels take inputs in blocks of {QBLOCK}; this layer has {k}")
        isa = best_isa() if isa is None else isa
        if not isa_supported(isa):
            raise ValueError(f"this CPU does not run the {ISA.NAMES.get(isa, isa)} path")
        tiles = -(-n // TILE_N)
        codes8 = codes.to(torch.int8).contiguous()
        quads = k // 8 if fmt == Format.Q4_1 else k // 4  # Q4_1: two codes a byte, as the file holds them
        packed = torch.empty(tiles, quads, TILE_N, 4, dtype=torch.uint8)
        if kernels.native().int8_pack(codes8.data_ptr(), n, k, fmt, isa, packed.data_ptr()) != 0:
            raise ValueError(f"int8_pack refused a [{n}, {k}] weight")
        if fmt == Format.ROW:
            scale = torch.zeros(tiles * TILE_N, dtype=torch.float32)
            scale[:n] = column_scale.float()
            return cls(fmt, n, k, isa, packed, scale, None, None)
        offset = _tiled(block_offset, n) if fmt == Format.Q4_1 else None
        return cls(fmt, n, k, isa, packed, None, _tiled(block_scale, n), offset)

    def tensors(self) -> dict[str, Tensor]:
        """The tensors to keep as a module's buffers (QuantizedLinear)."""
        return {name: t for name in ("packed", "column_scale", "block_scale", "block_offset")
                if (t := getattr(self, name)) is not None}


def _ptr(t: Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def int8_linear(x: Tensor, weight: PackedInt8, threads: int | None = None) -> Tensor:
    """x [..., K] float32 -> [..., N] float32."""
    k, n = weight.in_features, weight.out_features
    rows = x.reshape(-1, k)
    if rows.dtype != torch.float32:
        rows = rows.float()
    if not rows.is_contiguous():
        rows = rows.contiguous()
    out = torch.empty(rows.shape[0], n, dtype=torch.float32)
    status = kernels.native().int8_linear(
        weight.isa, weight.format, weight.packed.data_ptr(), n, k, _ptr(weight.column_scale), _ptr(weight.block_scale),
        _ptr(weight.block_offset), rows.data_ptr(), rows.shape[0], k, out.data_ptr(), n, threads or torch.get_num_threads())
    if status != 0:
        raise RuntimeError(f"int8_linear failed ({status})")
    return out.view(*x.shape[:-1], n)
