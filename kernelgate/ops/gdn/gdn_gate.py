"""GDN forget gate: one log-space decay per value head from the raw gate projection `a`.

    g = -exp(A_log[h]) * softplus(a + dt_bias[h])       (softplus linear above 20, like torch)

a [T, HV]; A_log, dt_bias [HV] (fp32 in the checkpoints; any float dtype is read as fp32);
output fp32 [T, HV]. Qwen3-Next / Qwen3.5: `-A_log.float().exp() * F.softplus(a.float() + dt_bias)`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ... import checks
from ...registry import Case, declare

OP = "gdn_gate"


def gdn_gate_native(a, A_log, dt_bias):
    """GDN gate reference: fp32 [T, HV] log-space decay."""
    return -A_log.float().exp() * F.softplus(a.float() + dt_bias.float())


def validate(a, A_log, dt_bias):
    checks.tensor(OP, "a", a, ndim=2, dtype=checks.FLOATS)
    HV = a.shape[1]
    checks.tensor(OP, "A_log", A_log, shape=(HV,), dtype=checks.FLOATS, device=a.device)
    checks.tensor(OP, "dt_bias", dt_bias, shape=(HV,), dtype=checks.FLOATS, device=a.device)


def _case(T, HV):
    def make(device, dtype, gen):
        a = (4 * torch.randn(T, HV, generator=gen)).to(device=device, dtype=dtype)
        A_log = torch.randn(HV, generator=gen).to(device)
        dt_bias = torch.randn(HV, generator=gen).to(device)
        return (a, A_log, dt_bias), {}
    return Case(f"T{T}-HV{HV}", make)


def cases():
    return [_case(1, 4), _case(0, 2), _case(65, 6)]


gdn_gate = declare(OP, gdn_gate_native, validate=validate, cases=cases)
