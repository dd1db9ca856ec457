"""Portable Triton grouped-GEMM MoE experts on FP8 e4m3fn weights (CUDA, ROCm, XPU; CPU under
TRITON_INTERPRET=1): fused_experts_triton.py's pipeline with the weight tiles read as bytes.

    route            moe_align: pairs sorted by expert, padded to BLOCK_M per expert   (shared)
    _gate_up_kernel  h[p] = swiglu(x[t] @ dequant(Wg[e])^T, x[t] @ dequant(Wu[e])^T)   [P, I] in x dtype
    _down_kernel     y[p] = w[p] * (h[p] @ dequant(Wd[e])^T)                            [P, D] fp32
    sum_slots        out[t] = sum_j y[t*k + j] over valid ids                           (shared)

Weight tiles [BLOCK_K, BLOCK_N] are decoded in registers (quant/fp8_triton.py: fp8 conversion where
the device has it, integer ops elsewhere) and multiplied as fp16 into fp32 partials, 16-bit x tiles
scaled to fp16 exactly (fp8_linear_triton.w8a16_part; fp32 x: fp32 operands). A K tile lies
inside one scale block, so each partial is scaled per column before it is added:
acc += (a @ w) * scale[e, n // bn, k0 // bk]; with one K block (per-channel scales, or K <= bk) the
scale multiplies once at the end. Gate and up rows take their own scale rows (with 2I not a multiple
of bn a block holds rows of both).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ... import alloc, platform
from ...platform import interpreting
from ..quant.fp8_gemv_triton import k_tile
from ..quant.fp8_linear_triton import operand_flags, w8a16_part
from ..quant.fp8_triton import MODES, SCALE, mode_for
from ..quant.fp8_weights import DEFAULT_BLOCK, block_dims
from .fused_experts_triton import _TUNE_MIN_WEIGHTS, _tile, _tuned, launch_config, route, sum_slots


@triton.jit
def _scaled_dot(a, w, acc, s_rows, k0, bk, ssk, n_ok, MODE: tl.constexpr, ONE_KBLOCK: tl.constexpr,
                X16: tl.constexpr, SCALED: tl.constexpr, F32: tl.constexpr):
    """acc + a @ dequant(w bytes), the tile's per-column scales at s_rows + (k0 // bk) * ssk."""
    if ONE_KBLOCK:
        acc = w8a16_part(a, w, acc, None, MODE, X16, SCALED, F32, False)
    else:
        s = tl.load(s_rows + (k0 // bk) * ssk, mask=n_ok, other=0.0)
        acc = w8a16_part(a, w, acc, s, MODE, X16, SCALED, F32, True)
    return acc


@triton.jit
def _finish(acc, s_rows, n_ok, out_mul, ONE_KBLOCK: tl.constexpr):
    if ONE_KBLOCK:
        acc = acc * tl.load(s_rows, mask=n_ok, other=0.0)[None, :]
    return acc * out_mul


@triton.jit(do_not_specialize=["P"])
def _gate_up_kernel(x_ptr, w_ptr, s_ptr, h_ptr, sorted_ptr, block_expert_ptr, P, N, K, P_BUCKET, NB,
                    sxt, sxd, swe, swn, swk, sse, ssn, ssk, bn, bk, limit, out_mul, TOPK,
                    HAS_LIMIT: tl.constexpr, MODE: tl.constexpr, ONE_KBLOCK: tl.constexpr, X16: tl.constexpr,
                    SCALED: tl.constexpr, F32: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    # N = I (h columns), K = D. Weight rows [0, N) are gate, [N, 2N) are up.
    pid_m, pid_n = _tile(NB, N, BLOCK_N, GROUP_M)
    e = tl.load(block_expert_ptr + pid_m)
    if e < 0:
        return
    pair = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = pair < P
    tok = (pair // TOPK).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    w_e = w_ptr + e.to(tl.int64) * swe
    s_e = s_ptr + e.to(tl.int64) * sse
    sg_rows = s_e + (offs_n // bn) * ssn
    su_rows = s_e + ((offs_n + N) // bn) * ssn
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        a = tl.load(x_ptr + tok[:, None] * sxt + offs_k[None, :] * sxd,
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)                 # [BM, BK]
        wmask = k_ok[:, None] & n_ok[None, :]
        wg = tl.load(w_e + offs_n[None, :] * swn + offs_k[:, None] * swk, mask=wmask, other=0)
        wu = tl.load(w_e + (offs_n + N)[None, :] * swn + offs_k[:, None] * swk, mask=wmask, other=0)
        acc_g = _scaled_dot(a, wg, acc_g, sg_rows, k0, bk, ssk, n_ok, MODE, ONE_KBLOCK, X16, SCALED, F32)
        acc_u = _scaled_dot(a, wu, acc_u, su_rows, k0, bk, ssk, n_ok, MODE, ONE_KBLOCK, X16, SCALED, F32)
    acc_g = _finish(acc_g, sg_rows, n_ok, out_mul, ONE_KBLOCK)
    acc_u = _finish(acc_u, su_rows, n_ok, out_mul, ONE_KBLOCK)
    if HAS_LIMIT:
        acc_g = tl.minimum(acc_g, limit)
        acc_u = tl.minimum(tl.maximum(acc_u, -limit), limit)
    h = acc_g * tl.sigmoid(acc_g) * acc_u
    tl.store(h_ptr + pair[:, None].to(tl.int64) * N + offs_n[None, :], h.to(h_ptr.dtype.element_ty),
             mask=row_ok[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["P"])
def _down_kernel(h_ptr, w_ptr, s_ptr, y_ptr, topk_w_ptr, sorted_ptr, block_expert_ptr, P, N, K, P_BUCKET, NB,
                 swe, swn, swk, sse, ssn, ssk, bn, bk, out_mul,
                 MODE: tl.constexpr, ONE_KBLOCK: tl.constexpr, X16: tl.constexpr, SCALED: tl.constexpr,
                 F32: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 GROUP_M: tl.constexpr):
    # N = D (output columns), K = I.
    pid_m, pid_n = _tile(NB, N, BLOCK_N, GROUP_M)
    e = tl.load(block_expert_ptr + pid_m)
    if e < 0:
        return
    pair = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = pair < P
    pair64 = pair.to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    w_e = w_ptr + e.to(tl.int64) * swe
    s_rows = s_ptr + e.to(tl.int64) * sse + (offs_n // bn) * ssn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        a = tl.load(h_ptr + pair64[:, None] * K + offs_k[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)                 # [BM, BK]
        w = tl.load(w_e + offs_n[None, :] * swn + offs_k[:, None] * swk,
                    mask=k_ok[:, None] & n_ok[None, :], other=0)                     # [BK, BN]
        acc = _scaled_dot(a, w, acc, s_rows, k0, bk, ssk, n_ok, MODE, ONE_KBLOCK, X16, SCALED, F32)
    acc = _finish(acc, s_rows, n_ok, out_mul, ONE_KBLOCK)
    wt = tl.load(topk_w_ptr + pair, mask=row_ok, other=0.0)
    acc = acc * wt[:, None]
    tl.store(y_ptr + pair64[:, None] * N + offs_n[None, :], acc, mask=row_ok[:, None] & n_ok[None, :])


def fused_experts_fp8_triton(x, w_gate_up, w_down, topk_weights, topk_ids, w_gate_up_scale, w_down_scale,
                             block_size=DEFAULT_BLOCK, activation="silu", swiglu_limit=None):
    T, D = x.shape
    E, I = w_down.shape[0], w_down.shape[2]
    out = alloc.empty((T, D), x.dtype, x.device)
    if T == 0:
        return out
    plat = platform.current()
    mode = MODES[mode_for(plat.capability)]
    r = route(topk_ids, E, largest_block_m=64)   # (128 rows: not measured with FP8 weights)
    P, nb = r.pairs, r.block_expert.numel()
    wts = topk_weights.contiguous()
    h = alloc.empty((P, I), x.dtype, x.device)
    y = alloc.empty((P, D), torch.float32, x.device)
    f32 = x.dtype == torch.float32 or interpreting()
    flags = operand_flags(x.dtype, f32)
    (gbn, gbk), (dbn, dbk) = block_dims(block_size, D), block_dims(block_size, I)
    kmax = min(k_tile(gbk, D, 128), k_tile(dbk, I, 128))   # one K tile size fits both GEMMs' blocks
    tune = not interpreting() and D * I >= _TUNE_MIN_WEIGHTS
    gate_up = _tuned(_gate_up_kernel, kmax) if tune else _gate_up_kernel
    down = _tuned(_down_kernel, kmax) if tune else _down_kernel
    meta = {} if tune else dict(launch_config(plat))
    if not tune:
        meta["BLOCK_K"] = min(meta["BLOCK_K"], kmax)
    wgu, wdn = w_gate_up.view(torch.uint8), w_down.view(torch.uint8)
    sgu, sdn = w_gate_up_scale, w_down_scale
    gate_up[lambda META: (nb * triton.cdiv(I, META["BLOCK_N"]),)](
        x, wgu, sgu, h, r.sorted_pairs, r.block_expert, P, I, D, r.bucket, nb,
        x.stride(0), x.stride(1), *wgu.stride(), *sgu.stride(), gbn, gbk,
        float(swiglu_limit) if swiglu_limit is not None else 0.0, SCALE[mode], topk_ids.shape[1],
        HAS_LIMIT=swiglu_limit is not None, MODE=mode, ONE_KBLOCK=triton.cdiv(D, gbk) == 1, **flags,
        BLOCK_M=r.block_m, **meta)
    down[lambda META: (nb * triton.cdiv(D, META["BLOCK_N"]),)](
        h, wdn, sdn, y, wts, r.sorted_pairs, r.block_expert, P, D, I, r.bucket, nb, *wdn.stride(), *sdn.stride(),
        dbn, dbk, SCALE[mode], MODE=mode, ONE_KBLOCK=triton.cdiv(I, dbk) == 1, **flags, BLOCK_M=r.block_m, **meta)
    return sum_slots(y, r.ids, out, E)
