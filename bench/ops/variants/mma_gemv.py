"""Variant probe (issue 37, not dispatched): the FP8 linear at one to eight tokens on the matrix units,
both operands fed from registers -- no shared memory, no decode instruction per code.

Why: Session 35's full-depth profile (bench/RESULTS.md) has the FP8 weight kernels reading at ~0.69 of the
copy rate where the bf16 ones read at ~0.83, and integer decode (more ALU work a code) made them slower:
the one-token FP8 GEMV pays ~2.5 instructions a code (two cvt.rn.f16x2.e4m3x2 a word, four f16 -> f32,
four FMAs). Here a warp multiplies a 16-row weight tile by the token with one mma.sync a 256 (f16) or
512 (e4m3) codes of the tile: ~0.3-0.6 instructions a code. Earlier tl.dot probes (Sessions 25, 30)
staged the operands through shared memory; these mma instructions take them from the registers the
weight loads filled, in inline PTX (tl.inline_asm_elementwise over one element a thread: all 32 lanes of
a warp run it together, as mma.sync.aligned requires).

The fragment a lane holds (PTX ISA, "Matrix Fragments for mma.m16n8k16 / m16n8k32"; g = lane // 4,
t = lane % 4): A rows g and g + 8, B column (token) g, D rows g and g + 8 at tokens 2t and 2t + 1. The
dot product over K does not care in which order K is walked, so each lane reads 16 consecutive codes of
its two rows a 64-code step (two 8-byte loads a row; 4 lanes cover 64 bytes of a row) and the token's
activations at the same 16 positions; the fragments' K positions are whatever those bytes are, the same
for A and B:

    MODE E4M3 (w8a8, sm_89+): the token quantized per (token, scale block of K) to e4m3fn as
        quantize_fp8_groups does (triton_w8a8's numbers; a PDL prep kernel); one
        mma.m16n8k32.e4m3.e4m3.f32 per 8-byte word pair: A = the row words, B = the token's words.
    MODE F16 (w8a16, exact products as the dispatched GEMV): the token turned to fp16 times a power of
        two per token (fp8_triton.fp16_rows' rule: exact for bf16); each weight word's four codes
        become two f16x2 with cvt.rn.f16x2.e4m3x2 (sm_89+); one mma.m16n8k16.f16.f16.f32 per word.

A program owns 16 weight rows; its warps walk the K scale blocks (one 128-code block an iteration) in
turn, each scaling its block's partial by the block's weight scale (and, E4M3, the token's group scale),
and sum their partials at the end. Tokens past T read zeros.

Under TRITON_INTERPRET=1 (EMULATE) the mma is computed from the fragments as the PTX ISA defines it:
the lanes' registers regathered into A [16, k], B [k, 8] per warp and D given back in the lanes' order,
so the interpreter checks the lane arithmetic, the K walk, the scales and the warps' sum; the layout
Triton gives the asm's operands (one element a thread, lane = element % 32) is read from the compiled
TTGIR (test_mma_gemv.py compiles it for sm_90 with compile_stand_in).

    install(mode="f16" | "e4m3", num_warps=0)   fp8_linear's one-token GEMV -> this probe (0: warps_for)
    install(mode="wgmma", block_n=32, stages=4)  -> the package's triton_w8a8 kernel at 64-row token tiles
    uninstall()
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernelgate import alloc, platform
from kernelgate.ops.common.fp8_triton import encode_e4m3
from kernelgate.ops.common.pdl import inputs_ready, pdl_args
from kernelgate.ops.quant import fp8_linear as fl
from kernelgate.ops.quant import fp8_linear_triton as flt
from kernelgate.ops.quant.fp8_weights import AMAX_FLOOR, FP8_MAX, block_dims

F16, E4M3 = 0, 1
MODES = {"f16": F16, "e4m3": E4M3}
_FLOOR = tl.constexpr(AMAX_FLOOR)
_FMAX = tl.constexpr(FP8_MAX)
STEP = 64                   # codes of a row a warp reads a step (4 lanes x 16 bytes)

# D = A (16 x 16, f16 from the e4m3 words $4 (row g) and $5 (row g + 8)) x B ($6, $7: f16x2) + C ($8..$11)
_MMA_F16 = tl.constexpr("""{
 .reg .b16 l, h, l8, h8;
 .reg .b32 a0, a1, a2, a3;
 mov.b32 {l, h}, $4;
 mov.b32 {l8, h8}, $5;
 cvt.rn.f16x2.e4m3x2 a0, l;
 cvt.rn.f16x2.e4m3x2 a2, h;
 cvt.rn.f16x2.e4m3x2 a1, l8;
 cvt.rn.f16x2.e4m3x2 a3, h8;
 mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {$0, $1, $2, $3}, {a0, a1, a2, a3}, {$6, $7}, {$8, $9, $10, $11};
}""")
# D = A ($4..$7: e4m3 x 4 each) x B ($8, $9) + C ($10..$13)
_MMA_E4M3 = tl.constexpr(
    "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, "
    "{$10, $11, $12, $13};")


# -- the mma as the PTX ISA defines it, for the interpreter ------------------------------------------------
@triton.jit
def _e4m3(w, SHIFT: tl.constexpr):
    return ((w >> SHIFT) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)


@triton.jit
def _codes4(w):
    """int32 words [L] -> [L, 4] fp32: their four e4m3fn codes, byte 0 first."""
    # (join stacks on a new last axis: join(join(c0, c2), join(c1, c3)) is [L, 2, 2] = c0, c1, c2, c3)
    return tl.reshape(tl.join(tl.join(_e4m3(w, 0), _e4m3(w, 16)), tl.join(_e4m3(w, 8), _e4m3(w, 24))),
                      [w.shape[0], 4])


@triton.jit
def _halves(w):
    """int32 words [L] -> [L, 2] fp32: the fp16 in bits 0..15, then the one in bits 16..31."""
    lo = (w & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    hi = (w >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return tl.join(lo, hi)


@triton.jit
def _by_warp(p, q, NW: tl.constexpr):
    """Two [32 NW, V] halves of each lane's K values -> [NW, 8, 8 V]: warp, g, the K values of the lanes g*4 ..
    g*4 + 3 (an order A and B share: only the pairing of A's and B's values matters to the sum over K)."""
    return tl.reshape(tl.join(p, q), [NW, 8, 8 * p.shape[1]])


@triton.jit
def _mma_out(a_lo, a_hi, b, c0, c1, c2, c3, NW: tl.constexpr):
    """a_lo / a_hi [NW, 8, k]: A's rows 0..7 / 8..15; b [NW, 8, k]: B's columns; D + C in the lanes' order."""
    d_lo = tl.sum(a_lo[:, :, None, :] * b[:, None, :, :], axis=3)                  # [NW, 8 rows, 8 tokens]
    d_hi = tl.sum(a_hi[:, :, None, :] * b[:, None, :, :], axis=3)
    e_lo, o_lo = tl.split(tl.reshape(d_lo, [NW, 8, 4, 2]))                          # lane (g, t): tokens 2t, 2t + 1
    e_hi, o_hi = tl.split(tl.reshape(d_hi, [NW, 8, 4, 2]))
    L: tl.constexpr = 32 * NW
    return (c0 + tl.reshape(e_lo, [L]), c1 + tl.reshape(o_lo, [L]), c2 + tl.reshape(e_hi, [L]),
            c3 + tl.reshape(o_hi, [L]))


