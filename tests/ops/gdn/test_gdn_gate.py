"""gdn_gate vs fla-core's naive GDN gate and transformers' Qwen3-Next gate line."""
import pytest
import torch
import torch.nn.functional as F

from kernelgate import KernelgateError, ops
from kernelgate.tools.testing import rel_err

from gdn_refs import fla_gate
from helpers.kda_refs import call, runnable


def _inputs(T, HV, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    a = (4 * torch.randn(T, HV, generator=g)).to(dtype)
    a[0, :4] = torch.tensor([25.0, -25.0, 0.0, 19.5])    # softplus linear region and tails
    return a, torch.randn(HV, generator=g), torch.randn(HV, generator=g)


@pytest.mark.parametrize("impl", runnable("gdn_gate"))
@pytest.mark.parametrize("T,HV", [(1, 4), (63, 6), (65, 32)], ids=lambda x: str(x))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gate_vs_fla_and_hf(impl, T, HV, dtype):
    a, A_log, dt_bias = _inputs(T, HV, dtype)
    out = call("gdn_gate", impl, a, A_log, dt_bias)
    assert out.dtype == torch.float32 and out.shape == (T, HV)
    assert rel_err(out, fla_gate().naive_gdn_gate(a, A_log, dt_bias)) < 1e-6
    # Qwen3NextGatedDeltaNet.forward: g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
    assert rel_err(out, -A_log.float().exp() * F.softplus(a.float() + dt_bias)) < 1e-6
    assert (out <= 0).all()


def test_gate_rejects_bad_input():
    a, A_log, dt_bias = _inputs(4, 6, torch.float32)
    with pytest.raises(KernelgateError, match=r"^gdn_gate: dt_bias shape \(5,\) != \(6,\)$"):
        ops.gdn_gate(a, A_log, dt_bias[:5])
    with pytest.raises(KernelgateError, match=r"^gdn_gate: A_log shape \(6, 1\) != \(6,\)$"):
        ops.gdn_gate(a, A_log[:, None], dt_bias)
    with pytest.raises(KernelgateError, match=r"^gdn_gate: a must have 2 dims, got shape \(4, 6, 1\)$"):
        ops.gdn_gate(a[..., None], A_log, dt_bias)
    with pytest.raises(KernelgateError, match=r"^gdn_gate: a dtype int64 not in"):
        ops.gdn_gate(a.long(), A_log, dt_bias)
