"""Triton kernel (NVIDIA): indexer query prep, token-major, with the Hadamard on two lanes (no MMA).

Same op and arithmetic as indexer_q_triton.py (fp32 throughout, the same `_quant`); what changes is
the split of the work, to cut what the row-major kernel spends besides bytes:
- one program = TOK tokens x HB heads (HB = next power of two >= H up to 128, masked; TOK grows
  so that a program has >= 16 rows), rows r = t * HB + h. The RoPE cos/sin are loaded once per
  token -- a [1, n] vector when TOK = 1, broadcast over the heads -- not gathered per row.
- a row is four [R, 32] quarters. H128 = H4 (x) H32: the butterfly across quarters is elementwise.
  Triton lays a [R, 32] quarter out as 16 columns per thread and two threads per row (32 bytes of
  bf16 in, one whole 32-byte sector of codes out per row and instruction), so H32 = H2 (x) H16 on
  that layout: H16 on a thread's 16 columns by a split tree (split / join / reshape of a dimension
  held in one thread are register renames), H2 across the row's two threads as a sum over a size-2
  axis (one shuffle + add: s = x0 + x1 in both lanes, the upper lane then takes x0 - x1 as
  s - 2 x1: one fma, s's rounding carries into the difference, within the op's compare bound).
  1/sqrt(128) is folded into 1/scale (amax scaled by it: rounding is monotonic).
- RoPE: v4 rotates interleaved pairs inside quarters 2 and 3 (view [R, 16, 2] and split: the pair
  is in one thread's registers); v3.2 pairs (i, 32 + i) are the same lane of quarters 0 and 1.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ... import alloc, platform
from ..common import fp8 as _fp8
from .indexer_q_triton import _quant, _rope_pair, dense_freqs

NORM = tl.constexpr(0.08838834764831845)  # 1/sqrt(128)
# registers per thread for v4 on NVIDIA: at 80, six programs of 4 warps share an SM's 64K registers
# (at 96, five); the sixth hides more of the memory latency, and 80 does not spill
MAXNREG_V4 = 80


def launch_config(plat: platform.Platform, variant: str = "v4", fp8_format: str = "e4m3fn") -> dict:
    """The token-major kernel's launch choices on `plat`. Compiled NVIDIA: the hardware e4m3fn cast
    where the device has fp8 conversion, one token per program, and a register cap for v4. Elsewhere
    (the interpreter, or forced onto another backend): the integer encoder, no cap. (The cast and the cap are NVIDIA ISA
    features: they follow the capability, so cuda simulated on another vendor's GPU still compiles.)"""
    nvidia = plat.name == "cuda" and plat.triton_mode == "compiled" and (plat.capability or "").startswith("sm_")
    hw = nvidia and fp8_format == "e4m3fn" and platform.fp8_hardware(plat.capability)
    # tok None: ~1024 rows per program (the interpreter pays per program and operation, not per element)
    return dict(form="tok", tok=1 if plat.triton_mode == "compiled" else None, num_warps=4, hw_encode=hw,
                maxnreg=MAXNREG_V4 if nvidia and variant == "v4" else None)


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
    """Natural-order 16-point transform of x [R, 16] by the split tree: the butterfly on bit 0 pairs
    the even and odd columns, whose halves then take the 8-point transform on bits 1.."""
    e, o = _halves(x, R, 16)
    e, o = _bf(e, o)
    return _interleave(_wht8(e, R), _wht8(o, R), R, 16)


@triton.jit
def _lanes32(v, R: tl.constexpr):
    """v [R, 32] times the natural-order 32-point Hadamard: H16 on columns 16l .. 16l + 15 (one
    thread's registers), then H2 across l (the row's two threads): (x0 + x1, s - 2 x1)."""
    x = tl.reshape(_wht16(tl.reshape(v, (R * 2, 16)), R * 2), (R, 2, 16))
    j = tl.arange(0, 2)[None, :, None]
    s = tl.expand_dims(tl.sum(x, 1), 1)
    return tl.reshape(s - (2 * j).to(tl.float32) * x, (R, 32))


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
def _rope_il(x, c, s, R: tl.constexpr):
    """x [R, 32] = 16 interleaved pairs rotated by c, s (broadcastable to [R, 16])."""
    a, b = _halves(x, R, 32)
    a, b = _rope_pair(a, b, c, s)
    return _interleave(a, b, R, 32)


@triton.jit
def _ld(base, K: tl.constexpr, m2, s_qd):
    return tl.load(base + (K * 32 + tl.arange(0, 32)[None, :]) * s_qd, mask=m2, other=0.0).to(tl.float32)


@triton.jit
def _st(out, K: tl.constexpr, x, inv, sc, fmax, m2, FNUZ: tl.constexpr, HW: tl.constexpr):
    """Quarter K's codes, as x * inv (within an fp32 ulp of x / scale: rarely one code off)."""
    tl.store(out + K * 32 + tl.arange(0, 32)[None, :], _quant(x, inv, sc, fmax, FNUZ, HW, True), mask=m2)


@triton.jit
def _amax(x):
    return tl.max(tl.abs(x), 1)


@triton.jit
def _indexer_q_tok_kernel(q_ptr, w_ptr, f_ptr, pos_ptr, qo_ptr, wo_ptr,
                          B, H, s_qb, s_qh, s_qd, s_wb, s_wh, s_pos, max_pos, weight_scale, fmax,
                          V4: tl.constexpr, HADAMARD: tl.constexpr, FNUZ: tl.constexpr,
                          HW_ENCODE: tl.constexpr, TOK: tl.constexpr, HB: tl.constexpr):
    R: tl.constexpr = TOK * HB
    r = tl.arange(0, R)                                             # [R], r = t * HB + h
    toks = tl.program_id(0) * TOK + tl.arange(0, TOK)               # [TOK]
    tok = tl.program_id(0) * TOK + r // HB
    head = tl.program_id(1) * HB + r % HB
    rmask = (tok < B) & (head < H)
    # a position outside freqs_cis: that token's rows are zeros (codes 0, weight 0); row 0 of the
    # table is read in its place and never used
    pos_r = tl.load(pos_ptr + tok.to(tl.int64) * s_pos, mask=rmask, other=0).to(tl.int64)
    ok = rmask & (pos_r >= 0) & (pos_r < max_pos)
    m2 = ok[:, None]
    base = (q_ptr + tok.to(tl.int64) * s_qb + head * s_qh)[:, None]
    out = (qo_ptr + (tok.to(tl.int64) * H + head) * 128)[:, None]
    pos = tl.load(pos_ptr + toks.to(tl.int64) * s_pos, mask=toks < B, other=0).to(tl.int64)
    pos = tl.where((pos >= 0) & (pos < max_pos), pos, 0)
    x0 = _ld(base, 0, m2, s_qd)
    x1 = _ld(base, 1, m2, s_qd)
    x2 = _ld(base, 2, m2, s_qd)
    x3 = _ld(base, 3, m2, s_qd)
    if V4:
        c, s = _freqs(f_ptr, pos, 0, 16, TOK, HB)
        x2 = _rope_il(x2, c, s, R)
        c, s = _freqs(f_ptr, pos, 16, 16, TOK, HB)
        x3 = _rope_il(x3, c, s, R)
    else:
        c, s = _freqs(f_ptr, pos, 0, 32, TOK, HB)
        x0, x1 = _rope_pair(x0, x1, c, s)
    if HADAMARD:   # H4 across quarters, then H32 inside each; NORM is folded into the scale below
        x0, x2 = _bf(x0, x2)
        x1, x3 = _bf(x1, x3)
        x0, x1 = _bf(x0, x1)
        x2, x3 = _bf(x2, x3)
        x0 = _lanes32(x0, R)
        x1 = _lanes32(x1, R)
        x2 = _lanes32(x2, R)
        x3 = _lanes32(x3, R)
    amax = tl.maximum(tl.maximum(_amax(x0), _amax(x1)), tl.maximum(_amax(x2), _amax(x3)))
    if HADAMARD:   # max |round(x * NORM)| = round(max |x| * NORM): the reference's amax
        amax = amax * NORM
    scale = tl.maximum(amax, 1e-4) / fmax                           # [R]
    sc = scale[:, None]
    inv = tl.math.div_rn(tl.full((R, 1), 1.0, tl.float32), sc)
    if HADAMARD:   # x * (NORM / scale): one multiply per value
        inv = inv * NORM
    ms = rmask[:, None]
    _st(out, 0, x0, inv, sc, fmax, ms, FNUZ, HW_ENCODE)
    _st(out, 1, x1, inv, sc, fmax, ms, FNUZ, HW_ENCODE)
    _st(out, 2, x2, inv, sc, fmax, ms, FNUZ, HW_ENCODE)
    _st(out, 3, x3, inv, sc, fmax, ms, FNUZ, HW_ENCODE)
    w = tl.load(w_ptr + tok * s_wb + head * s_wh, mask=ok, other=0.0).to(tl.float32)
    tl.store(wo_ptr + tok * H + head, w * weight_scale * scale, mask=rmask)


def indexer_q_tok_triton(q, weight, weight_scale, freqs_cis, positions, variant="v4", fp8_format="e4m3fn",
                         hadamard=None):
    return launch(q, weight, weight_scale, freqs_cis, positions, variant, fp8_format, hadamard)


def launch(q, weight, weight_scale, freqs_cis, positions, variant="v4", fp8_format="e4m3fn", hadamard=None,
           **config):
    """The op; `config` overrides launch_config's choices (tok, num_warps, maxnreg, hw_encode)
    for bench sweeps. Grid: (token blocks, head blocks)."""
    B, H, D = q.shape
    freqs_cis = dense_freqs(freqs_cis)
    plat = platform.current()
    cfg = {**launch_config(plat, variant, fp8_format), **config}
    dtype, fmax = _fp8.FORMATS[fp8_format]
    q_fp8 = alloc.empty((B, H, D), dtype, q.device)
    w_out = alloc.empty((B, H, 1), torch.float32, q.device)
    if B * H == 0:
        return q_fp8, w_out
    hb = min(triton.next_power_of_2(H), 128)
    tok = triton.next_power_of_2(max(cfg["tok"] or 1024 // hb, triton.cdiv(16, hb)))
    extra = {"num_warps": cfg["num_warps"]} if cfg["num_warps"] else {}
    if cfg["maxnreg"] and plat.triton_mode == "compiled" and (plat.capability or "").startswith("sm_"):
        extra["maxnreg"] = cfg["maxnreg"]
    _indexer_q_tok_kernel[(triton.cdiv(B, tok), triton.cdiv(H, hb))](
        q, weight, torch.view_as_real(freqs_cis), positions, q_fp8.view(torch.uint8), w_out,
        B, H, *q.stride(), weight.stride(0), weight.stride(1), positions.stride(0), freqs_cis.shape[0],
        float(weight_scale), fmax,
        V4=variant == "v4", HADAMARD=(variant == "v4") if hadamard is None else hadamard,
        FNUZ=fp8_format == "e4m3fnuz", HW_ENCODE=bool(cfg["hw_encode"]),
        TOK=tok, HB=hb, **extra)
    return q_fp8, w_out
