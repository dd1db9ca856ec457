"""Output allocation. Under `poisoned()` fresh outputs are filled with NaN (or an integer
sentinel) so that a kernel leaving an element unwritten fails the parity tests."""
from __future__ import annotations

import contextlib

import torch

_poison = [False]


def empty(shape, dtype: torch.dtype, device) -> torch.Tensor:
    out = torch.empty(shape, dtype=dtype, device=device)
    if _poison[0]:
        if dtype.is_floating_point:
            out.fill_(float("nan"))
        elif dtype != torch.bool:
            out.fill_(torch.iinfo(dtype).min if dtype not in (torch.uint8,) else 255)
    return out


def empty_like(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    return empty(t.shape, dtype or t.dtype, t.device)


@contextlib.contextmanager
def poisoned(on: bool = True):
    saved = _poison[0]
    _poison[0] = on
    try:
        yield
    finally:
        _poison[0] = saved
