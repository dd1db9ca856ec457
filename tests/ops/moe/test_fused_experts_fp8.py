"""fused_experts_fp8 against fused_experts on the dequantized weights (every implementation that runs
here, Triton under TRITON_INTERPRET=1), a hand-computed case, each GPU's fp8 decode, dispatch, bad scales."""
import math

import pytest
import torch

from kernelgate import KernelgateError, alloc, platform, registry
from kernelgate.ops.moe.fused_experts_fp8 import make_inputs
from kernelgate.ops.quant import dequantize_fp8
from kernelgate.platform import Device
from kernelgate.tools.testing import assert_close

OP = registry.get("fused_experts_fp8")
BF16 = registry.get("fused_experts")
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
# CPU tensors through Triton's interpreter standing in for each GPU's decode; on a GPU the generated
# parity suite checks the real device
interpreted = pytest.mark.skipif(not platform.interpreting(), reason="runs under TRITON_INTERPRET=1 only")


@pytest.fixture(autouse=True)
def _poisoned():
    """Kernel outputs start as NaN: an element a kernel leaves unwritten fails the comparison."""
    with alloc.poisoned():
        yield


def _runnable(args, kwargs):
    plat = platform.current()
    for impl in OP.impls.values():
        if impl.unavailable(plat) or (impl.dtypes and args[0].dtype not in impl.dtypes):
            continue
        if impl.supports and impl.supports(*args, **kwargs):
            continue
        yield impl.name, impl.callable()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("T,D,I,E,k,ids,block", [
    (3, 160, 72, 8, 4, "shared", (128, 128)),
    (20, 96, 136, 6, 2, "invalid", (128, 128)),
    (6, 64, 40, 4, 2, "random", None),
], ids=["T3-D160-I72-E8-k4-shared", "T20-D96-I136-E6-k2-invalid", "T6-D64-I40-E4-k2-channel"])
def test_matches_fused_experts_on_dequantized_weights(T, D, I, E, k, ids, block, dtype, device):
    (x, gu, dn, tw, ti, gus, dns), kw = make_inputs(T, D, I, E, k, dtype, device, torch.Generator().manual_seed(5),
                                                    ids=ids, block=block)
    gu_f, dn_f = dequantize_fp8(gu, gus, block), dequantize_fp8(dn, dns, block)
    want = BF16.reference(x.float(), gu_f, dn_f, tw, ti).to(dtype).cpu()  # fused_experts' definition
    impls = dict(_runnable((x, gu, dn, tw, ti, gus, dns), kw))
    assert "native" in impls
    for name, fn in impls.items():
        assert_close(fn(x, gu, dn, tw, ti, gus, dns, **kw).cpu(), want, TOL[dtype], what=name)


def _silu(z):
    return z / (1 + math.exp(-z))


def test_hand_computed(device):
    # D=2, I=1, E=2, per-channel scales. Expert 0: gate row (1, 1) = codes (2, 2) * 0.5, up row (2, 0) = codes
    # (1, 0) * 2, down column (1, -1) = codes (4, -4) * 0.25. Expert 1: gate (0, 1), up (1, 1), down (3, 0.5).
    fp8 = torch.float8_e4m3fn
    gu = torch.tensor([[[2.0, 2.0], [1.0, 0.0]], [[0.0, 1.0], [1.0, 1.0]]]).to(fp8)
    gus = torch.tensor([[[0.5], [2.0]], [[1.0], [1.0]]])
    dn = torch.tensor([[[4.0], [-4.0]], [[6.0], [1.0]]]).to(fp8)
    dns = torch.tensor([[[0.25], [0.25]], [[0.5], [0.5]]])
    x = torch.tensor([[1.0, 0.0], [0.0, 2.0]])
    ids = torch.tensor([[0, 1], [1, -1]], dtype=torch.int32)
    tw = torch.tensor([[0.25, 0.75], [0.5, 0.9]])
    a0, a1 = _silu(1.0) * 2.0, _silu(2.0) * 2.0      # token 0: expert 1's gate is 0 (silu 0 = 0)
    want = torch.tensor([[0.25 * a0, -0.25 * a0], [0.5 * a1 * 3.0, 0.5 * a1 * 0.5]])
    args, kw = tuple(a.to(device) for a in (x, gu, dn, tw, ids, gus, dns)), {"block_size": None}
    impls = dict(_runnable(args, kw))
    assert "native" in impls
    for name, fn in impls.items():
        assert_close(fn(*args, **kw).cpu(), want, 1e-6, what=name)


@interpreted
@pytest.mark.parametrize("device", [
    Device("cuda", "sm_90", "NVIDIA H100 80GB HBM3"), Device("rocm", "gfx942", "AMD Instinct MI300X")],
    ids=lambda d: d.capability)
