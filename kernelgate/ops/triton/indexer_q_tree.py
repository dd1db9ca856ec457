"""Triton kernel: indexer query prep, "split tree" form (no permutes, no MMA).

Same op and arithmetic as indexer_q.py (fp32 throughout, the same _quant / fp8 encoders); what
changes is how the 128-point Walsh-Hadamard transform is laid out, so that no value has to move
between threads (the other forms spend their time in layout conversions, not in FLOPs):
- a row (one (token, head)) is loaded as P pieces of W = 128 / P contiguous bf16 (P = 16: one
  16-byte vector per thread and piece; P = 8: two). With one row per thread (R = 32 * num_warps
  rows), every piece's columns sit in one thread's registers.
- column i = W * p + b: H128 = H_P (x) H_W (Sylvester order is separable). H_P acts across the
  pieces, elementwise between separate tensors; H_W acts inside a piece as a "split tree":
  the butterfly on bit 0 of x [R, W] is e, o = split(reshape(x, [R, W/2, 2])), then (e + o,
  e - o) each take the W/2-point transform on bits 1.. and are rebuilt by join + reshape
  (out[2j] from e + o, out[2j + 1] from e - o). split / join / reshape of a trailing dim held
  in one thread are register renames.
- RoPE v4 rotates the interleaved pairs (2i, 2i + 1) of dims 64..127 = the even / odd lanes of
  the upper pieces: exactly the tree's first split, so it costs no extra split. RoPE v3.2 pairs
  (i, 32 + i) are the same lane of pieces k and k + 32 / W.
- cos / sin (FREQ): 0 = per-token vectors ([1, n] when TOK == 1, broadcast over the heads),
  1 = gathered per row as [R, n], 2 = gathered per row as the interleaved (cos, sin) pairs and
  split like q (same shape as the piece's split halves).
"""
from __future__ import annotations

import triton
import triton.language as tl

from .indexer_q import _quant, _rope_pair

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
def _piece(x, c, s, ROPE: tl.constexpr, HAD: tl.constexpr, R: tl.constexpr, W: tl.constexpr):
    """One [R, W] piece (W = 8 or 16): interleaved RoPE by c, s ([*, W/2]) if ROPE, then the W-point
    transform if HAD; both on the same first split."""
    y = x
    if ROPE or HAD:
        e, o = _halves(x, R, W)
        if ROPE:
            e, o = _rope_pair(e, o, c, s)
        if HAD:
            e, o = _bf(e, o)
            if W == 16:
                e = _wht8(e, R)
                o = _wht8(o, R)
            else:
                e = _wht4(e, R)
                o = _wht4(o, R)
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
def _freqs(f_ptr, pos, prow, FIRST: tl.constexpr, N: tl.constexpr, FREQ: tl.constexpr,
           TOK: tl.constexpr, HB: tl.constexpr):
    """cos, sin of pairs FIRST .. FIRST + N - 1, broadcastable to [TOK * HB, N]. pos [TOK] and
    prow [R] (each row's position) are int64; freqs rows are 64 floats, (cos, sin) interleaved."""
    R: tl.constexpr = TOK * HB
    j = FIRST + tl.arange(0, N)
    if FREQ == 2:
        cs = tl.load((f_ptr + prow * 64)[:, None] + 2 * FIRST + tl.arange(0, 2 * N)[None, :])
        c, s = _halves(cs, R, 2 * N)
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
def _ld(base, K: tl.constexpr, W: tl.constexpr, m2):
    return tl.load(base + K * W + tl.arange(0, W)[None, :], mask=m2, other=0.0).to(tl.float32)


@triton.jit
def _st(out, K: tl.constexpr, W: tl.constexpr, x, inv, sc, fmax, m2, HAD: tl.constexpr,
        FNUZ: tl.constexpr, HW: tl.constexpr, FAST_DIV: tl.constexpr):
    if HAD:
        x = x * NORM
    tl.store(out + K * W + tl.arange(0, W)[None, :], _quant(x, inv, sc, fmax, FNUZ, HW, FAST_DIV), mask=m2)


