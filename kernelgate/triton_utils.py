"""Helpers for portable Triton kernels (CUDA, ROCm, XPU, and CPU under TRITON_INTERPRET=1)."""
from __future__ import annotations

import torch

from . import platform
from .platform import interpreting


def nvidia(device: torch.device | None = None) -> bool:
    """Dispatch decides for compiled Triton on an NVIDIA GPU (platform "cuda", not the interpreter).
    From the platform layer, so KERNELGATE_PLATFORM / a compile target's simulation drives it."""
    return platform.current().name == "cuda" and not interpreting()


def sm() -> int:
    """The NVIDIA device's compute capability as 80, 90, ...; 0 elsewhere."""
    cap = platform.current().capability or ""
    return int(cap[3:]) if cap.startswith("sm_") else 0


def fp8_hardware() -> bool:
    """The current device converts fp8 in hardware (platform.fp8_hardware)."""
    return platform.fp8_hardware(platform.current().capability)


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
