"""Triton kernel: indexer query prep, token-major form (one program = TOK tokens x HB heads).

Same op and arithmetic as indexer_q.py (see its docstring for HMODE and the fp8 encoders); what
changes is the split of the work, to cut what the row-major kernel spends besides bytes:
- rows r = t * HB + h of TOK tokens x HB heads (HB = next power of two >= H, masked; at least 16
  rows so tl.dot compiles), so the RoPE cos/sin are loaded once per token -- a [1, n] vector when
  TOK = 1, broadcast over the heads -- instead of a gathered [R, 32] pointer tile per row.
- PIECES = 4 ([R, 32] quarters, H128 = H4 (x) H32) or 8 ([R, 16] eighths, H128 = H8 (x) H16): the
  butterfly across pieces is elementwise (no data movement), the within-piece part is the HMODE
  form on W = 128 / PIECES columns; eighths halve the MMA work (8 x 16^2 vs 4 x 32^2 per row).
  PIECES = 16 ([R, 8] sixteenths, H16 (x) H8) uses no MMA: a piece is one 16-byte bf16 vector
  per thread, so the 8-point butterfly inside it should stay in registers (HMODE is ignored).
  (A whole-row [R, 128] x [128, 128] dot is 4x the quarters' MMA work -- 3xTF32 at T4096 x H64
  is ~26 GFLOP, ~50 us of tensor-core peak -- so there is no whole-row form.)
HMODE "lanes" / "lanes2" (PIECES = 4; no MMA): Triton (3.6, sm_90) lays a [R, 32] quarter out as
16 columns (32 bytes of bf16 in, 16 bytes of codes out) per thread and two threads per row, so
its codes store as one whole 32-byte sector per row and instruction -- ncu on the H200 showed the
one-row-per-thread tree form writing half sectors (its 16-byte stores are 16 of a row's 128 code
bytes), L2 at 75-80 % of its throughput with DRAM at 37 %. H32 = H2 (x) H16 on that layout: H16
on a thread's 16 columns by the split tree of indexer_q_tree.py (register renames), H2 across
the row's two threads as a sum over a size-2 axis (one shuffle + add: s = x0 + x1 in both lanes),
the upper lane then taking x0 - x1 as s - 2 x1 ("lanes": one fma; s's rounding, at most half an
ulp of s, carries into the difference) or as its own sum of (x0, -x1) ("lanes2": a second shuffle,
the difference rounded once as in a plain butterfly). 1/sqrt(128) is folded into 1/scale.
RoPE: v4 rotates interleaved pairs inside the upper pieces (view [R, W/2, 2] and split: the pair
is in one thread's registers); v3.2 pairs (i, 32 + i) are the same lane of two pieces (quarters
0/1, or eighths 0/2 and 1/3), so they need no data movement either.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ... import triton_utils
from ...checks import require
from .indexer_q_triton import OP
from .indexer_q_triton import _h32, _had32, _quant, _rope_pair
from .indexer_q_tree_triton import _wht16

NORM = tl.constexpr(0.08838834764831845)  # 1/sqrt(128), applied after the transform as the reference does


@triton.jit
def _freqs(f_ptr, pos, FIRST: tl.constexpr, N: tl.constexpr, TOK: tl.constexpr, HB: tl.constexpr):
    """cos, sin of pair indices FIRST .. FIRST+N-1 for the program's TOK tokens (pos [TOK] int64),
    shaped to broadcast over its rows: [1, N] when TOK == 1, else [TOK * HB, N]."""
    j = 2 * FIRST + tl.arange(0, 2 * N)                             # (cos, sin) interleaved: 16-byte loads
    c, s = tl.split(tl.reshape(tl.load((f_ptr + pos * 64)[:, None] + j[None, :]), (TOK, N, 2)))
    if TOK > 1:
        c = tl.reshape(tl.broadcast_to(c[:, None, :], (TOK, HB, N)), (TOK * HB, N))
        s = tl.reshape(tl.broadcast_to(s[:, None, :], (TOK, HB, N)), (TOK * HB, N))
    return c, s


@triton.jit
def _rope_il(x, c, s, R: tl.constexpr, W: tl.constexpr):
    """x [R, W] = W/2 interleaved pairs rotated by c, s (broadcastable to [R, W/2])."""
    a, b = tl.split(tl.reshape(x, (R, W // 2, 2)))
    a, b = _rope_pair(a, b, c, s)
    return tl.reshape(tl.join(a, b), (R, W))


@triton.jit
def _ld(base, K: tl.constexpr, W: tl.constexpr, m2):
    return tl.load(base + K * W + tl.arange(0, W)[None, :], mask=m2, other=0.0).to(tl.float32)


@triton.jit
def _st(out, K: tl.constexpr, W: tl.constexpr, x, inv, sc, fmax, m2,
        FNUZ: tl.constexpr, HW: tl.constexpr, FAST_DIV: tl.constexpr):
    tl.store(out + K * W + tl.arange(0, W)[None, :], _quant(x, inv, sc, fmax, FNUZ, HW, FAST_DIV), mask=m2)


@triton.jit
def _h2(a, b):
    return a + b, a - b


@triton.jit
def _amax(x):
    return tl.max(tl.abs(x), 1)


@triton.jit
def _lane_stage(x, EXACT: tl.constexpr):
    """Radix-2 stage over axis 1 (size 2) of x [R, 2, W]: (x0 + x1, x0 - x1) along it."""
    j = tl.arange(0, 2)[None, :, None]
    s = tl.expand_dims(tl.sum(x, 1), 1)
    if EXACT:
        d = tl.expand_dims(tl.sum(tl.where(j == 0, x, -x), 1), 1)
        y = tl.where(j == 0, s, d)
    else:
        y = s - (2 * j).to(tl.float32) * x          # the upper half: s - 2 x1
    return y


@triton.jit
def _lanes32(v, R: tl.constexpr, EXACT: tl.constexpr):
    """v [R, 32] times the natural-order 32-point Hadamard: H16 on columns 16l .. 16l + 15 (one
    thread's registers) by the split tree, then H2 across l (the row's two threads)."""
    x = tl.reshape(_wht16(tl.reshape(v, (R * 2, 16)), R * 2), (R, 2, 16))
    return tl.reshape(_lane_stage(x, EXACT), (R, 32))


@triton.jit
def _rope4(x, f_ptr, pos, FIRST: tl.constexpr, TOK: tl.constexpr, HB: tl.constexpr):
    c, s = _freqs(f_ptr, pos, FIRST, 4, TOK, HB)
    return _rope_il(x, c, s, TOK * HB, 8)


@triton.jit
def _h8(x0, x1, x2, x3, x4, x5, x6, x7, R: tl.constexpr):
    """H8 across eight [R, 8] pieces (elementwise), then the in-piece 8-point butterfly."""
    x0, x4 = _h2(x0, x4)
    x1, x5 = _h2(x1, x5)
    x2, x6 = _h2(x2, x6)
    x3, x7 = _h2(x3, x7)
    x0, x2 = _h2(x0, x2)
    x1, x3 = _h2(x1, x3)
    x4, x6 = _h2(x4, x6)
    x5, x7 = _h2(x5, x7)
    x0, x1 = _h2(x0, x1)
    x2, x3 = _h2(x2, x3)
    x4, x5 = _h2(x4, x5)
    x6, x7 = _h2(x6, x7)
    return (_had32(x0, x0, R, 3, "ieee", True, 8) * NORM, _had32(x1, x1, R, 3, "ieee", True, 8) * NORM,
            _had32(x2, x2, R, 3, "ieee", True, 8) * NORM, _had32(x3, x3, R, 3, "ieee", True, 8) * NORM,
            _had32(x4, x4, R, 3, "ieee", True, 8) * NORM, _had32(x5, x5, R, 3, "ieee", True, 8) * NORM,
            _had32(x6, x6, R, 3, "ieee", True, 8) * NORM, _had32(x7, x7, R, 3, "ieee", True, 8) * NORM)


@triton.jit
def _body4(base, out, m2, f_ptr, pos, h_ptr, fmax, V4: tl.constexpr, HADAMARD: tl.constexpr,
           FNUZ: tl.constexpr, PREC: tl.constexpr, HMODE: tl.constexpr, DOT_F32: tl.constexpr,
           HW: tl.constexpr, FAST_DIV: tl.constexpr, TOK: tl.constexpr, HB: tl.constexpr):
    R: tl.constexpr = TOK * HB
    x0 = _ld(base, 0, 32, m2)
    x1 = _ld(base, 1, 32, m2)
    x2 = _ld(base, 2, 32, m2)
    x3 = _ld(base, 3, 32, m2)
    if V4:
        c, s = _freqs(f_ptr, pos, 0, 16, TOK, HB)
        x2 = _rope_il(x2, c, s, R, 32)
        c, s = _freqs(f_ptr, pos, 16, 16, TOK, HB)
        x3 = _rope_il(x3, c, s, R, 32)
    else:
        c, s = _freqs(f_ptr, pos, 0, 32, TOK, HB)
        x0, x1 = _rope_pair(x0, x1, c, s)
    if HADAMARD:
        cols = tl.arange(0, 32)
        hm = tl.load(h_ptr + cols[:, None] * 32 + cols[None, :])    # [32, 32] of +-1
        x0, x2 = _h2(x0, x2)                                        # H4 across quarters
        x1, x3 = _h2(x1, x3)
        x0, x1 = _h2(x0, x1)
        x2, x3 = _h2(x2, x3)
        if HMODE >= 4:   # NORM is folded into the scale below
            x0 = _lanes32(x0, R, HMODE == 5)
            x1 = _lanes32(x1, R, HMODE == 5)
            x2 = _lanes32(x2, R, HMODE == 5)
            x3 = _lanes32(x3, R, HMODE == 5)
        else:
            x0 = _had32(x0, hm, R, HMODE, PREC, DOT_F32, 32) * NORM
            x1 = _had32(x1, hm, R, HMODE, PREC, DOT_F32, 32) * NORM
            x2 = _had32(x2, hm, R, HMODE, PREC, DOT_F32, 32) * NORM
            x3 = _had32(x3, hm, R, HMODE, PREC, DOT_F32, 32) * NORM
    amax = tl.maximum(tl.maximum(_amax(x0), _amax(x1)), tl.maximum(_amax(x2), _amax(x3)))
    FOLD: tl.constexpr = HADAMARD and HMODE >= 4
    if FOLD:   # rounding is monotonic: max |round(x * NORM)| = round(max |x| * NORM), the reference's amax
        amax = amax * NORM
    scale = tl.maximum(amax, 1e-4) / fmax                           # [R]
    sc = scale[:, None]
    inv = tl.math.div_rn(tl.full((R, 1), 1.0, tl.float32), sc)
    if FOLD:
        if FAST_DIV:   # x * (NORM / scale): one multiply per value
            inv = inv * NORM
        else:
            x0 = x0 * NORM
            x1 = x1 * NORM
            x2 = x2 * NORM
            x3 = x3 * NORM
    _st(out, 0, 32, x0, inv, sc, fmax, m2, FNUZ, HW, FAST_DIV)
    _st(out, 1, 32, x1, inv, sc, fmax, m2, FNUZ, HW, FAST_DIV)
    _st(out, 2, 32, x2, inv, sc, fmax, m2, FNUZ, HW, FAST_DIV)
    _st(out, 3, 32, x3, inv, sc, fmax, m2, FNUZ, HW, FAST_DIV)
    return scale


@triton.jit
def _body8(base, out, m2, f_ptr, pos, h_ptr, fmax, V4: tl.constexpr, HADAMARD: tl.constexpr,
           FNUZ: tl.constexpr, PREC: tl.constexpr, HMODE: tl.constexpr, DOT_F32: tl.constexpr,
           HW: tl.constexpr, FAST_DIV: tl.constexpr, TOK: tl.constexpr, HB: tl.constexpr):
    R: tl.constexpr = TOK * HB
    x0 = _ld(base, 0, 16, m2)
    x1 = _ld(base, 1, 16, m2)
    x2 = _ld(base, 2, 16, m2)
    x3 = _ld(base, 3, 16, m2)
    x4 = _ld(base, 4, 16, m2)
    x5 = _ld(base, 5, 16, m2)
    x6 = _ld(base, 6, 16, m2)
    x7 = _ld(base, 7, 16, m2)
    if V4:   # eighth 4 + k holds pairs 8k .. 8k + 7
        c, s = _freqs(f_ptr, pos, 0, 8, TOK, HB)
        x4 = _rope_il(x4, c, s, R, 16)
        c, s = _freqs(f_ptr, pos, 8, 8, TOK, HB)
        x5 = _rope_il(x5, c, s, R, 16)
        c, s = _freqs(f_ptr, pos, 16, 8, TOK, HB)
        x6 = _rope_il(x6, c, s, R, 16)
        c, s = _freqs(f_ptr, pos, 24, 8, TOK, HB)
        x7 = _rope_il(x7, c, s, R, 16)
    else:    # pair i < 16: eighths 0 / 2; pair 16 + i: eighths 1 / 3
        c, s = _freqs(f_ptr, pos, 0, 16, TOK, HB)
        x0, x2 = _rope_pair(x0, x2, c, s)
        c, s = _freqs(f_ptr, pos, 16, 16, TOK, HB)
        x1, x3 = _rope_pair(x1, x3, c, s)
    if HADAMARD:
        cols = tl.arange(0, 16)
        hm = tl.load(h_ptr + cols[:, None] * 16 + cols[None, :])    # [16, 16] of +-1
        x0, x4 = _h2(x0, x4)                                        # H8 across eighths: bit 2
        x1, x5 = _h2(x1, x5)
        x2, x6 = _h2(x2, x6)
        x3, x7 = _h2(x3, x7)
        x0, x2 = _h2(x0, x2)                                        # bit 1
        x1, x3 = _h2(x1, x3)
        x4, x6 = _h2(x4, x6)
        x5, x7 = _h2(x5, x7)
        x0, x1 = _h2(x0, x1)                                        # bit 0
        x2, x3 = _h2(x2, x3)
        x4, x5 = _h2(x4, x5)
        x6, x7 = _h2(x6, x7)
        x0 = _had32(x0, hm, R, HMODE, PREC, DOT_F32, 16) * NORM
        x1 = _had32(x1, hm, R, HMODE, PREC, DOT_F32, 16) * NORM
        x2 = _had32(x2, hm, R, HMODE, PREC, DOT_F32, 16) * NORM
        x3 = _had32(x3, hm, R, HMODE, PREC, DOT_F32, 16) * NORM
        x4 = _had32(x4, hm, R, HMODE, PREC, DOT_F32, 16) * NORM
        x5 = _had32(x5, hm, R, HMODE, PREC, DOT_F32, 16) * NORM
        x6 = _had32(x6, hm, R, HMODE, PREC, DOT_F32, 16) * NORM
        x7 = _had32(x7, hm, R, HMODE, PREC, DOT_F32, 16) * NORM
    amax = tl.maximum(tl.maximum(tl.maximum(_amax(x0), _amax(x1)), tl.maximum(_amax(x2), _amax(x3))),
                      tl.maximum(tl.maximum(_amax(x4), _amax(x5)), tl.maximum(_amax(x6), _amax(x7))))
    scale = tl.maximum(amax, 1e-4) / fmax                           # [R]
    sc = scale[:, None]
    inv = tl.math.div_rn(tl.full((R, 1), 1.0, tl.float32), sc)
    _st(out, 0, 16, x0, inv, sc, fmax, m2, FNUZ, HW, FAST_DIV)
    _st(out, 1, 16, x1, inv, sc, fmax, m2, FNUZ, HW, FAST_DIV)
    _st(out, 2, 16, x2, inv, sc, fmax, m2, FNUZ, HW, FAST_DIV)
    _st(out, 3, 16, x3, inv, sc, fmax, m2, FNUZ, HW, FAST_DIV)
    _st(out, 4, 16, x4, inv, sc, fmax, m2, FNUZ, HW, FAST_DIV)
    _st(out, 5, 16, x5, inv, sc, fmax, m2, FNUZ, HW, FAST_DIV)
    _st(out, 6, 16, x6, inv, sc, fmax, m2, FNUZ, HW, FAST_DIV)
    _st(out, 7, 16, x7, inv, sc, fmax, m2, FNUZ, HW, FAST_DIV)
    return scale


@triton.jit
def _body16(base, out, m2, f_ptr, pos, fmax, V4: tl.constexpr, HADAMARD: tl.constexpr,
            FNUZ: tl.constexpr, HW: tl.constexpr, FAST_DIV: tl.constexpr, TOK: tl.constexpr, HB: tl.constexpr):
    """Sixteenths [R, 8]: one 16-byte vector of bf16 per row and thread, so the 8-point butterfly
    inside a piece can stay in registers and H16 across pieces is elementwise: no MMA at all."""
    R: tl.constexpr = TOK * HB
    x0 = _ld(base, 0, 8, m2)
    x1 = _ld(base, 1, 8, m2)
    x2 = _ld(base, 2, 8, m2)
    x3 = _ld(base, 3, 8, m2)
    x4 = _ld(base, 4, 8, m2)
    x5 = _ld(base, 5, 8, m2)
    x6 = _ld(base, 6, 8, m2)
    x7 = _ld(base, 7, 8, m2)
    x8 = _ld(base, 8, 8, m2)
    x9 = _ld(base, 9, 8, m2)
    xa = _ld(base, 10, 8, m2)
    xb = _ld(base, 11, 8, m2)
    xc = _ld(base, 12, 8, m2)
    xd = _ld(base, 13, 8, m2)
    xe = _ld(base, 14, 8, m2)
    xf = _ld(base, 15, 8, m2)
    if V4:   # piece 8 + k holds pairs 4k .. 4k + 3
        x8 = _rope4(x8, f_ptr, pos, 0, TOK, HB)
        x9 = _rope4(x9, f_ptr, pos, 4, TOK, HB)
        xa = _rope4(xa, f_ptr, pos, 8, TOK, HB)
        xb = _rope4(xb, f_ptr, pos, 12, TOK, HB)
        xc = _rope4(xc, f_ptr, pos, 16, TOK, HB)
        xd = _rope4(xd, f_ptr, pos, 20, TOK, HB)
        xe = _rope4(xe, f_ptr, pos, 24, TOK, HB)
        xf = _rope4(xf, f_ptr, pos, 28, TOK, HB)
    else:    # pair 8k + i: pieces k / 4 + k
        c, s = _freqs(f_ptr, pos, 0, 8, TOK, HB)
        x0, x4 = _rope_pair(x0, x4, c, s)
        c, s = _freqs(f_ptr, pos, 8, 8, TOK, HB)
        x1, x5 = _rope_pair(x1, x5, c, s)
        c, s = _freqs(f_ptr, pos, 16, 8, TOK, HB)
        x2, x6 = _rope_pair(x2, x6, c, s)
        c, s = _freqs(f_ptr, pos, 24, 8, TOK, HB)
        x3, x7 = _rope_pair(x3, x7, c, s)
    if HADAMARD:   # H16 across pieces (bits 3..0 of the piece index), then H8 inside each
        x0, x8 = _h2(x0, x8)
        x1, x9 = _h2(x1, x9)
        x2, xa = _h2(x2, xa)
        x3, xb = _h2(x3, xb)
        x4, xc = _h2(x4, xc)
        x5, xd = _h2(x5, xd)
        x6, xe = _h2(x6, xe)
        x7, xf = _h2(x7, xf)
        x0, x1, x2, x3, x4, x5, x6, x7 = _h8(x0, x1, x2, x3, x4, x5, x6, x7, R)
        x8, x9, xa, xb, xc, xd, xe, xf = _h8(x8, x9, xa, xb, xc, xd, xe, xf, R)
    amax = tl.maximum(tl.maximum(tl.maximum(_amax(x0), _amax(x1)), tl.maximum(_amax(x2), _amax(x3))),
                      tl.maximum(tl.maximum(_amax(x4), _amax(x5)), tl.maximum(_amax(x6), _amax(x7))))
    amax = tl.maximum(amax, tl.maximum(tl.maximum(tl.maximum(_amax(x8), _amax(x9)),
                                                  tl.maximum(_amax(xa), _amax(xb))),
                                       tl.maximum(tl.maximum(_amax(xc), _amax(xd)),
                                                  tl.maximum(_amax(xe), _amax(xf)))))
    scale = tl.maximum(amax, 1e-4) / fmax                           # [R]
    sc = scale[:, None]
    inv = tl.math.div_rn(tl.full((R, 1), 1.0, tl.float32), sc)
    _st(out, 0, 8, x0, inv, sc, fmax, m2, FNUZ, HW, FAST_DIV)
    _st(out, 1, 8, x1, inv, sc, fmax, m2, FNUZ, HW, FAST_DIV)
    _st(out, 2, 8, x2, inv, sc, fmax, m2, FNUZ, HW, FAST_DIV)
    _st(out, 3, 8, x3, inv, sc, fmax, m2, FNUZ, HW, FAST_DIV)
    _st(out, 4, 8, x4, inv, sc, fmax, m2, FNUZ, HW, FAST_DIV)
    _st(out, 5, 8, x5, inv, sc, fmax, m2, FNUZ, HW, FAST_DIV)
    _st(out, 6, 8, x6, inv, sc, fmax, m2, FNUZ, HW, FAST_DIV)
    _st(out, 7, 8, x7, inv, sc, fmax, m2, FNUZ, HW, FAST_DIV)
    _st(out, 8, 8, x8, inv, sc, fmax, m2, FNUZ, HW, FAST_DIV)
    _st(out, 9, 8, x9, inv, sc, fmax, m2, FNUZ, HW, FAST_DIV)
    _st(out, 10, 8, xa, inv, sc, fmax, m2, FNUZ, HW, FAST_DIV)
    _st(out, 11, 8, xb, inv, sc, fmax, m2, FNUZ, HW, FAST_DIV)
    _st(out, 12, 8, xc, inv, sc, fmax, m2, FNUZ, HW, FAST_DIV)
    _st(out, 13, 8, xd, inv, sc, fmax, m2, FNUZ, HW, FAST_DIV)
    _st(out, 14, 8, xe, inv, sc, fmax, m2, FNUZ, HW, FAST_DIV)
    _st(out, 15, 8, xf, inv, sc, fmax, m2, FNUZ, HW, FAST_DIV)
    return scale


@triton.jit
def _indexer_q_tok_kernel(q_ptr, w_ptr, f_ptr, pos_ptr, h_ptr, qo_ptr, wo_ptr,
                          B, H, s_qb, s_qh, s_wb, s_wh, weight_scale, fmax,
                          V4: tl.constexpr, HADAMARD: tl.constexpr, FNUZ: tl.constexpr,
                          PREC: tl.constexpr, HMODE: tl.constexpr, DOT_F32: tl.constexpr,
                          HW_ENCODE: tl.constexpr, FAST_DIV: tl.constexpr,
                          TOK: tl.constexpr, HB: tl.constexpr, PIECES: tl.constexpr):
    r = tl.arange(0, TOK * HB)                                      # [R], r = t * HB + h
    toks = tl.program_id(0) * TOK + tl.arange(0, TOK)               # [TOK]
    tok = tl.program_id(0) * TOK + r // HB
    head = tl.program_id(1) * HB + r % HB
    rmask = (tok < B) & (head < H)
    m2 = rmask[:, None]
    base = (q_ptr + tok.to(tl.int64) * s_qb + head * s_qh)[:, None]
    out = (qo_ptr + (tok.to(tl.int64) * H + head) * 128)[:, None]
    pos = tl.load(pos_ptr + toks, mask=toks < B, other=0).to(tl.int64)
    if PIECES == 16:
        scale = _body16(base, out, m2, f_ptr, pos, fmax, V4, HADAMARD, FNUZ, HW_ENCODE, FAST_DIV, TOK, HB)
    elif PIECES == 4:
        scale = _body4(base, out, m2, f_ptr, pos, h_ptr, fmax, V4, HADAMARD, FNUZ, PREC, HMODE, DOT_F32,
                       HW_ENCODE, FAST_DIV, TOK, HB)
    else:
        scale = _body8(base, out, m2, f_ptr, pos, h_ptr, fmax, V4, HADAMARD, FNUZ, PREC, HMODE, DOT_F32,
                       HW_ENCODE, FAST_DIV, TOK, HB)
    w = tl.load(w_ptr + tok * s_wb + head * s_wh, mask=rmask, other=0.0).to(tl.float32)
    tl.store(wo_ptr + tok * H + head, w * weight_scale * scale, mask=rmask)


def launch_tok(q, weight, weight_scale, freqs_real, positions, q_u8, w_out, fmax, meta,
               tok=1, pieces=4, heads=128, num_warps=4, maxnreg=None):
    """Grid: (token blocks, head blocks). tok and the head block are rounded to powers of two and
    grown to >= 16 rows per program (tl.dot's minimum). maxnreg (NVIDIA only): a cap on registers
    per thread, for more resident warps (lanes at 96 -> 80 registers: 5 -> 6 programs per SM on the
    H200, 35.4 -> 32.5 us; 72 spills and is slower). A grid-stride loop over token blocks with
    Triton's cp.async pipelining (2-3 stages, 3-6 programs per SM) measured 37-44 us: not kept."""
    require(pieces == 4 or meta["HMODE"] < 4, OP, f"tok form: hmode lanes / lanes2 need pieces=4, got {pieces}")
    B, H, _ = q.shape
    hb = min(triton.next_power_of_2(H), heads)
    tok = triton.next_power_of_2(max(tok, triton.cdiv(16, hb)))
    grid = (triton.cdiv(B, tok), triton.cdiv(H, hb))
    extra = {"num_warps": num_warps} if num_warps else {}
    if maxnreg and triton_utils.nvidia(q.device):
        extra["maxnreg"] = maxnreg
    _indexer_q_tok_kernel[grid](
        q, weight, freqs_real, positions, _h32(q.device, 128 // pieces), q_u8, w_out,
        B, H, q.stride(0), q.stride(1), weight.stride(0), weight.stride(1), float(weight_scale), fmax,
        **meta, TOK=tok, HB=hb, PIECES=pieces, **extra)
