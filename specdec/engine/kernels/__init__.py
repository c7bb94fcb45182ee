"""Engine kernels PyTorch does not have: batch-invariant attention for the CPU target.

Why: greedy speculation equals the baseline only if a token's logits do not depend on how it
was computed (decoded alone, or verified among draft tokens and other sequences). PyTorch's
SDPA and matmul are not invariant in that sense (their reduction order depends on the number of
query rows and columns; measured 1e-7 to 8e-6 on the same row), and with weights that round
their inputs to bfloat16 (the quantized formats, engine/models/quantized.py) such differences
grow into greedy flips: 38 of 48 prompts identical before this kernel. The quantized weight
kernels are row-invariant (tests/engine/test_quantized.py), so with this attention the target's
forward is invariant and identity holds by construction (tests/engine/test_invariant_attention.py).

The kernel is plain C (invariant_attention.c), compiled on first use with the machine's C
compiler into the specdec cache and called through ctypes (which releases the GIL). Built for
the x86-64-v3 level (AVX2, FMA) where the CPU has it, never `-march=native`: a cache shared
between machines must not hold code another CPU cannot run.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch
from torch import Tensor

from specdec.config import cache_root

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("invariant_attention.c")
_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_failure: str | None = None


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _compile_flags() -> list[str]:
    flags = ["-O3", "-shared", "-fPIC", "-fopenmp", "-std=c11"]
    if platform.machine() in ("x86_64", "AMD64") and {"avx2", "fma"} <= _cpu_flags():
        flags += ["-mavx2", "-mfma"]
    return flags


def _cache_dir() -> Path:
    return cache_root() / "kernels"


def build() -> Path:
    """Compile the kernel into the cache (once per source and flags); its path."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler (cc or gcc) on PATH")
    flags = _compile_flags()
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join([compiler, *flags, platform.machine()]).encode()).hexdigest()[:16]
    target = _cache_dir() / f"invariant_attention-{key}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:  # several stubs may build at once: build apart, rename
        built = Path(tmp) / target.name
        result = subprocess.run([compiler, *flags, str(SOURCE), "-o", str(built), "-lm"], capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"{compiler} failed on {SOURCE.name}: {result.stderr.strip()[-800:]}")
        os.replace(built, target)
    return target


def _load() -> ctypes.CDLL | None:
    global _library, _failure
    with _lock:
        if _library is None and _failure is None:
            try:
                library = ctypes.CDLL(str(build()))
                fn = library.invariant_attention
                fn.restype = ctypes.c_int
                fn.argtypes = ([ctypes.c_void_p] + [ctypes.c_long] * 3 + [ctypes.c_void_p] * 2 + [ctypes.c_long] * 3
                               + [ctypes.c_void_p] + [ctypes.c_long] * 2 + [ctypes.c_void_p] + [ctypes.c_long] * 6
                               + [ctypes.c_float, ctypes.c_int])
                _library = library
            except (OSError, RuntimeError) as exc:
                _failure = str(exc)
                log.warning("batch-invariant attention unavailable: %s", exc)
    return _library


def available() -> bool:
    """Whether the kernel is built and loaded (building it on first call)."""
    return _load() is not None


def unavailable_reason() -> str | None:
    _load()
    return _failure


def invariant_attention(q: Tensor, k: Tensor, v: Tensor, allowed: Tensor) -> Tensor:
    """softmax(q k^T / sqrt(D)) v over the allowed columns, each row in a fixed order.

    q [B, H, N, D]; k, v [B, KVH, C, D] (views of the cache are fine: only the last dimension
    must be contiguous, and k and v strided alike); allowed [B, N, C'] bool with C' >= C (columns
    past C are never read). Returns a contiguous float32 [B, H, N, D]."""
    library = _library or _load()  # loaded once; every layer of every forward calls here
    if library is None:
        raise RuntimeError(f"batch-invariant attention unavailable: {_failure}")
    B, H, N, D = q.shape
    KVH, C = k.shape[1], k.shape[2]
    if q.dtype != torch.float32 or k.dtype != torch.float32 or v.dtype != torch.float32:
        raise TypeError("invariant_attention runs in float32")
    if q.stride(-1) != 1 or k.stride(-1) != 1 or k.stride() != v.stride():
        raise ValueError("q, k, v need a contiguous last dimension, and k and v the same strides")
    mask = allowed[..., :C]
    if mask.stride(-1) != 1:
        mask = mask.contiguous()
    out = torch.empty(B, H, N, D, dtype=torch.float32)
    status = library.invariant_attention(
        q.data_ptr(), q.stride(0), q.stride(1), q.stride(2),
        k.data_ptr(), v.data_ptr(), k.stride(0), k.stride(1), k.stride(2),
        mask.data_ptr(), mask.stride(0), mask.stride(1),
        out.data_ptr(), B, H, KVH, N, C, D, D ** -0.5, torch.get_num_threads())
    if status != 0:
        raise RuntimeError(f"invariant_attention failed ({status})")
    return out
