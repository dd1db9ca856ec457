"""Small-batch routed experts on FP8 e4m3fn weights (decode, T <= 8): fused_experts_gemv_triton.py's
GEMV kernels with the weight rows read as bytes -- half the bf16 bytes, which is the whole point at decode.

    _gate_up_kernel  grid (P, I / BLOCK_I):  h[p, i] = swiglu(gate[e] x[t], up[e] x[t])    [P, I] fp32
    _down_kernel     grid (P, D / BLOCK_O):  y[p, o] = w[t, j] * down[e][o, :] . h[p, :]    [P, D] fp32
    sum_slots        (fused_experts_triton)  out[t] = sum_j y[t*k + j]                        [T, D] x dtype

Each program decodes a [rows, NB, BK] tile of codes to fp32 (quant/fp8_triton.py) and accumulates
codes * (x * scale) with plain FMAs: NB sub-tiles of BK codes along K, each inside one scale block
(BK divides bk), so the tile takes one scale per row and sub-tile, scale[e, row // bn, k // bk].
The tile is NB x BK = the launch's BLOCK_K codes wide -- twice the bf16 GEMV's elements, the same
bytes per load -- however small the scale blocks (block FP8's 128). With one K block (per-channel
scales, or K <= bk) the accumulator is scaled once per row at the end instead. Ids outside [0, E)
read nothing and contribute zeros.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ... import alloc, platform
from ..quant.fp8_linear_triton import k_tile
from ..quant.fp8_triton import MODES, SCALE, fp8_operand, mode_for
from ..quant.fp8_weights import DEFAULT_BLOCK, block_dims
from .fused_experts_gemv_triton import launch_config
from .fused_experts_triton import sum_slots


# One token on NVIDIA (bench/ops/fused_experts_gemv_sweep.py --fp8 --shared --tokens 1, Kimi's shapes,
# H200): 4-row programs of 4 warps, 256-code tiles: 37.0 µs against 41.4 with the bf16 GEMV's
# one-token launch and 47.3 with 128-code tiles (one scale block: this kernel before the sub-tiles).
FP8_ONE_TOKEN = {"cuda": dict(BLOCK_I=4, BLOCK_O=16, BLOCK_K=128, num_warps=4)}


def _tile(bk: int, K: int, width: int) -> dict:
    """NB sub-tiles of BK codes (BK inside one scale block of bk) making a tile of about `width` codes."""
    bk_sub = k_tile(bk, K, width)
    return dict(NB=max(1, min(width // bk_sub, triton.next_power_of_2(triton.cdiv(K, bk_sub)))), BK=bk_sub)


@triton.jit
def _row_step(acc, w_rows, s_rows, xv, kk, k0, K, bk, swd, ssk, r_ok, MODE: tl.constexpr,
              ONE_KBLOCK: tl.constexpr, NB: tl.constexpr, BK: tl.constexpr):
    """acc [rows, NB, BK] += codes(w_rows + kk) * x (* the rows' scales of each sub-tile's K block);
    kk [NB, BK] the tile's K offsets, xv [NB, BK] the activations there."""
    m = r_ok[:, None, None] & (kk < K)[None, :, :]
    w = fp8_operand(tl.load(w_rows[:, None, None] + kk[None, :, :] * swd, mask=m, other=0), MODE).to(tl.float32)
    if ONE_KBLOCK:
        acc += w * xv[None, :, :]
    else:
        k_sub = k0 + tl.arange(0, NB) * BK                                 # [NB] sub-tile starts
        s = tl.load(s_rows[:, None] + (k_sub // bk)[None, :] * ssk, mask=r_ok[:, None] & (k_sub < K)[None, :],
                    other=0.0)                                             # [rows, NB]
        acc += w * (xv[None, :, :] * s[:, :, None])
    return acc


@triton.jit
def _row_sums(acc, s_rows, r_ok, out_mul, ONE_KBLOCK: tl.constexpr):
    r = tl.sum(tl.sum(acc, axis=2), axis=1)
    if ONE_KBLOCK:
        r = r * tl.load(s_rows, mask=r_ok, other=0.0)
    return r * out_mul


@triton.jit
def _gate_up_kernel(x_ptr, w_ptr, s_ptr, ids_ptr, h_ptr, D, I, E, TOPK, sxt, sxd, swe, swr, swd,
                    sse, ssr, ssk, sit, sij, bn, bk, limit, out_mul,
                    HAS_LIMIT: tl.constexpr, MODE: tl.constexpr, ONE_KBLOCK: tl.constexpr,
                    BLOCK_I: tl.constexpr, NB: tl.constexpr, BK: tl.constexpr):
    p = tl.program_id(0)
    t, j = p // TOPK, p % TOPK
    i = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)                # [BLOCK_I]
    i_ok = i < I
    e = tl.load(ids_ptr + t.to(tl.int64) * sit + j * sij).to(tl.int64)
    valid = (e >= 0) & (e < E)
    s_e = s_ptr + tl.where(valid, e, 0) * sse                             # scales: read, unused, for bad ids
    sg_rows = s_e + (i // bn).to(tl.int64) * ssr
    su_rows = s_e + ((i + I) // bn).to(tl.int64) * ssr
    acc_g = tl.zeros([BLOCK_I, NB, BK], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_I, NB, BK], dtype=tl.float32)
    sub = tl.arange(0, NB)[:, None] * BK + tl.arange(0, BK)[None, :]      # [NB, BK] offsets in a tile
    if valid:
        w_g = w_ptr + e * swe + i.to(tl.int64) * swr                         # gate rows [0, I)
        w_u = w_g + I * swr                                                   # up rows [I, 2I)
        for k0 in range(0, D, NB * BK):
            kk = k0 + sub
            xv = tl.load(x_ptr + t.to(tl.int64) * sxt + kk * sxd, mask=kk < D, other=0.0).to(tl.float32)
            acc_g = _row_step(acc_g, w_g, sg_rows, xv, kk, k0, D, bk, swd, ssk, i_ok, MODE, ONE_KBLOCK, NB, BK)
            acc_u = _row_step(acc_u, w_u, su_rows, xv, kk, k0, D, bk, swd, ssk, i_ok, MODE, ONE_KBLOCK, NB, BK)
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
                 MODE: tl.constexpr, ONE_KBLOCK: tl.constexpr, BLOCK_O: tl.constexpr, NB: tl.constexpr,
                 BK: tl.constexpr):
    p = tl.program_id(0)
    t, j = p // TOPK, p % TOPK
    o = tl.program_id(1) * BLOCK_O + tl.arange(0, BLOCK_O)                # [BLOCK_O] output columns
    o_ok = o < D
    e = tl.load(ids_ptr + t.to(tl.int64) * sit + j * sij).to(tl.int64)
    valid = (e >= 0) & (e < E)
    s_rows = s_ptr + tl.where(valid, e, 0) * sse + (o // bn).to(tl.int64) * ssr
    acc = tl.zeros([BLOCK_O, NB, BK], dtype=tl.float32)
    sub = tl.arange(0, NB)[:, None] * BK + tl.arange(0, BK)[None, :]      # [NB, BK] offsets in a tile
    if valid:
        w_rows = w_ptr + e * swe + o.to(tl.int64) * swr
        for k0 in range(0, I, NB * BK):
            kk = k0 + sub
            hv = tl.load(h_ptr + p.to(tl.int64) * I + kk, mask=kk < I, other=0.0)
            acc = _row_step(acc, w_rows, s_rows, hv, kk, k0, I, bk, swi, ssk, o_ok, MODE, ONE_KBLOCK, NB, BK)
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
    cfg = FP8_ONE_TOKEN[plat.name] if T == 1 and plat.name in FP8_ONE_TOKEN and not platform.interpreting() \
        else launch_config(plat, T)
    width = 2 * cfg["BLOCK_K"]          # codes per row and K step: twice the bf16 GEMV's elements, its bytes
    mode = MODES[mode_for(plat.capability)]
    (gbn, gbk), (dbn, dbk) = block_dims(block_size, D), block_dims(block_size, I)
    P = T * k
    h = alloc.empty((P, I), torch.float32, x.device)
    y = alloc.empty((P, D), torch.float32, x.device)
    wgu, wdn = w_gate_up.view(torch.uint8), w_down.view(torch.uint8)
    sgu, sdn = w_gate_up_scale, w_down_scale
    warps = {"num_warps": cfg["num_warps"]}
    _gate_up_kernel[(P, triton.cdiv(I, cfg["BLOCK_I"]))](
        x, wgu, sgu, topk_ids, h, D, I, E, k, *x.stride(), *wgu.stride(), *sgu.stride(), *topk_ids.stride(),
        gbn, gbk, float(swiglu_limit) if swiglu_limit is not None else 0.0, SCALE[mode],
        HAS_LIMIT=swiglu_limit is not None, MODE=mode, ONE_KBLOCK=triton.cdiv(D, gbk) == 1,
        BLOCK_I=cfg["BLOCK_I"], **_tile(gbk, D, width), **warps)
    _down_kernel[(P, triton.cdiv(D, cfg["BLOCK_O"]))](
        h, wdn, sdn, topk_ids, topk_weights, y, D, I, E, k, *wdn.stride(), *sdn.stride(), *topk_ids.stride(),
        *topk_weights.stride(), dbn, dbk, SCALE[mode], MODE=mode, ONE_KBLOCK=triton.cdiv(I, dbk) == 1,
        BLOCK_O=cfg["BLOCK_O"], **_tile(dbk, I, width), **warps)
    return sum_slots(y, topk_ids.contiguous(), out, E)    # the sum kernel reads ids densely