@triton.jit
def mma_e4m3(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3, NW: tl.constexpr, EMULATE: tl.constexpr):
    """mma.m16n8k32.row.col.f32.e4m3.e4m3.f32 over int32 / fp32 tensors of one element a lane ([32 NW])."""
    if EMULATE:
        a_lo = _by_warp(_codes4(a0), _codes4(a2), NW)       # row g: k = 4t + i (a0), 16 + 4t + i (a2)
        a_hi = _by_warp(_codes4(a1), _codes4(a3), NW)       # row g + 8
        b = _by_warp(_codes4(b0), _codes4(b1), NW)          # column g: k = 4t + i (b0), 16 + 4t + i (b1)
        d0, d1, d2, d3 = _mma_out(a_lo, a_hi, b, c0, c1, c2, c3, NW)
    else:
        d0, d1, d2, d3 = tl.inline_asm_elementwise(
            _MMA_E4M3, "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f", [a0, a1, a2, a3, b0, b1, c0, c1, c2, c3],
            dtype=(tl.float32, tl.float32, tl.float32, tl.float32), is_pure=True, pack=1)
    return d0, d1, d2, d3


@triton.jit
def mma_f16(wa, wb, b0, b1, c0, c1, c2, c3, NW: tl.constexpr, EMULATE: tl.constexpr):
    """A from the e4m3 words wa (row g) / wb (row g + 8): a0 = codes 0, 1 (k = 2t, 2t + 1), a2 = codes 2, 3
    (k = 2t + 8, 2t + 9); B = the fp16 pairs b0 (k = 2t, 2t + 1), b1 (k = 2t + 8, 2t + 9) of column g."""
    if EMULATE:
        b = tl.join(_halves(b0), _halves(b1))                          # [L, half, register]
        b = tl.reshape(tl.permute(b, (0, 2, 1)), [b0.shape[0], 4])   # b0.lo, b0.hi, b1.lo, b1.hi: codes 0..3
        L: tl.constexpr = 32 * NW
        a_lo = tl.reshape(_codes4(wa), [NW, 8, 16])
        a_hi = tl.reshape(_codes4(wb), [NW, 8, 16])
        d0, d1, d2, d3 = _mma_out(a_lo, a_hi, tl.reshape(b, [NW, 8, 16]), c0, c1, c2, c3, NW)
        tl.static_assert(L == b0.shape[0])
    else:
        d0, d1, d2, d3 = tl.inline_asm_elementwise(
            _MMA_F16, "=f,=f,=f,=f,r,r,r,r,f,f,f,f", [wa, wb, b0, b1, c0, c1, c2, c3],
            dtype=(tl.float32, tl.float32, tl.float32, tl.float32), is_pure=True, pack=1)
    return d0, d1, d2, d3


