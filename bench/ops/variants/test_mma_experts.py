"""bench/ops/variants/mma_experts.py against independent references under TRITON_INTERPRET=1 (the mma
emulated from the PTX fragment layout, mma_gemv.py):

- h (each slot's swiglu) against silu(x @ Wg^T) * (x @ Wu^T) in fp32 from the dequantized weights (E4M3:
  from x quantized per 128-group), to its rounding to x's dtype;
- y (each slot's weighted down projection, fp32) against w_j * h_j @ Wd[e_j]^T computed from the probe's
  own h (E4M3: quantized per group) -- 1e-6: the products are exact;
- the op's output against fused_experts_fp8's definition and the dispatched one-token GEMV;
- ids -1 and E give zero rows; swiglu_limit; per-channel scales; 256-wide scale blocks; install() routes the
  registry's `triton_gemv` and uninstall() restores it;
- compiled for sm_90 (no interpreter; launched nowhere) at Kimi's shapes: the four kernels build without
  spills or shared memory beyond the warps' sum, and keep PDL's contract.

Not part of CI (tests/ only):
    TRITON_INTERPRET=1 python -m pytest -q bench/ops/variants/test_mma_experts.py"""
import os
import sys

import pytest
import torch

from kernelgate import platform, registry
from kernelgate.ops.moe import fused_experts_fp8 as fe8
from kernelgate.ops.moe import fused_experts_words_triton as ew
from kernelgate.ops.quant.fp8_weights import block_dims, dequantize_fp8, quantize_fp8_groups
from kernelgate.tools.testing import rel_err

sys.path.insert(0, os.path.dirname(__file__))
import mma_experts as mx  # noqa: E402
from test_mma_gemv import DEV, TOL, interp, on_either  # noqa: E402  (where the parity tests run, and their bound)

# Hopper's fp8 wgmma keeps ~14 bits while it accumulates inside an instruction chain (DeepSeek-V3 report, 3.3.2):
# our tl.dot over 128 codes is such a chain, promoted to fp32 registers per K block
TOL_FP8_MMA = 1e-6 if DEV == "cpu" else 2e-3


def _inputs(D, I, E, k, block, limit=None, seed=0, invalid=False, dev="cpu"):
    gen = torch.Generator().manual_seed(seed)
    args, kw = fe8.make_inputs(1, D, I, E, k, torch.bfloat16, "cpu", gen, ids="shared", limit=limit, block=block)
    if invalid:
        args[4][0, 0], args[4][0, 1] = -1, E
    return tuple(a.to(dev) for a in args), kw


def _q(v, bk, mode):
    """The activations as the mode multiplies them (F16 exact, E4M3 quantized per group)."""
    if mode == "f16":
        return v.float()
    q, s = quantize_fp8_groups(v.float(), bk)
    return dequantize_fp8(q, s, (1, bk))


@on_either
@pytest.mark.parametrize("mode", ["f16", "e4m3"])
@pytest.mark.parametrize("D,I,E,k,block,limit,invalid", [
    (256, 128, 6, 3, (128, 128), None, False),     # two K blocks each way
    (384, 256, 5, 4, (128, 128), 0.5, True),       # three / two K blocks, swiglu_limit, ids -1 and E
    (192, 64, 4, 2, None, None, False),            # per channel
    (512, 256, 4, 2, (128, 256), None, False),     # 256-wide K blocks (4 steps an iteration)
    (320, 192, 4, 2, (128, 128), None, False),     # K blocks partial at the end both ways (as the tiny models)
])
def test_parts_and_output(mode, D, I, E, k, block, limit, invalid):
    args, kw = _inputs(D, I, E, k, block, limit, seed=D + I + k, invalid=invalid, dev=DEV)
    assert mx.unsupported(args[0], args[1], args[2], block) is None
    parts = {}
    out = mx.fused_experts_fp8_mma(*args, block, swiglu_limit=limit, mode=mode, parts=parts).cpu()
    h, y = parts["h"].cpu(), parts["y"].cpu()
    x, gu, dn, tw, ti, gus, dns = (a.cpu() for a in args)
    xa = _q(x, block_dims(block, D)[1], mode)[0]
    ha = _q(h, block_dims(block, I)[1], mode)
    for j in range(k):
        e = int(ti[0, j])
        if not 0 <= e < E:
            assert torch.all(h[j] == 0) and torch.all(y[j] == 0)
            continue
        w13 = dequantize_fp8(gu[e], gus[e], block)
        g, u = w13[:I] @ xa, w13[I:] @ xa
        if limit is not None:
            g, u = g.clamp(max=limit), u.clamp(-limit, limit)
        assert rel_err(h[j].float(), torch.nn.functional.silu(g) * u) < 8e-3     # (bf16 h; the interpreter truncates)
        y_ref = tw[0, j] * (dequantize_fp8(dn[e], dns[e], block) @ ha[j])
        assert rel_err(y[j], y_ref) < TOL
    ref = fe8.fused_experts_fp8_native(x, gu, dn, tw, ti, gus, dns, **kw)
    assert rel_err(out, ref) < (1e-2 if mode == "f16" else 1e-1)   # (E4M3 rounds x and h to 3 mantissa bits)
    if mode == "f16":
        assert rel_err(out, ew.fused_experts_fp8_gemv(*args, **kw).cpu()) < 1e-2


