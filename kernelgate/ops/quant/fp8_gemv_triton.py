"""Decode GEMV pieces on FP8 e4m3fn weight rows (one token's activations times a tile of rows), shared
by fp8_linear's one-token form (here) and the experts GEMV (moe/fused_experts_fp8_gemv_triton.py).

A program owns a tile of weight rows and walks K in steps of NB sub-tiles of BK codes, each sub-tile
inside one scale block (BK divides bk): acc [rows, NB, BK] += code * x * scale with plain FMAs,
summed over K at the end (row_sums). The codes become exact fp32 values (fp8_f32) by the device's
fp8 conversion where it has one (HW: sm_89+; e4m3x2 -> f16x2 -> f32), else with integer ops: a
sign-extended code shifted left by 20 and masked is the fp32 whose value is the code's times 2^-120
(subnormal codes land on fp32 subnormals), times 2^120. NaN codes are not supported. On the H200 the
conversion form measured 37.0 µs for Kimi's experts at one token, the integer form 40.5
(bench/ops/fused_experts_gemv_sweep.py --fp8, bench/RESULTS.md Session 19).

The activations come either as one [NB, BK] load per K step, broadcast over the tile's rows, or
(rows_of, a launch's X_ROWS) as a load in the weight tile's own shape. The first reads each value
once, but its register layout is not the weight tile's: compiled for sm_90 the loop exchanges it
through shared memory, two barriers per exchange (8 per K step in the experts' gate/up GEMV). The
second repeats each value per row (L1 hits) and needs no exchange; which is faster depends on the
tile (bench/RESULTS.md Session 26: Kimi's experts 37.6 -> 32.6 µs, KDA o_proj 8.4 -> 5.3).

Where a tile's rows share their scale blocks (bn a multiple of the tile's rows, UNIFORM) the scales
multiply the activations once per sub-tile, not once per code. A scale block's K size is a compile-time
constant (bk), so finding a sub-tile's block takes no runtime division in the loop.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common.pdl import inputs_ready, pdl_args
from .fp8_triton import mode_for
from .fp8_weights import block_dims

_UNBIAS = tl.constexpr(2.0 ** 120)


def k_tile(bk: int, K: int, want: int) -> int:
    """Largest power-of-two K tile <= want that stays inside one scale block of bk (any, with one K block)."""
    if triton.cdiv(K, bk) <= 1:
        return want
    t = want
    while t > 1 and bk % t:
        t //= 2
    return t


def tile(bk: int, K: int, width: int) -> dict:
    """NB sub-tiles of BK codes (BK inside one scale block of bk) making a K step of about `width` codes."""
    bk_sub = k_tile(bk, K, width)
    return dict(NB=max(1, min(width // bk_sub, triton.next_power_of_2(triton.cdiv(K, bk_sub)))), BK=bk_sub)


@triton.jit
def fp8_f32(byte, HW: tl.constexpr):
    """uint8 e4m3fn codes -> their exact fp32 values: HW, the device's fp8 conversion; else integer ops
    and one multiply."""
    if HW:
        x = byte.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:
        s = byte.to(tl.int8, bitcast=True).to(tl.int32)            # sign-extended: bits 31..7 the sign
        x = ((s << 20) & -2014314496).to(tl.float32, bitcast=True) * _UNBIAS   # mask 0x87F00000
    return x


def hw_decode(capability) -> bool:
    """Whether a device of this capability decodes e4m3fn by conversion instructions (fp8_f32's HW)."""
    return mode_for(capability) == "fn"


@triton.jit
def rows_of(x_row, kk, sxk, K, ROWS: tl.constexpr):
    """[ROWS, *kk.shape] fp32: the activations at K offsets kk ([BK] or [NB, BK]), once per weight row --
    loaded in the weight tile's own shape, so both loads get the same register layout (same shape,
    contiguous along K) and the product needs no exchange through shared memory (a [NB, BK] load
    broadcast to the rows does: the compiled loops then wait at barriers); the repeated rows are L1 hits."""
    if len(kk.shape) == 1:
        ptrs = tl.broadcast_to((x_row + kk * sxk)[None, :], (ROWS, kk.shape[0]))
        m = tl.broadcast_to((kk < K)[None, :], (ROWS, kk.shape[0]))
    else:
        ptrs = tl.broadcast_to((x_row + kk * sxk)[None, :, :], (ROWS, kk.shape[0], kk.shape[1]))
        m = tl.broadcast_to((kk < K)[None, :, :], (ROWS, kk.shape[0], kk.shape[1]))
    return tl.load(ptrs, mask=m, other=0.0).to(tl.float32)


@triton.jit
def row_step(acc, w_rows, s_rows, s_row0, xv, kk, k0, K, bk, swd, ssk, r_ok, HW: tl.constexpr,
             ONE_KBLOCK: tl.constexpr, UNIFORM: tl.constexpr, NB: tl.constexpr, BK: tl.constexpr):
    """acc [rows, NB, BK] += codes(w_rows + kk) * x (* the scales of each sub-tile's K block);
    kk [NB, BK] the step's K offsets, xv [NB, BK] or [rows, NB, BK] (rows_of) fp32 activations there. s_rows [rows]:
    each row's scale row; s_row0: the first row's (UNIFORM: all rows')."""
    m = r_ok[:, None, None] & (kk < K)[None, :, :]
    w = fp8_f32(tl.load(w_rows[:, None, None] + kk[None, :, :] * swd, mask=m, other=0), HW)
    if ONE_KBLOCK:
        acc += w * xv
    else:
        k_sub = k0 + tl.arange(0, NB) * BK                                 # [NB] sub-tile starts
        if UNIFORM:
            s = tl.load(s_row0 + (k_sub // bk) * ssk, mask=k_sub < K, other=0.0)             # [NB]
            acc += w * (xv * s[:, None])
        else:
            s = tl.load(s_rows[:, None] + (k_sub // bk)[None, :] * ssk, mask=r_ok[:, None] & (k_sub < K)[None, :],
                        other=0.0)                                         # [rows, NB]
            acc += w * (xv * s[:, :, None])
    return acc


@triton.jit
def row_sums(acc, s_rows, r_ok, out_mul, ONE_KBLOCK: tl.constexpr):
    """[rows]: acc summed over K, times the rows' scales with one K block, times out_mul."""
    r = tl.sum(tl.sum(acc, axis=2), axis=1)
    if ONE_KBLOCK:
        r = r * tl.load(s_rows, mask=r_ok, other=0.0)
    return r * out_mul


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, s_ptr, y_ptr, N, K, sxm, sxk, swn, swk, ssn, ssk, sym, syn, bn, bk: tl.constexpr,
                 HW: tl.constexpr, ONE_KBLOCK: tl.constexpr, UNIFORM: tl.constexpr, ROWS: tl.constexpr,
                 NB: tl.constexpr, BK: tl.constexpr, X_ROWS: tl.constexpr, PDL: tl.constexpr):
    t = tl.program_id(0)
    n0 = tl.program_id(1) * ROWS
    n = n0 + tl.arange(0, ROWS)
    n_ok = n < N
    w_rows = w_ptr + n.to(tl.int64) * swn
    s_rows = s_ptr + (n // bn).to(tl.int64) * ssn
    s_row0 = s_ptr + (n0 // bn).to(tl.int64) * ssn
    x_row = x_ptr + t.to(tl.int64) * sxm
    sub = tl.arange(0, NB)[:, None] * BK + tl.arange(0, BK)[None, :]      # [NB, BK] offsets in a step
    acc = tl.zeros([ROWS, NB, BK], dtype=tl.float32)
    inputs_ready(PDL)
    for k0 in range(0, K, NB * BK):
        kk = k0 + sub
        if X_ROWS:
            xv = rows_of(x_row, kk, sxk, K, ROWS)
        else:
            xv = tl.load(x_row + kk * sxk, mask=kk < K, other=0.0).to(tl.float32)
        acc = row_step(acc, w_rows, s_rows, s_row0, xv, kk, k0, K, bk, swk, ssk, n_ok, HW, ONE_KBLOCK, UNIFORM,
                       NB, BK)
    y = row_sums(acc, s_rows, n_ok, 1.0, ONE_KBLOCK)
    tl.store(y_ptr + t.to(tl.int64) * sym + n * syn, y.to(y_ptr.dtype.element_ty), mask=n_ok)


def fp8_gemv(x, weight, weight_scale, block_size, y, cfg: dict, hw: bool):
    """y [T, N] = x [T, K] @ dequant(weight).T, one program per token and ROWS weight rows
    (cfg: ROWS, WIDTH, num_warps; or `long` / `short`, two such sets for K >= long["K"] and below)."""
    T, K = x.shape
    N = weight.shape[0]
    bn, bk = block_dims(block_size, K)
    if "long" in cfg:
        cfg = cfg["long"] if K >= cfg["long"]["K"] else cfg["short"]
    rows = cfg["ROWS"]
    w = weight.view(torch.uint8)
    _gemv_kernel[(T, triton.cdiv(N, rows))](
        x, w, weight_scale, y, N, K, *x.stride(), *w.stride(), *weight_scale.stride(), *y.stride(), bn, bk,
        HW=hw, ONE_KBLOCK=triton.cdiv(K, bk) == 1, UNIFORM=bn % rows == 0, ROWS=rows, **tile(bk, K, cfg["WIDTH"]),
        X_ROWS=bool(cfg.get("X_ROWS", False)),
        num_warps=cfg["num_warps"], **pdl_args())
    return y
