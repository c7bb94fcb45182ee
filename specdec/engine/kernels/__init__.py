"""Engine kernels PyTorch does not have, compiled when the project is installed.

Why: greedy speculation equals the baseline only if a token's logits do not depend on how it
was computed (decoded alone, verified among draft tokens and other sequences). PyTorch's SDPA
and matmuls are not invariant in that sense (their reduction order depends on the number of
query rows and columns; measured 1e-7 to 8e-6 on the same row), and with quantized weights such
differences grow into greedy flips: 38 of 48 prompts identical before the attention kernel. Here:

- `invariant_attention` (invariant_attention.c): each query row in a fixed order.
- `int8_linear` (int8.py, int8_linear*.c): weight-only int8 linear layers whose cost is flat in
  rows at verification sizes and whose rows are bitwise independent of each other.
- `rms_norm` (rms_norm.c): RMSNorm, optionally after the residual add, in one pass per row.
- `rope_and_cache` (rope_cache.c), `silu_mul` (silu_mul.c), `head_norms` (rms_norm.c): RoPE with the KV
  cache write, the gated MLP's activation (SiLU, or Gemma's GELU), and the per-head query/key norms, each one pass (fixed_math.h: an exponential with the same bits on every
  build).

With both, a quantized target's whole forward is row-invariant and greedy speculation equals the
baseline by construction (tests/engine/test_invariant_attention.py, test_int8_kernels.py).

One shared library holds them all: setup.py builds it (`make setup`, `pip install`) as
specdec/engine/kernels/_native*.so, with one file per ISA family and the path picked once, at
load, from what the CPU reports (ggml's habit). Nothing is compiled at run time. A missing
library is never silent: `unavailable_reason()` says why, and a quantized weight format refuses
to load naming `weight_format` (engine/models/quantized.py).
"""
from __future__ import annotations

import ctypes
import importlib.machinery
import os
import threading
from pathlib import Path

import torch
from torch import Tensor

HERE = Path(__file__).parent
LIBRARY_NAME = "_native"  # setup.py's Extension specdec.engine.kernels._native
LIBRARY_ENV = "SPECDEC_KERNELS_LIBRARY"  # another build of the library, or "none" to run without one (tests)

_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_failure: str | None = None

_long, _ptr, _int, _float = ctypes.c_long, ctypes.c_void_p, ctypes.c_int, ctypes.c_float
_SIGNATURES = {
    "invariant_attention": (_int, [_ptr] + [_long] * 3 + [_ptr] * 2 + [_long] * 3 + [_ptr] * 2 + [_long] * 2 + [_ptr]
                            + [_long] * 6 + [_float, _int]),
    "rope_and_cache": (_int, [_ptr, _long, _long, _long, _long, _ptr, _ptr, _ptr, _ptr, _ptr, _long, _long, _long, _ptr,
                              _ptr, _int]),
    "silu_mul": (_int, [_ptr, _ptr, _long, _long, _int, _int]),
    "head_norms": (_int, [_ptr, _long, _long, _long, _long, _ptr, _ptr, _float, _int]),
    "int8_linear": (_int, [_int, _int, _ptr, _long, _long, _ptr, _ptr, _ptr, _ptr, _long, _long, _ptr, _long, _int]),
    "int8_pack": (_int, [_ptr, _long, _long, _int, _int, _ptr]),
    "int8_isa_supported": (_int, [_int]),
    "int8_best_isa": (_int, []),
    "rms_norm_rows": (_int, [_ptr, _ptr, _ptr, _ptr, _long, _long, _float, _int]),
    "int8_quantize_row": (_int, [_int, _ptr, _long, _ptr, _ptr, _ptr, _ptr]),
    "forward_plan_run": (_int, [_ptr, _ptr, _int]),  # engine/models/native_forward.py
    "forward_plan_free": (None, [_ptr]),
}