# -- the token's prep ------------------------------------------------------------------------------------
@triton.jit
def _prep_kernel(x_ptr, q_ptr, s_ptr, K, group, sxt, sqt, sst, MODE: tl.constexpr, BLOCK: tl.constexpr,
                 PDL: tl.constexpr):
    """Program (token t, group j) of `group` columns. E4M3: codes and scale max(amax, floor) / 448 as
    quantize_fp8_groups; F16 (one group: K): fp16 of x times 2^(141 - e), the factor 2^(e - 141) stored
    (e: the biased exponent of the row's amax; fp8_triton.fp16_rows' rule)."""
    t = tl.program_id(0)
    j = tl.program_id(1)
    lo = j * group
    hi = tl.minimum(K, lo + group)
    x_row = x_ptr + t.to(tl.int64) * sxt
    q_row = q_ptr + t.to(tl.int64) * sqt
    inputs_ready(PDL)
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for k0 in range(lo, hi, BLOCK):
        offs = k0 + tl.arange(0, BLOCK)
        amax = tl.maximum(amax, tl.abs(tl.load(x_row + offs, mask=offs < hi, other=0.0).to(tl.float32)))
    m = tl.max(amax, 0)
    if MODE == 1:
        scale = tl.math.div_rn(tl.maximum(m, _FLOOR), _FMAX + tl.zeros([BLOCK], dtype=tl.float32))
    else:
        eb = tl.minimum(tl.maximum((m.to(tl.int32, bitcast=True) >> 23) & 0xFF, 15), 253)
        up = ((268 - eb) << 23).to(tl.float32, bitcast=True)
        scale = ((eb - 14) << 23).to(tl.float32, bitcast=True) + tl.zeros([BLOCK], dtype=tl.float32)
    for k0 in range(lo, hi, BLOCK):
        offs = k0 + tl.arange(0, BLOCK)
        ok = offs < hi
        v = tl.load(x_row + offs, mask=ok, other=0.0).to(tl.float32)
        if MODE == 1:
            y = tl.math.div_rn(v, scale)
            tl.store(q_row + offs, encode_e4m3(tl.minimum(tl.maximum(y, -_FMAX), _FMAX), False), mask=ok)
        else:
            tl.store(q_row + offs, (v * up).to(tl.float16), mask=ok)
    tl.store(s_ptr + t.to(tl.int64) * sst + j + tl.arange(0, BLOCK), scale, mask=tl.arange(0, BLOCK) == 0)


