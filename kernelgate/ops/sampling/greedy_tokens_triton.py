"""Triton kernel: greedy_tokens in one launch, grid (row, block of V).

Each program finds its block's first maximum and whether the block holds a NaN / infinity, writes them to a
scratch row, and counts itself out on the row's counter (an acq_rel atomic); the row's last program reduces
the blocks in order -- the first maximum of the row, or -1 -- and resets the counter for the next call.
The counters are per device: calls on one device must not overlap (the engine samples its steps one after
another on one stream).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ... import alloc

BLOCK = 8192                    # logits a program reads
_I32_MAX = tl.constexpr(2147483647)
_COUNTERS: dict = {}            # device -> int32 counters, one per row, zero between calls


@triton.jit
def _greedy_kernel(x_ptr, out_ptr, part_max, part_idx, part_bad, count_ptr, V, sxn, sxv, NB: tl.constexpr,
                   NBP: tl.constexpr, BLOCK: tl.constexpr):
    n = tl.program_id(0)
    b = tl.program_id(1)
    offs = b * BLOCK + tl.arange(0, BLOCK)
    ok = offs < V
    x = tl.load(x_ptr + n.to(tl.int64) * sxn + offs.to(tl.int64) * sxv, mask=ok, other=float("-inf"))
    x = x.to(tl.float32)
    bad = tl.max((((x != x) | (tl.abs(x) == float("inf"))) & ok).to(tl.int32), 0)
    m = tl.max(x, 0)
    i = tl.min(tl.where(x == m, offs, _I32_MAX), 0)                   # the block's first maximum
    tl.store(part_max + n * NB + b, m)
    tl.store(part_idx + n * NB + b, i)
    tl.store(part_bad + n * NB + b, bad)
    tl.debug_barrier()                                                # every thread's stores before the count
    if tl.atomic_add(count_ptr + n, 1) == NB - 1:                     # acq_rel: the row's last program
        j = tl.arange(0, NBP)
        jm = j < NB
        pm = tl.load(part_max + n * NB + j, mask=jm, other=float("-inf"))
        pi = tl.load(part_idx + n * NB + j, mask=jm, other=_I32_MAX)
        pb = tl.load(part_bad + n * NB + j, mask=jm, other=0)
        best = tl.max(pm, 0)
        tok = tl.min(tl.where(pm == best, pi, _I32_MAX), 0)             # blocks in order: the first one wins
        tok = tl.where(tl.max(pb, 0) > 0, -1, tok)
        tl.store(out_ptr + n, tok.to(tl.int64))
        tl.store(count_ptr + n, 0)


def greedy_tokens_triton(logits):
    N, V = logits.shape
    dev = logits.device
    out = alloc.empty((N,), torch.int64, dev)
    if N == 0:
        return out
    block = min(BLOCK, triton.next_power_of_2(V))
    NB = triton.cdiv(V, block)
    counters = _COUNTERS.get(dev)
    if counters is None or counters.numel() < N:
        counters = _COUNTERS[dev] = torch.zeros(max(N, 256), dtype=torch.int32, device=dev)
    pm = alloc.empty((N, NB), torch.float32, dev)
    pi = alloc.empty((N, NB), torch.int32, dev)
    pb = alloc.empty((N, NB), torch.int32, dev)
    _greedy_kernel[(N, NB)](logits, out, pm, pi, pb, counters, V, *logits.stride(), NB=NB,
                            NBP=triton.next_power_of_2(NB), BLOCK=block, num_warps=8)
    return out
