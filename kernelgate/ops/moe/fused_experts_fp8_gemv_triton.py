"""Small-batch routed experts on FP8 e4m3fn weights (decode, T <= 8): the GEMV form of fused_experts,
one program per (token, slot) pair and tile of weight rows, the rows read as bytes -- half the bf16
bytes, which is the whole point at decode.

    _gate_up_kernel  grid (P, I / BLOCK_I):  h[p, i] = swiglu(gate[e] x[t], up[e] x[t])    [P, I] fp32
    _down_kernel     grid (P, D / BLOCK_O):  y[p, o] = w[t, j] * down[e][o, :] . h[p, :]    [P, D] fp32
    sum_slots        (fused_experts_triton)  out[t] = sum_j y[t*k + j]                        [T, D] x dtype

Each K step multiplies a [rows, BK] tile of codes, decoded to fp16 (two codes per conversion
instruction, or integer ops), by the pair's activations on the matrix units: tl.dot(codes, xb) with
xb [BK, 16] holding the activation tile in column 0 and zeros elsewhere (scaled to fp16 by a power of
two, quant/fp8_triton.fp16_rows: exact for 16-bit x, the down kernel's fp32 h rounded to fp16's 11
bits), so its column 0 is the rows' dot products, accumulated in fp32 (fp32 x: fp32 operands). A GEMV decoding each code to fp32 for an FMA is bound by the conversions (one
and a half per code; 16 per clock per SM on sm_90), not by the bytes. BK lies inside one scale
block: the step's partial takes one scale per row, scale[e, row // bn, k // bk]; with one K block
(per-channel scales, or K <= bk) the scale multiplies once at the end. Ids outside [0, E) read
nothing and contribute zeros.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ... import alloc, platform
from ..quant.fp8_linear_triton import k_tile, operand_flags
from ..quant.fp8_triton import MODES, SCALE, dot, fp16_operand, fp16_rows, fp8_operand, mode_for
from ..quant.fp8_weights import DEFAULT_BLOCK, block_dims
from .fused_experts_triton import sum_slots

# rows per program (gate / up: BLOCK_I of each; down: BLOCK_O), codes per K step (at most a scale
# block), warps, pipeline stages of the weight loads
LAUNCH = {"default": dict(BLOCK_I=32, BLOCK_O=32, BLOCK_K=128, num_warps=4, num_stages=3)}
_INTERP = dict(BLOCK_I=16, BLOCK_O=64, BLOCK_K=64, num_warps=4, num_stages=1)   # few, wide programs


def launch_config(plat, tokens: int = 2) -> dict:
    if platform.interpreting():
        return _INTERP
    return LAUNCH.get(plat.name, LAUNCH["default"])


@triton.jit
def _x_tile(x_row, kk, K, X16: tl.constexpr, SCALED: tl.constexpr, BK: tl.constexpr):
    """One activation row's K tile -> (xb [BK, 16]: the tile in column 0, zeros elsewhere; its factor)."""
    xv = tl.load(x_row + kk, mask=kk < K, other=0.0)
    col0 = tl.arange(0, 16)[None, :] == 0
    if X16:
        x16, f = fp16_rows(xv[None, :], SCALED)                          # [1, BK] fp16, [1]
        xb = tl.where(col0, tl.reshape(x16, [BK, 1]), tl.zeros([BK, 16], tl.float16))
        factor = tl.max(f, axis=0)
    else:
        xb = tl.where(col0, xv[:, None].to(tl.float32), tl.zeros([BK, 16], tl.float32))
        factor = 1.0
    return xb, factor


