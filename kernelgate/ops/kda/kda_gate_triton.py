"""Triton kernel: the KDA gate in one elementwise pass, fp32 math (kda_gate.py is the definition).

A prefill chunk's gate is [T, H*K] (Kimi: 8,192 x 4,096): torch's ops take four passes over an fp32
copy of it (upcast, + dt_bias, softplus, * -exp(A_log)); this reads f once and writes g once."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ... import alloc
from ..common.triton_math import softplus

BLOCK = 1024


@triton.jit
def _kda_gate_kernel(f, A_log, dt_bias, g, HK, K, sf0, sf1, sa, sd, lower_bound,
                     HAS_BIAS: tl.constexpr, USE_LB: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < HK
    x = tl.load(f + row * sf0 + cols * sf1, mask=m, other=0).to(tl.float32)
    if HAS_BIAS:
        x += tl.load(dt_bias + cols * sd, mask=m, other=0).to(tl.float32)
    a = tl.exp(tl.load(A_log + (cols // K) * sa, mask=m, other=0).to(tl.float32))
    if USE_LB:
        y = lower_bound * tl.sigmoid(a * x)
    else:
        y = -a * softplus(x)
    tl.store(g + row * HK + cols, y, mask=m)


def kda_gate_triton(f, A_log, dt_bias, lower_bound=None):
    T, H = f.shape[0], A_log.shape[0]
    HK = f.shape[1] * (f.shape[2] if f.dim() == 3 else 1)
    K = HK // H
    g = alloc.empty((T, H, K), torch.float32, f.device)
    if T == 0:
        return g
    f2 = f.reshape(T, HK)                     # a view where the heads are laid out together
    block = min(BLOCK, triton.next_power_of_2(HK))
    _kda_gate_kernel[(T, triton.cdiv(HK, block))](
        f2, A_log, dt_bias if dt_bias is not None else A_log, g, HK, K, *f2.stride(), A_log.stride(0),
        dt_bias.stride(0) if dt_bias is not None else 0, float(lower_bound or 0.0),
        HAS_BIAS=dt_bias is not None, USE_LB=lower_bound is not None, BLOCK=block, num_warps=4)
    return g
