"""Device-generic side streams (torch.Stream / torch.accelerator), never torch.cuda.

`side_stream()` returns a stream on the current accelerator, or None where the platform has
none (CPU) — callers then run serially, with the same result."""
from __future__ import annotations

import contextlib
import functools

import torch

from . import platform


@functools.cache
def _side(device_type: str):
    try:
        return torch.Stream(device=device_type)
    except Exception:  # noqa: BLE001 - no streams on this device: serial
        return None


def side_stream(device: torch.device | None = None):
    device = device or platform.default_device()
    if device.type == "cpu" or not platform.current().streams:
        return None
    return _side(device.type)


@contextlib.contextmanager
def on(stream):
    """Run the block on `stream` (after the current stream's queued work); no-op for None."""
    if stream is None:
        yield
        return
    main = torch.accelerator.current_stream(stream.device)
    stream.wait_stream(main)
    with stream:
        yield


def join(stream) -> None:
    """Make the current stream wait for the work queued on `stream` (no-op for None)."""
    if stream is not None:
        torch.accelerator.current_stream(stream.device).wait_stream(stream)
