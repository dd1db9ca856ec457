"""Helpers for portable Triton kernels (CUDA, ROCm, XPU, and CPU under TRITON_INTERPRET=1)."""
from __future__ import annotations

from .platform import interpreting


def autotune_or_fixed(configs, key, fixed):
    """`triton.autotune(configs, key)` on a GPU; under the interpreter (no driver, so
    autotuning fails) a decorator pinning the kernel to `fixed` (a dict of meta-params)."""
    import triton

    if interpreting():
        def pin(kernel):
            return _Pinned(kernel, fixed)
        return pin
    return triton.autotune(configs=configs, key=key)


class _Pinned:
    def __init__(self, kernel, meta):
        self.kernel, self.meta = kernel, meta

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            return self.kernel[grid](*args, **{**self.meta, **kwargs})
        return launch
