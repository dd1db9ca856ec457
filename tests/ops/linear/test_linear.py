"""linear (one-token GEMV beside PyTorch's GEMM) against float64 sums, every launch form under the
interpreter; dispatch by token count per simulated GPU; the projection modules go through it; bad
inputs. Which platforms launch with programmatic dependent launch (ops/common/pdl.py)."""
import pytest
import torch

from kernelgate import KernelgateError, alloc, envs, platform, registry
from kernelgate.models.parallel import SINGLE, column, row
from kernelgate.ops.common import pdl
from kernelgate.platform import Device
from kernelgate.tools.testing import assert_close
from helpers.impls import on_device, on_platform

OP = registry.get("linear")
interpreted = pytest.mark.skipif(not platform.interpreting(), reason="runs under TRITON_INTERPRET=1 only")
H100 = Device("cuda", "sm_90", "NVIDIA H100 80GB HBM3")
PVC = Device("xpu", "pvc", "Intel(R) Data Center GPU Max 1550")


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


@interpreted
@pytest.mark.parametrize("x_rows", [False, True], ids=["x-once", "x-rows"])
@pytest.mark.parametrize("N,K,rows,width", [(37, 300, 4, 128), (64, 1100, 16, 256), (5, 64, 8, 128)],
                         ids=["partial-tiles", "long-rows", "one-step-wider-than-K"])
def test_gemv_launch_forms_match_float64(N, K, rows, width, x_rows):
    """Each launch form (activations broadcast or loaded per row; rows and K steps that do not divide
    N and K; a K step wider than K) equals the float64 product: fp32 to round-off, bf16 to its rounding."""
    fn = OP.impls["triton"].callable()
    for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 1e-2)):
        x = torch.randn(1, K, generator=_gen(1)).to(dtype)
        w = (torch.randn(N, K, generator=_gen(2)) * K ** -0.5).to(dtype)
        with alloc.poisoned():
            out = on_device(fn, x, w, ROWS=rows, WIDTH=width, num_warps=4, X_ROWS=x_rows)
        assert out.dtype == dtype and out.shape == (1, N)
        assert_close(out, (x.double() @ w.double().T).to(dtype), tol, what=f"{dtype}")


@interpreted
def test_strided_activations():
    """x as a column slice of a wider activation (stride 2 along K): the GEMV reads it through its stride."""
    wide = torch.randn(1, 400, generator=_gen(3))
    w = torch.randn(20, 200, generator=_gen(4))
    out = on_device(OP.impls["triton"].callable(), wide[:, ::2], w)
    assert_close(out, (wide[:, ::2].double() @ w.double().T).float(), 1e-6)


@interpreted
def test_dispatch_takes_the_gemv_for_one_token_only():
    with platform.simulate(H100):
        for T, want in ((1, "triton"), (2, "native"), (64, "native")):
            args = on_platform((torch.zeros(T, 64), torch.zeros(32, 64)))
            rows = {i.name: r for i, r in OP.explain(args, {})}
            assert rows[want] is None, rows
        assert "reads the weight once per token" in rows["triton"]
    with platform.simulate(PVC):
        rows = {i.name: r for i, r in OP.explain(on_platform((torch.zeros(1, 64), torch.zeros(32, 64))), {})}
        assert rows["triton"] is None, rows


def test_projection_modules_call_the_op(monkeypatch):
    """column / row projections (the models' q / o / out projections) compute x @ W.T through `linear`."""
    calls = []
    real = OP.__call__
    monkeypatch.setattr(type(OP), "__call__", lambda self, *a, **k: (calls.append(self.name), real(*a, **k))[1])
    for lin in (column(48, 32, SINGLE, "q"), row(48, 32, SINGLE, "o")):
        lin.weight.data = torch.randn(32, 48, generator=_gen(5))
        x = torch.randn(2, 3, 48, generator=_gen(6))
        y = lin(x)
        assert y.shape == (2, 3, 32)
        assert_close(y, (x.double() @ lin.weight.double().T).float(), 1e-6)
    assert calls.count("linear") == 2


@pytest.mark.parametrize("x,w,msg", [
    (torch.zeros(1, 8, dtype=torch.int32), torch.zeros(4, 8), "linear: x dtype int32"),
    (torch.zeros(8), torch.zeros(4, 8), "linear: x must have 2 dims"),
    (torch.zeros(1, 8), torch.zeros(4, 9), "linear: weight shape (4, 9) != (*, 8)"),
    (torch.zeros(1, 8), torch.zeros(4, 8, dtype=torch.bfloat16), "linear: weight dtype bfloat16"),
    (torch.zeros(1, 0), torch.zeros(4, 0), "linear: x must have K > 0 columns"),
])
def test_bad_inputs_name_the_argument(x, w, msg):
    with pytest.raises(KernelgateError, match=msg.replace("(", r"\(").replace(")", r"\)").replace("*", r"\*")):
        OP(x, w)


def test_pdl_only_on_compiled_cuda_of_capability_9(monkeypatch):
    """Programmatic dependent launch: NVIDIA sm_90 and newer, compiled; never sm_80, AMD, Intel or the
    interpreter; KERNELGATE_PDL=0 turns it off."""
    on = pdl.gdc_wait is not None
    assert pdl.enabled("cuda", "compiled", "sm_90") == on
    assert pdl.enabled("cuda", "compiled", "sm_100") == on
    for args in (("cuda", "compiled", "sm_80"), ("cuda", "interpreter", "sm_90"), ("rocm", "compiled", "gfx942"),
                 ("xpu", "compiled", "pvc"), ("cpu", None, None)):
        assert not pdl.enabled(*args), args
    monkeypatch.setenv("KERNELGATE_PDL", "0")
    assert not pdl.enabled("cuda", "compiled", "sm_90")
    monkeypatch.setenv("KERNELGATE_PDL", "maybe")
    with pytest.raises(KernelgateError, match="KERNELGATE_PDL='maybe'"):
        envs.get("KERNELGATE_PDL")


def test_pdl_args_follow_the_platform():
    with platform.simulate(Device("cuda", "sm_90", "H100"), compiling=True):
        assert pdl.pdl_args() == ({"PDL": True, "launch_pdl": True} if pdl.gdc_wait is not None else {"PDL": False})
    with platform.simulate(Device("cuda", "sm_80", "A100"), compiling=True):
        assert pdl.pdl_args() == {"PDL": False}
    with platform.simulate(Device("rocm", "gfx942", "MI300X"), compiling=True):
        assert pdl.pdl_args() == {"PDL": False}


def test_doctor_says_whether_kernels_launch_as_dependents(monkeypatch):
    from kernelgate.cli.ops import doctor_report
    with platform.simulate(Device("cuda", "sm_90", "H100"), compiling=True):
        assert pdl.line(platform.current()).startswith("launches  decode kernels as programmatic dependents") \
            or pdl.gdc_wait is None
        monkeypatch.setenv("KERNELGATE_PDL", "0")
        platform.refresh()
        assert "no PDL: KERNELGATE_PDL=0" in pdl.line(platform.current())
        monkeypatch.delenv("KERNELGATE_PDL")
        platform.refresh()
    with platform.simulate(Device("rocm", "gfx942", "MI300X"), compiling=True):
        assert "no PDL: NVIDIA sm_90 and newer" in doctor_report()["launches"]
