"""fp8_linear against x @ dequantize(W).T, every implementation that runs here (Triton under
TRITON_INTERPRET=1); every e4m3 code through each decode mode; the w8a8 form against its own
reference (activations quantized per group); dispatch per simulated GPU; bad inputs."""
import pytest
import torch

from kernelgate import KernelgateError, alloc, platform, registry
from kernelgate.ops.quant import dequantize_fp8, quantize_fp8_block, quantize_fp8_channel, quantize_fp8_groups
from kernelgate.platform import Device
from kernelgate.tools.testing import assert_close
from helpers.impls import on_device, on_platform

OP = registry.get("fp8_linear")
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 5e-3}
triton_here = pytest.mark.skipif(platform.current().triton is not None,
                                 reason="Triton cannot run here (set TRITON_INTERPRET=1 on CPU)")
# CPU tensors through Triton's interpreter, which also stands in for GPUs this machine does not have
# (each GPU's decode mode): on a GPU the generated parity suite checks the real device.
interpreted = pytest.mark.skipif(not platform.interpreting(), reason="runs under TRITON_INTERPRET=1 only")
H100 = Device("cuda", "sm_90", "NVIDIA H100 80GB HBM3")
A100 = Device("cuda", "sm_80", "NVIDIA A100-SXM4-80GB")
MI300 = Device("rocm", "gfx942", "AMD Instinct MI300X")
MI250 = Device("rocm", "gfx90a", "AMD Instinct MI250X")
PVC = Device("xpu", "pvc", "Intel(R) Data Center GPU Max 1550")


@pytest.fixture(autouse=True)
def _poisoned():
    """Kernel outputs start as NaN: an element a kernel leaves unwritten fails the comparison."""
    with alloc.poisoned():
        yield


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _weights(N, K, block, seed=0):
    w = torch.randn(N, K, generator=_gen(seed)) * K ** -0.5 * (0.5 * torch.randn(1, K, generator=_gen(seed + 1))).exp()
    return quantize_fp8_channel(w) if block is None else quantize_fp8_block(w, block)


def _impl(name, **config):
    fn = OP.impls[name].callable()
    return lambda *a, **kw: on_device(fn, *a, **kw, **config)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("T,N,K,block", [(1, 150, 200, (128, 128)), (65, 150, 200, (128, 128)),
                                         (8, 60, 63, None), (9, 64, 130, (64, 32))],
                         ids=["T1-N150-K200-b128", "T65-N150-K200-b128", "T8-N60-K63-channel", "T9-N64-K130-b64x32"])
def test_matches_linear_on_dequantized_weights(T, N, K, block, dtype, device):
    wq, s = _weights(N, K, block)
    x = torch.randn(T, K, generator=_gen(9)).to(dtype)
    want = torch.nn.functional.linear(x.double(), dequantize_fp8(wq, s, block).double()).to(dtype)
    x, wq, s = x.to(device), wq.to(device), s.to(device)
    for name, impl in OP.impls.items():
        if name == "triton_w8a8" or impl.unavailable(platform.current()) or dtype not in (impl.dtypes or {dtype}):
            continue
        assert_close(impl.callable()(x, wq, s, block_size=block).cpu(), want, TOL[dtype], what=name)


@interpreted
@pytest.mark.parametrize("mode", ["int", "fn", "fnuz"])
@pytest.mark.parametrize("T", [1, 40], ids=["decode", "gemm"])
def test_every_code_decodes_exactly(mode, T):
    """Weight rows hold every e4m3fn code but NaN (0x80 = -0 included); x = the identity picks each
    column out, so y is dequantize(W) exactly, whatever the decode (integer ops, fn or fnuz views)."""
    codes = torch.tensor([c for c in range(256) if c not in (0x7F, 0xFF)], dtype=torch.uint8)
    K = 40
    w = torch.cat([codes, codes[:K * 7 - codes.numel()]]).view(torch.float8_e4m3fn).reshape(7, K)
    s = torch.tensor([[0.5], [2.0], [1.0], [4.0], [0.25], [1.0], [3.0]])
    x = torch.eye(K)[:T] if T <= K else torch.eye(K)
    y = OP.impls["triton"].callable()(x, w, s, None, mode=mode)
    assert torch.equal(y, (w.float() * s)[:, :T].t()), mode


@interpreted
@pytest.mark.parametrize("device,mode", [(A100, "int"), (H100, "fn"), (MI250, "int"), (MI300, "fnuz"), (PVC, "int")],
                         ids=["sm_80", "sm_90", "gfx90a", "gfx942", "pvc"])
