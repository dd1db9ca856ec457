"""Argument checks shared by op declarations; every message names op, argument, constraint."""
from __future__ import annotations

import torch

from .platform import KernelgateError

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