# -- the GEMV --------------------------------------------------------------------------------------------
@triton.jit
def _lo(v):
    return v.to(tl.int32)


@triton.jit
def _hi(v):
    return (v >> 32).to(tl.int32)


@triton.jit
def _ld(ptr, ok, MASKED: tl.constexpr):
    if MASKED:
        v = tl.load(ptr, mask=ok, other=0)
    else:
        v = tl.load(ptr)
    return v


@triton.jit
def _scaled(acc0, acc1, acc2, acc3, p0, p1, p2, p3, ps, pxe, pxo, ok, MODE: tl.constexpr, ONE_KBLOCK: tl.constexpr,
            MASKED: tl.constexpr):
    """acc + the iteration's partial times its K block's scales (the weight block's; E4M3 also the tokens')."""
    if ONE_KBLOCK:
        acc0 += p0
        acc1 += p1
        acc2 += p2
        acc3 += p3
    else:
        if MASKED:
            sw = tl.load(ps, mask=ok, other=0.0)
        else:
            sw = tl.load(ps)
        if MODE == 1:
            if MASKED:
                se = sw * tl.load(pxe, mask=ok, other=0.0)
                so = sw * tl.load(pxo, mask=ok, other=0.0)
            else:
                se = sw * tl.load(pxe)
                so = sw * tl.load(pxo)
        else:
            se = sw
            so = sw
        acc0 += p0 * se
        acc1 += p1 * so
        acc2 += p2 * se
        acc3 += p3 * so
    return acc0, acc1, acc2, acc3


@triton.jit
def _block(pa, pb, px, ok, sub0, n_sub, MODE: tl.constexpr, SUBS: tl.constexpr, NW: tl.constexpr,
           MASKED: tl.constexpr, EMULATE: tl.constexpr):
    """One iteration's partial D over SUBS 64-code steps (a K scale block) of the lanes' rows; pa / pb / px:
    the lanes' first words (row g, row g + 8, the token's), int64. MASKED: only where ok and the step
    (sub0 + s) is below n_sub (K's last block may be partial)."""
    L: tl.constexpr = 32 * NW
    p0 = tl.zeros([L], dtype=tl.float32)
    p1 = tl.zeros([L], dtype=tl.float32)
    p2 = tl.zeros([L], dtype=tl.float32)
    p3 = tl.zeros([L], dtype=tl.float32)
    for s in tl.static_range(SUBS):
        if MASKED:
            ok_s = ok & (sub0 + s < n_sub)
        else:
            ok_s = ok
        for j in tl.static_range(2):
            wa = _ld(pa + s * 8 + j, ok_s, MASKED)
            wb = _ld(pb + s * 8 + j, ok_s, MASKED)
            if MODE == 1:
                xb = _ld(px + s * 8 + j, ok_s, MASKED)
                p0, p1, p2, p3 = mma_e4m3(_lo(wa), _lo(wb), _hi(wa), _hi(wb), _lo(xb), _hi(xb),
                                          p0, p1, p2, p3, NW, EMULATE)
            else:
                xb = _ld(px + s * 16 + 2 * j, ok_s, MASKED)
                p0, p1, p2, p3 = mma_f16(_lo(wa), _lo(wb), _lo(xb), _hi(xb), p0, p1, p2, p3, NW, EMULATE)
                xb = _ld(px + s * 16 + 2 * j + 1, ok_s, MASKED)
                p0, p1, p2, p3 = mma_f16(_hi(wa), _hi(wb), _lo(xb), _hi(xb), p0, p1, p2, p3, NW, EMULATE)
    return p0, p1, p2, p3


