"""bench/ops/variants/mma_gemv.py against independent references, under TRITON_INTERPRET=1 (the mma emulated
from the PTX ISA's fragment layout), and its sm_90 code (compiled here, launched nowhere):

- E4M3 (w8a8): fp32 output against (quantize_fp8_groups(x) dequantized) @ dequantize_fp8(w).T in fp32;
  bf16 output against the package's triton_w8a8 (the same quantized operands);
- F16 (w8a16): fp32 output against x @ dequantize_fp8(w).T, the definition (exact products);
- shapes: a partial last row tile, several K blocks over warps that do not divide them, one K block,
  per-channel scales, 1, 3 and 8 tokens, 1 and 4 warps;
- install() routes fp8_linear's one-token GEMV through it and uninstall() puts dispatch's back;
- compiled for sm_90: the asm's operands are one element a thread (lane = element % 32), no shared
  memory in the K loop, the mma instructions in the SASS.

Not part of CI (tests/ only):
    TRITON_INTERPRET=1 python -m pytest -q bench/ops/variants/test_mma_gemv.py"""
import os
import re
import sys

import pytest
import torch

from kernelgate import platform
from kernelgate.ops.quant import fp8_linear as fl
from kernelgate.ops.quant import fp8_linear_triton as flt
from kernelgate.ops.quant.fp8_weights import block_dims, dequantize_fp8, quantize_fp8_groups
from kernelgate.tools.testing import rel_err

sys.path.insert(0, os.path.dirname(__file__))
import mma_gemv as mg  # noqa: E402

interp = pytest.mark.skipif(not platform.interpreting(), reason="CPU tensors: needs TRITON_INTERPRET=1")
# the parity tests run on the GPU too (the real mma instructions; the device session's first check)
DEV = "cuda" if torch.cuda.is_available() and not platform.interpreting() else "cpu"
on_either = pytest.mark.skipif(DEV == "cpu" and not platform.interpreting(),
                               reason="needs TRITON_INTERPRET=1 (CPU) or an NVIDIA GPU (sm_89+)")
TOL = 1e-6 if DEV == "cpu" else 1e-5      # (the tensor cores' fp32 accumulation is not IEEE add by add)

# (N, K, block): 18 K blocks (a partial last round of warps); one K block; per channel; K = 320 and 192, whose
# last K block is half a block; 256-wide blocks (4 steps an iteration) with 16-row scale blocks
SHAPES = [(40, 2304, (128, 128)), (24, 128, (128, 128)), (33, 192, None), (16, 320, (128, 128)),
          (20, 192, (128, 128)), (48, 1024, (16, 256))]


def _inputs(T, N, K, block, seed, dev="cpu"):
    gen = torch.Generator().manual_seed(seed)
    (x, w, s), kw = fl.make_inputs(T, N, K, block, torch.bfloat16, "cpu", gen)
    return x.to(dev), w.to(dev), s.to(dev), kw["block_size"]


@on_either
@pytest.mark.parametrize("N,K,block", SHAPES)
@pytest.mark.parametrize("T,nw", [(1, 4), (3, 1), (8, 4)])
def test_e4m3_matches_the_w8a8_definition(N, K, block, T, nw):
    x, w, s, block = _inputs(T, N, K, block, N * K + T, DEV)
    assert mg.unsupported(x, w, s, block) is None
    y = mg.fp8_linear_mma(x, w, s, block, mode="e4m3", num_warps=nw, out=torch.empty(T, N, device=DEV))
    xq, xs = quantize_fp8_groups(x.cpu().float(), block_dims(block, K)[1])
    ref = dequantize_fp8(xq, xs, (1, block_dims(block, K)[1])) @ dequantize_fp8(w.cpu(), s.cpu(), block).t()
    assert rel_err(y.cpu(), ref) < TOL
    yb = mg.fp8_linear_mma(x, w, s, block, mode="e4m3", num_warps=nw)
    assert yb.dtype == torch.bfloat16 and rel_err(yb, flt.fp8_linear_w8a8(x, w, s, block)) < 1e-2


@on_either
@pytest.mark.parametrize("N,K,block", SHAPES)
@pytest.mark.parametrize("T,nw", [(1, 4), (3, 1), (8, 4)])
def test_f16_matches_the_definition(N, K, block, T, nw):
    x, w, s, block = _inputs(T, N, K, block, N * K + T + 1, DEV)
    x[0, 5] = 3e4                                   # a large value: the token's power of two keeps it in fp16
    if T > 1:
        x[1] *= 1e-6                                # a small token: no fp16 underflow either
    y = mg.fp8_linear_mma(x, w, s, block, mode="f16", num_warps=nw, out=torch.empty(T, N, device=DEV)).cpu()
    wd = dequantize_fp8(w.cpu(), s.cpu(), block)
    assert rel_err(y, x.cpu().float() @ wd.t()) < TOL
    for i in range(T):
        assert rel_err(y[i], x[i].cpu().float() @ wd.t()) < TOL


