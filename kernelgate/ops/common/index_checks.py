"""Host checks of index VALUES, for the ops' `check_values` (checked mode: KERNELGATE_CHECKS=1).

They read device data (a sync), so the registry runs them only in checked mode; with checks
off the kernels skip out-of-range rows on their own (the op docstrings say what such a row
gives). Every message names the op, the argument, the index and the bad value:
`kda_decode: slots[1] = 9 outside [0, 4) (negative = skip)`.
"""
from __future__ import annotations

import torch

from ...errors import KernelgateError


def _first(mask: torch.Tensor) -> int:
    return int(mask.nonzero()[0, 0])


def slots(op: str, name: str, slots_t: torch.Tensor, pool: int) -> None:
    """Each slot in [0, pool) or negative (skip); no slot twice in one call."""
    s = slots_t.detach().reshape(-1).cpu().long()
    bad = s >= pool
    if bool(bad.any()):
        i = _first(bad)
        raise KernelgateError(f"{op}: {name}[{i}] = {int(s[i])} outside [0, {pool}) (negative = skip)")
    live = s[s >= 0]
    if live.numel() > 1:
        uniq, counts = torch.unique(live, return_counts=True)
        if bool((counts > 1).any()):
            dup = int(uniq[_first(counts > 1)])
            idx = (s == dup).nonzero()[:, 0].tolist()
            raise KernelgateError(f"{op}: {name} holds slot {dup} at {idx} (each slot at most once per call)")


def cu_seqlens(op: str, cu: torch.Tensor, total: int, name: str = "cu_seqlens") -> None:
    """Start 0, non-decreasing, end at the token count."""
    c = cu.detach().cpu().long()
    if int(c[0]) != 0:
        raise KernelgateError(f"{op}: {name}[0] = {int(c[0])}, must be 0")
    drop = c[1:] < c[:-1]
    if bool(drop.any()):
        i = _first(drop) + 1
        raise KernelgateError(f"{op}: {name}[{i}] = {int(c[i])} < {name}[{i - 1}] = {int(c[i - 1])} "
                              "(must be non-decreasing)")
    if int(c[-1]) != total:
        raise KernelgateError(f"{op}: {name}[-1] = {int(c[-1])} != the token count {total}")


def hint(op: str, name: str, host: torch.Tensor | None, device_t: torch.Tensor) -> None:
    """A host copy (`*_cpu` hint) holds the same values as its device tensor."""
    if host is not None and not torch.equal(host.long(), device_t.detach().cpu().long()):
        raise KernelgateError(f"{op}: {name} {host.tolist()} != the device tensor's values "
                              f"{device_t.tolist()}")


def ids_below(op: str, name: str, ids: torch.Tensor, bound: int, what: str, negative_ok: bool = True) -> None:
    """Every id < bound; negative ids mean skip where `negative_ok`, else they are errors too."""
    i = ids.detach().cpu().long()
    bad = (i >= bound) if negative_ok else ((i >= bound) | (i < 0))
    if bool(bad.any()):
        pos = tuple(int(p) for p in bad.nonzero()[0])
        raise KernelgateError(f"{op}: {name}{list(pos)} = {int(i[pos])} outside [0, {bound}) ({what}"
                              + ("; negative = skip)" if negative_ok else ")"))
