"""Probe (issue 37, not dispatched): the greedy token of a decode step in one Triton launch instead of six
torch ones.

After a decode step's graph, `executor.sampling.sample_async` takes an all-greedy batch's tokens as
    top, out = logits.max(-1); finite = isfinite(top) & isfinite(logits.amin(-1)); where(finite, out, -1)
six launches, each a few µs on the device with the host's launch gaps between them: ~25 µs a step in
Session 31's profile of a Kimi step (163,840 fp32 logits), 1.3 % of an FP8 step at batch 1. Here one
launch, grid (row, block of V): each program finds its block's first maximum and whether the block holds a
non-finite logit, writes them to a scratch row, and the row's last program to finish (an acq_rel atomic
counter, reset by that program for the next call) reduces the blocks: the first maximum of the row, or
-1 where any logit is NaN / inf -- what sample_async returns. Batches with a sampled row keep
sample_async.

    sys.path.insert(0, "bench/ops/variants"); import greedy_one_launch; greedy_one_launch.install()
    bench/e2e/fp8_decode.py --forms "none;greedy_one_launch"
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernelgate import alloc
from kernelgate.executor import model_runner, sampling

BLOCK = 8192                              # logits a program reads
_ORIGINAL = model_runner.sample_async
_COUNTERS: dict = {}                      # device -> int32 counters, one per row, zero between calls


@triton.jit
def _greedy_kernel(x_ptr, out_ptr, part_max, part_idx, part_bad, count_ptr, V, sx, NB: tl.constexpr,
                   NBP: tl.constexpr, BLOCK: tl.constexpr):
    n = tl.program_id(0)
    b = tl.program_id(1)
    offs = b * BLOCK + tl.arange(0, BLOCK)
    ok = offs < V
    x = tl.load(x_ptr + n.to(tl.int64) * sx + offs, mask=ok, other=float("-inf"))
    bad = tl.max(((x != x) | (tl.abs(x) == float("inf"))) & ok, 0)     # NaN or +-inf in the block
    m = tl.max(x, 0)
    i = tl.min(tl.where(x == m, offs, 2147483647), 0)                  # the first maximum of the block
    tl.store(part_max + n * NB + b, m)
    tl.store(part_idx + n * NB + b, i)
    tl.store(part_bad + n * NB + b, bad.to(tl.int32))
    done = tl.atomic_add(count_ptr + n, 1)                              # acq_rel: the stores above first
    if done == NB - 1:                                                  # the row's last program
        j = tl.arange(0, NBP)
        jm = j < NB
        pm = tl.load(part_max + n * NB + j, mask=jm, other=float("-inf"))
        pi = tl.load(part_idx + n * NB + j, mask=jm, other=2147483647)
        pb = tl.load(part_bad + n * NB + j, mask=jm, other=0)
        best = tl.max(pm, 0)
        tok = tl.min(tl.where(pm == best, pi, 2147483647), 0)            # blocks in order: the first wins
        tok = tl.where(tl.max(pb, 0) > 0, -1, tok)
        tl.store(out_ptr + n, tok.to(tl.int64))
        tl.store(count_ptr + n, 0)


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """logits [N, V] fp32 -> N int64 token ids: each row's first maximum, -1 where a logit is not finite."""
    N, V = logits.shape
    NB = triton.cdiv(V, BLOCK)
    dev = logits.device
    counters = _COUNTERS.get(dev)
    if counters is None or counters.numel() < N:
        counters = _COUNTERS[dev] = torch.zeros(max(N, 64), dtype=torch.int32, device=dev)
    out = alloc.empty((N,), torch.int64, dev)
    pm = alloc.empty((N, NB), torch.float32, dev)
    pi = alloc.empty((N, NB), torch.int32, dev)
    pb = alloc.empty((N, NB), torch.int32, dev)
    _greedy_kernel[(N, NB)](logits, out, pm, pi, pb, counters, V, logits.stride(0), NB=NB,
                            NBP=triton.next_power_of_2(NB), BLOCK=BLOCK, num_warps=8)
    return out


def sample_async(logits, params, generators):
    """sampling.sample_async, with an all-greedy batch of fp32 rows through greedy_tokens."""
    if logits.dtype != torch.float32 or logits.stride(-1) != 1 or not all(p.greedy for p in params) \
            or logits.shape[0] == 0:
        return sampling.sample_async(logits, params, generators)
    return greedy_tokens(logits)


def install() -> str:
    model_runner.sample_async = sample_async
    return "greedy_one_launch: an all-greedy step's tokens in one Triton launch (first maximum, -1 if not finite)"


def uninstall() -> None:
    model_runner.sample_async = _ORIGINAL
