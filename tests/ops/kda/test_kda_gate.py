"""kda_gate vs fla-core's naive gates and HF's KimiLinearForgetGate math."""
import pytest
import torch

from kernelgate import KernelgateError
from kernelgate.tools.testing import rel_err

from helpers.kda_refs import call, fla_gate, runnable


def _inputs(T, H, K, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    f = (3 * torch.randn(T, H * K, generator=g)).to(dtype)
    f[0, :4] = torch.tensor([25.0, -25.0, 0.0, 19.5])    # softplus linear region and tails
    return f, torch.randn(H, generator=g), torch.randn(H * K, generator=g)


@pytest.mark.parametrize("impl", runnable("kda_gate"))
@pytest.mark.parametrize("T,H,K", [(1, 2, 16), (63, 3, 60), (65, 4, 128)], ids=lambda x: str(x))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_standard_gate_vs_fla_and_hf(impl, T, H, K, dtype):
    f, A_log, dt_bias = _inputs(T, H, K, dtype)
    out = call("kda_gate", impl, f, A_log, dt_bias)
    assert out.dtype == torch.float32 and out.shape == (T, H, K)
    ref = fla_gate().naive_kda_gate(f.view(T, H, K), A_log, dt_bias)
    assert rel_err(out, ref) < 1e-6
    # HF KimiLinearForgetGate.forward after its projections (A_log broadcast per head)
    x = (f.float() + dt_bias).view(T, H, K)
    hf_ref = -torch.exp(A_log.view(1, H, 1)) * torch.where(x > 20.0, x, torch.log(1.0 + torch.exp(x)))
    assert rel_err(out, hf_ref) < 1e-6


@pytest.mark.parametrize("impl", runnable("kda_gate"))
@pytest.mark.parametrize("lb", [-5.0, -0.5])
def test_lower_bound_gate_vs_fla(impl, lb):
    f, A_log, dt_bias = _inputs(33, 2, 60, torch.float32, seed=1)
    out = call("kda_gate", impl, f.view(33, 2, 60), A_log, dt_bias, lower_bound=lb)
    ref = fla_gate().naive_kda_lowerbound_gate(f.view(33, 2, 60), A_log, dt_bias, lower_bound=lb)
    assert rel_err(out, ref) < 1e-6
    assert (out >= lb).all() and (out <= 0).all()


def test_gate_rejects_bad_input():
    from kernelgate import ops
    f, A_log, dt_bias = _inputs(4, 2, 16, torch.float32)
    with pytest.raises(KernelgateError, match=r"kda_gate: dt_bias shape \(31,\)"):
        ops.kda_gate(f, A_log, dt_bias[:31])
    with pytest.raises(KernelgateError, match="kda_gate: lower_bound -6.0 not None or a number in"):
        ops.kda_gate(f, A_log, dt_bias, lower_bound=-6.0)
    with pytest.raises(KernelgateError, match="kda_gate: f width 30 is not a multiple of num heads 4"):
        ops.kda_gate(f[:, :30], torch.zeros(4), None)
