"""Argument checks at the engine's public edges: one clear line naming the argument; types
are checked, never coerced (a float is not a token id, "2" is not an int, True is not 1)."""
from __future__ import annotations

import math
import numbers

import torch

from ..platform import KernelgateError


def is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def require_int(where: str, name: str, x, lo: int | None = None, hi: int | None = None) -> None:
    if not is_int(x):
        raise KernelgateError(f"{where}: {name} must be an int, got {type(x).__name__} {x!r}")
    if lo is not None and x < lo:
        raise KernelgateError(f"{where}: {name} must be >= {lo}, got {x}")
    if hi is not None and x > hi:
        raise KernelgateError(f"{where}: {name} must be <= {hi}, got {x}")


def require_number(where: str, name: str, x, lo: float | None = None, hi: float | None = None,
                   lo_open: bool = False) -> None:
    if not is_number(x) or not math.isfinite(x):
        raise KernelgateError(f"{where}: {name} must be a finite number, got {x!r}")
    if lo is not None and (x <= lo if lo_open else x < lo):
        raise KernelgateError(f"{where}: {name} must be {'>' if lo_open else '>='} {lo}, got {x}")
    if hi is not None and x > hi:
        raise KernelgateError(f"{where}: {name} must be <= {hi}, got {x}")


def check_engine_args(**kw) -> None:
    w = "engine"
    for name in ("max_num_seqs", "max_model_len", "max_num_batched_tokens", "block_size"):
        require_int(w, name, kw[name], lo=1)
    require_number(w, "gpu_memory_utilization", kw["gpu_memory_utilization"], lo=0.0, hi=1.0, lo_open=True)
    if "scheduler_delay_factor" in kw:
        require_number(w, "scheduler_delay_factor", kw["scheduler_delay_factor"], lo=0.0)
    if kw["num_cache_blocks"] is not None:
        require_int(w, "num_cache_blocks", kw["num_cache_blocks"], lo=1)
    for flag in ("graphs", "async_scheduling"):
        if flag in kw and not isinstance(kw[flag], bool):
            raise KernelgateError(f"{w}: {flag} must be a bool, got {kw[flag]!r}")


def check_prompt(prompt, vocab: int, who: str) -> list:
    """Token ids (list / tuple of ints, or a 1-D integer tensor) -> list of ints in [0, vocab)."""
    if isinstance(prompt, torch.Tensor):
        if prompt.dim() != 1 or prompt.dtype.is_floating_point or prompt.dtype == torch.bool:
            raise KernelgateError(f"engine: {who}: prompt tensor must be 1-D integer, got "
                                  f"{prompt.dtype} of shape {tuple(prompt.shape)}")
        prompt = prompt.tolist()
    if not isinstance(prompt, (list, tuple)):
        raise KernelgateError(f"engine: {who}: prompt must be a list of token ids, got {type(prompt).__name__}")
    if not prompt:
        raise KernelgateError(f"engine: {who} has an empty prompt")
    if not all(type(t) is int for t in prompt):      # (the common case first: 2 us, not 150, per 128 ids)
        bad = next((t for t in prompt if not is_int(t)), None)
        if bad is not None:
            raise KernelgateError(f"engine: {who}: token ids must be ints, got {type(bad).__name__} {bad!r}")
    if min(prompt) < 0 or max(prompt) >= vocab:
        raise KernelgateError(f"engine: {who} has token ids outside [0, {vocab})")
    return [int(t) for t in prompt]
