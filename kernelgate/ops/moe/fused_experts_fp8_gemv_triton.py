"""Routed experts on FP8 e4m3fn weights for one token (decode at batch 1): fused_experts_gemv_triton.py's
GEMV kernels with the weight rows read as bytes -- half the bf16 bytes, which is the whole point at decode.

    _gate_up_kernel  grid (P, I / BLOCK_I):  h[p, i] = swiglu(gate[e] x[t], up[e] x[t])    [P, I] x's dtype
    _down_kernel     grid (P, D / BLOCK_O):  y[p, o] = w[t, j] * down[e][o, :] . h[p, :]    [P, D] fp32
    sum_slots        (fused_experts_triton)  out[t] = sum_j y[t*k + j]                        [T, D] x dtype

Each program walks K in steps of NB sub-tiles of BK codes, each inside one scale block, the codes
decoded to fp32 (conversion instructions where the device has them, integer ops elsewhere) and
multiplied with plain FMAs (quant/fp8_gemv_triton.py: row_step,
which fp8_linear's GEMV shares): scale[e, row // bn, k // bk] per row and sub-tile, or once per
sub-tile where the program's rows share a scale block. With one K block (per-channel scales, or
K <= bk) the accumulator is scaled once per row at the end instead. Ids outside [0, E) read nothing
and contribute zeros.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ... import alloc, platform
from ..common.pdl import inputs_ready, pdl_args
from ..quant.fp8_gemv_triton import hw_decode, row_step, row_sums, rows_of, tile
from ..quant.fp8_weights import DEFAULT_BLOCK, block_dims
from .fused_experts_gemv_triton import launch_config
from .fused_experts_triton import sum_slots


# One token only: from two the grouped GEMM (fused_experts_fp8_triton.py) is faster. H200, Kimi's
# shapes, each forced, CUDA graphs (bench/RESULTS.md Session 25): T=1 34.6 µs against 37.3; T=2 103.5
# against 53.5; T=4 187.9 against 87.6; T=8 344.9 against 133.8. Above one token this GEMV ran
# launch_config's LAUNCH (32-row programs, tuned for bf16), 0.26 of its floor; no FP8 launch for
# 2-8 tokens was swept, as the grouped GEMM already reads the experts at 0.5-0.69 of theirs.
MAX_TOKENS = 1

# One token on NVIDIA (bench/ops/fused_experts_gemv_sweep.py --fp8 --shared --tokens 1, Kimi's shapes,
# H200, codes decoded by fp8 conversion instructions): 4-row gate/up and 8-row down programs of 4 warps,
# 256-code steps, activations loaded in the weight tile's shape (X_ROWS; fp8_gemv_triton.rows_of):
# 32.6 µs, against 36.9 for the same launch with the activations broadcast from one [NB, BK] load
# (whose compiled loop waits at 8 barriers per K step) and 37.6 for Session 19's 4 / 16 launch
# (bench/RESULTS.md Session 26).
FP8_ONE_TOKEN = {"cuda": dict(BLOCK_I=4, BLOCK_O=8, BLOCK_K=128, num_warps=4, X_ROWS=True)}


@triton.jit
def _gate_up_kernel(x_ptr, w_ptr, s_ptr, ids_ptr, h_ptr, D, I, E, TOPK, sxt, sxd, swe, swr, swd,
                    sse, ssr, ssk, sit, sij, bn, bk: tl.constexpr, limit, out_mul,
                    HAS_LIMIT: tl.constexpr, HW: tl.constexpr, ONE_KBLOCK: tl.constexpr, UNIFORM: tl.constexpr,
                    BLOCK_I: tl.constexpr, NB: tl.constexpr, BK: tl.constexpr, X_ROWS: tl.constexpr,
                    PDL: tl.constexpr):
    p = tl.program_id(0)
    t, j = p // TOPK, p % TOPK
    i = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)                # [BLOCK_I]
    i_ok = i < I
    inputs_ready(PDL)
    e = tl.load(ids_ptr + t.to(tl.int64) * sit + j * sij).to(tl.int64)
    valid = (e >= 0) & (e < E)
    s_e = s_ptr + tl.where(valid, e, 0) * sse                             # scales: read, unused, for bad ids
    sg_rows = s_e + (i // bn).to(tl.int64) * ssr
    su_rows = s_e + ((i + I) // bn).to(tl.int64) * ssr
    i0 = tl.program_id(1) * BLOCK_I
    sg_row0 = s_e + (i0 // bn).to(tl.int64) * ssr
    su_row0 = s_e + ((i0 + I) // bn).to(tl.int64) * ssr
    acc_g = tl.zeros([BLOCK_I, NB, BK], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_I, NB, BK], dtype=tl.float32)
    sub = tl.arange(0, NB)[:, None] * BK + tl.arange(0, BK)[None, :]      # [NB, BK] offsets in a tile
    if valid:
        w_g = w_ptr + e * swe + i.to(tl.int64) * swr                         # gate rows [0, I)
        w_u = w_g + I * swr                                                   # up rows [I, 2I)
        for k0 in range(0, D, NB * BK):
            kk = k0 + sub
            if X_ROWS:
                xv = rows_of(x_ptr + t.to(tl.int64) * sxt, kk, sxd, D, BLOCK_I)
            else:
                xv = tl.load(x_ptr + t.to(tl.int64) * sxt + kk * sxd, mask=kk < D, other=0.0).to(tl.float32)
            acc_g = row_step(acc_g, w_g, sg_rows, sg_row0, xv, kk, k0, D, bk, swd, ssk, i_ok, HW, ONE_KBLOCK, UNIFORM,
                             NB, BK)
            acc_u = row_step(acc_u, w_u, su_rows, su_row0, xv, kk, k0, D, bk, swd, ssk, i_ok, HW, ONE_KBLOCK, UNIFORM,
                             NB, BK)
    g = row_sums(acc_g, sg_rows, i_ok, out_mul, ONE_KBLOCK)
    u = row_sums(acc_u, su_rows, i_ok, out_mul, ONE_KBLOCK)
    if HAS_LIMIT:
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
    h = g * tl.sigmoid(g) * u                                                 # zeros for an invalid id
    tl.store(h_ptr + p.to(tl.int64) * I + i, h, mask=i_ok)


@triton.jit
def _down_kernel(h_ptr, w_ptr, s_ptr, ids_ptr, tw_ptr, y_ptr, D, I, E, TOPK, swe, swr, swi, sse, ssr, ssk,
                 sit, sij, stt, stj, bn, bk: tl.constexpr, out_mul,
                 HW: tl.constexpr, ONE_KBLOCK: tl.constexpr, UNIFORM: tl.constexpr, BLOCK_O: tl.constexpr,
                 NB: tl.constexpr, BK: tl.constexpr, X_ROWS: tl.constexpr, PDL: tl.constexpr):
    p = tl.program_id(0)
    t, j = p // TOPK, p % TOPK
    o = tl.program_id(1) * BLOCK_O + tl.arange(0, BLOCK_O)                # [BLOCK_O] output columns
    o_ok = o < D
    inputs_ready(PDL)
    e = tl.load(ids_ptr + t.to(tl.int64) * sit + j * sij).to(tl.int64)
    valid = (e >= 0) & (e < E)
    s_e = s_ptr + tl.where(valid, e, 0) * sse
    s_rows = s_e + (o // bn).to(tl.int64) * ssr
    s_row0 = s_e + (tl.program_id(1) * BLOCK_O // bn).to(tl.int64) * ssr
    acc = tl.zeros([BLOCK_O, NB, BK], dtype=tl.float32)
    sub = tl.arange(0, NB)[:, None] * BK + tl.arange(0, BK)[None, :]      # [NB, BK] offsets in a tile
    if valid:
        w_rows = w_ptr + e * swe + o.to(tl.int64) * swr
        for k0 in range(0, I, NB * BK):
            kk = k0 + sub
            if X_ROWS:
                hv = rows_of(h_ptr + p.to(tl.int64) * I, kk, 1, I, BLOCK_O)
            else:
                hv = tl.load(h_ptr + p.to(tl.int64) * I + kk, mask=kk < I, other=0.0).to(tl.float32)
            acc = row_step(acc, w_rows, s_rows, s_row0, hv, kk, k0, I, bk, swi, ssk, o_ok, HW, ONE_KBLOCK,
                           UNIFORM, NB, BK)
    wt = tl.load(tw_ptr + t.to(tl.int64) * stt + j * stj)
    y = row_sums(acc, s_rows, o_ok, out_mul, ONE_KBLOCK) * wt
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
    (gbn, gbk), (dbn, dbk) = block_dims(block_size, D), block_dims(block_size, I)
    hw = hw_decode(plat.capability)
    bi, bo, xr = cfg["BLOCK_I"], cfg["BLOCK_O"], bool(cfg.get("X_ROWS", False))
    P = T * k
    h = alloc.empty((P, I), torch.float32 if x.dtype == torch.float32 else x.dtype, x.device)
    wgu, wdn = w_gate_up.view(torch.uint8), w_down.view(torch.uint8)
    sgu, sdn = w_gate_up_scale, w_down_scale
    warps = {"num_warps": cfg["num_warps"]}
    _gate_up_kernel[(P, triton.cdiv(I, bi))](
        x, wgu, sgu, topk_ids, h, D, I, E, k, *x.stride(), *wgu.stride(), *sgu.stride(), *topk_ids.stride(),
        gbn, gbk, float(swiglu_limit) if swiglu_limit is not None else 0.0, 1.0,
        HAS_LIMIT=swiglu_limit is not None, HW=hw, ONE_KBLOCK=triton.cdiv(D, gbk) == 1,
        UNIFORM=gbn % bi == 0 and I % bi == 0, BLOCK_I=bi, **tile(gbk, D, width), X_ROWS=xr, **warps,
        **pdl_args())
    y = alloc.empty((P, D), torch.float32, x.device)
    _down_kernel[(P, triton.cdiv(D, bo))](
        h, wdn, sdn, topk_ids, topk_weights, y, D, I, E, k, *wdn.stride(), *sdn.stride(), *topk_ids.stride(),
        *topk_weights.stride(), dbn, dbk, 1.0, HW=hw, ONE_KBLOCK=triton.cdiv(I, dbk) == 1, UNIFORM=dbn % bo == 0,
        BLOCK_O=bo, **tile(dbk, I, width), X_ROWS=xr, **warps,
        **pdl_args())
    return sum_slots(y, topk_ids.contiguous(), out, E)    # the sum kernel reads ids densely