@triton.jit
def _row_step(acc, w_rows, s_rows, xb, factor, kk, k0, K, bk, swd, ssk, r_ok, MODE: tl.constexpr,
              ONE_KBLOCK: tl.constexpr, X16: tl.constexpr, F32: tl.constexpr):
    """acc [rows, 16] += codes(w_rows + kk) @ xb (* factor, * the rows' scales of this K block)."""
    w = tl.load(w_rows[:, None] + kk[None, :] * swd, mask=r_ok[:, None] & (kk < K)[None, :], other=0)
    w = fp16_operand(w, MODE) if X16 else fp8_operand(w, MODE)
    part = dot(w, xb, tl.zeros_like(acc), F32)
    if ONE_KBLOCK:
        acc += part * factor
    else:
        s = tl.load(s_rows + (k0 // bk) * ssk, mask=r_ok, other=0.0)   # [rows]
        acc += part * (s * factor)[:, None]
    return acc


@triton.jit
def _row_sums(acc, s_rows, r_ok, out_mul, ONE_KBLOCK: tl.constexpr):
    r = tl.sum(acc, axis=1)                    # column 0: the others are zeros
    if ONE_KBLOCK:
        r = r * tl.load(s_rows, mask=r_ok, other=0.0)
    return r * out_mul


@triton.jit
def _gate_up_kernel(x_ptr, w_ptr, s_ptr, ids_ptr, h_ptr, D, I, E, TOPK, sxt, sxd, swe, swr, swd,
                    sse, ssr, ssk, sit, sij, bn, bk, limit, out_mul,
                    HAS_LIMIT: tl.constexpr, MODE: tl.constexpr, ONE_KBLOCK: tl.constexpr, X16: tl.constexpr,
                    SCALED: tl.constexpr, F32: tl.constexpr, BLOCK_I: tl.constexpr, BK: tl.constexpr):
    p = tl.program_id(0)
    t, j = p // TOPK, p % TOPK
    i = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)                # [BLOCK_I]
    i_ok = i < I
    e = tl.load(ids_ptr + t.to(tl.int64) * sit + j * sij).to(tl.int64)
    valid = (e >= 0) & (e < E)
    s_e = s_ptr + tl.where(valid, e, 0) * sse                             # scales: read, unused, for bad ids
    sg_rows = s_e + (i // bn).to(tl.int64) * ssr
    su_rows = s_e + ((i + I) // bn).to(tl.int64) * ssr
    acc_g = tl.zeros([BLOCK_I, 16], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_I, 16], dtype=tl.float32)
    if valid:
        w_g = w_ptr + e * swe + i.to(tl.int64) * swr                         # gate rows [0, I)
        w_u = w_g + I * swr                                                   # up rows [I, 2I)
        x_row = x_ptr + t.to(tl.int64) * sxt
        for k0 in range(0, D, BK):
            kk = k0 + tl.arange(0, BK)
            xb, f = _x_tile(x_row, kk * sxd, D * sxd, X16, SCALED, BK)
            acc_g = _row_step(acc_g, w_g, sg_rows, xb, f, kk, k0, D, bk, swd, ssk, i_ok, MODE, ONE_KBLOCK, X16, F32)
            acc_u = _row_step(acc_u, w_u, su_rows, xb, f, kk, k0, D, bk, swd, ssk, i_ok, MODE, ONE_KBLOCK, X16, F32)
    g = _row_sums(acc_g, sg_rows, i_ok, out_mul, ONE_KBLOCK)
    u = _row_sums(acc_u, su_rows, i_ok, out_mul, ONE_KBLOCK)
    if HAS_LIMIT:
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
    h = g * tl.sigmoid(g) * u                                                 # zeros for an invalid id
    tl.store(h_ptr + p.to(tl.int64) * I + i, h, mask=i_ok)


@triton.jit
def _down_kernel(h_ptr, w_ptr, s_ptr, ids_ptr, tw_ptr, y_ptr, D, I, E, TOPK, swe, swr, swi, sse, ssr, ssk,
                 sit, sij, stt, stj, bn, bk, out_mul,
                 MODE: tl.constexpr, ONE_KBLOCK: tl.constexpr, X16: tl.constexpr, SCALED: tl.constexpr,
                 F32: tl.constexpr, BLOCK_O: tl.constexpr, BK: tl.constexpr):
    p = tl.program_id(0)
    t, j = p // TOPK, p % TOPK
    o = tl.program_id(1) * BLOCK_O + tl.arange(0, BLOCK_O)                # [BLOCK_O] output columns
    o_ok = o < D
    e = tl.load(ids_ptr + t.to(tl.int64) * sit + j * sij).to(tl.int64)
    valid = (e >= 0) & (e < E)
    s_rows = s_ptr + tl.where(valid, e, 0) * sse + (o // bn).to(tl.int64) * ssr
    acc = tl.zeros([BLOCK_O, 16], dtype=tl.float32)
    if valid:
        w_rows = w_ptr + e * swe + o.to(tl.int64) * swr
        h_row = h_ptr + p.to(tl.int64) * I
        for k0 in range(0, I, BK):
            kk = k0 + tl.arange(0, BK)
            hb, f = _x_tile(h_row, kk, I, X16, SCALED, BK)
            acc = _row_step(acc, w_rows, s_rows, hb, f, kk, k0, I, bk, swi, ssk, o_ok, MODE, ONE_KBLOCK, X16, F32)
    wt = tl.load(tw_ptr + t.to(tl.int64) * stt + j * stj)
    y = _row_sums(acc, s_rows, o_ok, out_mul, ONE_KBLOCK) * wt
    tl.store(y_ptr + p.to(tl.int64) * D + o, y, mask=o_ok)


def fused_experts_fp8_gemv(x, w_gate_up, w_down, topk_weights, topk_ids, w_gate_up_scale, w_down_scale,
                           block_size=DEFAULT_BLOCK, activation="silu", swiglu_limit=None):
    T, D = x.shape
    E, I = w_down.shape[0], w_down.shape[2]
    k = topk_ids.shape[1]
    out = alloc.empty((T, D), x.dtype, x.device)
    if T == 0:
        return out
    plat = platform.current()
    cfg = launch_config(plat, T)
    mode = MODES[mode_for(plat.capability)]
    (gbn, gbk), (dbn, dbk) = block_dims(block_size, D), block_dims(block_size, I)
    P = T * k
    h = alloc.empty((P, I), torch.float32, x.device)
    y = alloc.empty((P, D), torch.float32, x.device)
    wgu, wdn = w_gate_up.view(torch.uint8), w_down.view(torch.uint8)
    sgu, sdn = w_gate_up_scale, w_down_scale
    flags = operand_flags(x.dtype, x.dtype == torch.float32 or platform.interpreting())
    launch = {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]}
    _gate_up_kernel[(P, triton.cdiv(I, cfg["BLOCK_I"]))](
        x, wgu, sgu, topk_ids, h, D, I, E, k, *x.stride(), *wgu.stride(), *sgu.stride(), *topk_ids.stride(),
        gbn, gbk, float(swiglu_limit) if swiglu_limit is not None else 0.0, SCALE[mode],
        HAS_LIMIT=swiglu_limit is not None, MODE=mode, ONE_KBLOCK=triton.cdiv(D, gbk) == 1, **flags,
        BLOCK_I=cfg["BLOCK_I"], BK=k_tile(gbk, D, cfg["BLOCK_K"]), **launch)
    # h is fp32: with 16-bit x it goes to fp16 scaled per tile like a bf16 row (rounded to fp16's 11 bits)
    _down_kernel[(P, triton.cdiv(D, cfg["BLOCK_O"]))](
        h, wdn, sdn, topk_ids, topk_weights, y, D, I, E, k, *wdn.stride(), *sdn.stride(), *topk_ids.stride(),
        *topk_weights.stride(), dbn, dbk, SCALE[mode], MODE=mode, ONE_KBLOCK=triton.cdiv(I, dbk) == 1,
        **{**flags, "SCALED": flags["X16"]}, BLOCK_O=cfg["BLOCK_O"], BK=k_tile(dbk, I, cfg["BLOCK_K"]), **launch)
    return sum_slots(y, topk_ids.contiguous(), out, E)    # the sum kernel reads ids densely
