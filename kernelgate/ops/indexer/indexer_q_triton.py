"""Triton kernel (portable): indexer query RoPE + Hadamard + per-(token, head) FP8 quantization.

One program handles BLOCK_R (token, head) rows of 128 dims, loaded as four quarters of 32
dims each ([BLOCK_R, 32] tiles). Splitting by quarters makes both steps local:
- RoPE v4 (interleaved, dims 64..127) rotates pairs (2i, 2i+1) inside quarters 2 and 3: the
  quarter is viewed as [R, 16, 2] and split into its even/odd lanes (register-local), the
  freqs row likewise into cos/sin. RoPE v3.2 (dims 0..63, pair (i, 32+i)) pairs quarter 0
  with quarter 1 lane by lane.
- Hadamard: H128 = H4 (x) H32 in Sylvester order, so y_a = H32 (sum_b H4[a,b] x_b): a 4-point
  butterfly across the quarters, then each quarter times the 32x32 +-1 Sylvester matrix, then
  times 1/sqrt(128) (the reference's order). The 32-point product splits x = hi + mid + lo in
  bf16 (the +-1 matrix is exact in bf16) and sums three MMAs with fp32 accumulation: fp32-level
  accuracy from bf16 tensor cores (two parts, 16 significand bits, are not enough: amax and
  values near fp8 subnormals inherit the error). With DOT_F32 the three parts go through fp32
  IEEE dots instead: the same products, for the interpreter (whose bf16 tl.dot is wrong) and for
  the backends the launch table sends there.
- FP8 encode: the integer RNE encoder (exact everywhere: e4m3fn and e4m3fnuz, compiled or
  interpreted). `_quant` also takes the hardware cast (`cvt.rn.satfinite.e4m3x2.f32`, round to
  nearest even like torch) for the token-major kernel (indexer_q_tok_triton.py).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ... import alloc, platform
from ...triton_utils import autotune_or_fixed
from ..common import fp8 as _fp8
from ..common.fp8_triton import encode_e4m3
from .hadamard import sylvester_hadamard

OP = "fused_q_indexer_rope_hadamard_quant"
BLOCK_R = 64  # rows per program under the interpreter (autotuned on GPUs)
_H32: dict = {}


def launch_config(plat: platform.Platform) -> dict:
    """The portable kernel's launch choices on `plat`: bf16 MMAs on compiled NVIDIA, fp32 IEEE
    dots (DOT_F32) elsewhere and under the interpreter; rows per program autotuned when compiled."""
    compiled = plat.triton_mode == "compiled"
    return dict(form="rows", dot_f32=not (compiled and plat.name == "cuda"),
                block_r=None if compiled else BLOCK_R)


@triton.jit
def _rope_pair(a, b, c, s):
    return a * c - b * s, a * s + b * c


@triton.jit
def _rope_interleaved(x, fptr, m2, R: tl.constexpr):
    """x [R, 32] = 16 interleaved pairs, fptr [R, 32] pointers to their 16 (cos, sin)."""
    a, b = tl.split(tl.reshape(x, (R, 16, 2)))
    c, s = tl.split(tl.reshape(tl.load(fptr, mask=m2, other=0.0), (R, 16, 2)))
    a, b = _rope_pair(a, b, c, s)
    return tl.reshape(tl.join(a, b), (R, 32))


@triton.jit
def _dot(a, hm, DOT_F32: tl.constexpr):
    # a, hm bf16: one MMA with fp32 accumulation; DOT_F32: the same products in fp32 (exact)
    if DOT_F32:
        return tl.dot(a.to(tl.float32), hm.to(tl.float32), input_precision="ieee")
    return tl.dot(a, hm.to(tl.bfloat16))


@triton.jit
def _had32(v, hm, DOT_F32: tl.constexpr):
    """v [R, 32] fp32 times the +-1 Sylvester matrix hm [32, 32], as hi + mid + lo bf16 parts."""
    hi = v.to(tl.bfloat16)
    r = v - hi.to(tl.float32)                                   # exact
    mid = r.to(tl.bfloat16)
    lo = (r - mid.to(tl.float32)).to(tl.bfloat16)
    acc = _dot(lo, hm, DOT_F32)                                 # smallest part first
    acc += _dot(mid, hm, DOT_F32)
    return acc + _dot(hi, hm, DOT_F32)


@triton.jit
def _quant(x, inv, sc, fmax, FNUZ: tl.constexpr, HW: tl.constexpr, FAST_DIV: tl.constexpr):
    """x / scale as fp8 codes (uint8). FAST_DIV: x * (1 / scale), within an fp32 ulp (rarely one code
    off). HW: the hardware e4m3fn cast, which saturates at +-448 itself (NaN stays NaN, as torch's clamp)."""
    if FAST_DIV:
        y = x * inv
    else:
        y = tl.math.div_rn(x, sc)
    if HW:
        return y.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    return encode_e4m3(tl.minimum(tl.maximum(y, -fmax), fmax), FNUZ)


@triton.jit
def _indexer_q_kernel(q_ptr, w_ptr, f_ptr, pos_ptr, h_ptr, qo_ptr, wo_ptr,
                      n_rows, H, s_qb, s_qh, s_qd, s_wb, s_wh, s_pos, max_pos, weight_scale, fmax,
                      V4: tl.constexpr, HADAMARD: tl.constexpr, FNUZ: tl.constexpr,
                      DOT_F32: tl.constexpr, BLOCK_R: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)       # [R] = token * H + head
    rmask = rows < n_rows
    tok = rows // H
    head = rows % H
    cols = tl.arange(0, 32)
    pos = tl.load(pos_ptr + tok.to(tl.int64) * s_pos, mask=rmask, other=0).to(tl.int64)
    ok = rmask & (pos >= 0) & (pos < max_pos)     # a position outside freqs_cis: zero codes and weight
    base = (q_ptr + tok.to(tl.int64) * s_qb + head * s_qh)[:, None]  # [R, 1]
    m2 = ok[:, None]
    x0 = tl.load(base + cols[None, :] * s_qd, mask=m2, other=0.0).to(tl.float32)
    x1 = tl.load(base + (32 + cols[None, :]) * s_qd, mask=m2, other=0.0).to(tl.float32)
    x2 = tl.load(base + (64 + cols[None, :]) * s_qd, mask=m2, other=0.0).to(tl.float32)
    x3 = tl.load(base + (96 + cols[None, :]) * s_qd, mask=m2, other=0.0).to(tl.float32)
    # freqs_cis viewed as real: [max_pos, 32, 2] fp32 = 64 floats (cos, sin interleaved) per position
    fbase = (f_ptr + tl.where(ok, pos, 0) * 64)[:, None]
    if V4:
        x2 = _rope_interleaved(x2, fbase + cols[None, :], m2, BLOCK_R)
        x3 = _rope_interleaved(x3, fbase + 32 + cols[None, :], m2, BLOCK_R)
    else:
        c64 = tl.arange(0, 64)
        c, s = tl.split(tl.reshape(tl.load(fbase + c64[None, :], mask=m2, other=0.0), (BLOCK_R, 32, 2)))
        x0, x1 = _rope_pair(x0, x1, c, s)
    if HADAMARD:
        u0 = x0 + x1
        u1 = x0 - x1
        u2 = x2 + x3
        u3 = x2 - x3
        hm = tl.load(h_ptr + cols[:, None] * 32 + cols[None, :])    # [32, 32] of +-1
        norm = 0.08838834764831845                                  # 1/sqrt(128), as the reference
        x0 = _had32(u0 + u2, hm, DOT_F32) * norm
        x1 = _had32(u1 + u3, hm, DOT_F32) * norm
        x2 = _had32(u0 - u2, hm, DOT_F32) * norm
        x3 = _had32(u1 - u3, hm, DOT_F32) * norm
    amax = tl.maximum(tl.maximum(tl.max(tl.abs(x0), 1), tl.max(tl.abs(x1), 1)),
                      tl.maximum(tl.max(tl.abs(x2), 1), tl.max(tl.abs(x3), 1)))
    scale = tl.maximum(amax, 1e-4) / fmax                          # [R]
    sc = scale[:, None]
    out = (qo_ptr + rows.to(tl.int64) * 128)[:, None] + cols[None, :]
    ms = rmask[:, None]
    tl.store(out, _quant(x0, sc, sc, fmax, FNUZ, False, False), mask=ms)
    tl.store(out + 32, _quant(x1, sc, sc, fmax, FNUZ, False, False), mask=ms)
    tl.store(out + 64, _quant(x2, sc, sc, fmax, FNUZ, False, False), mask=ms)
    tl.store(out + 96, _quant(x3, sc, sc, fmax, FNUZ, False, False), mask=ms)
    w = tl.load(w_ptr + tok * s_wb + head * s_wh, mask=ok, other=0.0).to(tl.float32)
    tl.store(wo_ptr + rows, w * weight_scale * scale, mask=rmask)


_tuned = autotune_or_fixed(
    [triton.Config({"BLOCK_R": r}, num_warps=w) for r in (32, 64, 128) for w in (4, 8)],
    key=["H", "V4", "HADAMARD", "DOT_F32"], fixed={"BLOCK_R": BLOCK_R})(_indexer_q_kernel)


def hadamard_matrix(device, n: int = 32) -> torch.Tensor:
    key = (str(device), n)
    if key not in _H32:
        _H32[key] = sylvester_hadamard(n).to(device)                # +-1, exact in bf16
    return _H32[key]


def dense_freqs(freqs_cis):
    """freqs_cis as the kernels address it ([max_pos, 32] complex, contiguous; a copy otherwise)."""
    return freqs_cis if freqs_cis.is_contiguous() else freqs_cis.contiguous()


def indexer_q_triton(q, weight, weight_scale, freqs_cis, positions, variant="v4", fp8_format="e4m3fn",
                     hadamard=None):
    return launch(q, weight, weight_scale, freqs_cis, positions, variant, fp8_format, hadamard)


def launch(q, weight, weight_scale, freqs_cis, positions, variant="v4", fp8_format="e4m3fn", hadamard=None,
           **config):
    """The op; `config` overrides launch_config's choices (block_r, num_warps) for bench sweeps."""
    B, H, D = q.shape
    freqs_cis = dense_freqs(freqs_cis)
    cfg = {**launch_config(platform.current()), "num_warps": None, **config}
    dtype, fmax = _fp8.FORMATS[fp8_format]
    q_fp8 = alloc.empty((B, H, D), dtype, q.device)
    w_out = alloc.empty((B, H, 1), torch.float32, q.device)
    n_rows = B * H
    if n_rows == 0:
        return q_fp8, w_out
    meta = dict(V4=variant == "v4", HADAMARD=(variant == "v4") if hadamard is None else hadamard,
                FNUZ=fp8_format == "e4m3fnuz", DOT_F32=bool(cfg["dot_f32"]))
    args = (q, weight, torch.view_as_real(freqs_cis), positions, hadamard_matrix(q.device),
            q_fp8.view(torch.uint8), w_out, n_rows, H, *q.stride(),
            weight.stride(0), weight.stride(1), positions.stride(0), freqs_cis.shape[0], float(weight_scale), fmax)
    if cfg["block_r"] is None:
        _tuned[lambda m: (triton.cdiv(n_rows, m["BLOCK_R"]),)](*args, **meta)
    else:
        br = cfg["block_r"]
        extra = {"num_warps": cfg["num_warps"]} if cfg["num_warps"] else {}
        _indexer_q_kernel[(triton.cdiv(n_rows, br),)](*args, **meta, BLOCK_R=br, **extra)
    return q_fp8, w_out
