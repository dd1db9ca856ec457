"""gated_rms_norm against hand-computed values and independent references (transformers'
KimiLinearRMSNormGated and MambaRMSNormGated, fla's rms_norm_ref), for every implementation
that runs here (native; triton under TRITON_INTERPRET=1; fla on a GPU). Bad input errors."""
import math

import pytest
import torch

from kernelgate import KernelgateError, alloc, ops, platform, registry
from kernelgate.tools.testing import rel_err

OP = registry.get("gated_rms_norm")
IMPLS = ["native", "triton", "fla"]
DEV = platform.default_device()  # GPU tensors on a GPU machine; CPU (Triton interpreted) here


def run(impl_name, *args, **kwargs):
    """Call one implementation directly, outputs NaN-poisoned; skip if it cannot take the call."""
    impl = OP.impl(impl_name)
    why = impl.unavailable(platform.current())
    if why is None and impl.supports is not None:
        why = impl.supports(*args, **kwargs)
    if why:
        pytest.skip(f"{impl_name}: {why}")
    with alloc.poisoned():
        return impl.callable()(*args, **kwargs)


def randn(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(device=DEV, dtype=dtype)


# -- hand-computed ----------------------------------------------------------------------
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("c", [3.0, -0.5], ids=["c3", "c-0.5"])
@pytest.mark.parametrize("act", ["sigmoid", "silu"])
def test_constant_row(impl, c, act):
    # A row of constant c has rms |c|, so y = sign(c) * w * act(gate).
    D = 60
    x = torch.full((5, D), c, device=DEV)
    w, g = randn(D, seed=1), randn(5, D, seed=2)
    y = run(impl, x, w, g, 1e-9, activation=act)
    a = torch.sigmoid(g) if act == "sigmoid" else g * torch.sigmoid(g)
    torch.testing.assert_close(y, math.copysign(1.0, c) * w * a, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("impl", IMPLS)
def test_two_elements_by_hand(impl):
    # x = [3, 4]: mean square 12.5, rms 5/sqrt(2); w = [1, 2]; sigmoid(0) = 1/2, sigmoid(ln 3) = 3/4.
    t = lambda v: torch.tensor(v, device=DEV)  # noqa: E731
    x, w, g = t([[3.0, 4.0]]), t([1.0, 2.0]), t([[0.0, math.log(3)]])
    y = run(impl, x, w, g, 1e-12)
    s2 = math.sqrt(2)
    torch.testing.assert_close(y, t([[3 * s2 / 5 / 2, 4 * s2 / 5 * 2 * 3 / 4]]), rtol=1e-6, atol=0)
    # Gate first (silu): x * silu(g) = [0, 4 ln3 * 3/4]; one nonzero of two normalises to sqrt(2).
    y = run(impl, x, w, g, 1e-12, norm_before_gate=False, activation="silu")
    torch.testing.assert_close(y, t([[0.0, s2 * 2]]), rtol=1e-6, atol=1e-7)
    # No gate, with bias: rms(x) * w + b.
    y = run(impl, x, w, None, 1e-12, bias=t([10.0, 20.0]))
    torch.testing.assert_close(y, t([[10 + 3 * s2 / 5, 20 + 8 * s2 / 5]]), rtol=1e-6, atol=0)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("nbg", [True, False], ids=["nbg", "gbn"])
@pytest.mark.parametrize("rows,D,G", [((1,), 64, 16), ((63,), 96, 32), ((5, 13), 128, 64)],
                         ids=["T1-D64-G16", "T63-D96-G32", "5x13-D128-G64"])
def test_groups_are_separate_norms(impl, nbg, rows, D, G):
    x, w, g = randn(*rows, D, seed=3), randn(D, seed=4), randn(*rows, D, seed=5)
    y = run(impl, x, w, g, 1e-6, group_size=G, norm_before_gate=nbg, activation="silu")
    parts = [run(impl, x[..., j:j + G].contiguous(), w[j:j + G].contiguous(), g[..., j:j + G].contiguous(),
                 1e-6, norm_before_gate=nbg, activation="silu") for j in range(0, D, G)]
    torch.testing.assert_close(y, torch.cat(parts, -1), rtol=1e-5, atol=1e-6)
    whole = run(impl, x, w, g, 1e-6, norm_before_gate=nbg, activation="silu")
    assert rel_err(y, whole) > 1e-3  # the grouping changes the answer


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("rfp32", [False, True], ids=["res-bf16", "res-fp32"])
def test_prenorm_residual_dtypes(impl, rfp32):
    x, r = randn(7, 128, seed=6, dtype=torch.bfloat16), randn(7, 128, seed=7, dtype=torch.bfloat16)
    w, g = randn(128, seed=8, dtype=torch.bfloat16), randn(7, 128, seed=9, dtype=torch.bfloat16)
    y, res = run(impl, x, w, g, 1e-6, residual=r, prenorm=True, residual_in_fp32=rfp32)
    assert y.dtype == torch.bfloat16
    assert res.dtype == (torch.float32 if rfp32 else torch.bfloat16)
    s = x.float() + r.float()
    # Exact, except that Triton's interpreter truncates fp32 -> bf16 casts (compiled Triton
    # rounds to nearest even like torch): then allow one bf16 ulp.
    ulp = 2.0 ** -7 if impl == "triton" and platform.interpreting() and not rfp32 else 0.0
    torch.testing.assert_close(res, s.to(res.dtype), rtol=ulp, atol=0)
    ref = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6) * w.float() * torch.sigmoid(g.float())
    assert rel_err(y, ref) < 1e-2
    # Without a residual, prenorm hands back x itself (in x's dtype), never aliasing x.
    y2, res2 = run(impl, x, w, g, 1e-6, prenorm=True)
    assert res2.dtype == torch.bfloat16 and torch.equal(res2, x) and res2.data_ptr() != x.data_ptr()
    y3, res3 = run(impl, x, w, g, 1e-6, prenorm=True, residual_in_fp32=True)
    assert res3.dtype == torch.float32 and torch.equal(res3, x.float())


# -- independent references -------------------------------------------------------------
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_matches_transformers_kimi_linear(impl, dtype):
    hf = pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")
    norm = hf.KimiLinearRMSNormGated(128, eps=1e-6).to(DEV)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * randn(128, seed=10))
    x, g = randn(65, 4, 128, seed=11, dtype=dtype), randn(65, 4, 128, seed=12, dtype=dtype)
    with torch.no_grad():
        ref = norm(x, g)
    y = run(impl, x, norm.weight.detach(), g, 1e-6, activation="sigmoid")
    assert y.dtype == dtype
    assert rel_err(y, ref) < (1e-6 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("impl", IMPLS)
def test_matches_transformers_mamba2(impl):
    hf = pytest.importorskip("transformers.models.mamba2.modeling_mamba2")
    # (transformers 5.25 renamed MambaRMSNormGated to Mamba2RMSNormGated)
    cls = getattr(hf, "Mamba2RMSNormGated", None) or hf.MambaRMSNormGated
    norm = cls(256, group_size=64, eps=1e-5).to(DEV)
    with torch.no_grad():
        norm.weight.copy_(randn(256, seed=13))
    x, g = randn(33, 256, seed=14), randn(33, 256, seed=15)
    with torch.no_grad():
        ref = norm(x, g)
    y = run(impl, x, norm.weight.detach(), g, 1e-5, group_size=64, norm_before_gate=False, activation="silu")
    assert rel_err(y, ref) < 1e-6


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("nbg,G,bias", [(True, None, True), (False, 32, True), (True, 48, False)],
                         ids=["nbg-bias", "gbn-G32-bias", "nbg-G48"])
def test_matches_fla_rms_norm_ref(impl, nbg, G, bias):
    ref_mod = pytest.importorskip("fla.modules.norm.layernorm_gated")
    x, z, w = randn(17, 96, seed=16), randn(17, 96, seed=17), randn(96, seed=18)
    b = randn(96, seed=19) if bias else None
    ref = ref_mod.rms_norm_ref(x, w, b, z=z, eps=1e-6, group_size=G, norm_before_gate=nbg)
    y = run(impl, x, w, z, 1e-6, group_size=G, norm_before_gate=nbg, activation="swish", bias=b)
    assert rel_err(y, ref) < 1e-6


# -- where fla-core's kernel is not this op --------------------------------------------------
@pytest.mark.parametrize("change,reason", [
    (dict(gate=None), "gate=None (plain RMSNorm): fla's rms_norm_gated always reads a gate"),
    (dict(group_size=32), "group_size=32: fla normalises whole rows only"),
    (dict(norm_before_gate=False), "norm_before_gate=False: fla gates after the norm only"),
    (dict(residual="bf16", prenorm=True, residual_in_fp32=True),
     "residual_in_fp32 with a bfloat16 residual: fla returns the residual in the residual's dtype"),
    (dict(D=40000), "row of 40000 x 2 bytes exceeds fla's 64 KB per-row block"),
], ids=["nogate", "groups", "gate-first", "residual-fp32", "wide-row"])
def test_fla_supports_names_each_mismatch(change, reason):
    from kernelgate.ops.norm.gated_rms_norm import _fla_supports
    D = change.pop("D", 64)
    x = torch.ones(2, D, dtype=torch.bfloat16, device="meta")
    kw = {"gate": x, **change}
    if kw.get("residual") == "bf16":
        kw["residual"] = x
    assert _fla_supports(x, torch.ones(D, device="meta"), **kw) == reason


def test_fla_supports_its_contract():
    from kernelgate.ops.norm.gated_rms_norm import _fla_supports
    x, w = torch.ones(2, 64, dtype=torch.bfloat16, device="meta"), torch.ones(64, device="meta")
    # Whole-row norm then gate, either activation, bias, residual, prenorm, fp32 residual stream.
    assert _fla_supports(x, w, x, 1e-6, None, True, "silu", bias=w, residual=x, prenorm=True) is None
    assert _fla_supports(x, w, x, group_size=64, residual=x.float(), prenorm=True, residual_in_fp32=True) is None
    xc = torch.ones(2, 64)
    assert _fla_supports(xc, xc[0], xc) == "x is a CPU tensor: fla's kernels autotune and need a GPU"


# -- layouts the Triton wrapper must accept ---------------------------------------------
@pytest.mark.parametrize("layout", ["row-stride", "transposed", "3d-slice", "empty"])
def test_layouts(layout):
    D = 60
    if layout == "row-stride":      # x, gate as column slices of one fused projection
        big = randn(65, 3 * D, seed=20)
        x, g = big[:, :D], big[:, 2 * D:]
    elif layout == "transposed":    # last dim not contiguous
        x, g = randn(D, 63, seed=21).t(), randn(D, 63, seed=22).t()
    elif layout == "3d-slice":
        x, g = randn(5, 7, 2 * D, seed=23)[:, 1:6, D:], randn(5, 5, D, seed=24)
    else:
        x, g = torch.empty(0, D, device=DEV), torch.empty(0, D, device=DEV)
    w = randn(D, seed=25)
    ref = OP.reference(x, w, g, 1e-6, bias=w)
    y = run("triton", x, w, g, 1e-6, bias=w)
    assert y.shape == x.shape and y.is_contiguous()
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-6)


