"""Varlen batch metadata shared by the ops that take packed sequences (KDA prefill, short conv):
index dtypes and the host copies (`*_cpu` hints) a caller that knows the layout passes."""
from __future__ import annotations

import torch

from ... import checks

INDEX = (torch.int32, torch.int64)


def validate_host_hint(op, name, hint, like):
    """A host copy of the device tensor `like`: CPU, index dtype, same shape (values unchecked)."""
    if hint is None:
        return
    checks.tensor(op, name, hint, shape=tuple(like.shape), dtype=INDEX)
    checks.require(hint.device.type == "cpu", op, f"{name} must be a CPU tensor (host copy), got {hint.device}")


def host_hints(cu_seqlens, slots):
    """The keyword hints a caller that knows the layout on the host passes (CPU copies)."""
    return dict(cu_seqlens_cpu=cu_seqlens.cpu(), slots_cpu=slots.cpu())


def seq_range(bounds: list, n: int, total: int) -> tuple[int, int] | None:
    """Rows [start, end) of sequence n, or None when its bounds are not 0 <= start <= end <= total.
    The varlen ops skip such a sequence (no output rows, no state read or written), as their
    kernels do, whatever the other entries of cu_seqlens hold."""
    s, e = bounds[n], bounds[n + 1]
    return (s, e) if 0 <= s <= e <= total else None
