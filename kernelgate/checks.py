"""Argument checks shared by op declarations and the runtime's public edges; every message names
the op (or flag), the argument and the constraint. Types are checked, never coerced (a float is
not a token id, "2" is not an int, True is not 1)."""
from __future__ import annotations

import math
import numbers

import torch

from .errors import KernelgateError

FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def _dt(d) -> str:
    return str(d).replace("torch.", "")


def tensor(op: str, name: str, t, *, ndim=None, dtype=None, shape=None, device=None,
           optional: bool = False) -> None:
    """Check a tensor argument. `ndim` may be an int or a tuple of ints; `dtype` a dtype or
    tuple; `shape` a tuple whose None entries match anything; `device` a torch.device."""
    if t is None:
        if optional:
            return
        raise KernelgateError(f"{op}: {name} is required")
    if not isinstance(t, torch.Tensor):
        raise KernelgateError(f"{op}: {name} must be a tensor, got {type(t).__name__}")
    if ndim is not None:
        allowed = (ndim,) if isinstance(ndim, int) else tuple(ndim)
        if t.dim() not in allowed:
            raise KernelgateError(f"{op}: {name} must have {' or '.join(map(str, allowed))} dims, "
                                  f"got shape {tuple(t.shape)}")
    if dtype is not None:
        allowed = (dtype,) if isinstance(dtype, torch.dtype) else tuple(dtype)
        if t.dtype not in allowed:
            raise KernelgateError(f"{op}: {name} dtype {_dt(t.dtype)} not in "
                                  f"({', '.join(_dt(d) for d in allowed)})")
    if shape is not None:
        if len(shape) != t.dim() or any(s is not None and s != d for s, d in zip(shape, t.shape)):
            want = "(" + ", ".join("*" if s is None else str(s) for s in shape) + ("," if len(shape) == 1 else "") + ")"
            raise KernelgateError(f"{op}: {name} shape {tuple(t.shape)} != {want}")
    if device is not None and t.device != device:
        raise KernelgateError(f"{op}: {name} is on {t.device}, expected {device} (same device as the first input)")


def same_shape(op: str, name: str, t: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    if t.shape != ref.shape:
        raise KernelgateError(f"{op}: {name} shape {tuple(t.shape)} != {ref_name} shape {tuple(ref.shape)}")


def require(cond: bool, op: str, message: str) -> None:
    if not cond:
        raise KernelgateError(f"{op}: {message}")


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


def require_bool(where: str, name: str, x) -> None:
    if not isinstance(x, bool):
        raise KernelgateError(f"{where}: {name} must be a bool, got {x!r}")
