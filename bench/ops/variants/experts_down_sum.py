"""Probe (issues 37 / 38, not dispatched): the one-token experts' down GEMV sums the slots itself -- one launch
fewer in every MoE layer of a batch-1 step.

fused_experts' word GEMV at one token (moe/fused_experts_words_triton.py, FP8 and bf16 weights) runs the
gate/up kernel, the down kernel (y[j, rows] for each slot j) and `sum_slots` (out = sum_j y[j], a third
launch of ~2 µs, most of it latency). Here the down kernel's programs of one row block count themselves
out on an acq_rel atomic counter (one per row block); the last of the k slots' programs adds the k rows
in slot order -- sum_slots' order, so the output is bitwise the same -- writes out[rows] and resets the
counter. The gate/up kernel is the module's (so gemv_inflight's experts form composes with this one; its
down kernel is replaced here). Compiled here for sm_90 at Kimi's dispatched down launch (16 rows, 2 warps):
96 registers, no spills.

    sys.path.insert(0, "bench/ops/variants"); import experts_down_sum; experts_down_sum.install()
    bench/e2e/fp8_decode.py --forms "none;experts_down_sum"
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernelgate import alloc
from kernelgate.ops.common.pdl import inputs_ready, pdl_args
from kernelgate.ops.moe import fused_experts_words_triton as ew
from kernelgate.ops.quant import fp8_gemv_triton as gt

_ORIGINAL = ew._launch
_COUNTERS: dict = {}                  # device -> int32 counters, one per row block, zero between calls


@triton.jit
def _down_sum_kernel(h_ptr, w_ptr, s_ptr, ids_ptr, tw_ptr, y_ptr, out_ptr, count_ptr, D, KW, E, shj, swe, swr, sse,
                     ssr, ssk, stw, bn, bkw: tl.constexpr, R: tl.constexpr, W: tl.constexpr, TOPK: tl.constexpr,
                     SCALED: tl.constexpr, ONE_KBLOCK: tl.constexpr, EVEN: tl.constexpr, PTX: tl.constexpr,
                     WORDS: tl.constexpr, PDL: tl.constexpr):
    # fused_experts_words_triton._down_kernel, then sum_slots' sum by the row block's last program
    j = tl.program_id(0)
    b = tl.program_id(1)
    o0 = b * R
    inputs_ready(PDL)
    valid, w_e, s_e = ew._slot_expert(ids_ptr, j, E, w_ptr, swe, s_ptr, sse)
    tiles, rows = gt.row_tile(w_e, o0, D, swr, R, W)
    y = gt.rows_dot(tiles, s_e + (o0 // bn) * ssr, h_ptr + j * shj, KW, 1, ssk, bkw, R, W, ONE_KBLOCK, EVEN, PTX,
                    WORDS, False)
    if SCALED and ONE_KBLOCK:
        y = y * gt.row_scales(s_e, rows, D, bn, ssr)
    y = tl.where(valid, y * tl.load(tw_ptr + j * stw), 0.0)
    r_ok = rows < D
    tl.store(y_ptr + j * D + rows, y, mask=r_ok)
    done = tl.atomic_add(count_ptr + b, 1)                  # acq_rel: the row above first
    if done == TOPK - 1:                                    # the row block's last slot: out = sum_j y[j]
        acc = tl.zeros([R], dtype=tl.float32)
        for jj in tl.static_range(TOPK):                    # sum_slots' order: the same fp32 sums
            e = tl.load(ids_ptr + jj) + tl.zeros_like(rows)       # as a vector mask
            acc += tl.load(y_ptr + jj * D + rows, mask=r_ok & (e >= 0) & (e < E), other=0.0)
        tl.store(out_ptr + rows, acc.to(out_ptr.dtype.element_ty), mask=r_ok)
        tl.store(count_ptr + b, 0)


def _launch(x, wgu, wdn, topk_weights, topk_ids, out, cfg, swiglu_limit, scales=None, ptx=False):
    """fused_experts_words_triton._launch with the down kernel summing the slots (no sum_slots launch)."""
    D = x.shape[1]
    E, I = wdn.shape[0], wdn.shape[2] * 4
    k = topk_ids.shape[1]
    sgu, sdn, gbn, dbn, gbkw, dbkw, g_one, d_one = ew.scale_args(wgu, wdn, D, I, scales)
    ids = topk_ids[0].contiguous()
    tw = topk_weights[0]
    h = alloc.empty((k, I), torch.float32 if x.dtype == torch.float32 else x.dtype, x.device)
    y = alloc.empty((k, D), torch.float32, x.device)
    xw, x_is_words = gt.x_words(x[0])
    scaled = dict(SCALED=scales is not None, PTX=ptx)
    R, C, warps = cfg["gate_up"]
    R = gt.rows_per_program(R, g_one, gbn, I)
    W, even = gt.step(D, C)
    ew._gate_up_kernel[(k, triton.cdiv(I, R))](
        xw, wgu, sgu, ids, h, I, D // 4, E, x.stride(1), wgu.stride(0), wgu.stride(1), *sgu.stride(), gbn,
        gbkw, float(swiglu_limit) if swiglu_limit is not None else 0.0,
        HAS_LIMIT=swiglu_limit is not None, R=R, W=W, ONE_KBLOCK=g_one, EVEN=even, WORDS=x_is_words, **scaled,
        num_warps=warps, **pdl_args())
    hw, h_is_words = gt.x_words(h)
    R, C, warps = cfg["down"]
    R = gt.rows_per_program(R, d_one, dbn)
    W, even = gt.step(I, C)
    blocks = triton.cdiv(D, R)
    counters = _COUNTERS.get(x.device)
    if counters is None or counters.numel() < blocks:
        counters = _COUNTERS[x.device] = torch.zeros(max(blocks, 4096), dtype=torch.int32, device=x.device)
    _down_sum_kernel[(k, blocks)](
        hw, wdn, sdn, ids, tw, y, out, counters, D, I // 4, E, hw.stride(0), wdn.stride(0), wdn.stride(1),
        *sdn.stride(), tw.stride(0), dbn, dbkw, R=R, W=W, TOPK=k, ONE_KBLOCK=d_one, EVEN=even, WORDS=h_is_words,
        **scaled, num_warps=warps, **pdl_args())
    return out


def install() -> str:
    ew._launch = _launch
    return "experts_down_sum: the one-token experts' down GEMV sums the slots (no sum_slots launch)"


def uninstall() -> None:
    ew._launch = _ORIGINAL