@triton.jit
def rows16(w_rows, swn, n0, N, s_rows, ssk, x_rows, sxt, T, xs_ptr, sxs, n_sub, MODE: tl.constexpr,
           ONE_KBLOCK: tl.constexpr, SUBS: tl.constexpr, NW: tl.constexpr, EMULATE: tl.constexpr):
    """The warps' sum of D for weight rows n0 .. n0 + 15 of w_rows (int64 words of 8 codes, row stride swn;
    rows past N read row N - 1) and the prepped token rows x_rows (int64 words: 8 codes E4M3, 4 fp16 F16;
    row stride sxt; tokens past T read token T - 1: an mma's rows and columns do not mix), over the n_sub
    64-code steps of K in iterations of SUBS steps -- one K scale block each (SUBS = 1 with one K block; the
    last one partial where K is not a multiple of the block), iteration i warp i % NW's, each times its block's scale at s_rows + i * ssk (and, E4M3, the tokens' group scales
    xs_ptr[token * sxs + i]). Returns [32] a lane (g, t): rows n0 + g (r0, r1) and n0 + g + 8 (r2, r3) at
    tokens 2t (r0, r2) and 2t + 1 (r1, r3)."""
    L: tl.constexpr = 32 * NW
    XW: tl.constexpr = 8 if MODE == 1 else 16            # int64 words of the token a 64-code step
    ln = tl.arange(0, L)
    warp = ln // 32
    g = (ln % 32) // 4
    t = ln % 4
    pa = w_rows + tl.minimum(n0 + g, N - 1).to(tl.int64) * swn + 2 * t + warp * (SUBS * 8)
    pb = w_rows + tl.minimum(n0 + g + 8, N - 1).to(tl.int64) * swn + 2 * t + warp * (SUBS * 8)
    px = x_rows + tl.minimum(g, T - 1).to(tl.int64) * sxt + (2 * t if MODE == 1 else 4 * t) + warp * (SUBS * XW)
    ps = s_rows + warp * ssk
    pxe = xs_ptr + tl.minimum(2 * t, T - 1) * sxs + warp
    pxo = xs_ptr + tl.minimum(2 * t + 1, T - 1) * sxs + warp
    acc0 = tl.zeros([L], dtype=tl.float32)
    acc1 = tl.zeros([L], dtype=tl.float32)
    acc2 = tl.zeros([L], dtype=tl.float32)
    acc3 = tl.zeros([L], dtype=tl.float32)
    n_it = (n_sub + SUBS - 1) // SUBS
    rounds = (n_sub // SUBS) // NW                       # rounds of whole iterations, unmasked
    for _ in range(0, rounds):
        p0, p1, p2, p3 = _block(pa, pb, px, None, None, None, MODE, SUBS, NW, False, EMULATE)
        acc0, acc1, acc2, acc3 = _scaled(acc0, acc1, acc2, acc3, p0, p1, p2, p3, ps, pxe, pxo, None,
                                         MODE, ONE_KBLOCK, False)
        pa += NW * SUBS * 8
        pb += NW * SUBS * 8
        px += NW * SUBS * XW
        ps += NW * ssk
        pxe += NW
        pxo += NW
    if rounds * NW < n_it:                               # the last round: NW iterations at most, masked
        it = rounds * NW + warp
        ok = it < n_it
        p0, p1, p2, p3 = _block(pa, pb, px, ok, it * SUBS, n_sub, MODE, SUBS, NW, True, EMULATE)
        acc0, acc1, acc2, acc3 = _scaled(acc0, acc1, acc2, acc3, p0, p1, p2, p3, ps, pxe, pxo, ok,
                                         MODE, ONE_KBLOCK, True)
    r0 = tl.sum(tl.reshape(acc0, [NW, 32]), axis=0)
    r1 = tl.sum(tl.reshape(acc1, [NW, 32]), axis=0)
    r2 = tl.sum(tl.reshape(acc2, [NW, 32]), axis=0)
    r3 = tl.sum(tl.reshape(acc3, [NW, 32]), axis=0)
    return r0, r1, r2, r3


@triton.jit
def _mma_gemv_kernel(w_ptr, s_ptr, x_ptr, xs_ptr, y_ptr, T, N, swn, sxt, ssn, ssk, sxs, syt, bn, n_sub,
                     MODE: tl.constexpr, ONE_KBLOCK: tl.constexpr, SUBS: tl.constexpr, NW: tl.constexpr,
                     EMULATE: tl.constexpr, PDL: tl.constexpr):
    n0 = tl.program_id(0) * 16
    inputs_ready(PDL)
    r0, r1, r2, r3 = rows16(w_ptr, swn, n0, N, s_ptr + (n0 // bn).to(tl.int64) * ssn, ssk, x_ptr, sxt, T, xs_ptr,
                            sxs, n_sub, MODE, ONE_KBLOCK, SUBS, NW, EMULATE)
    lane = tl.arange(0, 32)
    rg = n0 + lane // 4
    te = 2 * (lane % 4)
    te_ok = te < T
    to_ok = te + 1 < T
    if MODE == 1:                                        # (E4M3 with one K block: the token's one group scale)
        if ONE_KBLOCK:
            fe = tl.load(xs_ptr + te * sxs, mask=te_ok, other=0.0)
            fo = tl.load(xs_ptr + (te + 1) * sxs, mask=to_ok, other=0.0)
        else:
            fe = tl.full([32], 1.0, tl.float32)
            fo = fe
    else:                                                # F16: the token's power of two
        fe = tl.load(xs_ptr + te * sxs, mask=te_ok, other=0.0)
        fo = tl.load(xs_ptr + (te + 1) * sxs, mask=to_ok, other=0.0)
    if ONE_KBLOCK:
        sa = tl.load(s_ptr + (tl.minimum(rg, N - 1) // bn).to(tl.int64) * ssn)
        sb = tl.load(s_ptr + (tl.minimum(rg + 8, N - 1) // bn).to(tl.int64) * ssn)
    else:
        sa = tl.full([32], 1.0, tl.float32)
        sb = sa
    out = y_ptr + te.to(tl.int64) * syt
    ty = y_ptr.dtype.element_ty
    tl.store(out + rg, (r0 * fe * sa).to(ty), mask=te_ok & (rg < N))
    tl.store(out + syt + rg, (r1 * fo * sa).to(ty), mask=to_ok & (rg < N))
    tl.store(out + rg + 8, (r2 * fe * sb).to(ty), mask=te_ok & (rg + 8 < N))
    tl.store(out + syt + rg + 8, (r3 * fo * sb).to(ty), mask=to_ok & (rg + 8 < N))


def unsupported(x, weight, weight_scale, block_size) -> str | None:
    """None, or why this probe does not take the call (fp8_linear's dispatched form takes it)."""
    T, K = x.shape
    N = weight.shape[0]
    if x.dtype not in (torch.bfloat16, torch.float16):
        return f"x dtype {x.dtype}: the probe takes 16-bit activations"
    if not 1 <= T <= 8:
        return f"T = {T}: the probe takes 1-8 tokens (an mma's 8 columns)"
    if K % STEP:
        return f"K = {K} is not a multiple of {STEP}"
    if x.stride(1) != 1:
        return "x's columns are not contiguous (the prep reads rows of contiguous values)"
    if weight.stride() != (K, 1) or weight.data_ptr() % 8:
        return "the weight is not a contiguous row-major tensor on an 8-byte boundary"
    bn, bk = block_dims(block_size, K)
    if triton.cdiv(K, bk) > 1 and (bk % STEP or bn % 16):
        return f"block_size {block_size}: the probe needs bk a multiple of {STEP} and bn of 16"
    if N == 0:
        return "N = 0"
    return None


def prep(x: torch.Tensor, mode: int, bk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The token rows x [T, K] as the GEMVs read them: E4M3 (codes uint8 [T, K], scales [T, ceil(K / bk)]),
    F16 (fp16 [T, K], the tokens' powers of two [T, 1]); one PDL launch."""
    T, K = x.shape
    group = bk if mode == E4M3 else K
    groups = triton.cdiv(K, group)
    xq = alloc.empty((T, K), torch.uint8 if mode == E4M3 else torch.float16, x.device)
    xs = alloc.empty((T, groups), torch.float32, x.device)
    _prep_kernel[(T, groups)](x, xq, xs, K, group, x.stride(0), xq.stride(0), xs.stride(0), MODE=mode,
                              BLOCK=128, num_warps=4, **pdl_args())
    return xq, xs


def warps_for(N: int, n_it: int, want: int = 2048) -> int:
    """Warps a program: about `want` warps in all (H200: 132 SMs x ~16 resident, each warp ~2 KB in flight an
    iteration), at most one iteration each and 16 a program."""
    w = triton.next_power_of_2(max(1, -(-want // triton.cdiv(N, 16))))
    return max(1, min(16, w, triton.next_power_of_2(n_it + 1) // 2))


def fp8_linear_mma(x, weight, weight_scale, block_size=(128, 128), mode: str = "f16", num_warps: int = 0,
                   out: torch.Tensor | None = None):
    """y [T, N] = x [T, K] @ dequant(weight).T on the matrix units (module docstring), into `out` (rows of
    contiguous values; x's dtype by default, fp32 for the tests); num_warps 0: warps_for. The caller checks
    unsupported() first."""
    T, K = x.shape
    N = weight.shape[0]
    md = MODES[mode]
    bn, bk = block_dims(block_size, K)
    one = triton.cdiv(K, bk) == 1
    subs = 1 if one else bk // STEP
    xq, xs = prep(x, md, bk)
    y = alloc.empty((T, N), x.dtype, x.device) if out is None else out
    w = weight.view(torch.uint8).view(torch.int64)
    xw = xq.view(torch.int64)
    n_sub = K // STEP
    num_warps = num_warps or warps_for(N, triton.cdiv(n_sub, subs))
    _mma_gemv_kernel[(triton.cdiv(N, 16),)](
        w, weight_scale, xw, xs, y, T, N, w.stride(0), xw.stride(0), *weight_scale.stride(), xs.stride(0),
        y.stride(0), bn, n_sub, MODE=md, ONE_KBLOCK=one, SUBS=subs, NW=num_warps, EMULATE=platform.interpreting(),
        num_warps=num_warps, **pdl_args())
    return y


# -- install into fp8_linear's one-token form ---------------------------------------------------------------
_ORIGINAL = {"gemv": flt.fp8_gemv, "tokens": flt.GEMV_TOKENS}
_STATE: dict = {}


def _gemv(x, weight, weight_scale, block_size, y, cfg=None):
    if "wgmma" in _STATE:                                # (fp8_linear_triton returns what its GEMV returns)
        if x.dtype != torch.float32 and fl._w8a8_supports(x, weight, weight_scale, block_size) is None:
            return flt.fp8_linear_w8a8(x, weight, weight_scale, block_size, **_STATE["wgmma"])
    elif unsupported(x, weight, weight_scale, block_size) is None:
        return fp8_linear_mma(x, weight, weight_scale, block_size, out=y, **_STATE)
    return _ORIGINAL["gemv"](x, weight, weight_scale, block_size, y, cfg)


def install(mode: str = "f16", num_warps: int = 0, block_n: int = 32, stages: int = 4) -> str:
    """mode f16 / e4m3: this module's kernels; wgmma: the package's triton_w8a8 kernel with 64-row token tiles
    (block_n weight rows a program, `stages` cp.async stages; on sm_90 a wgmma on fp8, QGMMA)."""
    if mode not in (*MODES, "wgmma") or num_warps not in (0, 1, 2, 4, 8, 16):
        raise ValueError(f"mma_gemv: mode must be f16, e4m3 or wgmma and num_warps 0 (by shape) or 1-16, "
                         f"got {mode!r}, {num_warps}")
    if mode == "wgmma":
        _STATE["wgmma"] = dict(BLOCK_M=64, BLOCK_N=block_n, BLOCK_K=128, num_warps=num_warps or 4,
                               num_stages=stages)
        flt.fp8_gemv = _gemv
        return (f"mma_gemv: fp8_linear's one-token GEMV -> triton_w8a8 with 64-row token tiles, {block_n} weight "
                f"rows a program, {stages} stages, {num_warps or 4} warps")
    _STATE.update(mode=mode, num_warps=num_warps)
    flt.fp8_gemv = _gemv
    return (f"mma_gemv: fp8_linear's one-token GEMV on mma.sync ({mode}: "
            f"{'x quantized per 128-group, m16n8k32 e4m3' if mode == 'e4m3' else 'x as fp16, m16n8k16 f16'}), "
            f"{num_warps or 'warps_for(N, K)'} warps a 16-row program")


def uninstall() -> None:
    flt.fp8_gemv = _ORIGINAL["gemv"]
    flt.GEMV_TOKENS = _ORIGINAL["tokens"]
    _STATE.clear()