@interp
def test_install_routes_the_one_token_gemv():
    x, w, s, block = _inputs(1, 40, 256, (128, 128), 7)
    before = flt.fp8_linear_triton(x, w, s, block)
    try:
        assert "f16" in mg.install(mode="f16", num_warps=2)
        assert flt.fp8_gemv is mg._gemv
        y = flt.fp8_linear_triton(x, w, s, block)
        assert rel_err(y, fl.fp8_linear_native(x, w, s, block)) < 1e-2 and rel_err(y, before) < 1e-2
        xf = x.float()                               # fp32 x: not taken, the dispatched GEMV runs
        assert mg.unsupported(xf, w, s, block) is not None
        assert rel_err(flt.fp8_linear_triton(xf, w, s, block), fl.fp8_linear_native(xf, w, s, block)) < 1e-6
    finally:
        mg.uninstall()
    assert flt.fp8_gemv is mg._ORIGINAL["gemv"]


@interp
def test_install_wgmma_routes_to_w8a8():
    x, w, s, block = _inputs(1, 40, 256, (128, 128), 8)
    w8a16 = flt.fp8_linear_triton(x, w, s, block)
    try:
        assert "triton_w8a8" in mg.install(mode="wgmma", block_n=16, stages=2)
        y = flt.fp8_linear_triton(x, w, s, block)
        xq, xs = quantize_fp8_groups(x.float(), 128)
        ref = dequantize_fp8(xq, xs, (1, 128)) @ dequantize_fp8(w, s, block).t()
        assert rel_err(y, ref) < 1e-2 and rel_err(y, flt.fp8_linear_w8a8(x, w, s, block)) < 1e-3
        assert rel_err(y, w8a16) > 1e-3                  # (the activation rounding: not the w8a16 GEMV's numbers)
    finally:
        mg.uninstall()
    assert flt.fp8_gemv is mg._ORIGINAL["gemv"] and not mg._STATE


def test_unsupported_says_why():
    x, w, s, block = _inputs(1, 16, 100, (128, 128), 0)
    assert "multiple of 64" in mg.unsupported(x, w, s, block)
    x, w, s, block = _inputs(9, 16, 128, (128, 128), 0)
    assert "1-8 tokens" in mg.unsupported(x, w, s, block)
    x, w, s, block = _inputs(1, 16, 256, (128, 96), 0)
    assert "bk a multiple of 64" in mg.unsupported(x, w, s, block)
    x, w, s, block = _inputs(1, 16, 256, (128, 128), 0)
    assert "not contiguous" in mg.unsupported(torch.cat([x, x], 1)[:, ::2], w, s, block)


@pytest.mark.skipif(platform.interpreting(), reason="compiles for a stand-in sm_90 (no interpreter)")
@pytest.mark.parametrize("mode", ["e4m3", "f16"])
def test_sm90_code(mode, tmp_path):
    """The asm's operands one element a thread in the identity layout (lane = element % 32, warp = element //
    32), no shared memory before the warps' sum, and the mma in the SASS: sm_90 has no fp8 mma.sync, so ptxas
    builds both modes from F2FP.F16.E4M3.UNPACK_B conversions and HMMA.16816.F32 (e4m3: also the token's codes
    unpacked, two HMMA an m16n8k32)."""
    from kernelgate.tools import compile_stand_in as cs
    if cs.available("sm_90"):
        pytest.skip(cs.available("sm_90"))
    x, w, s, block = _inputs(1, 64, 2304, (128, 128), 0)
    mg._mma_gemv_kernel.device_caches.clear()
    mg._prep_kernel.device_caches.clear()
    with cs.targeting("sm_90") as rec:
        rec.begin({"specs": []})
        mg.fp8_linear_mma(x, w, s, block, mode=mode, num_warps=4)
        specs = rec.row["specs"]
    assert [sp["kernel"] for sp in specs] == ["_prep_kernel", "_mma_gemv_kernel"]
    assert not any(sp["problem"] for sp in specs), specs          # (PDL contract, shared memory, binary)
    (k,) = [k for c in mg._mma_gemv_kernel.device_caches.values() for k in c[0].values()]
    ttgir = k.asm["ttgir"]
    layouts = dict(re.findall(r"(#blocked\d*) = #ttg.blocked<\{([^}]*)\}>", ttgir))
    asm_ops = [ln for ln in ttgir.splitlines() if "elementwise_inline_asm" in ln]
    assert asm_ops
    for ln in asm_ops:
        used = set(re.findall(r"tensor<128x\w+, (#blocked\d*)>", ln))
        assert used and all(layouts[u] == "sizePerThread = [1], threadsPerWarp = [32], warpsPerCTA = [4], order = [0]"
                            for u in used), (used, layouts)
    loop = ttgir[ttgir.index("scf.for"):ttgir.index("scf.yield")]
    assert "local_alloc" not in loop and "convert_layout" not in loop
    import subprocess
    import triton
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    cubin = tmp_path / "k.cubin"
    cubin.write_bytes(k.asm["cubin"])
    sass = subprocess.run([tool, "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
    assert sass.count("HMMA.16816.F32") == 2 * 8      # 8 an iteration (e4m3: 4 m16n8k32 of 2), loop and last round
    assert "F2FP.F16.E4M3.UNPACK_B" in sass
