"""Small-batch routed experts (decode, T <= 8): GEMV kernels, one (token, slot) pair per program row.

At decode a token meets each routed expert once, so the work is weight streaming: the grouped
GEMM (fused_experts_triton.py) pads every pair to a 16-row MMA block and sorts pairs first;
here every program multiplies one pair's activation vector by a slice of its expert's weights
with plain fp32 FMAs and never sorts:

    _gate_up_kernel  grid (P, I / BLOCK_I):  h[p, i] = swiglu(gate[e] x[t], up[e] x[t])          [P, I] x's dtype
    _down_kernel     grid (T, D / DOWN_O):   out[t, o] = sum_j w[t, j] down[e_j][o, :] . h[p_j, :]  [T, D] x dtype

with p = t*k + j and e = ids[t, j]; h is stored in x's dtype, as the grouped GEMM stores it (bf16 since
Session 26: half the bytes, and the down GEMV's h tile as wide as its weight tile). Each program
streams a [rows, BLOCK_K] tile per step (16 KB of bf16 at the default sizes) and keeps a 2-D fp32
accumulator, reduced once at the end; the gate and up rows of the same outputs are read by the same
program, so SwiGLU needs no second pass; a down program walks its token's k slots in a fixed order,
so the sum over slots needs no third launch (H200, one token, bench/RESULTS.md Session 24: 24.5 ->
21.8 µs at Qwen's shapes, 43.7 -> 41.4 at Kimi's; 2-3 % slower at 4 and 8 tokens). A pair whose id is outside [0, E) reads
nothing and contributes zeros. Strides of every input are honoured (views are fine).

One token on bf16 weights whose rows are whole 8-byte words (every checkpoint's layout) takes the FP8
GEMV's kernels instead (fused_experts_words_triton.py): rows read as int64 words of 4 values, K steps
of 256 values loaded one step ahead, a program per (slot, rows), then the sum over slots.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ... import alloc, platform
from ..common.pdl import inputs_ready, pdl_args
from ..quant.fp8_gemv_triton import rows_of
from .fused_experts_words_triton import bf16_words, fused_experts_bf16_words

# Up to this many tokens the GEMV streams each hit expert's bytes faster than the grouped GEMM, whose
# 16-row MMA tiles are mostly padding at a few tokens; by 16 tokens the MMA form reads each expert as
# well and wins (figures: bench/RESULTS.md, "fused_experts at decode sizes").
MAX_TOKENS = 8
# Launch choices per platform name (from platform.current(), so a simulated platform takes its own):
# rows of outputs per program, reduction tile width, warps (BLOCK_O is the FP8 GEMV's down rows; the
# bf16 down takes DOWN_O / DOWN_K / DOWN_WARPS, falling back to BLOCK_O / BLOCK_K / num_warps).
# The down GEMV: 2-row programs of 4 warps, h loaded in the weight tile's shape (DOWN_X_ROWS, no exchange
# through shared memory; fp8_gemv_triton.rows_of). H200, whole op, bench/ops/fused_experts_gemv_sweep.py
# --shared (bench/RESULTS.md Session 26): Kimi T=1 45.8 -> 41.0 µs, T=8 219.8 -> 215.0; Qwen T=1 22.8 -> 21.9
# (the gate/up GEMV is faster with its [BLOCK_K] activation load: 47.1 against 45.6 at Kimi's T=1).
# Elsewhere (not measured there) Session 24's down launch: 4-row programs, h loaded once per K step.
_DOWN_CUDA = dict(DOWN_O=2, DOWN_K=512, DOWN_WARPS=4, DOWN_X_ROWS=True)
_DOWN = dict(DOWN_O=4, DOWN_K=512, DOWN_WARPS=4)
LAUNCH = {
    "default": dict(BLOCK_I=32, BLOCK_O=16, BLOCK_K=256, num_warps=4, **_DOWN),
    "cuda": dict(BLOCK_I=32, BLOCK_O=16, BLOCK_K=256, num_warps=4, **_DOWN_CUDA),
    "rocm": dict(BLOCK_I=32, BLOCK_O=16, BLOCK_K=256, num_warps=4, **_DOWN),   # 64-wide wavefronts: 4 = 256 lanes
}


# One token (k + 1 = 9 pairs with Kimi's stacked shared expert): 8-row programs of 8 warps, so
# the gate_up grid is 1,152 programs rather than 288 (about two per SM, a ragged last wave);
# from a few tokens on, LAUNCH's grid is wide enough. Tuned on NVIDIA only: elsewhere LAUNCH.
# 128-wide K steps since Session 26 (H200, whole op, two runs each): Kimi 41.0 -> 38.5 µs, Qwen 22.0 -> 19.9.
# The down GEMV at one token on 8 warps since Session 28 (its 2-row programs walk the 9 slots one after
# another: twice the threads keep twice the loads in flight; whole op, same call, PDL on): Qwen 24.1 ->
# 21.9 µs, Kimi 42.4 -> 40.4 (bench/ops/fused_experts_gemv_sweep.py --shared [--qwen] --down).
ONE_TOKEN = {"cuda": dict(BLOCK_I=8, BLOCK_O=16, BLOCK_K=128, num_warps=8, **{**_DOWN_CUDA, "DOWN_WARPS": 8})}


def launch_config(plat, tokens: int = 2) -> dict:
    if platform.interpreting():   # the interpreter pays per program: few, wide ones
        return dict(BLOCK_I=128, BLOCK_O=128, BLOCK_K=128, num_warps=4)
    if tokens == 1 and plat.name in ONE_TOKEN:
        return ONE_TOKEN[plat.name]
    return LAUNCH.get(plat.name, LAUNCH["default"])


@triton.jit
def _gate_up_kernel(x_ptr, w_ptr, ids_ptr, h_ptr, D, I, E, TOPK, sxt, sxd, swe, swr, swd, sit, sij, limit,
                    HAS_LIMIT: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_K: tl.constexpr, X_ROWS: tl.constexpr,
                    PDL: tl.constexpr):
    p = tl.program_id(0)
    t, j = p // TOPK, p % TOPK
    i = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)                # [BLOCK_I]
    i_ok = i < I
    inputs_ready(PDL)
    e = tl.load(ids_ptr + t.to(tl.int64) * sit + j * sij).to(tl.int64)
    valid = (e >= 0) & (e < E)
    acc_g = tl.zeros([BLOCK_I, BLOCK_K], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_I, BLOCK_K], dtype=tl.float32)
    if valid:
        w_g = w_ptr + e * swe + i[:, None].to(tl.int64) * swr               # gate rows [0, I)
        w_u = w_g + I * swr                                                   # up rows [I, 2I)
        for k0 in range(0, D, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            k_ok = kk < D
            if X_ROWS:
                xv = rows_of(x_ptr + t.to(tl.int64) * sxt, kk, sxd, D, BLOCK_I)
            else:
                xv = tl.load(x_ptr + t.to(tl.int64) * sxt + kk * sxd, mask=k_ok, other=0.0).to(tl.float32)[None, :]
            m = i_ok[:, None] & k_ok[None, :]
            acc_g += tl.load(w_g + kk[None, :] * swd, mask=m, other=0.0).to(tl.float32) * xv
            acc_u += tl.load(w_u + kk[None, :] * swd, mask=m, other=0.0).to(tl.float32) * xv
    g = tl.sum(acc_g, axis=1)
    u = tl.sum(acc_u, axis=1)
    if HAS_LIMIT:
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
    h = g * tl.sigmoid(g) * u                                                 # zeros for an invalid id
    tl.store(h_ptr + p.to(tl.int64) * I + i, h, mask=i_ok)


@triton.jit
def _down_kernel(h_ptr, w_ptr, ids_ptr, tw_ptr, out_ptr, D, I, E, TOPK, swe, swr, swi, sit, sij, stt, stj, sot,
                 BLOCK_O: tl.constexpr, BLOCK_K: tl.constexpr, X_ROWS: tl.constexpr, PDL: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    o = tl.program_id(1) * BLOCK_O + tl.arange(0, BLOCK_O)                # [BLOCK_O] output columns
    o_ok = o < D
    acc = tl.zeros([BLOCK_O, BLOCK_K], dtype=tl.float32)
    inputs_ready(PDL)
    for j in range(TOPK):   # the token's slots in a fixed order: deterministic
        e = tl.load(ids_ptr + t * sit + j * sij).to(tl.int64)
        if (e >= 0) & (e < E):
            wt = tl.load(tw_ptr + t * stt + j * stj)
            w_rows = w_ptr + e * swe + o[:, None].to(tl.int64) * swr
            h_row = h_ptr + (t * TOPK + j) * I
            for k0 in range(0, I, BLOCK_K):
                kk = k0 + tl.arange(0, BLOCK_K)
                k_ok = kk < I
                if X_ROWS:
                    hv = rows_of(h_row, kk, 1, I, BLOCK_O) * wt
                else:
                    hv = (tl.load(h_row + kk, mask=k_ok, other=0.0).to(tl.float32) * wt)[None, :]
                w = tl.load(w_rows + kk[None, :] * swi, mask=o_ok[:, None] & k_ok[None, :], other=0.0)
                acc += w.to(tl.float32) * hv
    tl.store(out_ptr + t * sot + o, tl.sum(acc, axis=1).to(out_ptr.dtype.element_ty), mask=o_ok)


def fused_experts_gemv(x, w_gate_up, w_down, topk_weights, topk_ids, activation="silu", swiglu_limit=None,
                       launch=None):
    """`launch`: the one-token word form's gate_up / down (R, C, num_warps) overrides (bench sweeps)."""
    T, D = x.shape
    E, I = w_down.shape[0], w_down.shape[2]
    k = topk_ids.shape[1]
    out = alloc.empty((T, D), x.dtype, x.device)
    if T == 0:
        return out
    if T == 1:
        wgu, wdn = bf16_words(w_gate_up), bf16_words(w_down)
        if wgu is not None and wdn is not None:
            return fused_experts_bf16_words(x, wgu, wdn, topk_weights, topk_ids, out, swiglu_limit, launch)
    cfg = launch_config(platform.current(), T)
    P = T * k
    h = alloc.empty((P, I), torch.float32 if x.dtype == torch.float32 else x.dtype, x.device)
    warps, xr = {"num_warps": cfg["num_warps"]}, bool(cfg.get("X_ROWS", False))
    _gate_up_kernel[(P, triton.cdiv(I, cfg["BLOCK_I"]))](
        x, w_gate_up, topk_ids, h, D, I, E, k, *x.stride(), *w_gate_up.stride(), *topk_ids.stride(),
        float(swiglu_limit) if swiglu_limit is not None else 0.0,
        HAS_LIMIT=swiglu_limit is not None, BLOCK_I=cfg["BLOCK_I"], BLOCK_K=cfg["BLOCK_K"], X_ROWS=xr, **warps,
        **pdl_args())
    bo = cfg.get("DOWN_O", cfg["BLOCK_O"])
    _down_kernel[(T, triton.cdiv(D, bo))](
        h, w_down, topk_ids, topk_weights, out, D, I, E, k, *w_down.stride(), *topk_ids.stride(),
        *topk_weights.stride(), out.stride(0), BLOCK_O=bo, BLOCK_K=cfg.get("DOWN_K", cfg["BLOCK_K"]),
        X_ROWS=bool(cfg.get("DOWN_X_ROWS", False)), num_warps=cfg.get("DOWN_WARPS", cfg["num_warps"]),
        **pdl_args())
    return out
