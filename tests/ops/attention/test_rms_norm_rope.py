"""rms_norm_rope against hand-computed values and an independent composition (transformers'
Qwen3-Next RMSNorm, rotary embedding and `apply_rotary_pos_emb`), strided views against
contiguous copies, the empty batch, the Triton launch tiling, and the argument checks. Every
test runs each implementation that can run here (Triton under TRITON_INTERPRET=1)."""
import re

import pytest
import torch

from kernelgate import KernelgateError, alloc, forcing, platform, registry
from kernelgate.ops.attention import rms_norm_rope as M
from kernelgate.tools.testing import rel_err

OP = "rms_norm_rope"
DEV = platform.default_device()   # GPU tensors on a GPU machine; CPU (Triton interpreted) here
# bf16: one rounding of each output (the interpreter truncates fp32 -> bf16: up to one ulp, 2^-7)
BOUND = {torch.float32: 1e-6, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def _impls():
    op = registry.get(OP)
    return [pytest.param(name, id=name) for name in op.impls]


def route(impl, *args, **kwargs):
    """Call the op through the registry with `impl` forced (outputs NaN-poisoned); skip if it
    cannot run here."""
    op = registry.get(OP)
    why = op.impls[impl].unavailable(platform.current())
    if why:
        pytest.skip(f"{impl} cannot run here: {why}")
    with forcing({OP: impl}), alloc.poisoned():
        return op(*args, **kwargs)          # (the tests build their tensors on DEV)


def t(v, dtype=torch.float32):
    return torch.tensor(v, dtype=dtype, device=DEV)


def inputs(T, H, Dh, R, dtype=torch.float32, seed=0, fused=False):
    x, w, c, s = M.make_inputs(T, H, Dh, R, dtype, torch.Generator().manual_seed(seed), DEV, fused)
    return x, w, c, s


# -- hand-computed -------------------------------------------------------------------------
@pytest.mark.parametrize("impl", _impls())
def test_hand_computed_R2(impl):
    # x = [2, -2, 4, 1]: mean square 25 / 4, rms 5 / 2; weight [1, 2, 0.5, 1] -> y = [0.8, -1.6, 0.8, 0.4].
    # R = 2 (h = 1): token 0 at a 3-4-5 angle (cos 0.6, sin 0.8) turns (y0, y1):
    #   out0 = 0.8 * 0.6 + 1.6 * 0.8 = 1.76, out1 = -1.6 * 0.6 + 0.8 * 0.8 = -0.32; dims 2, 3 pass.
    # Token 1 at angle 0 is y itself. Head 1 is head 0 times 10: the norm makes them equal.
    x = t([[[2.0, -2.0, 4.0, 1.0], [20.0, -20.0, 40.0, 10.0]]] * 2)        # [2, 2, 4]
    w = t([1.0, 2.0, 0.5, 1.0])
    cos, sin = t([[0.6], [1.0]]), t([[0.8], [0.0]])
    out = route(impl, x, w, cos, sin, 1e-12)
    want = t([[[1.76, -0.32, 0.8, 0.4]] * 2, [[0.8, -1.6, 0.8, 0.4]] * 2])
    assert out.shape == (2, 2, 4) and out.dtype == torch.float32 and out.is_contiguous()
    torch.testing.assert_close(out, want, rtol=0, atol=1e-6)


@pytest.mark.parametrize("impl", _impls())
def test_hand_computed_full_rotary(impl):
    # Same y = [0.8, -1.6, 0.8, 0.4]; R = 4 (h = 2): pair (y0, y2) turns by (cos 0.6, sin 0.8),
    # pair (y1, y3) by a quarter turn (cos 0, sin 1):
    #   out0 = 0.8 * 0.6 - 0.8 * 0.8 = -0.16   out2 = 0.8 * 0.6 + 0.8 * 0.8 = 1.12
    #   out1 = -1.6 * 0 - 0.4 * 1   = -0.4    out3 = 0.4 * 0 + -1.6 * 1   = -1.6
    x = t([[[2.0, -2.0, 4.0, 1.0]]])
    w = t([1.0, 2.0, 0.5, 1.0])
    out = route(impl, x, w, t([[0.6, 0.0]]), t([[0.8, 1.0]]), 1e-12)
    torch.testing.assert_close(out, t([[[-0.16, -0.4, 1.12, -1.6]]]), rtol=0, atol=1e-6)


@pytest.mark.parametrize("impl", _impls())
def test_eps_is_inside_the_root(impl):
    # x = [1, 1] (mean square 1), eps 3: y = x / sqrt(1 + 3) = 0.5; no turn.
    out = route(impl, t([[[1.0, 1.0]]]), t([1.0, 1.0]), t([[1.0]]), t([[0.0]]), 3.0)
    torch.testing.assert_close(out, t([[[0.5, 0.5]]]), rtol=0, atol=1e-7)


# -- transformers' Qwen3-Next composition (independent reference) ------------------------------
def _hf_reference(x, w0, positions, R, eps):
    """transformers' Qwen3NextRMSNorm (weight w0, multiplier 1 + w0) on each head, then its rotary
    embedding (theta 1e7, partial_rotary_factor R / Dh) through apply_rotary_pos_emb; fp32 cos / sin."""
    hf = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    from transformers.models.qwen3_next.configuration_qwen3_next import Qwen3NextConfig
    Dh = x.shape[-1]
    cfg = Qwen3NextConfig(head_dim=Dh, rope_parameters={"rope_type": "default", "rope_theta": M.THETA,
                                                        "partial_rotary_factor": R / Dh})
    norm = hf.Qwen3NextRMSNorm(Dh, eps=eps).to(x.device)
    rope = hf.Qwen3NextRotaryEmbedding(cfg).to(x.device)
    with torch.no_grad():
        norm.weight.copy_(w0)
        cos, sin = rope(torch.zeros(1, device=x.device), positions[None])       # [1, T, R] fp32
        assert cos.shape[-1] == R
        xn = norm(x)                                                             # [T, H, Dh] in x.dtype
        # [T, H, Dh] with cos [T, R] -> unsqueeze at the head dim
        q, _ = hf.apply_rotary_pos_emb(xn, xn, cos[0], sin[0], unsqueeze_dim=1)
    return q, cos[0, :, :R // 2].contiguous(), sin[0, :, :R // 2].contiguous()


@pytest.mark.parametrize("impl", _impls())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("T,H,Dh,R,fused", [
    pytest.param(37, 16, 256, 64, True, id="T37-H16-D256-R64-qview"),
    pytest.param(5, 2, 256, 64, False, id="T5-H2-D256-R64-k"),
    pytest.param(3, 4, 80, 80, False, id="T3-H4-D80-R80-full"),
    pytest.param(9, 3, 96, 32, False, id="T9-H3-D96-R32"),
])
def test_matches_transformers_qwen3_next(impl, dtype, T, H, Dh, R, fused):
    g = torch.Generator().manual_seed(T * 1000 + Dh)
    xx = (2 * torch.randn(T, H, 2 * Dh if fused else Dh, generator=g)).to(device=DEV, dtype=dtype)
    x = xx[..., :Dh] if fused else xx
    w0 = (0.1 * torch.randn(Dh, generator=g)).to(DEV)
    positions = torch.randint(0, 1 << 17, (T,), generator=g).to(DEV)
    ref, cos, sin = _hf_reference(x, w0, positions, R, 1e-6)
    out = route(impl, x, 1 + w0, cos, sin, 1e-6)
    assert out.shape == (T, H, Dh) and out.dtype == dtype and out.is_contiguous()
    # (transformers rounds to bf16 between the norm and the rotary: two roundings against one)
    assert rel_err(out, ref) < (1e-6 if dtype == torch.float32 else 1e-2), rel_err(out, ref)


@pytest.mark.parametrize("impl", _impls())
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
def test_matches_native(impl, dtype):
    x, w, c, s = inputs(37, 16, 256, 64, dtype, seed=1, fused=True)
    out = route(impl, x, w, c, s, 1e-6)
    ref = M.rms_norm_rope_native(x, w, c, s, 1e-6)
    assert out.dtype == dtype and rel_err(out, ref) < BOUND[dtype]
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


# -- layouts: any token / head strides; a strided last dim is copied -------------------------
def _restride(x, layout):
    T, H, Dh = x.shape
    if layout == "qview":           # query half of a [T, H, 2 * Dh] projection
        buf = torch.full((T, H, 2 * Dh), float("nan"), dtype=x.dtype, device=x.device)
        out = buf[..., :Dh]
    elif layout == "gate-half":     # the other half: offset by Dh elements
        buf = torch.full((T, H, 2 * Dh), float("nan"), dtype=x.dtype, device=x.device)
        out = buf[..., Dh:]
    elif layout == "heads-major":   # [H, T, Dh] in memory
        out = torch.empty(H, T, Dh, dtype=x.dtype, device=x.device).transpose(0, 1)
    elif layout == "every-other-head":
        out = torch.empty(T, 2 * H, Dh, dtype=x.dtype, device=x.device)[:, ::2]
    elif layout == "last-dim-strided":
        out = torch.empty(T, H, 2 * Dh, dtype=x.dtype, device=x.device)[..., ::2]
    else:
        raise ValueError(layout)
    out.copy_(x)
    return out


@pytest.mark.parametrize("impl", _impls())
@pytest.mark.parametrize("layout", ["qview", "gate-half", "heads-major", "every-other-head", "last-dim-strided"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_strided_x_equals_contiguous(impl, layout, dtype):
    x, w, c, s = inputs(7, 5, 96, 32, dtype, seed=2)
    xs = _restride(x, layout)
    assert torch.equal(xs, x) and not xs.is_contiguous()
    # cos / sin as column slices of wider tables
    c2 = torch.cat([c, torch.full_like(c, float("nan"))], dim=1)[:, :16]
    s2 = torch.cat([torch.full_like(s, float("nan")), s], dim=1)[:, 16:]
    out = route(impl, xs, w, c2, s2, 1e-6)
    assert out.is_contiguous() and out.shape == x.shape
    assert torch.equal(out, route(impl, x, w, c, s, 1e-6))


@pytest.mark.parametrize("impl", _impls())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_no_tokens(impl, dtype):
    x = torch.empty(0, 16, 512, dtype=dtype, device=DEV)[..., :256]
    c = torch.empty(0, 32, device=DEV)
    out = route(impl, x, torch.ones(256, device=DEV), c, c.clone(), 1e-6)
    assert out.shape == (0, 16, 256) and out.dtype == dtype and out.is_contiguous()


# -- the Triton launch ---------------------------------------------------------------------
def _triton():
    pytest.importorskip("triton")
    if not platform.interpreting() and platform.current().device == "cpu":
        pytest.skip("Triton needs a GPU or TRITON_INTERPRET=1")
    from kernelgate.ops.attention import rms_norm_rope_triton
    return rms_norm_rope_triton


@pytest.mark.parametrize("values,num_warps", [(16, 1), (64, 1), (512, 2), (1 << 16, 4)],
                         ids=["1-row", "4-rows", "32-rows", "all-rows"])
def test_triton_tiles(values, num_warps):
    # 13 tokens x 3 heads = 39 rows, Dh 12 (padded to 16): one row a program up to all rows in one,
    # partial last tiles in between
    K = _triton()
    x, w, c, s = inputs(13, 3, 12, 8, seed=3)
    with alloc.poisoned():
        out = K.rms_norm_rope_triton(x, w, c, s, 1e-6, cfg=dict(values=values, num_warps=num_warps))
    torch.testing.assert_close(out, M.rms_norm_rope_native(x, w, c, s, 1e-6), rtol=1e-5, atol=1e-6)


def test_launch_choices_follow_the_platform():
    import dataclasses
    pytest.importorskip("triton")
    from kernelgate.ops.attention import rms_norm_rope_triton as K
    here = platform.current()
    cfgs = {n: K.launch_config(dataclasses.replace(here, name=n)) for n in ("cuda", "rocm", "xpu", "cpu")}
    if platform.interpreting():
        assert all(cfg["values"] == K.INTERPRETER["values"] for cfg in cfgs.values())
    else:
        assert (cfgs["cuda"]["values"], cfgs["rocm"]["values"], cfgs["xpu"]["values"]) == (2048, 4096, 2048)
    cuda = dict(values=2048, num_warps=4)
    assert K.tile(cuda, 16, 256) == (8, 256, 4)     # Qwen3.5 q, decode: 2 programs of 8 heads
    assert K.tile(cuda, 2, 256) == (2, 256, 2)      # k, decode: one program of both heads
    assert K.tile(cuda, 1000, 96) == (16, 128, 4)   # odd head dim padded to 128
    assert K.tile(cuda, 1, 4) == (1, 16, 1)


def test_dispatch_picks_triton_on_gpu_platforms():
    op = registry.get(OP)
    x, w, c, s = inputs(2, 2, 64, 16)
    for name in ("cuda", "rocm", "xpu"):
        with platform.simulate(name):
            reasons = {i.name: r for i, r in op.explain((x, w, c, s, 1e-6))}
            if platform.current().triton is None:   # Triton usable here (a GPU, or the interpreter)
                assert reasons["triton"] is None, (name, reasons)
    with platform.simulate("cpu"):
        reasons = {i.name: r for i, r in op.explain((x, w, c, s, 1e-6))}
        assert reasons["triton"].startswith("not declared for cpu") and reasons["native"] is None


def test_triton_declines_wide_heads():
    x = torch.empty(1, 1, 2048, device="meta")
    c = torch.empty(1, 32, device="meta")
    assert M._triton_supports(x, torch.empty(2048, device="meta"), c, c, 1e-6) == \
        "head dim 2048 > 1024 (a row is held whole in registers)"


# -- bad input: one per check; the message names op, argument and constraint -----------------
def _args():
    return dict(x=torch.randn(3, 2, 8), weight=torch.ones(8), cos=torch.ones(3, 2), sin=torch.zeros(3, 2), eps=1e-6)


BAD = {
    "x-not-tensor": (dict(x=[[[1.0] * 8]]), "x must be a tensor, got list"),
    "x-2d": (dict(x=torch.randn(3, 8)), "x must have 3 dims, got shape (3, 8)"),
    "x-int": (dict(x=torch.ones(3, 2, 8, dtype=torch.int32)), "x dtype int32 not in (float32, float16, bfloat16)"),
    "x-head-dim-1": (dict(x=torch.randn(3, 2, 1), weight=torch.ones(1)),
                     "x head dim (last) must be >= 2 (room for one rotary pair), got shape (3, 2, 1)"),
    "weight-shape": (dict(weight=torch.ones(7)), "weight shape (7,) != (8,)"),
    "weight-bf16": (dict(weight=torch.ones(8, dtype=torch.bfloat16)), "weight dtype bfloat16 not in (float32)"),
    "weight-device": (dict(weight=torch.ones(8, device="meta")),
                      "weight is on meta, expected cpu (same device as the first input)"),
    "cos-1d": (dict(cos=torch.ones(3)), "cos must have 2 dims, got shape (3,)"),
    "cos-bf16": (dict(cos=torch.ones(3, 2, dtype=torch.bfloat16)), "cos dtype bfloat16 not in (float32)"),
    "cos-device": (dict(cos=torch.ones(3, 2, device="meta")), "cos is on meta, expected cpu"),
    "sin-fp16": (dict(sin=torch.zeros(3, 2, dtype=torch.float16)), "sin dtype float16 not in (float32)"),
    "sin-shape": (dict(sin=torch.zeros(3, 3)), "sin shape (3, 3) != cos shape (3, 2)"),
    "cos-rows": (dict(cos=torch.ones(4, 2), sin=torch.zeros(4, 2)), "cos shape (4, 2): rows != x tokens 3"),
    "rotary-empty": (dict(cos=torch.ones(3, 0), sin=torch.zeros(3, 0)),
                     "cos shape (3, 0): rotary dim 2 * 0 = 0 must be in [2, head dim 8]"),
    "rotary-too-wide": (dict(cos=torch.ones(3, 5), sin=torch.zeros(3, 5)),
                        "cos shape (3, 5): rotary dim 2 * 5 = 10 must be in [2, head dim 8]"),
    "eps-0": (dict(eps=0.0), "eps must be > 0, got 0.0"),
    "eps-negative": (dict(eps=-1e-6), "eps must be > 0, got -1e-06"),
    "eps-nan": (dict(eps=float("nan")), "eps must be a finite number, got nan"),
    "eps-str": (dict(eps="1e-6"), "eps must be a finite number, got '1e-6'"),
    "eps-bool": (dict(eps=True), "eps must be a finite number, got True"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_arguments_raise(case):
    change, message = BAD[case]
    a = {**_args(), **change}
    if "device" in case:   # the registry refuses meta tensors before validate: check validate itself
        with pytest.raises(KernelgateError, match=f"^{OP}: {re.escape(message)}"):
            M.validate(**a)
        return
    with pytest.raises(KernelgateError, match=f"^{OP}: {re.escape(message)}$"):
        registry.get(OP)(**a)