def library_path() -> Path | None:
    """The built library: $SPECDEC_KERNELS_LIBRARY, else the one setup.py put beside this file."""
    override = os.environ.get(LIBRARY_ENV)
    if override:
        return None if override == "none" else Path(override)
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        candidate = HERE / f"{LIBRARY_NAME}{suffix}"
        if candidate.is_file():
            return candidate
    return None


def _load() -> ctypes.CDLL | None:
    global _library, _failure
    with _lock:
        if _library is None and _failure is None:
            path = library_path()
            if path is None:
                _failure = ("the kernel library is not built (specdec/engine/kernels/_native*.so): "
                            "run `make setup` or `pip install .`, which compile it")
                return None
            try:
                library = ctypes.CDLL(str(path))
                for name, (restype, argtypes) in _SIGNATURES.items():
                    fn = getattr(library, name)
                    fn.restype, fn.argtypes = restype, argtypes
                _library = library
            except (OSError, AttributeError) as exc:
                _failure = f"the kernel library {path} does not load: {exc}"
    return _library


def native() -> ctypes.CDLL:
    """The loaded library, or RuntimeError saying why there is none."""
    library = _library or _load()
    if library is None:
        raise RuntimeError(f"specdec kernels unavailable: {_failure}")
    return library


def available() -> bool:
    """Whether the kernel library is built and loads."""
    return _load() is not None


def unavailable_reason() -> str | None:
    _load()
    return _failure


def reset() -> None:
    """Forget the loaded library (tests that point LIBRARY_ENV elsewhere)."""
    global _library, _failure
    with _lock:
        _library, _failure = None, None


def invariant_attention(q: Tensor, k: Tensor, v: Tensor, allowed: Tensor, slots: Tensor | None = None,
                        columns: int | None = None) -> Tensor:
    """softmax(q k^T / sqrt(D)) v over the allowed columns, each row in a fixed order.

    q [B, H, N, D]; k, v [S, KVH, C, D] (the KV cache's layer itself, or views of it: only the
    last dimension must be contiguous, and k and v strided alike); row b reads k[slots[b]]
    (slots: int64 [B]) or, without slots, k[b]; columns: how many of the C columns to read
    (default all). allowed [B, N, C'] bool with C' >= columns (columns past them are never read).
    Returns float32 [B, H, N, D]: a view of a contiguous [B, N, H, D] (the output projection's layout)."""
    library = native()
    B, H, N, D = q.shape
    KVH = k.shape[1]
    C = k.shape[2] if columns is None else columns
    if q.dtype != torch.float32 or k.dtype != torch.float32 or v.dtype != torch.float32:
        raise TypeError("invariant_attention runs in float32")
    if q.stride(-1) != 1 or k.stride(-1) != 1 or k.stride() != v.stride():
        raise ValueError("q, k, v need a contiguous last dimension, and k and v the same strides")
    if slots is not None and (slots.dtype != torch.int64 or not slots.is_contiguous() or slots.numel() != B):
        raise ValueError("slots: int64 [B], contiguous")
    mask = allowed[..., :C]
    if mask.stride(-1) != 1:
        mask = mask.contiguous()
    out = torch.empty(B, N, H, D, dtype=torch.float32)
    status = library.invariant_attention(
        q.data_ptr(), q.stride(0), q.stride(1), q.stride(2),
        k.data_ptr(), v.data_ptr(), k.stride(0), k.stride(1), k.stride(2),
        None if slots is None else slots.data_ptr(), mask.data_ptr(), mask.stride(0), mask.stride(1),
        out.data_ptr(), B, H, KVH, N, C, D, D ** -0.5, torch.get_num_threads())
    if status != 0:
        raise RuntimeError(f"invariant_attention failed ({status})")
    return out.transpose(1, 2)


