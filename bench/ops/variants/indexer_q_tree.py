"""Sweep-only variant (bench/ops/variants, not dispatched): indexer query prep, "split tree" form.

The op fused_q_indexer_rope_hadamard_quant with no permutes and no MMA, one row per thread.
Measured on the H200 (T4096 x H64 v4): 51.0 us at 4 pieces, 0.48 of the byte floor; ncu showed it
L2-bound on half-sector code stores (16 of a row's 128 bytes per thread and instruction), which the
package's token-major "lanes" kernel (32.5 us) avoids. Kept runnable for bench/ops/indexer_sweep.py.

Same arithmetic as kernelgate/ops/indexer/indexer_q_triton.py (fp32 throughout, the same _quant / fp8 encoders); what
changes is how the 128-point Walsh-Hadamard transform is laid out, so that no value has to move
between threads (the other forms spend their time in layout conversions, not in FLOPs):
- a row (one (token, head)) is loaded as P pieces of W = 128 / P contiguous bf16 (P = 8, 4, 2:
  two, four, eight 16-byte vectors per thread and piece). With one row per thread (R = 32 *
  num_warps rows), every piece's columns sit in one thread's registers: 128 fp32 per thread
  (the H200 sweep: p16 [R, 8] 81 us, p8 [R, 16] 51 us, so p16 was dropped for wider pieces).
- column i = W * p + b: H128 = H_P (x) H_W (Sylvester order is separable). H_P acts across the
  pieces, elementwise between separate tensors; H_W acts inside a piece as a "split tree":
  the butterfly on bit 0 of x [R, W] is e, o = split(reshape(x, [R, W/2, 2])), then (e + o,
  e - o) each take the W/2-point transform on bits 1.. and are rebuilt by join + reshape
  (out[2j] from e + o, out[2j + 1] from e - o). split / join / reshape of a trailing dim held
  in one thread are register renames. W = 64 is a 6-level tree, W = 32 five, W = 16 four.
- RoPE v4 rotates the interleaved pairs (2i, 2i + 1) of dims 64..127 = the even / odd lanes of
  the upper pieces: exactly the tree's first split, so it costs no extra split. RoPE v3.2 pairs
  (i, 32 + i) are the same lane of pieces k and k + 32 / W (W <= 32); with W = 64 both lanes are
  in piece 0, loaded as two halves, rotated, then put back together (_cat).
- cos / sin (FREQ): 0 = per-token vectors ([1, n] when TOK == 1, broadcast over the heads),
  1 = gathered per row as [R, n], 2 = gathered per row as the interleaved (cos, sin) pairs and
  split like q (same shape as the piece's split halves).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernelgate import alloc
from kernelgate.checks import require
from kernelgate.ops.common import fp8 as _fp8
from kernelgate.ops.indexer.indexer_q_triton import OP, _quant, _rope_pair, dense_freqs

PIECES = (8, 4, 2)

NORM = tl.constexpr(0.08838834764831845)  # 1/sqrt(128), applied after the transform as the reference does


@triton.jit
def _bf(a, b):
    return a + b, a - b


@triton.jit
def _halves(x, R: tl.constexpr, W: tl.constexpr):
    """[R, W] -> even, odd columns [R, W // 2]."""
    return tl.split(tl.reshape(x, (R, W // 2, 2)))


@triton.jit
def _interleave(e, o, R: tl.constexpr, W: tl.constexpr):
    """even, odd columns [R, W // 2] -> [R, W] (inverse of _halves)."""
    return tl.reshape(tl.join(e, o), (R, W))


@triton.jit
def _wht2(x, R: tl.constexpr):
    a, b = tl.split(x)                                              # x [R, 2]
    a, b = _bf(a, b)
    return tl.join(a, b)


@triton.jit
def _wht4(x, R: tl.constexpr):
    e, o = _halves(x, R, 4)
    e, o = _bf(e, o)
    return _interleave(_wht2(e, R), _wht2(o, R), R, 4)


@triton.jit
def _wht8(x, R: tl.constexpr):
    e, o = _halves(x, R, 8)
    e, o = _bf(e, o)
    return _interleave(_wht4(e, R), _wht4(o, R), R, 8)


@triton.jit
def _wht16(x, R: tl.constexpr):
    e, o = _halves(x, R, 16)
    e, o = _bf(e, o)
    return _interleave(_wht8(e, R), _wht8(o, R), R, 16)


@triton.jit
def _wht32(x, R: tl.constexpr):
    e, o = _halves(x, R, 32)
    e, o = _bf(e, o)
    return _interleave(_wht16(e, R), _wht16(o, R), R, 32)


@triton.jit
def _wht(x, R: tl.constexpr, W: tl.constexpr):
    """W-point transform of x [R, W], W = 4 .. 32 (a piece's halves)."""
    if W == 32:
        y = _wht32(x, R)
    elif W == 16:
        y = _wht16(x, R)
    elif W == 8:
        y = _wht8(x, R)
    else:
        y = _wht4(x, R)
    return y


@triton.jit
def _piece(x, c, s, ROPE: tl.constexpr, HAD: tl.constexpr, R: tl.constexpr, W: tl.constexpr):
    """One [R, W] piece (W = 16, 32 or 64): interleaved RoPE by c, s ([*, W/2]) if ROPE, then the W-point
    transform if HAD; both on the same first split."""
    y = x
    if ROPE or HAD:
        e, o = _halves(x, R, W)
        if ROPE:
            e, o = _rope_pair(e, o, c, s)
        if HAD:
            e, o = _bf(e, o)
            e = _wht(e, R, W // 2)
            o = _wht(o, R, W // 2)
        y = _interleave(e, o, R, W)
    return y


@triton.jit
def _h4x(x0, x1, x2, x3):
    """H4 across four pieces (elementwise)."""
    x0, x2 = _bf(x0, x2)
    x1, x3 = _bf(x1, x3)
    x0, x1 = _bf(x0, x1)
    x2, x3 = _bf(x2, x3)
    return x0, x1, x2, x3


@triton.jit
def _h8x(x0, x1, x2, x3, x4, x5, x6, x7):
    x0, x4 = _bf(x0, x4)
    x1, x5 = _bf(x1, x5)
    x2, x6 = _bf(x2, x6)
    x3, x7 = _bf(x3, x7)
    x0, x1, x2, x3 = _h4x(x0, x1, x2, x3)
    x4, x5, x6, x7 = _h4x(x4, x5, x6, x7)
    return x0, x1, x2, x3, x4, x5, x6, x7


@triton.jit
def _cs8(f_ptr, prow, FIRST: tl.constexpr, R: tl.constexpr):
    """cos, sin [R, 8] of pairs FIRST .. FIRST + 7 at each row's position."""
    return _halves(tl.load((f_ptr + prow * 64)[:, None] + 2 * FIRST + tl.arange(0, 16)[None, :]), R, 16)


@triton.jit
def _freqs(f_ptr, pos, prow, FIRST: tl.constexpr, N: tl.constexpr, FREQ: tl.constexpr,
           TOK: tl.constexpr, HB: tl.constexpr):
    """cos, sin of pairs FIRST .. FIRST + N - 1, broadcastable to [TOK * HB, N]. pos [TOK] and
    prow [R] (each row's position) are int64; freqs rows are 64 floats, (cos, sin) interleaved."""
    R: tl.constexpr = TOK * HB
    j = FIRST + tl.arange(0, N)
    if FREQ == 2:   # 16 floats (8 pairs) per load: wider fp32 loads put a row on several threads
        c, s = _cs8(f_ptr, prow, FIRST, R)
        if N >= 16:
            c1, s1 = _cs8(f_ptr, prow, FIRST + 8, R)
            c = _cat(c, c1, R, 8)
            s = _cat(s, s1, R, 8)
        if N == 32:
            c2, s2 = _cs8(f_ptr, prow, FIRST + 16, R)
            c3, s3 = _cs8(f_ptr, prow, FIRST + 24, R)
            c = _cat(c, _cat(c2, c3, R, 8), R, 16)
            s = _cat(s, _cat(s2, s3, R, 8), R, 16)
    elif FREQ == 1:
        fb = (f_ptr + prow * 64)[:, None] + 2 * j[None, :]
        c = tl.load(fb)
        s = tl.load(fb + 1)
    else:
        fb = (f_ptr + pos * 64)[:, None] + 2 * j[None, :]           # [TOK, N]
        c = tl.load(fb)
        s = tl.load(fb + 1)
        if TOK > 1:
            c = tl.reshape(tl.broadcast_to(c[:, None, :], (TOK, HB, N)), (R, N))
            s = tl.reshape(tl.broadcast_to(s[:, None, :], (TOK, HB, N)), (R, N))
    return c, s


@triton.jit
def _cat(lo, hi, R: tl.constexpr, N: tl.constexpr):
    """lo, hi [R, N] -> [R, 2N] = lo then hi (join puts them on a trailing axis; move it first)."""
    return tl.reshape(tl.permute(tl.join(lo, hi), (0, 2, 1)), (R, 2 * N))


@triton.jit
def _ld16(base, K: tl.constexpr, m2):
    return tl.load(base + K * 16 + tl.arange(0, 16)[None, :], mask=m2, other=0.0).to(tl.float32)


@triton.jit
def _ld(base, K: tl.constexpr, W: tl.constexpr, m2):
    """Piece K [R, W] as fp32. Wider than 16, Triton (3.6, sm_90) lays a [R, W] bf16 load out over two
    threads per row, and the tree then converts every level: build it from [R, 16] loads instead."""
    R: tl.constexpr = m2.shape[0]
    if W == 64:
        x = _cat(_cat(_ld16(base, 4 * K, m2), _ld16(base, 4 * K + 1, m2), R, 16),
                 _cat(_ld16(base, 4 * K + 2, m2), _ld16(base, 4 * K + 3, m2), R, 16), R, 32)
    elif W == 32:
        x = _cat(_ld16(base, 2 * K, m2), _ld16(base, 2 * K + 1, m2), R, 16)
    else:
        x = tl.load(base + K * W + tl.arange(0, W)[None, :], mask=m2, other=0.0).to(tl.float32)
    return x


@triton.jit
def _uncat(x, R: tl.constexpr, N: tl.constexpr):
    """x [R, 2N] -> its halves [R, N] (inverse of _cat)."""
    return tl.split(tl.permute(tl.reshape(x, (R, 2, N)), (0, 2, 1)))


@triton.jit
def _st16(out, K: tl.constexpr, y, m2):
    tl.store(out + K * 16 + tl.arange(0, 16)[None, :], y, mask=m2)


@triton.jit
def _st(out, K: tl.constexpr, W: tl.constexpr, x, inv, sc, fmax, m2, HAD: tl.constexpr,
        FNUZ: tl.constexpr, HW: tl.constexpr, FAST_DIV: tl.constexpr):
    """Codes of piece K, stored 16 per row and thread: Triton caps a store at 128 bits per thread, so a
    wider u8 store would put a row on several threads and that layout would spread back up the tree."""
    R: tl.constexpr = m2.shape[0]
    if HAD:
        if FAST_DIV:    # one multiply per value, x * (NORM / scale): a rounding step fewer than
            inv = inv * NORM    # (x * NORM) * (1 / scale), within FAST_DIV's one-code difference
        else:
            x = x * NORM
    y = _quant(x, inv, sc, fmax, FNUZ, HW, FAST_DIV)               # [R, W] u8
    if W == 64:
        a, b = _uncat(y, R, 32)
        a0, a1 = _uncat(a, R, 16)
        b0, b1 = _uncat(b, R, 16)
        _st16(out, 4 * K, a0, m2)
        _st16(out, 4 * K + 1, a1, m2)
        _st16(out, 4 * K + 2, b0, m2)
        _st16(out, 4 * K + 3, b1, m2)
    elif W == 32:
        a, b = _uncat(y, R, 16)
        _st16(out, 2 * K, a, m2)
        _st16(out, 2 * K + 1, b, m2)
    else:
        _st16(out, K, y, m2)


@triton.jit
def _amax4(x0, x1, x2, x3):
    """elementwise max of |x| over four pieces."""
    return tl.maximum(tl.maximum(tl.abs(x0), tl.abs(x1)), tl.maximum(tl.abs(x2), tl.abs(x3)))


@triton.jit
def _up(x, f_ptr, pos, prow, K: tl.constexpr, N: tl.constexpr, V4: tl.constexpr, HAD: tl.constexpr,
        FREQ: tl.constexpr, TOK: tl.constexpr, HB: tl.constexpr, W: tl.constexpr):
    """Upper-half piece K (v4: its RoPE pairs are N * K .. N * K + N - 1 of the rope dims)."""
    R: tl.constexpr = TOK * HB
    if V4:
        c, s = _freqs(f_ptr, pos, prow, N * K, N, FREQ, TOK, HB)
        y = _piece(x, c, s, True, HAD, R, W)
    else:
        y = _piece(x, x, x, False, HAD, R, W)
    return y


@triton.jit
def _scales(amax, fmax, HAD: tl.constexpr, R: tl.constexpr):
    """amax [R, W] (elementwise over pieces, before NORM) -> scale [R], its reciprocal [R, 1]. Rounding
    is monotonic, so max |round(x * NORM)| = round(max |x| * NORM): the reference's amax exactly."""
    a = tl.max(amax, 1)
    if HAD:
        a = a * NORM
    scale = tl.maximum(a, 1e-4) / fmax
    inv = tl.math.div_rn(tl.full((R, 1), 1.0, tl.float32), scale[:, None])
    return scale, inv


@triton.jit
def _body8(base, out, m2, f_ptr, pos, prow, fmax, V4: tl.constexpr, HAD: tl.constexpr, FNUZ: tl.constexpr,
           HW: tl.constexpr, FAST_DIV: tl.constexpr, FREQ: tl.constexpr, TOK: tl.constexpr, HB: tl.constexpr):
    """Eight [R, 16] pieces: H16 inside by the split tree, H8 across."""
    R: tl.constexpr = TOK * HB
    x0 = _ld(base, 0, 16, m2)
    x1 = _ld(base, 1, 16, m2)
    x2 = _ld(base, 2, 16, m2)
    x3 = _ld(base, 3, 16, m2)
    x4 = _ld(base, 4, 16, m2)
    x5 = _ld(base, 5, 16, m2)
    x6 = _ld(base, 6, 16, m2)
    x7 = _ld(base, 7, 16, m2)
    if not V4:   # pair 16k + i: lane i of pieces k, 2 + k
        F: tl.constexpr = 1 if FREQ == 2 else FREQ
        c, s = _freqs(f_ptr, pos, prow, 0, 16, F, TOK, HB)
        x0, x2 = _rope_pair(x0, x2, c, s)
        c, s = _freqs(f_ptr, pos, prow, 16, 16, F, TOK, HB)
        x1, x3 = _rope_pair(x1, x3, c, s)
    x0 = _piece(x0, x0, x0, False, HAD, R, 16)
    x1 = _piece(x1, x1, x1, False, HAD, R, 16)
    x2 = _piece(x2, x2, x2, False, HAD, R, 16)
    x3 = _piece(x3, x3, x3, False, HAD, R, 16)
    x4 = _up(x4, f_ptr, pos, prow, 0, 8, V4, HAD, FREQ, TOK, HB, 16)  # v4: piece 4 + k has pairs 8k..8k+7
    x5 = _up(x5, f_ptr, pos, prow, 1, 8, V4, HAD, FREQ, TOK, HB, 16)
    x6 = _up(x6, f_ptr, pos, prow, 2, 8, V4, HAD, FREQ, TOK, HB, 16)
    x7 = _up(x7, f_ptr, pos, prow, 3, 8, V4, HAD, FREQ, TOK, HB, 16)
    if HAD:
        x0, x1, x2, x3, x4, x5, x6, x7 = _h8x(x0, x1, x2, x3, x4, x5, x6, x7)
    scale, inv = _scales(tl.maximum(_amax4(x0, x1, x2, x3), _amax4(x4, x5, x6, x7)), fmax, HAD, R)
    sc = scale[:, None]
    _st(out, 0, 16, x0, inv, sc, fmax, m2, HAD, FNUZ, HW, FAST_DIV)
    _st(out, 1, 16, x1, inv, sc, fmax, m2, HAD, FNUZ, HW, FAST_DIV)
    _st(out, 2, 16, x2, inv, sc, fmax, m2, HAD, FNUZ, HW, FAST_DIV)
    _st(out, 3, 16, x3, inv, sc, fmax, m2, HAD, FNUZ, HW, FAST_DIV)
    _st(out, 4, 16, x4, inv, sc, fmax, m2, HAD, FNUZ, HW, FAST_DIV)
    _st(out, 5, 16, x5, inv, sc, fmax, m2, HAD, FNUZ, HW, FAST_DIV)
    _st(out, 6, 16, x6, inv, sc, fmax, m2, HAD, FNUZ, HW, FAST_DIV)
    _st(out, 7, 16, x7, inv, sc, fmax, m2, HAD, FNUZ, HW, FAST_DIV)
    return scale


@triton.jit
def _body4(base, out, m2, f_ptr, pos, prow, fmax, V4: tl.constexpr, HAD: tl.constexpr, FNUZ: tl.constexpr,
           HW: tl.constexpr, FAST_DIV: tl.constexpr, FREQ: tl.constexpr, TOK: tl.constexpr, HB: tl.constexpr):
    """Four [R, 32] pieces: H32 inside by the split tree, H4 across."""
    R: tl.constexpr = TOK * HB
    x0 = _ld(base, 0, 32, m2)
    x1 = _ld(base, 1, 32, m2)
    x2 = _ld(base, 2, 32, m2)
    x3 = _ld(base, 3, 32, m2)
    if not V4:   # pair i: lane i of pieces 0, 1
        F: tl.constexpr = 1 if FREQ == 2 else FREQ
        c, s = _freqs(f_ptr, pos, prow, 0, 32, F, TOK, HB)
        x0, x1 = _rope_pair(x0, x1, c, s)
    x0 = _piece(x0, x0, x0, False, HAD, R, 32)
    x1 = _piece(x1, x1, x1, False, HAD, R, 32)
    x2 = _up(x2, f_ptr, pos, prow, 0, 16, V4, HAD, FREQ, TOK, HB, 32)  # v4: piece 2 + k has pairs 16k..16k+15
    x3 = _up(x3, f_ptr, pos, prow, 1, 16, V4, HAD, FREQ, TOK, HB, 32)
    if HAD:
        x0, x1, x2, x3 = _h4x(x0, x1, x2, x3)
    scale, inv = _scales(_amax4(x0, x1, x2, x3), fmax, HAD, R)
    sc = scale[:, None]
    _st(out, 0, 32, x0, inv, sc, fmax, m2, HAD, FNUZ, HW, FAST_DIV)
    _st(out, 1, 32, x1, inv, sc, fmax, m2, HAD, FNUZ, HW, FAST_DIV)
    _st(out, 2, 32, x2, inv, sc, fmax, m2, HAD, FNUZ, HW, FAST_DIV)
    _st(out, 3, 32, x3, inv, sc, fmax, m2, HAD, FNUZ, HW, FAST_DIV)
    return scale


@triton.jit
def _body2(base, out, m2, f_ptr, pos, prow, fmax, V4: tl.constexpr, HAD: tl.constexpr, FNUZ: tl.constexpr,
           HW: tl.constexpr, FAST_DIV: tl.constexpr, FREQ: tl.constexpr, TOK: tl.constexpr, HB: tl.constexpr):
    """Two [R, 64] pieces: H64 inside by the split tree, H2 across."""
    R: tl.constexpr = TOK * HB
    if V4:
        x0 = _ld(base, 0, 64, m2)
    else:        # pair i = lanes i, 32 + i of piece 0: RoPE on its two halves, then one piece again
        F: tl.constexpr = 1 if FREQ == 2 else FREQ
        lo = _ld(base, 0, 32, m2)
        hi = _ld(base, 1, 32, m2)
        c, s = _freqs(f_ptr, pos, prow, 0, 32, F, TOK, HB)
        lo, hi = _rope_pair(lo, hi, c, s)
        x0 = _cat(lo, hi, R, 32)
    x1 = _ld(base, 1, 64, m2)
    x0 = _piece(x0, x0, x0, False, HAD, R, 64)
    x1 = _up(x1, f_ptr, pos, prow, 0, 32, V4, HAD, FREQ, TOK, HB, 64)  # v4: piece 1 has pairs 0..31
    if HAD:
        x0, x1 = _bf(x0, x1)
    scale, inv = _scales(tl.maximum(tl.abs(x0), tl.abs(x1)), fmax, HAD, R)
    sc = scale[:, None]
    _st(out, 0, 64, x0, inv, sc, fmax, m2, HAD, FNUZ, HW, FAST_DIV)
    _st(out, 1, 64, x1, inv, sc, fmax, m2, HAD, FNUZ, HW, FAST_DIV)
    return scale


@triton.jit
def _indexer_q_tree_kernel(q_ptr, w_ptr, f_ptr, pos_ptr, qo_ptr, wo_ptr,
                           B, H, s_qb, s_qh, s_wb, s_wh, weight_scale, fmax,
                           V4: tl.constexpr, HADAMARD: tl.constexpr, FNUZ: tl.constexpr,
                           HW_ENCODE: tl.constexpr, FAST_DIV: tl.constexpr, FREQ: tl.constexpr,
                           TOK: tl.constexpr, HB: tl.constexpr, PIECES: tl.constexpr):
    r = tl.arange(0, TOK * HB)                                      # [R], r = t * HB + h
    toks = tl.program_id(0) * TOK + tl.arange(0, TOK)               # [TOK]
    tok = tl.program_id(0) * TOK + r // HB
    head = tl.program_id(1) * HB + r % HB
    rmask = (tok < B) & (head < H)
    m2 = rmask[:, None]
    base = (q_ptr + tok.to(tl.int64) * s_qb + head * s_qh)[:, None]
    out = (qo_ptr + (tok.to(tl.int64) * H + head) * 128)[:, None]
    if FREQ == 0:
        pos = tl.load(pos_ptr + toks, mask=toks < B, other=0).to(tl.int64)
        prow = pos
    else:     # each row's own position (a masked row reads position 0's freqs, unused)
        prow = tl.load(pos_ptr + tok, mask=rmask, other=0).to(tl.int64)
        pos = prow
    if PIECES == 8:
        scale = _body8(base, out, m2, f_ptr, pos, prow, fmax, V4, HADAMARD, FNUZ, HW_ENCODE, FAST_DIV, FREQ,
                       TOK, HB)
    elif PIECES == 4:
        scale = _body4(base, out, m2, f_ptr, pos, prow, fmax, V4, HADAMARD, FNUZ, HW_ENCODE, FAST_DIV, FREQ,
                       TOK, HB)
    else:
        scale = _body2(base, out, m2, f_ptr, pos, prow, fmax, V4, HADAMARD, FNUZ, HW_ENCODE, FAST_DIV, FREQ,
                       TOK, HB)
    w = tl.load(w_ptr + tok * s_wb + head * s_wh, mask=rmask, other=0.0).to(tl.float32)
    tl.store(wo_ptr + tok * H + head, w * weight_scale * scale, mask=rmask)


def launch(q, weight, weight_scale, freqs_cis, positions, variant="v4", fp8_format="e4m3fn", hadamard=None,
           tok=1, pieces=8, heads=128, freq=0, num_warps=4, hw_encode=False, fast_div=False):
    """The op by the split-tree kernel (hw_encode: the e4m3fn hardware cast, NVIDIA sm_89+ only)."""
    require(q.stride(-1) == 1, OP, f"tree form: q must be contiguous in the head dim, got strides {q.stride()}")
    freqs_cis = dense_freqs(freqs_cis)
    B, H, D = q.shape
    dtype, fmax = _fp8.FORMATS[fp8_format]
    q_fp8 = alloc.empty((B, H, D), dtype, q.device)
    w_out = alloc.empty((B, H, 1), torch.float32, q.device)
    meta = dict(V4=variant == "v4", HADAMARD=(variant == "v4") if hadamard is None else hadamard,
                FNUZ=fp8_format == "e4m3fnuz", HW_ENCODE=hw_encode and fp8_format == "e4m3fn",
                FAST_DIV=fast_div)
    if B * H:
        launch_tree(q, weight, weight_scale, torch.view_as_real(freqs_cis), positions, q_fp8.view(torch.uint8),
                    w_out, fmax, meta, tok=tok, pieces=pieces, heads=heads, freq=freq, num_warps=num_warps)
    return q_fp8, w_out


def launch_tree(q, weight, weight_scale, freqs_real, positions, q_u8, w_out, fmax, meta,
                tok=1, pieces=8, heads=128, freq=0, num_warps=4):
    """Grid: (token blocks, head blocks); a program is tok tokens x the next power of two >= H heads
    (at most `heads`), so R = tok * that many rows. R = 32 * num_warps is one row per thread: compiled
    for sm_90 (Triton 3.6 / 3.9) then 1-4 layout conversions, none of them of a piece; with R = 64 at
    4 warps a piece's columns straddle two threads and Triton 3.9 inserts ~190 conversions.
    meta: the constexprs launch() derives (V4, HADAMARD, FNUZ, HW_ENCODE, FAST_DIV)."""
    require(pieces in PIECES, OP, f"tree form: pieces must be one of {PIECES}, got {pieces}")
    require(freq in (0, 1, 2), OP, f"tree form: freq must be 0, 1 or 2, got {freq}")
    B, H, _ = q.shape
    hb = min(triton.next_power_of_2(H), triton.next_power_of_2(heads))
    tok = triton.next_power_of_2(tok)
    grid = (triton.cdiv(B, tok), triton.cdiv(H, hb))
    keep = ("V4", "HADAMARD", "FNUZ", "HW_ENCODE", "FAST_DIV")
    extra = {"num_warps": num_warps} if num_warps else {}
    _indexer_q_tree_kernel[grid](
        q, weight, freqs_real, positions, q_u8, w_out,
        B, H, q.stride(0), q.stride(1), weight.stride(0), weight.stride(1), float(weight_scale), fmax,
        **{k: meta[k] for k in keep}, FREQ=freq, TOK=tok, HB=hb, PIECES=pieces, **extra)