def test_simulated_gpus_give_the_same_bits(device, mode):
    """Each GPU's decode (integer ops on sm_80 / gfx90a / PVC, fp8 conversion on sm_90, fnuz on gfx942) is
    exact: fp32 results are bit-identical to the interpreter's integer decode, decode and GEMM launches."""
    from kernelgate.ops.quant.fp8_linear_triton import launch_config
    with platform.simulate(device):
        assert launch_config(platform.current())["mode"] == mode
    if mode == "int":
        return                                                            # the interpreter's own decode
    for T, block in ((3, (128, 128)), (20, (128, 128)), (5, None)):
        wq, s = _weights(150, 200, block, seed=T)
        x = torch.randn(T, 200, generator=_gen(T))
        base = OP.impls["triton"].callable()(x, wq, s, block)
        with platform.simulate(device):
            out = OP.impls["triton"].callable()(x, wq, s, block)
        assert torch.equal(out, base), (device.capability, T, block)


@interpreted
def test_decode_rows_do_not_depend_on_the_batch():
    """The split-K decode launch depends on (N, K) only: a token's row is the same bits at T = 2..8;
    the one-token GEMV gives the same row to fp32 round-off."""
    wq, s = _weights(150, 200, (128, 128))
    x = torch.randn(8, 200, generator=_gen(3))
    fn = OP.impls["triton"].callable()
    full = fn(x, wq, s)
    for T in (2, 3, 8):
        assert torch.equal(fn(x[:T], wq, s), full[:T]), T
    assert_close(fn(x[:1], wq, s), full[:1], 1e-6, what="GEMV")


# -- w8a8 ---------------------------------------------------------------------------------------
def _w8a8_reference(x, wq, s, block):
    """Activations quantized per (token, bk columns) -- per token with per-channel weights -- then fp32 math."""
    K = x.shape[1]
    group = K if block is None else block[1]
    xq, xs = quantize_fp8_groups(x, group)
    xd = dequantize_fp8(xq, xs, (1, group))
    return (xd @ dequantize_fp8(wq, s, block).t()).to(x.dtype)


@interpreted
def test_w8a8_activation_codes_match_quantize_fp8_groups():
    from kernelgate.ops.quant.fp8_linear_triton import quantize_groups
    x = torch.randn(37, 300, generator=_gen(4)).bfloat16()
    x[3] = 0                                                              # an all-zero row: floored scale
    x[5, :128] *= 1e3
    for group in (128, 300):
        q, s = quantize_groups(x, group)
        rq, rs = quantize_fp8_groups(x, group)
        assert torch.equal(s, rs), group
        assert torch.equal(q, rq.view(torch.uint8)), group


@interpreted
@pytest.mark.parametrize("mode", ["int", "fn", "fnuz"])
@pytest.mark.parametrize("T,N,K,block", [(20, 150, 200, (128, 128)), (17, 96, 160, None), (33, 72, 96, (32, 64))],
                         ids=["T20-N150-K200-b128", "T17-N96-K160-channel", "T33-N72-K96-b32x64"])
def test_w8a8_matches_its_reference(T, N, K, block, mode):
    wq, s = _weights(N, K, block, seed=2)
    x = torch.randn(T, K, generator=_gen(5)).bfloat16()
    want = _w8a8_reference(x, wq, s, block)
    assert_close(_impl("triton_w8a8", mode=mode)(x, wq, s, block), want, 1e-2, what=mode)
    # and the definition, within activation rounding (fp8_linear's declared bound for this implementation)
    assert_close(_impl("triton_w8a8", mode=mode)(x, wq, s, block), OP.reference(x, wq, s, block), 5e-2)


@triton_here
@pytest.mark.parametrize("device,T,dtype,chosen", [
    (H100, 130, torch.bfloat16, "triton_w8a8"),
    (H100, 130, torch.float32, "triton"),
    (H100, 65, torch.bfloat16, "triton"),
    (MI300, 130, torch.float16, "triton_w8a8"),
    (A100, 130, torch.bfloat16, "triton"),
    (MI250, 130, torch.bfloat16, "triton"),
    (PVC, 130, torch.bfloat16, "triton"),
], ids=["sm90-T130-bf16", "sm90-T130-fp32", "sm90-T65-bf16", "gfx942-T130-fp16", "sm80-T130-bf16",
        "gfx90a-T130-bf16", "pvc-T130-bf16"])
def test_dispatch_per_gpu(device, T, dtype, chosen):
    """w8a8 only where the GPU has fp8 matrix instructions, for 16-bit prefill; the reason says so."""
    wq, s = _weights(96, 128, (128, 128))
    x = torch.randn(T, 128, generator=_gen(6)).to(dtype)
    with platform.simulate(device):
        rows = OP.explain(on_platform((x, wq, s)), {})
        assert [i.name for i, why in rows if why is None] == [chosen]
        why = dict((i.name, r) for i, r in rows)["triton"]
        if chosen == "triton_w8a8":
            assert "fp8 matrix instructions" in why and device.capability in why


