"""silu_and_mul_clamp against hand-computed values and HF transformers' DeepSeek V4 expert gate."""
import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from kernelgate import KernelgateError, registry
from helpers.impls import poisoned_impl
from helpers.impls import on_device

OP = "silu_and_mul_clamp"


@pytest.fixture(params=["native", "triton"])
def run(request):
    fn = poisoned_impl(OP, request.param)
    return lambda *a, **k: on_device(fn, *a, **k)


def _silu(v):
    return v / (1 + math.exp(-v))


def test_values_beyond_the_limit(run):
    L = 7.0
    gate = [-20.0, 0.0, 3.0, 100.0, 7.5]
    up = [100.0, -100.0, 0.5, 2.0, -7.5]
    x = torch.tensor([gate + up])
    # gate clamped above only (-20 stays), up clamped both ways
    want = [_silu(-20.0) * 7.0, 0.0, _silu(3.0) * 0.5, _silu(7.0) * 2.0, _silu(7.0) * -7.0]
    out = run(x, L)
    assert out.shape == (1, 5) and out.dtype == torch.float32
    torch.testing.assert_close(out, torch.tensor([want]), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("M,H,dtype", [(1, 64, torch.float32), (63, 60, torch.float32), (65, 130, torch.bfloat16)],
                         ids=["M1-H64-fp32", "M63-H60-fp32", "M65-H130-bf16"])
def test_matches_hf_deepseek_v4_gate(run, M, H, dtype):
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4Experts
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(M, 2 * H, generator=g) * 6).to(dtype)
    ref = DeepseekV4Experts._apply_gate(SimpleNamespace(limit=5.0, act_fn=F.silu), x.float()).to(dtype)
    out = run(x, 5.0)
    assert out.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert ((out.float() - ref.float()).norm() / ref.float().norm()).item() < tol


@pytest.mark.parametrize("x,limit,match", [
    (torch.randn(4, 7), 1.0, "last dim 7 must be even"),
    (torch.randn(2, 4, 8), 1.0, "x must have 2 dims"),
    (torch.randn(4, 8), 0.0, "limit must be a number > 0"),
    (torch.randint(0, 3, (4, 8)), 1.0, "x dtype int64"),
], ids=["odd", "3d", "limit", "dtype"])
def test_bad_input(x, limit, match):
    with pytest.raises(KernelgateError, match=match) as e:
        registry.get(OP)(x, limit)
    assert OP in str(e.value)