def test_wide_grouped_rows_use_the_loop_kernel():
    # Groups wider than one register block (8192) take the two-pass kernel.
    from kernelgate.ops.norm.gated_rms_norm_triton import MAX_BLOCK_N, config
    G = MAX_BLOCK_N + 100
    assert config(4, G)["kernel"] == "loop" and config(4, 128)["kernel"] == "block"
    x, g, w = randn(2, 2 * G, seed=26), randn(2, 2 * G, seed=27), randn(2 * G, seed=28)
    ref = OP.reference(x, w, g, 1e-6, group_size=G, norm_before_gate=False, activation="silu")
    y = run("triton", x, w, g, 1e-6, group_size=G, norm_before_gate=False, activation="silu")
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-6)


# -- bad input ---------------------------------------------------------------------------
@pytest.mark.parametrize("mutate,message", [
    (lambda a: a.update(gate=torch.randn(4, 60)), "gated_rms_norm: gate shape (4, 60) != x shape (4, 64)"),
    (lambda a: a.update(group_size=48), "gated_rms_norm: group_size 48 must be a positive divisor of the last dim 64"),
    (lambda a: a.update(group_size=0), "group_size 0 must be a positive divisor"),
    (lambda a: a.update(activation="relu"), "gated_rms_norm: activation 'relu' not in"),
    (lambda a: a.update(weight=torch.randn(60)), "gated_rms_norm: weight shape (60,) != (64,)"),
    (lambda a: a.update(weight=torch.randn(64, device="meta")), "gated_rms_norm: weight is on meta, expected cpu (same device as the first input)"),
    (lambda a: a.update(x=torch.randint(0, 5, (4, 64))), "gated_rms_norm: x dtype int64 not in"),
    (lambda a: a.update(residual=torch.randn(4, 32)), "gated_rms_norm: residual shape (4, 32) != x shape (4, 64)"),
    (lambda a: a.update(eps=0.0), "gated_rms_norm: eps must be a number > 0"),
], ids=["gate-shape", "group-size", "group-size-0", "activation", "weight-shape", "device", "x-dtype",
        "residual-shape", "eps"])
def test_bad_input(mutate, message):
    a = dict(x=torch.randn(4, 64), weight=torch.randn(64), gate=torch.randn(4, 64))
    mutate(a)
    with pytest.raises(KernelgateError) as e:
        ops.gated_rms_norm(**a)
    assert message in str(e.value)