@on_either
@pytest.mark.parametrize("D,I,block,limit,invalid", [(256, 128, (128, 128), None, False),
                                                     (384, 256, (128, 128), 0.5, True),
                                                     (192, 64, None, None, False)])
def test_wgmma_mode_matches_e4m3(D, I, block, limit, invalid):
    """mode wgmma multiplies the same quantized operands as e4m3: h to its bf16 rounding, y from its own h to
    fp32 round-off (exact fp8 products in both)."""
    args, kw = _inputs(D, I, 5, 3, block, limit, seed=D + I, invalid=invalid, dev=DEV)
    pw, pe = {}, {}
    out = mx.fused_experts_fp8_mma(*args, block, swiglu_limit=limit, mode="wgmma", block_n=16, stages=2,
                                   parts=pw).cpu()
    mx.fused_experts_fp8_mma(*args, block, swiglu_limit=limit, mode="e4m3", parts=pe)
    pw = {k: v.cpu() for k, v in pw.items()}
    x, gu, dn, tw, ti, gus, dns = (a.cpu() for a in args)
    assert rel_err(pw["h"].float(), pe["h"].cpu().float()) < 8e-3
    ha = _q(pw["h"], block_dims(block, I)[1], "e4m3")
    for j in range(3):
        e = int(ti[0, j])
        if not 0 <= e < 5:
            assert torch.all(pw["y"][j] == 0)
            continue
        assert rel_err(pw["y"][j], tw[0, j] * (dequantize_fp8(dn[e], dns[e], block) @ ha[j])) < TOL_FP8_MMA
    assert rel_err(out, fe8.fused_experts_fp8_native(x, gu, dn, tw, ti, gus, dns, **kw)) < 1e-1


@interp
def test_install_routes_triton_gemv():
    """Through dispatch: the op's cached choice (made before install) gives way to the probe, and back."""
    (x, gu, dn, tw, ti, gus, dns), kw = _inputs(256, 128, 6, 3, (128, 128))
    entry = fe8.fused_experts_fp8.impls["triton_gemv"]
    calls = []
    mma = mx.fused_experts_fp8_mma
    with registry.forcing({"fused_experts_fp8": "triton_gemv"}):
        before = fe8.fused_experts_fp8(x, gu, dn, tw, ti, gus, dns, **kw)      # dispatch caches its choice
        try:
            assert "f16" in mx.install(mode="f16", down_warps=2)
            mx.fused_experts_fp8_mma = lambda *a, **k: calls.append(1) or mma(*a, **k)
            assert entry.resolve() is mx._gemv
            after = fe8.fused_experts_fp8(x, gu, dn, tw, ti, gus, dns, **kw)
            assert calls and rel_err(after, before) < 1e-2
            x2 = torch.cat([x, x])                   # two tokens: not taken, the dispatched path runs
            assert mx.unsupported(x2, gu, dn, (128, 128)) is not None
        finally:
            mx.fused_experts_fp8_mma = mma
            mx.uninstall()
        assert entry.resolve() is mx._ORIGINAL["gemv"]
        fe8.fused_experts_fp8(x, gu, dn, tw, ti, gus, dns, **kw)
        assert len(calls) == 1


@pytest.mark.skipif(platform.interpreting(), reason="compiles for a stand-in sm_90 (no interpreter)")
@pytest.mark.parametrize("mode", ["f16", "e4m3", "wgmma"])
def test_sm90_builds(mode):
    """At Kimi's shapes the kernels build for sm_90 without spills, keep PDL's contract and use shared memory only
    for the warps' sum -- or, wgmma, QGMMA on fp8 with the weight tiles staged by cp.async."""
    import subprocess
    import tempfile
    import triton
    from kernelgate.tools import compile_stand_in as cs
    if cs.available("sm_90"):
        pytest.skip(cs.available("sm_90"))
    (x, gu, dn, tw, ti, gus, dns), kw = _inputs(2304, 1024, 4, 3, (128, 128))
    kernels = (mx._wg_gate_up_kernel, mx._wg_down_kernel) if mode == "wgmma" else (mx._gate_up_kernel, mx._down_kernel)
    for kern in (mx.mg._prep_kernel, *kernels):
        kern.device_caches.clear()
    with cs.targeting("sm_90") as rec:
        rec.begin({"specs": []})
        mx.fused_experts_fp8_mma(x, gu, dn, tw, ti, gus, dns, (128, 128), mode=mode)
        specs = rec.row["specs"]
    # (the second prep, of h, is the first's specialisation: listed once; sum_slots' kernel only where this
    # process had not built it yet)
    assert [sp["kernel"] for sp in specs][:3] == ["_prep_kernel", *(k.fn.__name__ for k in kernels)]
    assert not any(sp["problem"] for sp in specs), specs
    if mode != "wgmma":
        assert all(sp["shared"] <= 2048 for sp in specs), specs
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    for kern in kernels:
        for c in kern.device_caches.values():
            for k in c[0].values():
                with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
                    f.write(k.asm["cubin"])
                    f.flush()
                    use = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
                    sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True).stdout
                assert "STACK:0" in use and "LOCAL:0" in use, use          # no spills
                assert ("QGMMA" in sass and "LDGSTS" in sass) if mode == "wgmma" else "HMMA.16816.F32" in sass
