"""Where compiled kernels live between runs, so only a machine's first run compiles.

Triton keeps compiled binaries in TRITON_CACHE_DIR and, with TRITON_CACHE_AUTOTUNING=1, the
autotuner's choices beside them. kernelgate points both at one folder of its own
(KERNELGATE_CACHE_DIR, default ~/.cache/kernelgate) unless the user set them, and keeps a
marker per (device, kernelgate version, torch, triton) there once a warm-up has finished, so
`run` / `serve` / `warmup` can say whether they are compiling or only loading.
"""
from __future__ import annotations

import os
from pathlib import Path

from . import envs


def root() -> Path:
    return Path(envs.get("KERNELGATE_CACHE_DIR") or Path.home() / ".cache" / "kernelgate")


def configure() -> None:
    """Point Triton's compile and autotune caches at kernelgate's folder (user settings win)."""
    os.environ.setdefault("TRITON_CACHE_DIR", str(root() / "triton"))
    os.environ.setdefault("TRITON_CACHE_AUTOTUNING", "1")
