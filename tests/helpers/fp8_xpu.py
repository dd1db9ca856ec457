"""The simulated-XPU check of an FP8 model, shared by both families' FP8 tests."""
from kernelgate import platform, registry
from kernelgate.ops.common.compare import rel_err


def check_simulated_xpu_fp8(m, ids) -> None:
    """An XPU's dispatch (interpreted on CPU tensors): FP8 projections through fp8_linear's Triton
    w8a16 kernel, experts through fused_experts_fp8's Triton kernels, fp32 equal to the native ops."""
    with registry.forcing({"fp8_linear": "native", "fused_experts_fp8": "native"}):
        want = m(ids)
    others = {op: "native" for op in registry.ops() if op not in ("fp8_linear", "fused_experts_fp8")}
    registry._plan.clear()
    with platform.simulate("xpu"), registry.forcing(others):
        got = m(ids)
        plan = registry.plan()
    assert plan["fp8_linear"] == ["triton"] and set(plan["fused_experts_fp8"]) <= {"triton", "triton_gemv"}
    assert rel_err(got, want) < 1e-5
