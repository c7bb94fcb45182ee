"""The compiled part of the project: the engine's kernels (specdec/engine/kernels), built by
`pip install` (and so by `make setup`) into one shared library loaded through ctypes. Every
other setting lives in pyproject.toml.

Compiled for the baseline x86-64 (or the machine's own baseline elsewhere): each SIMD file
selects its ISA with a target pragma and runs only where the CPU reports it, so the same build
runs on any CPU. -ffp-contract=off: the compiler may not fuse a multiply and an add on its own,
so every path performs the reference's float operations and no others."""
from setuptools import Extension, setup

KERNELS = "specdec/engine/kernels/"

setup(ext_modules=[Extension(
    "specdec.engine.kernels._native",
    sources=[KERNELS + name for name in (
        "int8_linear.c", "int8_linear_avx2.c", "int8_linear_avx512.c", "int8_linear_amx.c",  # weight-only int8 matmuls
        "invariant_attention.c", "rms_norm.c", "rope_cache.c", "silu_mul.c",  # the rest of the invariant forward
        "forward_plan.c",  # the native forward: every layer in one call, on the kernels above
    )],
    depends=[KERNELS + name for name in ("int8_linear.h", "fixed_math.h", "vector_paths.h", "invariant_attention.h",
                                         "row_kernels.h")],
    extra_compile_args=["-O3", "-std=c11", "-fopenmp", "-ffp-contract=off"],
    extra_link_args=["-fopenmp"],
    libraries=["m"],
    # A machine with no C compiler still installs the rest (the GPU image need not have one): the
    # kernels are then missing, which is never silent (a quantized weight format refuses to load,
    # naming the setting; the CPU image checks them at build time).
    optional=True,
)])
