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
    if device.type == "cpu" or host.device.type != "cpu":   # (already on a device: an ordinary copy, if any)
        return host.to(device)
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


# Triton specializes a kernel on whether each pointer is 16-byte aligned: index arrays packed into
# one upload must each start on a 16-byte boundary, or a batch of another size (another offset)
# builds another kernel in the middle of serving (serving/late_compiles.py found two).
ALIGN = 16


def _offsets(sizes: list, itemsize: int) -> tuple[list, int]:
    step = max(1, ALIGN // itemsize)
    offs, at = [], 0
    for n in sizes:
        offs.append(at)
        at += -(-n // step) * step
    return offs, at


def pack(parts: list) -> torch.Tensor:
    """1-D host tensors of one dtype in one buffer, each starting on a 16-byte boundary (zeros between)."""
    offs, total = _offsets([p.numel() for p in parts], parts[0].element_size())
    out = torch.zeros(total, dtype=parts[0].dtype)
    for o, p in zip(offs, parts):
        out[o:o + p.numel()] = p
    return out


def unpack(buf: torch.Tensor, sizes: list) -> list:
    """The parts of a `pack`ed buffer (on any device), as views of it."""
    offs, _ = _offsets(sizes, buf.element_size())
    return [buf[o:o + n] for o, n in zip(offs, sizes)]


def packed_size(sizes: list, itemsize: int) -> int:
    return _offsets(sizes, itemsize)[1]


def upload_parts(parts: list, device) -> list:
    """`upload` of several 1-D host tensors in one copy: device views, each 16-byte aligned."""
    return unpack(upload(pack(parts), device), [p.numel() for p in parts])


class Download:
    """A device tensor's values on their way to the host. The copy is queued now (pinned memory,
    non-blocking, CUDA / ROCm) behind the work that produces it, and an event marks its end;
    `tolist()` waits for that event only. A plain `tensor.tolist()` would also wait for all the
    work queued after it on the stream -- the next engine step, launched before this one is read.
    Elsewhere the copy is made at once (the device has no pinned memory path here)."""

    def __init__(self, t: torch.Tensor):
        self.event = None
        if t.device.type == "cuda":
            self.host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            self.host.copy_(t, non_blocking=True)
            self.event = torch.Event(device=t.device)
            self.event.record()
        else:
            self.host = t.to("cpu")

    def tolist(self) -> list:
        if self.event is not None:
            self.event.synchronize()
        return self.host.tolist()


@contextlib.contextmanager
def poisoned(on: bool = True):
    saved = _poison[0]
    _poison[0] = on
    try:
        yield
    finally:
        _poison[0] = saved
