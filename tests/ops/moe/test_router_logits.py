"""router_logits keeps the fp32 router exact for bf16 activations: every implementation against
float64 sums and a hand-computed case that a bf16 weight would get wrong."""
import pytest
import torch

from helpers.impls import on_device, poisoned_impl
from kernelgate import KernelgateError, registry

OP = "router_logits"


@pytest.fixture(params=["native", "triton", "triton_bf16x3"])
def run(request):
    fn = poisoned_impl(OP, request.param)
    return lambda *a, **k: on_device(fn, *a, **k)


def test_hand_computed_weight_below_bf16(run):
    # w[0, 0] = 1 + 2^-20 is not a bf16 value (8 significand bits): a bf16 weight gives 7, fp32 gives 7 + 2^-20
    x = torch.tensor([[1.0, 2.0]], dtype=torch.bfloat16)
    w = torch.tensor([[1.0 + 2.0 ** -20, 3.0], [-0.5, 2.0 ** -30]])
    out = run(x, w)
    assert out.dtype == torch.float32
    assert out[0, 0].item() == 7.0 + 2.0 ** -20
    assert out[0, 1].item() == torch.tensor(-0.5 + 2.0 ** -29, dtype=torch.float32).item()


@pytest.mark.parametrize("T", [1, 9, 70])
def test_fp32_accuracy_from_bf16_activations(run, T):
    g = torch.Generator().manual_seed(T)
    x = torch.randn(T, 300, generator=g).bfloat16()
    w = torch.randn(37, 300, generator=g) * 0.05
    ref = x.double() @ w.double().t()
    err = lambda y: ((y.double() - ref).abs().max() / ref.abs().max()).item()  # noqa: E731
    assert err(run(x, w)) < 1e-6
    assert err(x.float() @ w.bfloat16().float().t()) > 1e-4      # (the bound tells fp32 from a bf16 weight)


def test_bad_weight_is_one_line_naming_it():
    x = torch.randn(2, 8).bfloat16()
    with registry.checked(True), pytest.raises(KernelgateError, match=r"^router_logits: weight dtype bfloat16 not in"):
        registry.get(OP)(x, torch.randn(4, 8).bfloat16())
    with registry.checked(True), pytest.raises(KernelgateError, match=r"^router_logits: weight shape \(4, 7\) != \(\*, 8\)"):
        registry.get(OP)(x, torch.randn(4, 7))
