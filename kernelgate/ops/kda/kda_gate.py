"""KDA forget gate: per-channel log-space decay from the raw gate projection.

    standard   : g = -exp(A_log[h]) * softplus(f + dt_bias)
    lower-bound: g = lb * sigmoid(exp(A_log[h]) * (f + dt_bias)),  lb in [-5, 0)

f is [T, H*K] or [T, H, K]; A_log [H]; dt_bias [H*K] (or None); output fp32 [T, H, K].
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ... import checks
from ...registry import GPU_TRITON, Case, declare

OP = "kda_gate"


def kda_gate_native(f, A_log, dt_bias, lower_bound=None):
    """KDA gate reference: fp32 [T, H, K] log-space decay."""
    H = A_log.shape[0]
    HK = f.shape[1] * (f.shape[2] if f.dim() == 3 else 1)
    x = f.float().reshape(f.shape[0], H, HK // H)            # [T, H, K] (T may be 0)
    if dt_bias is not None:
        x = x + dt_bias.float().view(H, -1)
    a = A_log.float().exp().view(H, 1)                       # [H, 1]
    if lower_bound is None:
        return -a * F.softplus(x)
    return lower_bound * torch.sigmoid(a * x)


def validate(f, A_log, dt_bias, lower_bound=None):
    checks.tensor(OP, "f", f, ndim=(2, 3), dtype=checks.FLOATS)
    checks.tensor(OP, "A_log", A_log, ndim=1, dtype=checks.FLOATS, device=f.device)
    H = A_log.shape[0]
    HK = f.shape[1] * (f.shape[2] if f.dim() == 3 else 1)
    if f.dim() == 3:
        checks.require(f.shape[1] == H, OP, f"f has {f.shape[1]} heads, A_log has {H}")
    checks.require(H > 0 and HK % H == 0, OP, f"f width {HK} is not a multiple of num heads {H} (A_log)")
    checks.tensor(OP, "dt_bias", dt_bias, shape=(HK,), dtype=checks.FLOATS, device=f.device, optional=True)
    checks.require(lower_bound is None or (isinstance(lower_bound, (int, float)) and -5.0 <= lower_bound < 0.0),
                   OP, f"lower_bound {lower_bound!r} not None or a number in [-5, 0)")


def _case(T, H, K, lb=None, flat=True, bias=True):
    def make(device, dtype, gen):
        f = (2 * torch.randn(T, H * K, generator=gen)).to(device=device, dtype=dtype)
        if not flat:
            f = f.view(T, H, K)
        A_log = torch.randn(H, generator=gen).to(device)
        dt_bias = torch.randn(H * K, generator=gen).to(device) if bias else None
        return (f, A_log, dt_bias), dict(lower_bound=lb)
    parts = [f"T{T}-H{H}-K{K}", "flat" if flat else "3d", f"lb{lb}" if lb is not None else "softplus",
             "" if bias else "nobias"]
    return Case("-".join(p for p in parts if p), make)


def cases():
    return [_case(1, 2, 16), _case(0, 2, 16), _case(63, 3, 60, flat=False), _case(65, 4, 32, lb=-5.0),
            _case(17, 2, 128, lb=-1.5, bias=False)]


kda_gate = declare(OP, kda_gate_native, validate=validate, cases=cases)
kda_gate.implementation(
    "triton", ".kda_gate_triton:kda_gate_triton", provider="triton", platforms=GPU_TRITON, requires=("triton",),
    priority=10, doc="one elementwise pass, fp32 math (torch's ops: four passes over an fp32 copy)")