def rope_and_cache(qkv: Tensor, cos: Tensor, sin: Tensor, heads: int, kv_heads: int, k_cache: Tensor, v_cache: Tensor,
                   slot: Tensor, column: Tensor) -> Tensor:
    """RoPE on the queries and keys of qkv [T, (heads + 2 kv_heads) D] (cos, sin [T, D], sin's first
    half negated), each row's key and value written to the cache layer ([slots, kv_heads, capacity,
    D]) at slot[t], column column[t] (int64 [T]). Returns the rotated queries [T, heads * D]."""
    T = qkv.shape[0]
    D = qkv.shape[1] // (heads + 2 * kv_heads)
    for name, t in (("qkv", qkv), ("cos", cos), ("sin", sin)):
        if t.dtype != torch.float32 or not t.is_contiguous():
            raise TypeError(f"rope_and_cache: {name} must be contiguous float32")
    if k_cache.dtype != torch.float32 or k_cache.stride(-1) != 1 or k_cache.stride() != v_cache.stride():
        raise TypeError("rope_and_cache: the cache must be float32, its last dimension contiguous, k and v alike")
    q = torch.empty(T, heads * D, dtype=torch.float32)
    status = native().rope_and_cache(qkv.data_ptr(), T, heads, kv_heads, D, cos.data_ptr(), sin.data_ptr(), q.data_ptr(),
                                     k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(0), k_cache.stride(1),
                                     k_cache.stride(2), slot.data_ptr(), column.data_ptr(), torch.get_num_threads())
    if status != 0:
        raise RuntimeError(f"rope_and_cache failed ({status})")
    return q


def head_norms(qkv: Tensor, heads: int, kv_heads: int, q_norm: Tensor, k_norm: Tensor, eps: float) -> Tensor:
    """Qwen3's and Gemma 3's per-head RMSNorm of the queries and keys of qkv [T, (heads + 2 kv_heads) D]
    (contiguous float32), in place, before RoPE. Returns qkv."""
    if qkv.dtype != torch.float32 or not qkv.is_contiguous() or q_norm.dtype != torch.float32 or k_norm.dtype != torch.float32:
        raise TypeError("head_norms takes contiguous float32 rows and float32 weights")
    D = q_norm.shape[0]
    T = qkv.numel() // ((heads + 2 * kv_heads) * D)
    native().head_norms(qkv.data_ptr(), T, heads, kv_heads, D, q_norm.data_ptr(), k_norm.data_ptr(), eps,
                        torch.get_num_threads())
    return qkv


def silu_mul(gate_up: Tensor, gelu: bool = False) -> Tensor:
    """silu(gate) * up for gate_up [..., 2 I] (gate first, as the fused projection stores them);
    gelu: Gemma's tanh-GELU gate (fixed_math.h) instead of SiLU."""
    if gate_up.dtype != torch.float32 or not gate_up.is_contiguous():
        raise TypeError("silu_mul takes contiguous float32")
    I = gate_up.shape[-1] // 2
    out = torch.empty(*gate_up.shape[:-1], I, dtype=torch.float32)
    native().silu_mul(gate_up.data_ptr(), out.data_ptr(), gate_up.numel() // (2 * I), I, int(gelu), torch.get_num_threads())
    return out


def rms_norm(x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None) -> Tensor:
    """RMSNorm of each row of x [..., n] (float32, contiguous). With residual: x += residual first,
    in place (x is the residual stream), and the norm is of the sum. Returns a new tensor."""
    if x.dtype != torch.float32 or not x.is_contiguous() or weight.dtype != torch.float32:
        raise TypeError("rms_norm takes contiguous float32 rows and a float32 weight")
    if residual is not None and (residual.dtype != torch.float32 or residual.shape != x.shape):
        raise TypeError("the residual must be float32 and shaped like x")
    if residual is not None and not residual.is_contiguous():
        residual = residual.contiguous()
    n = x.shape[-1]
    out = torch.empty_like(x)
    native().rms_norm_rows(x.data_ptr(), None if residual is None else residual.data_ptr(), weight.data_ptr(),
                           out.data_ptr(), x.numel() // n, n, eps, torch.get_num_threads())
    return out