@pytest.mark.parametrize("T", [1, 2], ids=["gemv", "grouped"])
def test_each_gpus_decode_gives_the_same_bits(device, T):
    """fp8 conversion (sm_90) and the fnuz view (gfx942) decode exactly: fp32 results are bit-identical
    to the integer decode's (sm_80, gfx90a, Intel, the interpreter)."""
    args, kw = make_inputs(T, 160, 72, 6, 2, torch.float32, "cpu", torch.Generator().manual_seed(T))
    with platform.simulate("cuda"):      # no capability on this machine: the integer decode
        base = OP(*args, **kw)
    with platform.simulate(device):
        assert [i.name for i, why in OP.explain(args, kw) if why is None] == ["triton_gemv" if T == 1 else "triton"]
        assert torch.equal(OP(*args, **kw), base)


@interpreted
@pytest.mark.parametrize("D,I", [(160, 72), (256, 128)], ids=["k-tail", "k-tiled"])
@pytest.mark.parametrize("rows,block", [(8, (128, 128)), (16, (24, 32)), (8, None)],
                         ids=["uniform", "rows-straddle-blocks", "one-k-block"])
def test_gemv_launch_forms_match_the_definition(rows, block, D, I):
    """The one-token word GEMV (x, then h, read as 4-value words in bf16) with K steps that tile K or end
    in a masked tail, tiles whose rows share a scale block (rows halved to fit), per-column scales inside a
    step, or one K block, a shared-expert slot and a -1 id: equal to fused_experts on the dequantized
    weights."""
    from kernelgate.ops.moe import fused_experts_words_triton as gemv
    launch = dict(gate_up=(rows, 128, 4), down=(rows, 64, 2))
    for dtype in (torch.float32, torch.bfloat16):
        gen = torch.Generator().manual_seed(8)
        (x, gu, dn, tw, ti, gus, dns), kw = make_inputs(1, D, I, 6, 3, dtype, "cpu", gen, ids="shared", block=block)
        ti[0, 0] = -1
        want = BF16.reference(x.float(), dequantize_fp8(gu, gus, block), dequantize_fp8(dn, dns, block), tw, ti)
        out = gemv.fused_experts_fp8_gemv(x, gu, dn, tw, ti, gus, dns, **kw, launch=launch)
        assert_close(out, want.to(dtype), TOL[dtype], what=f"{dtype}")


@pytest.mark.parametrize("bad,arg,needle", [
    (lambda a: {**a, "w_gate_up_scale": a["w_gate_up_scale"][:, :1]}, "w_gate_up_scale",
     "shape (4, 1, 2) != (4, 2, 2)"),
    (lambda a: {**a, "w_down_scale": a["w_down_scale"][:3]}, "w_down_scale", "!= (4, 2, 1)"),
    (lambda a: {**a, "w_down_scale": a["w_down_scale"].double()}, "w_down_scale", "dtype float64"),
    (lambda a: {**a, "block_size": None}, "w_gate_up_scale", "per-channel"),
    (lambda a: {**a, "block_size": [128]}, "block_size", "two ints"),
    (lambda a: {**a, "w_gate_up": a["w_gate_up"].bfloat16()}, "w_gate_up", "float8_e4m3fn"),
    (lambda a: {**a, "w_down": a["w_down"][:, :, :-1]}, "w_down", "shape"),
], ids=["gu-scale-shape", "dn-scale-experts", "dn-scale-dtype", "block-vs-scales", "block-size", "gu-dtype",
        "dn-shape"])
def test_bad_input_is_one_line_naming_the_argument(bad, arg, needle):
    (x, gu, dn, tw, ti, gus, dns), _ = make_inputs(3, 160, 72, 4, 2, torch.float32, "cpu",
                                                   torch.Generator().manual_seed(0))
    good = dict(x=x, w_gate_up=gu, w_down=dn, topk_weights=tw, topk_ids=ti, w_gate_up_scale=gus,
                w_down_scale=dns, block_size=(128, 128))
    with pytest.raises(KernelgateError) as e:
        OP(**bad(good))
    msg = str(e.value)
    assert msg.startswith("fused_experts_fp8:") and arg in msg and needle in msg and "\n" not in msg, msg


def test_non_finite_scale_and_bad_ids_are_errors_in_checked_mode():
    args, kw = make_inputs(3, 160, 72, 4, 2, torch.float32, "cpu", torch.Generator().manual_seed(0))
    args = list(args)
    args[6] = args[6].clone()
    args[6][2, 1, 0] = float("nan")
    with registry.checked(), pytest.raises(KernelgateError, match=r"w_down_scale\[2, 1, 0\] = nan is not finite"):
        OP(*args, **kw)
    args[6][2, 1, 0] = 1.0
    args[4] = args[4].clone()
    args[4][1, 0] = 4
    with registry.checked(), pytest.raises(KernelgateError, match="fused_experts_fp8: topk_ids"):
        OP(*args, **kw)
