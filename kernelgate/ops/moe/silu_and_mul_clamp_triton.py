"""Triton kernel: clamped SwiGLU, out[m, j] = silu(min(x[m, j], L)) * clamp(x[m, H + j], -L, L)."""
from __future__ import annotations

import triton
import triton.language as tl

from ... import alloc

BLOCK = 1024


@triton.jit
def _silu_mul_clamp_kernel(x_ptr, o_ptr, H, s_xm, s_xh, s_om, limit, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < H
    g = tl.load(x_ptr + row * s_xm + cols * s_xh, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * s_xm + (H + cols) * s_xh, mask=mask, other=0.0).to(tl.float32)
    g = tl.minimum(g, limit)
    u = tl.minimum(tl.maximum(u, -limit), limit)
    y = g / (1.0 + tl.exp(-g)) * u
    tl.store(o_ptr + row * s_om + cols, y.to(o_ptr.dtype.element_ty), mask=mask)


def silu_and_mul_clamp_triton(x, limit):
    M, H2 = x.shape
    H = H2 // 2
    out = alloc.empty((M, H), x.dtype, x.device)
    if M == 0 or H == 0:
        return out
    block = min(BLOCK, triton.next_power_of_2(H))
    _silu_mul_clamp_kernel[(M, triton.cdiv(H, block))](x, out, H, *x.stride(), out.stride(0), float(limit),
                                                        BLOCK=block, num_warps=4)
    return out
