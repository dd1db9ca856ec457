"""Portable Triton grouped-GEMM MoE experts (CUDA, ROCm, XPU; CPU under TRITON_INTERPRET=1).

    moe_align        pairs sorted by expert, padded to BLOCK_M per expert       (2-3 launches)
    _gate_up_kernel  h[p] = silu(clamp(x[t] @ Wg[e]^T)) * clamp(x[t] @ Wu[e]^T)  [P, I] in x dtype
    _down_kernel     y[p] = w[p] * (h[p] @ Wd[e]^T)                             [P, D] fp32
    _sum_k_kernel    out[t] = sum_j y[t*k + j] over valid ids                    [T, D] x dtype

with p = t*k + j. Row-block b of the GEMMs holds pairs of one expert only, so each program
streams one weight tile of one expert; programs of one N tile and consecutive row-blocks
run together (row-blocks vary fastest), so an expert's tile is read from HBM about once
(decode is weight-bandwidth bound). Accumulation in fp32; fp32 inputs use IEEE dot (no TF32).
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ... import alloc
from ... import platform
from ...platform import interpreting
from ..common.pdl import inputs_ready, pdl_args
from .moe_align_triton import moe_align


def _configs():
    # (BLOCK_N, BLOCK_K, warps, stages); BLOCK_M is fixed by the permutation, not tuned. The last
    # three are the prefill GEMMs' best at BLOCK_M 128 (bench/ops/fused_experts_prefill_sweep.py;
    # a config whose tiles exceed shared memory is skipped by the autotuner).
    # GROUP_M > 0: GROUP_M row blocks take all their column tiles one after another (_tile), so
    # the programs resident at once share their rows (h in the down GEMM: 151 MB at a Kimi 8k
    # chunk, re-read per column tile otherwise) in L2; tried beside 0 (every row block, one column
    # tile after another: the order measured before) for the prefill launches.
    plain = ((32, 128, 4, 4), (64, 64, 4, 4), (64, 128, 4, 4), (128, 64, 4, 4), (128, 128, 8, 3), (64, 256, 4, 3))
    prefill = ((128, 64, 8, 3), (128, 64, 8, 4), (256, 64, 8, 3))
    return [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": g}, num_warps=w, num_stages=st)
            for (bn, bk, w, st), g in [(c, 0) for c in plain + prefill] + [(c, 8) for c in prefill]]


# Small problems (tests, toy models) and the interpreter: one fixed config per platform, no tuning cost.
_FIXED = dict(BLOCK_N=64, BLOCK_K=64, GROUP_M=0, num_warps=4, num_stages=3)
LAUNCH = {
    # AMD GPUs have 64 KiB of LDS per workgroup: three fp32 stages need 72 KiB (compile_targets: gfx90a, gfx942)
    "rocm": dict(_FIXED, num_stages=2),
}


def launch_config(plat) -> dict:
    """The fixed launch choice on platform `plat` (platform.current(), or a simulated one)."""
    return LAUNCH.get(plat.name, _FIXED)
_TUNE_MIN_WEIGHTS = 1 << 20   # D * I at which autotuning pays off (Kimi: 2304 * 1024)


@functools.cache
def _tuned(kernel, max_block_k: int = 256):
    """The autotuned kernel, built on first use (on a GPU only), keyed on problem shape and the
    bucket of pairs, so decode and prefill each get their own config. BLOCK_M follows from the
    bucket (block_m_for), so steps of power-of-two token counts meet every key (engine/warmup.py).
    max_block_k: configs with larger K tiles are left out (FP8 weights: a K tile in one scale block)."""
    configs = [c for c in _configs() if c.kwargs["BLOCK_K"] <= max_block_k]
    return triton.autotune(configs=configs, key=["N", "K", "BLOCK_M", "P_BUCKET"])(kernel)


@triton.jit
def _dot(a, b, acc, IEEE: tl.constexpr):
    # IEEE: fp32 operands without TF32 rounding. Also used under the interpreter, whose
    # bf16 tl.dot (triton 3.9) returns garbage.
    if IEEE:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def _tile(NB, N, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(row block, column tile) of this program in a 1-D grid of NB x cdiv(N, BLOCK_N): GROUP_M
    row blocks take all their column tiles before the next GROUP_M; GROUP_M 0: all NB row blocks
    vary fastest, one column tile after another (the order of a 2-D grid (NB, tiles))."""
    pid = tl.program_id(0)
    if GROUP_M == 0:
        return pid % NB, pid // NB
    tiles = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles
    first = (pid // per_group) * GROUP_M
    rows = tl.minimum(NB - first, GROUP_M)
    return first + (pid % per_group) % rows, (pid % per_group) // rows


# P (pairs) is not specialised on: odd and even token counts share one compiled program
@triton.jit(do_not_specialize=["P"])
def _gate_up_kernel(x_ptr, w_ptr, h_ptr, sorted_ptr, block_expert_ptr, P, N, K, P_BUCKET, NB,
                    sxt, sxd, swe, swn, swk, limit, TOPK,
                    HAS_LIMIT: tl.constexpr, IEEE: tl.constexpr,
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
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        a = tl.load(x_ptr + tok[:, None] * sxt + offs_k[None, :] * sxd,
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)                 # [BM, BK]
        wmask = k_ok[:, None] & n_ok[None, :]
        wg = tl.load(w_e + offs_n[None, :] * swn + offs_k[:, None] * swk, mask=wmask, other=0.0)
        wu = tl.load(w_e + (offs_n + N)[None, :] * swn + offs_k[:, None] * swk, mask=wmask, other=0.0)
        acc_g = _dot(a, wg, acc_g, IEEE)
        acc_u = _dot(a, wu, acc_u, IEEE)
    if HAS_LIMIT:
        acc_g = tl.minimum(acc_g, limit)
        acc_u = tl.minimum(tl.maximum(acc_u, -limit), limit)
    h = acc_g * tl.sigmoid(acc_g) * acc_u
    tl.store(h_ptr + pair[:, None].to(tl.int64) * N + offs_n[None, :], h.to(h_ptr.dtype.element_ty),
             mask=row_ok[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["P"])
def _down_kernel(h_ptr, w_ptr, y_ptr, topk_w_ptr, sorted_ptr, block_expert_ptr, P, N, K, P_BUCKET, NB,
                 swe, swn, swk,
                 IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
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
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        a = tl.load(h_ptr + pair64[:, None] * K + offs_k[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)                 # [BM, BK]
        w = tl.load(w_e + offs_n[None, :] * swn + offs_k[:, None] * swk,
                    mask=k_ok[:, None] & n_ok[None, :], other=0.0)                   # [BK, BN]
        acc = _dot(a, w, acc, IEEE)
    wt = tl.load(topk_w_ptr + pair, mask=row_ok, other=0.0)
    acc = acc * wt[:, None]
    tl.store(y_ptr + pair64[:, None] * N + offs_n[None, :], acc, mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _sum_k_kernel(y_ptr, ids_ptr, out_ptr, D, E, sot, TOPK: tl.constexpr, BLOCK_D: tl.constexpr,
                  PDL: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = offs < D
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    inputs_ready(PDL)
    for j in tl.static_range(TOPK):   # fixed order over slots: deterministic; unrolled, so the k loads
        # are in flight together (a loop waits for each: ~5 µs for one token's 9 rows on the H200)
        e = tl.load(ids_ptr + t * TOPK + j) + tl.zeros([BLOCK_D], dtype=tl.int32)  # as a vector mask
        ok = d_ok & (e >= 0) & (e < E)
        acc += tl.load(y_ptr + (t * TOPK + j) * D + offs, mask=ok, other=0.0)
    tl.store(out_ptr + t * sot + offs, acc.to(out_ptr.dtype.element_ty), mask=d_ok)


def block_m_for(P: int, E: int, largest: int = 128) -> int:
    """Rows per GEMM block for P token-expert pairs (fused_experts passes P's power-of-two bucket):
    small for decode (pairs per expert ~1), so little compute is padding;
    large enough in prefill that an expert's weights are not re-read by many row-blocks. 128 from
    ~128 rows per expert (a 4k-token prefill chunk of Kimi / Qwen): on the H200 an 8k chunk's GEMMs
    took 1.64 + 1.09 ms at 128 against 1.73 + 1.26 at 64, with the padding doubled (22 -> 44 %)."""
    avg = P / max(E, 1)
    bm = 16 if avg <= 8 else 32 if avg <= 20 else 64 if avg <= 128 else 128
    return min(bm, largest)


class Routing(NamedTuple):
    """(token, slot) pairs sorted by expert for the grouped GEMMs (moe_align)."""
    ids: torch.Tensor            # topk_ids [T, k], dense
    pairs: int                   # P = T * k
    bucket: int                  # P's power-of-two bucket (autotune key)
    block_m: int                 # rows per GEMM block (block_m_for the bucket)
    sorted_pairs: torch.Tensor   # [num_blocks * block_m]
    block_expert: torch.Tensor   # [num_blocks]


def route(topk_ids: torch.Tensor, num_experts: int, largest_block_m: int = 128) -> Routing:
    ids = topk_ids.contiguous()
    P = ids.numel()
    bucket = triton.next_power_of_2(P)
    bm = block_m_for(bucket, num_experts, largest_block_m)   # from the bucket: one BLOCK_M per autotune key
    sorted_pairs, block_expert = moe_align(ids, num_experts, bm)
    return Routing(ids, P, bucket, bm, sorted_pairs, block_expert)


def sum_slots(y: torch.Tensor, ids: torch.Tensor, out: torch.Tensor, num_experts: int) -> torch.Tensor:
    """out[t] = sum over slots j with a valid id of y[t*k + j] (fp32 [T*k, D] -> out [T, D], fixed order)."""
    T, k = ids.shape
    D = out.shape[1]
    block_d = min(1024, triton.next_power_of_2(D))
    _sum_k_kernel[(T, triton.cdiv(D, block_d))](y, ids, out, D, num_experts, out.stride(0), k, BLOCK_D=block_d,
                                               **pdl_args())
    return out


def fused_experts_triton(x, w_gate_up, w_down, topk_weights, topk_ids, activation="silu",
                         swiglu_limit=None):
    T, D = x.shape
    E, I = w_down.shape[0], w_down.shape[2]
    k = topk_ids.shape[1]
    out = alloc.empty((T, D), x.dtype, x.device)
    if T == 0:
        return out
    r = route(topk_ids, E)
    P, bucket, bm = r.pairs, r.bucket, r.block_m
    wts = topk_weights.contiguous()
    nb = r.block_expert.numel()
    h = alloc.empty((P, I), x.dtype, x.device)
    y = alloc.empty((P, D), torch.float32, x.device)
    ieee = x.dtype == torch.float32 or interpreting()
    tune = not interpreting() and D * I >= _TUNE_MIN_WEIGHTS
    gate_up = _tuned(_gate_up_kernel) if tune else _gate_up_kernel
    down = _tuned(_down_kernel) if tune else _down_kernel
    meta = {} if tune else launch_config(platform.current())
    gate_up[lambda META: (nb * triton.cdiv(I, META["BLOCK_N"]),)](
        x, w_gate_up, h, r.sorted_pairs, r.block_expert, P, I, D, bucket, nb,
        x.stride(0), x.stride(1), *w_gate_up.stride(),
        float(swiglu_limit) if swiglu_limit is not None else 0.0, k,
        HAS_LIMIT=swiglu_limit is not None, IEEE=ieee, BLOCK_M=bm, **meta)
    down[lambda META: (nb * triton.cdiv(D, META["BLOCK_N"]),)](
        h, w_down, y, wts, r.sorted_pairs, r.block_expert, P, D, I, bucket, nb, *w_down.stride(),
        IEEE=ieee, BLOCK_M=bm, **meta)
    return sum_slots(y, r.ids, out, E)
