"""Clamped SwiGLU activation of the DeepSeek V4 experts.

    silu_and_mul_clamp(x[M, 2H], limit) -> [M, H] in x's dtype
    gate = x[:, :H].clamp(max=limit); up = x[:, H:].clamp(-limit, limit); out = silu(gate) * up

fp32 math. The gate is clamped from above only (silu is bounded below anyway); the up
projection symmetrically.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ... import checks
from ...registry import GPU_TRITON, Case, declare

OP = "silu_and_mul_clamp"


def silu_and_mul_clamp_native(x, limit):
    """silu(min(gate, L)) * clamp(up, -L, L) over the two halves of the last dim; fp32 math."""
    H = x.shape[-1] // 2
    gate = x[..., :H].float().clamp(max=limit)
    up = x[..., H:].float().clamp(-limit, limit)
    return (F.silu(gate) * up).to(x.dtype)


def validate(x, limit):
    checks.tensor(OP, "x", x, ndim=2, dtype=checks.FLOATS)
    checks.require(x.shape[1] % 2 == 0, OP, f"x last dim {x.shape[1]} must be even (gate | up halves)")
    checks.require(isinstance(limit, (int, float)) and not isinstance(limit, bool) and limit > 0, OP,
                   f"limit must be a number > 0, got {limit!r}")


def _case(M, H, limit, spread=4.0):
    def make(device, dtype, gen):
        # spread > limit so that both clamps bite on a good share of the elements
        x = (spread * torch.randn(M, 2 * H, generator=gen)).to(device=device, dtype=dtype)
        return (x, limit), {}
    return Case(f"M{M}-H{H}-L{limit:g}", make)


def cases():
    return [_case(1, 64, 7.0), _case(63, 60, 2.5), _case(65, 128, 10.0, spread=8.0), _case(4, 1000, 1.0)]


def _bytes(args, kwargs):
    x = args[0]
    return x.numel() * x.element_size() * 3 // 2      # read [M, 2H], write [M, H]


def bench_cases():
    def make(M, H):
        def f(device, dtype, gen):
            return (4 * torch.randn(M, 2 * H, device=device, dtype=dtype), 7.0), {}
        return f
    return [Case(f"M{m}-H{h}", make(m, h), dtypes=(torch.bfloat16,), bytes=_bytes)
            for m, h in ((4096, 2048), (16384, 2048))]


silu_and_mul_clamp = declare(OP, silu_and_mul_clamp_native, validate=validate, cases=cases,
                             bench_cases=bench_cases)
silu_and_mul_clamp.implementation(
    "triton", ".silu_and_mul_clamp_triton:silu_and_mul_clamp_triton", provider="triton",
    platforms=GPU_TRITON, requires=("triton",), priority=10, doc="one elementwise pass, fp32 math")