# -- bad inputs ---------------------------------------------------------------------------------
@pytest.mark.parametrize("bad,arg,needle", [
    (lambda a: {**a, "weight_scale": a["weight_scale"][:, :1]}, "weight_scale", "shape (2, 1) != (2, 2)"),
    (lambda a: {**a, "weight_scale": a["weight_scale"].bfloat16()}, "weight_scale", "dtype bfloat16"),
    (lambda a: {**a, "weight_scale": a["weight_scale"][None]}, "weight_scale", "2 dims"),
    (lambda a: {**a, "block_size": None}, "weight_scale", "per-channel"),
    (lambda a: {**a, "block_size": (128, 0)}, "block_size", "ints > 0"),
    (lambda a: {**a, "weight": a["weight"].float()}, "weight", "float8_e4m3fn"),
    (lambda a: {**a, "weight": a["weight"][:, :-1]}, "weight", "shape"),
    (lambda a: {**a, "x": a["x"].long()}, "x", "dtype"),
], ids=["scale-shape", "scale-dtype", "scale-ndim", "block-vs-scale", "block-size", "weight-dtype",
        "weight-K", "x-dtype"])
def test_bad_input_is_one_line_naming_the_argument(bad, arg, needle):
    wq, s = _weights(150, 200, (128, 128))
    good = dict(x=torch.randn(3, 200), weight=wq, weight_scale=s, block_size=(128, 128))
    with pytest.raises(KernelgateError) as e:
        OP(**bad(good))
    msg = str(e.value)
    assert msg.startswith("fp8_linear:") and arg in msg and needle in msg and "\n" not in msg, msg


@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_non_finite_scale_is_an_error_in_checked_mode(value):
    wq, s = _weights(150, 200, (128, 128))
    s[1, 0] = value
    with registry.checked(), pytest.raises(KernelgateError, match=r"fp8_linear: weight_scale\[1, 0\] = .* not finite"):
        OP(torch.randn(3, 200), wq, s)


@interpreted
@pytest.mark.parametrize("name,dtype,tol", [("triton", torch.float32, 1e-5), ("triton_w8a8", torch.bfloat16, 1e-2)])
def test_strided_views_give_the_same_result(name, dtype, tol):
    wq, s = _weights(150, 200, (128, 128))
    x = torch.randn(9, 200, generator=_gen(7)).to(dtype)
    wide = torch.empty(150, 400, dtype=torch.float8_e4m3fn)
    wide[:, ::2] = wq
    x_t = x.t().contiguous().t()                                          # column-major x
    s_t = s.t().contiguous().t()
    for T in (3, 9):
        want = _impl(name)(x[:T].contiguous(), wq, s)
        assert_close(_impl(name)(x_t[:T], wide[:, ::2], s_t), want, tol, what=f"{name} T{T}")


@interpreted
@pytest.mark.parametrize("K", [200, 256], ids=["k-tail", "k-tiled"])
@pytest.mark.parametrize("rows,block", [(8, (128, 128)), (16, (24, 32)), (16, None)],
                         ids=["uniform", "rows-straddle-blocks", "one-k-block"])
def test_gemv_launch_forms_match_the_definition(rows, block, K):
    """The one-token word GEMV (fp8_gemv_triton) with K steps that tile K or end in a masked tail, tiles
    whose rows share a scale block (rows halved to fit a 24-row block), per-column scales of 32-code blocks
    inside a step, or one K block (per-row scales at the end): fp32 equal to the definition to round-off,
    bf16 to its rounding; bf16 x read as 4-value words, fp32 x as elements."""
    wq, s = _weights(100, K, block, seed=4)
    w = dequantize_fp8(wq, s, block).double()
    for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 2e-2)):
        x = torch.randn(1, K, generator=_gen(6)).to(dtype)
        out = OP.impls["triton"].callable()(x, wq, s, block, form="gemv", R=rows, C=128, num_warps=4)
        assert_close(out, torch.nn.functional.linear(x.double(), w).to(dtype), tol, what=f"{dtype}")

@interpreted
def test_gemv_reads_unaligned_and_strided_activations():
    """The one-token GEMV reads bf16 x as 4-value words only from a contiguous, 8-byte aligned row: a row
    2 bytes off alignment and a column-major fp32 x take element loads, with the same result."""
    wq, s = _weights(64, 256, (128, 128), seed=5)
    gemv = OP.impls["triton"].callable()
    x = torch.randn(1, 256, generator=_gen(3)).to(torch.bfloat16)
    off = torch.empty(257, dtype=torch.bfloat16)
    off[1:] = x[0]
    assert off[1:].data_ptr() % 8 != 0
    assert torch.equal(gemv(off[1:].view(1, 256), wq, s), gemv(x, wq, s))
    x32 = torch.randn(4, 256, generator=_gen(4))
    col = x32.t().contiguous().t()[:1]                                     # stride (1, 4)
    assert col.stride(1) != 1
    assert_close(gemv(col, wq, s), gemv(x32[:1].contiguous(), wq, s), 1e-6, what="fp32 column-major")