@triton.jit
def _amax(x0, x1, x2, x3, x4, x5, x6, x7):
    """elementwise max of |x| over eight pieces."""
    return tl.maximum(tl.maximum(tl.maximum(tl.abs(x0), tl.abs(x1)), tl.maximum(tl.abs(x2), tl.abs(x3))),
                      tl.maximum(tl.maximum(tl.abs(x4), tl.abs(x5)), tl.maximum(tl.abs(x6), tl.abs(x7))))


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
def _body16(base, out, m2, f_ptr, pos, prow, fmax, V4: tl.constexpr, HAD: tl.constexpr, FNUZ: tl.constexpr,
            HW: tl.constexpr, FAST_DIV: tl.constexpr, FREQ: tl.constexpr, TOK: tl.constexpr, HB: tl.constexpr):
    """Sixteen [R, 8] pieces: H8 inside by the split tree, H16 across."""
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
    if not V4:   # pair 8k + i: lane i of pieces k, 4 + k
        F: tl.constexpr = 1 if FREQ == 2 else FREQ
        c, s = _freqs(f_ptr, pos, prow, 0, 8, F, TOK, HB)
        x0, x4 = _rope_pair(x0, x4, c, s)
        c, s = _freqs(f_ptr, pos, prow, 8, 8, F, TOK, HB)
        x1, x5 = _rope_pair(x1, x5, c, s)
        c, s = _freqs(f_ptr, pos, prow, 16, 8, F, TOK, HB)
        x2, x6 = _rope_pair(x2, x6, c, s)
        c, s = _freqs(f_ptr, pos, prow, 24, 8, F, TOK, HB)
        x3, x7 = _rope_pair(x3, x7, c, s)
    x0 = _piece(x0, x0, x0, False, HAD, R, 8)
    x1 = _piece(x1, x1, x1, False, HAD, R, 8)
    x2 = _piece(x2, x2, x2, False, HAD, R, 8)
    x3 = _piece(x3, x3, x3, False, HAD, R, 8)
    x4 = _piece(x4, x4, x4, False, HAD, R, 8)
    x5 = _piece(x5, x5, x5, False, HAD, R, 8)
    x6 = _piece(x6, x6, x6, False, HAD, R, 8)
    x7 = _piece(x7, x7, x7, False, HAD, R, 8)
    x8 = _up(x8, f_ptr, pos, prow, 0, 4, V4, HAD, FREQ, TOK, HB, 8)   # v4: piece 8 + k has pairs 4k..4k+3
    x9 = _up(x9, f_ptr, pos, prow, 1, 4, V4, HAD, FREQ, TOK, HB, 8)
    xa = _up(xa, f_ptr, pos, prow, 2, 4, V4, HAD, FREQ, TOK, HB, 8)
    xb = _up(xb, f_ptr, pos, prow, 3, 4, V4, HAD, FREQ, TOK, HB, 8)
    xc = _up(xc, f_ptr, pos, prow, 4, 4, V4, HAD, FREQ, TOK, HB, 8)
    xd = _up(xd, f_ptr, pos, prow, 5, 4, V4, HAD, FREQ, TOK, HB, 8)
    xe = _up(xe, f_ptr, pos, prow, 6, 4, V4, HAD, FREQ, TOK, HB, 8)
    xf = _up(xf, f_ptr, pos, prow, 7, 4, V4, HAD, FREQ, TOK, HB, 8)
    if HAD:   # H16 across pieces: bit 3 of the piece index here, bits 2..0 in _h8x
        x0, x8 = _bf(x0, x8)
        x1, x9 = _bf(x1, x9)
        x2, xa = _bf(x2, xa)
        x3, xb = _bf(x3, xb)
        x4, xc = _bf(x4, xc)
        x5, xd = _bf(x5, xd)
        x6, xe = _bf(x6, xe)
        x7, xf = _bf(x7, xf)
        x0, x1, x2, x3, x4, x5, x6, x7 = _h8x(x0, x1, x2, x3, x4, x5, x6, x7)
        x8, x9, xa, xb, xc, xd, xe, xf = _h8x(x8, x9, xa, xb, xc, xd, xe, xf)
    scale, inv = _scales(tl.maximum(_amax(x0, x1, x2, x3, x4, x5, x6, x7), _amax(x8, x9, xa, xb, xc, xd, xe, xf)),
                         fmax, HAD, R)
    sc = scale[:, None]
    _st(out, 0, 8, x0, inv, sc, fmax, m2, HAD, FNUZ, HW, FAST_DIV)
    _st(out, 1, 8, x1, inv, sc, fmax, m2, HAD, FNUZ, HW, FAST_DIV)
    _st(out, 2, 8, x2, inv, sc, fmax, m2, HAD, FNUZ, HW, FAST_DIV)
    _st(out, 3, 8, x3, inv, sc, fmax, m2, HAD, FNUZ, HW, FAST_DIV)
    _st(out, 4, 8, x4, inv, sc, fmax, m2, HAD, FNUZ, HW, FAST_DIV)
    _st(out, 5, 8, x5, inv, sc, fmax, m2, HAD, FNUZ, HW, FAST_DIV)
    _st(out, 6, 8, x6, inv, sc, fmax, m2, HAD, FNUZ, HW, FAST_DIV)
    _st(out, 7, 8, x7, inv, sc, fmax, m2, HAD, FNUZ, HW, FAST_DIV)
    _st(out, 8, 8, x8, inv, sc, fmax, m2, HAD, FNUZ, HW, FAST_DIV)
    _st(out, 9, 8, x9, inv, sc, fmax, m2, HAD, FNUZ, HW, FAST_DIV)
    _st(out, 10, 8, xa, inv, sc, fmax, m2, HAD, FNUZ, HW, FAST_DIV)
    _st(out, 11, 8, xb, inv, sc, fmax, m2, HAD, FNUZ, HW, FAST_DIV)
    _st(out, 12, 8, xc, inv, sc, fmax, m2, HAD, FNUZ, HW, FAST_DIV)
    _st(out, 13, 8, xd, inv, sc, fmax, m2, HAD, FNUZ, HW, FAST_DIV)
    _st(out, 14, 8, xe, inv, sc, fmax, m2, HAD, FNUZ, HW, FAST_DIV)
    _st(out, 15, 8, xf, inv, sc, fmax, m2, HAD, FNUZ, HW, FAST_DIV)
    return scale


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
    scale, inv = _scales(_amax(x0, x1, x2, x3, x4, x5, x6, x7), fmax, HAD, R)
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
    if PIECES == 16:
        scale = _body16(base, out, m2, f_ptr, pos, prow, fmax, V4, HADAMARD, FNUZ, HW_ENCODE, FAST_DIV, FREQ,
                        TOK, HB)
    else:
        scale = _body8(base, out, m2, f_ptr, pos, prow, fmax, V4, HADAMARD, FNUZ, HW_ENCODE, FAST_DIV, FREQ,
                       TOK, HB)
    w = tl.load(w_ptr + tok * s_wb + head * s_wh, mask=rmask, other=0.0).to(tl.float32)
    tl.store(wo_ptr + tok * H + head, w * weight_scale * scale, mask=rmask)


def launch_tree(q, weight, weight_scale, freqs_real, positions, q_u8, w_out, fmax, meta,
                tok=1, pieces=16, heads=128, freq=0, num_warps=4):
    """Grid: (token blocks, head blocks); a program is tok tokens x the next power of two >= H heads
    (at most `heads`), so R = tok * that many rows. R = 32 * num_warps is one row per thread: compiled
    for sm_90 (Triton 3.6 / 3.9) then 1-4 layout conversions, none of them of a piece; with R = 64 at
    4 warps a piece's columns straddle two threads and Triton 3.9 inserts ~190 conversions.
    meta: the constexprs launch() derives (V4, HADAMARD, FNUZ, HW_ENCODE, FAST_DIV; others ignored)."""
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
