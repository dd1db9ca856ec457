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


def upload(host: torch.Tensor, device) -> torch.Tensor:
    """Host -> device copy that does not make the host wait for the device: through pinned
    memory, non-blocking, where the device is CUDA / ROCm (a pageable copy syncs the stream)."""
    device = torch.device(device)
    if device.type == "cpu":
        return host
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


@contextlib.contextmanager
def poisoned(on: bool = True):
    saved = _poison[0]
    _poison[0] = on
    try:
        yield
    finally:
        _poison[0] = saved
