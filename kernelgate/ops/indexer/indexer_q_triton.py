"""Triton kernel: indexer query RoPE + Hadamard + per-(token, head) FP8 quantization.

One program handles BLOCK_R (token, head) rows of 128 dims, loaded as four quarters of 32
dims each ([BLOCK_R, 32] tiles). Splitting by quarters makes both steps local:
- RoPE v4 (interleaved, dims 64..127) rotates pairs (2i, 2i+1) inside quarters 2 and 3: the
  quarter is viewed as [R, 16, 2] and split into its even/odd lanes (register-local), the
  freqs row likewise into cos/sin. RoPE v3.2 (dims 0..63, pair (i, 32+i)) pairs quarter 0
  with quarter 1 lane by lane.
- Hadamard: H128 = H4 (x) H32 in Sylvester order, so y_a = H32 (sum_b H4[a,b] x_b): a 4-point
  butterfly across the quarters, then each quarter times the 32x32 +-1 Sylvester matrix, then
  times 1/sqrt(128) (the reference's order). The 32-point part has several exact-enough forms
  (`HMODE`, picked per device in CONFIG and swept by bench/indexer_sweep.py):
    0 "fp32": fp32 tl.dot (PREC: 3xTF32 on CUDA, IEEE elsewhere)
    2 "bf16x3": x = hi + mid + lo in bf16 (the +-1 matrix is exact in bf16), three bf16
      MMAs with fp32 accumulation: fp32-level accuracy. (Two parts, 16 significand bits, are
      not enough: measured 1e-3 of the codes one apart, some two apart, and weights_out
      1.5e-5 off, because amax and small values near fp8 subnormals inherit the error.)
    3 "butterfly": five fp32 butterfly stages via reshape/permute/split/join (no MMA)
    4 "lanes", 5 "lanes2" (token-major quarters only, indexer_q_tok.py; the NVIDIA CONFIG for v4):
      H2 across the two threads that hold a quarter row x H16 inside each thread (no MMA)
  Under the interpreter (bf16 tl.dot is wrong there) the bf16 mode runs its parts
  through fp32 dots (DOT_F32), which is the same arithmetic, so CPU tests check their error.
- FP8 encode: integer RNE encoder (exact everywhere, the only option for e4m3fnuz and under
  the interpreter, whose fp32 -> fp8 cast rounds wrongly) or, on CUDA for e4m3fn, the
  hardware cast (`cvt.rn.satfinite.e4m3x2.f32`: round to nearest even, like torch).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ... import alloc, triton_utils
from ...checks import require
from ...triton_utils import autotune_or_fixed
from ..common import fp8 as _fp8
from .hadamard import sylvester_hadamard

OP = "fused_q_indexer_rope_hadamard_quant"
from ..common.fp8_triton import encode_e4m3

BLOCK_R = 64  # rows per program under the interpreter; autotuned on GPUs unless CONFIG pins it
HMODES = {"fp32": 0, "bf16x3": 2, "butterfly": 3, "lanes": 4, "lanes2": 5}   # 4, 5: tok form only (indexer_q_tok.py)
# Launch choices on CUDA, per variant. form "rows": this file's kernel (block_r rows per program,
# None = autotuned); form "tok": indexer_q_tok.py (tok tokens x all heads per program, pieces 4 / 8
# / 16 column pieces); form "tree": indexer_q_tree.py (split-tree Hadamard, no MMA). Measured on
# the H200 (2026-11-29, T4096 x H64, CUDA graph, bench/indexer_sweep.py), rows form: v4 R64 w4 fp32
# Hadamard 76.8 us (bf16x3 85.1, butterfly 83.8); v3.2 R64 w4 without the split RoPE 39.2 us.
ROWS = dict(form="rows", hmode="fp32", hw_encode=True, fast_div=True, rope_split=True, block_r=64, num_warps=4)
# v4: token-major quarters with the Hadamard across two lanes ("lanes", indexer_q_tok.py), 80 registers:
# 32.5 us = 0.75 of the floor on the H200 (2026-11-29, session 4; at 96 registers 35.4; the split-tree
# form, a row per thread, 51.0 = 0.48: ncu shows it L2-bound on half-sector accesses; quarters with an
# fp32 dot 74.7, rows 77.4). v3.2: token-major quarters, 29.5 us = 0.83.
CONFIG = dict(ROWS, form="tok", tok=1, pieces=4, hmode="lanes", num_warps=4, maxnreg=80)
TREE = dict(ROWS, form="tree", tok=1, pieces=8, num_warps=2, freq=2)       # the session-3 CONFIG
CONFIG_V32 = dict(ROWS, form="tok", tok=1, pieces=4, rope_split=False)
# Under the interpreter and on non-NVIDIA backends: portable choices.
PORTABLE = dict(form="rows", hmode="bf16x3", hw_encode=False, fast_div=False, rope_split=True, block_r=None,
                num_warps=None)
_H32: dict = {}


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
def _bfly(x, R: tl.constexpr, S: tl.constexpr, W: tl.constexpr):
    """One radix-2 stage (pairs i, i + S) of the natural-order Walsh-Hadamard transform of [R, W]."""
    y = tl.permute(tl.reshape(x, (R, W // (2 * S), 2, S)), (0, 1, 3, 2))
    a, b = tl.split(y)
    return tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 1, 3, 2)), (R, W))


@triton.jit
def _dot(a, hm, DOT_F32: tl.constexpr):
    # a, hm bf16: one MMA with fp32 accumulation; DOT_F32: the same products in fp32 (exact)
    if DOT_F32:
        return tl.dot(a.to(tl.float32), hm.to(tl.float32), input_precision="ieee")
    return tl.dot(a, hm.to(tl.bfloat16))


@triton.jit
def _had32(v, hm, R: tl.constexpr, HMODE: tl.constexpr, PREC: tl.constexpr, DOT_F32: tl.constexpr,
           W: tl.constexpr):
    """v [R, W] fp32 times the +-1 Sylvester matrix hm [W, W] fp32 (W = 32, 16 or 8; 8 only as butterfly)."""
    if HMODE == 0:
        return tl.dot(v, hm, input_precision=PREC)
    elif HMODE == 3:
        v = _bfly(v, R, 1, W)
        v = _bfly(v, R, 2, W)
        v = _bfly(v, R, 4, W)
        if W >= 16:
            v = _bfly(v, R, 8, W)
        if W >= 32:
            v = _bfly(v, R, 16, W)
        return v
    else:
        hi = v.to(tl.bfloat16)
        r = v - hi.to(tl.float32)                               # exact
        mid = r.to(tl.bfloat16)
        lo = (r - mid.to(tl.float32)).to(tl.bfloat16)
        acc = _dot(lo, hm, DOT_F32)                             # smallest part first
        acc += _dot(mid, hm, DOT_F32)
        return acc + _dot(hi, hm, DOT_F32)


@triton.jit
def _encode(y, FNUZ: tl.constexpr, HW: tl.constexpr):
    if HW:
        return y.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    return encode_e4m3(y, FNUZ)


@triton.jit
def _quant(x, inv, sc, fmax, FNUZ: tl.constexpr, HW: tl.constexpr, FAST_DIV: tl.constexpr):
    if FAST_DIV:
        y = x * inv          # within an fp32 ulp of x / scale: rarely a one-code difference
    else:
        y = tl.math.div_rn(x, sc)
    if HW:   # cvt.rn.satfinite saturates at +-448 itself (and keeps NaN a NaN, as torch's clamp does)
        return _encode(y, FNUZ, HW)
    return _encode(tl.minimum(tl.maximum(y, -fmax), fmax), FNUZ, HW)


@triton.jit
def _indexer_q_kernel(q_ptr, w_ptr, f_ptr, pos_ptr, h_ptr, qo_ptr, wo_ptr,
                      n_rows, H, s_qb, s_qh, s_wb, s_wh, weight_scale, fmax,
                      V4: tl.constexpr, HADAMARD: tl.constexpr, FNUZ: tl.constexpr,
                      PREC: tl.constexpr, HMODE: tl.constexpr, DOT_F32: tl.constexpr,
                      HW_ENCODE: tl.constexpr, FAST_DIV: tl.constexpr, ROPE_SPLIT: tl.constexpr,
                      BLOCK_R: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)       # [R] = token * H + head
    rmask = rows < n_rows
    tok = rows // H
    head = rows % H
    cols = tl.arange(0, 32)
    base = (q_ptr + tok.to(tl.int64) * s_qb + head * s_qh)[:, None]  # [R, 1]
    m2 = rmask[:, None]
    x0 = tl.load(base + cols[None, :], mask=m2, other=0.0).to(tl.float32)
    x1 = tl.load(base + 32 + cols[None, :], mask=m2, other=0.0).to(tl.float32)
    x2 = tl.load(base + 64 + cols[None, :], mask=m2, other=0.0).to(tl.float32)
    x3 = tl.load(base + 96 + cols[None, :], mask=m2, other=0.0).to(tl.float32)
    # freqs_cis viewed as real: [max_pos, 32, 2] fp32 = 64 floats (cos, sin interleaved) per position
    fbase = (f_ptr + tl.load(pos_ptr + tok, mask=rmask, other=0).to(tl.int64) * 64)[:, None]
    if V4:
        if ROPE_SPLIT:
            x2 = _rope_interleaved(x2, fbase + cols[None, :], m2, BLOCK_R)
            x3 = _rope_interleaved(x3, fbase + 32 + cols[None, :], m2, BLOCK_R)
        else:   # partner lane by a second load
            partner = cols ^ 1
            sgn = tl.where((cols & 1) == 0, -1.0, 1.0)[None, :]     # even lane: a*c - b*s
            fi = (cols // 2)[None, :]
            c2 = tl.load(fbase + 2 * fi, mask=m2, other=1.0)
            s2 = tl.load(fbase + 2 * fi + 1, mask=m2, other=0.0)
            c3 = tl.load(fbase + 2 * (fi + 16), mask=m2, other=1.0)
            s3 = tl.load(fbase + 2 * (fi + 16) + 1, mask=m2, other=0.0)
            p2 = tl.load(base + 64 + partner[None, :], mask=m2, other=0.0).to(tl.float32)
            p3 = tl.load(base + 96 + partner[None, :], mask=m2, other=0.0).to(tl.float32)
            x2 = x2 * c2 + sgn * p2 * s2
            x3 = x3 * c3 + sgn * p3 * s3
    else:
        if ROPE_SPLIT:
            c64 = tl.arange(0, 64)
            c, s = tl.split(tl.reshape(tl.load(fbase + c64[None, :], mask=m2, other=0.0), (BLOCK_R, 32, 2)))
        else:
            c = tl.load(fbase + 2 * cols[None, :], mask=m2, other=1.0)
            s = tl.load(fbase + 2 * cols[None, :] + 1, mask=m2, other=0.0)
        x0, x1 = _rope_pair(x0, x1, c, s)
    if HADAMARD:
        u0 = x0 + x1
        u1 = x0 - x1
        u2 = x2 + x3
        u3 = x2 - x3
        hm = tl.load(h_ptr + cols[:, None] * 32 + cols[None, :])    # [32, 32] of +-1
        norm = 0.08838834764831845                                  # 1/sqrt(128), as the reference
        x0 = _had32(u0 + u2, hm, BLOCK_R, HMODE, PREC, DOT_F32, 32) * norm
        x1 = _had32(u1 + u3, hm, BLOCK_R, HMODE, PREC, DOT_F32, 32) * norm
        x2 = _had32(u0 - u2, hm, BLOCK_R, HMODE, PREC, DOT_F32, 32) * norm
        x3 = _had32(u1 - u3, hm, BLOCK_R, HMODE, PREC, DOT_F32, 32) * norm
    amax = tl.maximum(tl.maximum(tl.max(tl.abs(x0), 1), tl.max(tl.abs(x1), 1)),
                      tl.maximum(tl.max(tl.abs(x2), 1), tl.max(tl.abs(x3), 1)))
    scale = tl.maximum(amax, 1e-4) / fmax                          # [R]
    sc = scale[:, None]
    inv = tl.math.div_rn(tl.full((BLOCK_R, 1), 1.0, tl.float32), sc)
    out = (qo_ptr + rows.to(tl.int64) * 128)[:, None] + cols[None, :]
    tl.store(out, _quant(x0, inv, sc, fmax, FNUZ, HW_ENCODE, FAST_DIV), mask=m2)
    tl.store(out + 32, _quant(x1, inv, sc, fmax, FNUZ, HW_ENCODE, FAST_DIV), mask=m2)
    tl.store(out + 64, _quant(x2, inv, sc, fmax, FNUZ, HW_ENCODE, FAST_DIV), mask=m2)
    tl.store(out + 96, _quant(x3, inv, sc, fmax, FNUZ, HW_ENCODE, FAST_DIV), mask=m2)
    w = tl.load(w_ptr + tok * s_wb + head * s_wh, mask=rmask, other=0.0).to(tl.float32)
    tl.store(wo_ptr + rows, w * weight_scale * scale, mask=rmask)


_tuned = autotune_or_fixed(
    [triton.Config({"BLOCK_R": r}, num_warps=w) for r in (32, 64, 128) for w in (4, 8)],
    key=["H", "V4", "HADAMARD", "HMODE", "ROPE_SPLIT"], fixed={"BLOCK_R": BLOCK_R})(_indexer_q_kernel)


def _h32(device, n: int = 32) -> torch.Tensor:
    key = (str(device), n)
    if key not in _H32:
        _H32[key] = sylvester_hadamard(n).to(device)                # +-1, exact in bf16
    return _H32[key]


def indexer_q_triton(q, weight, weight_scale, freqs_cis, positions, variant="v4", fp8_format="e4m3fn",
                     hadamard=None):
    return launch(q, weight, weight_scale, freqs_cis, positions, variant, fp8_format, hadamard)


def launch(q, weight, weight_scale, freqs_cis, positions, variant="v4", fp8_format="e4m3fn", hadamard=None,
           **config):
    """The op, with launch choices (keys of CONFIG) overridable for bench/indexer_sweep.py."""
    B, H, D = q.shape
    require(q.stride(-1) == 1, OP, f"q must be contiguous in the head dim, got strides {q.stride()}")
    require(freqs_cis.is_contiguous(), OP, "freqs_cis must be contiguous")
    dtype, fmax = _fp8.FORMATS[fp8_format]
    nvidia = triton_utils.nvidia(q.device)
    cfg = {**((CONFIG if variant == "v4" else CONFIG_V32) if nvidia else PORTABLE), **config}
    use_h = (variant == "v4") if hadamard is None else hadamard
    q_fp8 = alloc.empty((B, H, D), dtype, q.device)
    w_out = alloc.empty((B, H, 1), torch.float32, q.device)
    n_rows = B * H
    if n_rows == 0:
        return q_fp8, w_out
    meta = dict(V4=variant == "v4", HADAMARD=use_h, FNUZ=fp8_format == "e4m3fnuz",
                PREC="tf32x3" if nvidia else "ieee", HMODE=HMODES[cfg["hmode"]],
                DOT_F32=not nvidia, HW_ENCODE=bool(cfg["hw_encode"]) and nvidia and fp8_format == "e4m3fn"
                and triton_utils.fp8_hardware(),
                FAST_DIV=bool(cfg["fast_div"]))
    if cfg.get("form", "rows") == "tok":   # token-major programs, see indexer_q_tok.py
        from .indexer_q_tok import launch_tok
        launch_tok(q, weight, weight_scale, torch.view_as_real(freqs_cis), positions, q_fp8.view(torch.uint8),
                   w_out, fmax, meta, tok=cfg.get("tok", 1), pieces=cfg.get("pieces", 4),
                   heads=cfg.get("heads", 128), num_warps=cfg.get("num_warps", 4), maxnreg=cfg.get("maxnreg"))
        return q_fp8, w_out
    if cfg.get("form", "rows") == "tree":  # split-tree Hadamard, no MMA, see indexer_q_tree.py
        from .indexer_q_tree_triton import launch_tree
        launch_tree(q, weight, weight_scale, torch.view_as_real(freqs_cis), positions, q_fp8.view(torch.uint8),
                    w_out, fmax, meta, tok=cfg.get("tok", 1), pieces=cfg.get("pieces", 8),
                    heads=cfg.get("heads", 128), freq=cfg.get("freq", 0), num_warps=cfg.get("num_warps", 4))
        return q_fp8, w_out
    meta["ROPE_SPLIT"] = bool(cfg["rope_split"])
    args = (q, weight, torch.view_as_real(freqs_cis), positions, _h32(q.device),
            q_fp8.view(torch.uint8), w_out, n_rows, H, q.stride(0), q.stride(1),
            weight.stride(0), weight.stride(1), float(weight_scale), fmax)
    if cfg["block_r"] is None:
        grid = lambda m: (triton.cdiv(n_rows, m["BLOCK_R"]),)  # noqa: E731
        _tuned[grid](*args, **meta)
    else:
        br = cfg["block_r"]
        extra = {"num_warps": cfg["num_warps"]} if cfg["num_warps"] else {}
        _indexer_q_kernel[(triton.cdiv(n_rows, br),)](*args, **meta, BLOCK_R=br, **extra)
    return q_fp8, w_out
