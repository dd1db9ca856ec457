"""Helpers for portable Triton kernels (CUDA, ROCm, XPU, and CPU under TRITON_INTERPRET=1)."""
from __future__ import annotations

from .platform import current, interpreting


def compiled_needs_gpu(x, *args, **kwargs):
    """A `supports` reason for a Triton implementation whose input `x` is not on the platform's
    device: compiled Triton launches there; tensors elsewhere need TRITON_INTERPRET=1.
    (compile_targets' stand-in GPU is a platform whose device is this machine's CPU.)"""
    if x.device.type != current().device and not interpreting():
        return f"x is a {x.device.type} tensor and Triton is compiled for a GPU (set TRITON_INTERPRET=1 to interpret)"
    return None


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
