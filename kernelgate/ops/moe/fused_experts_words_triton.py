"""Routed experts for one token (decode at batch 1) on weight rows read as words -- FP8 e4m3fn codes, 4 a
32-bit word with their block scales (fused_experts_fp8), or bf16 values, 4 a 64-bit word (fused_experts'
GEMV at one token): the word GEMV of quant/fp8_gemv_triton.py over the slots' experts.

    _gate_up_kernel  grid (k, I / R):  h[j, i] = swiglu(gate[e_j] x, up[e_j] x)       [k, I] x's dtype
    _down_kernel     grid (k, D / R):  y[j, o] = w_j * down[e_j][o, :] . h[j, :]      [k, D] fp32
    sum_slots        (fused_experts_triton)  out = sum_j y[j]                          [1, D] x dtype

A program owns R rows of one slot's expert (gate/up: R gate rows and the R up rows beside them, one loop
over x for both) and walks K in word steps loaded one ahead (rows_dot / rows_dot2). Ids outside [0, E)
read expert 0's rows and contribute zeros. Both kernels wait (PDL) before anything: the expert ids are
the router's output, so no weight is known before the wait. SCALED (FP8): scales per K step and column,
or per row with one K block; bf16 rows have none.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ... import alloc, platform
from ..common.pdl import inputs_ready, pdl_args
from ..quant.fp8_gemv_triton import ptx_decode, row_scales, row_tile, rows_dot, rows_dot2, rows_per_program, \
    step, x_words
from ..quant.fp8_weights import DEFAULT_BLOCK, block_dims
from .fused_experts_triton import sum_slots

# FP8, one token only: from two the grouped GEMM (fused_experts_fp8_triton.py) is faster. H200, Kimi's
# shapes, each forced, CUDA graphs (bench/RESULTS.md Session 25): T=1 34.6 µs against 37.3; T=2 103.5
# against 53.5; T=4 187.9 against 87.6; T=8 344.9 against 133.8 (with the previous GEMV).
MAX_TOKENS = 1

# FP8: (R, C, num_warps) of the gate/up and the down kernel. NVIDIA (H200, bench/ops/fp8_gemv_sweep.py, whole op
# with the shared expert, Session 30): Kimi 21.0 µs at gate/up (16, 256, 8) -- what (16, 512, 8) becomes
# for D = 2,304 -- and down (16, 256, 2), 29.2 with the previous GEMV; Qwen3.5-MoE 10.7 at (8, 512, 8) /
# (16, 256, 2), 15.8 before ((16, 512, 8) and (8, 512, 8) measured 11.4 / 11.3 beside one down launch).
# C is capped by what tiles K (fp8_gemv_triton.step).
LAUNCH = {"cuda": dict(gate_up=(16, 512, 8), down=(16, 256, 2))}
_DEFAULT = dict(gate_up=(16, 256, 4), down=(16, 256, 4))
_INTERP = dict(gate_up=(16, 128, 4), down=(16, 128, 4))


# bf16 (R, C, num_warps). H200, whole op with the shared expert, CUDA graphs (bench/ops/fp8_gemv_sweep.py
# --experts --bf16, bench/RESULTS.md Session 31): Kimi 40.1 -> 35.8 µs against the previous bf16 GEMV
# (moe/fused_experts_gemv_triton.py), Qwen3.5-MoE 21.6 -> 18.3; at full depth bf16 B1 403.3 -> 420.5 tok/s.
BF16_LAUNCH = {"cuda": dict(gate_up=(8, 256, 8), down=(16, 256, 8))}


def launch_config(plat, fp8: bool = True) -> dict:
    if plat.triton_mode != "compiled":
        return _INTERP
    return (LAUNCH if fp8 else BF16_LAUNCH).get(plat.name, _DEFAULT)


@triton.jit
def _slot_expert(ids_ptr, j, E, w_ptr, swe, s_ptr, sse):
    """(whether slot j's id is in [0, E), its expert's weights, its scales): an invalid id reads expert 0's."""
    e = tl.load(ids_ptr + j).to(tl.int64)
    valid = (e >= 0) & (e < E)
    e = tl.where(valid, e, 0)
    return valid, w_ptr + e * swe, s_ptr + e * sse


@triton.jit
def _gate_up_kernel(x_ptr, w_ptr, s_ptr, ids_ptr, h_ptr, I, KW, E, sxd, swe, swr, sse, ssr, ssk, bn,
                    bkw: tl.constexpr, limit, HAS_LIMIT: tl.constexpr, R: tl.constexpr, W: tl.constexpr,
                    SCALED: tl.constexpr, ONE_KBLOCK: tl.constexpr, EVEN: tl.constexpr, PTX: tl.constexpr,
                    WORDS: tl.constexpr, PDL: tl.constexpr):
    j = tl.program_id(0)
    i0 = tl.program_id(1) * R
    inputs_ready(PDL)
    valid, w_e, s_e = _slot_expert(ids_ptr, j, E, w_ptr, swe, s_ptr, sse)
    g_tiles, rows = row_tile(w_e, i0, I, swr, R, W)
    u_tiles, _ = row_tile(w_e + I * swr, i0, I, swr, R, W)
    g, u = rows_dot2(g_tiles, u_tiles, s_e + (i0 // bn) * ssr, s_e + ((i0 + I) // bn) * ssr, x_ptr, KW, sxd, ssk,
                     bkw, R, W, ONE_KBLOCK, EVEN, PTX, WORDS)
    if SCALED and ONE_KBLOCK:
        g = g * row_scales(s_e, rows, I, bn, ssr)
        u = u * row_scales(s_e, rows + I, 2 * I, bn, ssr)
    if HAS_LIMIT:
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
    h = tl.where(valid, g * tl.sigmoid(g) * u, 0.0)
    tl.store(h_ptr + j * I + rows, h.to(h_ptr.dtype.element_ty), mask=rows < I)


@triton.jit
def _down_kernel(h_ptr, w_ptr, s_ptr, ids_ptr, tw_ptr, y_ptr, D, KW, E, shj, swe, swr, sse, ssr, ssk, stw, bn,
                 bkw: tl.constexpr, R: tl.constexpr, W: tl.constexpr, SCALED: tl.constexpr, ONE_KBLOCK: tl.constexpr,
                 EVEN: tl.constexpr, PTX: tl.constexpr, WORDS: tl.constexpr, PDL: tl.constexpr):
    j = tl.program_id(0)
    o0 = tl.program_id(1) * R
    inputs_ready(PDL)
    valid, w_e, s_e = _slot_expert(ids_ptr, j, E, w_ptr, swe, s_ptr, sse)
    tiles, rows = row_tile(w_e, o0, D, swr, R, W)
    y = rows_dot(tiles, s_e + (o0 // bn) * ssr, h_ptr + j * shj, KW, 1, ssk, bkw, R, W, ONE_KBLOCK, EVEN, PTX,
                 WORDS, False)
    if SCALED and ONE_KBLOCK:
        y = y * row_scales(s_e, rows, D, bn, ssr)
    y = tl.where(valid, y * tl.load(tw_ptr + j * stw), 0.0)
    tl.store(y_ptr + j * D + rows, y, mask=rows < D)


def scale_args(wgu, wdn, D: int, I: int, scales):
    """(gate/up scales, down scales, their rows per scale block, their K blocks in words, whether each has
    one K block) of the kernels; bf16 words (scales None): the weights stand in, unread."""
    if scales is None:
        return wgu, wdn, 1, 1, 1, 1, True, True
    sgu, sdn, block_size = scales
    (gbn, gbk), (dbn, dbk) = block_dims(block_size, D), block_dims(block_size, I)
    return sgu, sdn, gbn, dbn, max(gbk // 4, 1), max(dbk // 4, 1), triton.cdiv(D, gbk) == 1, triton.cdiv(I, dbk) == 1


def _launch(x, wgu, wdn, topk_weights, topk_ids, out, cfg, swiglu_limit, scales=None, ptx=False):
    """Both kernels and sum_slots on the word views wgu [E, 2I, D/4], wdn [E, D, I/4]; scales (FP8):
    (w_gate_up_scale, w_down_scale, block_size), None for bf16 words."""
    D = x.shape[1]
    E, I = wdn.shape[0], wdn.shape[2] * 4
    k = topk_ids.shape[1]
    sgu, sdn, gbn, dbn, gbkw, dbkw, g_one, d_one = scale_args(wgu, wdn, D, I, scales)
    ids = topk_ids[0].contiguous()
    tw = topk_weights[0]
    h = alloc.empty((k, I), torch.float32 if x.dtype == torch.float32 else x.dtype, x.device)
    y = alloc.empty((k, D), torch.float32, x.device)
    xw, x_is_words = x_words(x[0])
    scaled = dict(SCALED=scales is not None, PTX=ptx)
    R, C, warps = cfg["gate_up"]
    R = rows_per_program(R, g_one, gbn, I)                # a tile's gate rows and its up rows: one scale row each
    W, even = step(D, C)
    _gate_up_kernel[(k, triton.cdiv(I, R))](
        xw, wgu, sgu, ids, h, I, D // 4, E, x.stride(1), wgu.stride(0), wgu.stride(1), *sgu.stride(), gbn,
        gbkw, float(swiglu_limit) if swiglu_limit is not None else 0.0,
        HAS_LIMIT=swiglu_limit is not None, R=R, W=W, ONE_KBLOCK=g_one, EVEN=even, WORDS=x_is_words, **scaled,
        num_warps=warps, **pdl_args())
    hw, h_is_words = x_words(h)
    R, C, warps = cfg["down"]
    R = rows_per_program(R, d_one, dbn)
    W, even = step(I, C)
    _down_kernel[(k, triton.cdiv(D, R))](
        hw, wdn, sdn, ids, tw, y, D, I // 4, E, hw.stride(0), wdn.stride(0), wdn.stride(1), *sdn.stride(),
        tw.stride(0), dbn, dbkw, R=R, W=W, ONE_KBLOCK=d_one, EVEN=even, WORDS=h_is_words, **scaled,
        num_warps=warps, **pdl_args())
    return sum_slots(y, topk_ids.contiguous(), out, E)


def fused_experts_fp8_gemv(x, w_gate_up, w_down, topk_weights, topk_ids, w_gate_up_scale, w_down_scale,
                           block_size=DEFAULT_BLOCK, activation="silu", swiglu_limit=None, launch=None):
    """One token (fused_experts_fp8._gemv_fp8_supports); `launch`: gate_up / down (R, C, num_warps) overrides."""
    out = alloc.empty(x.shape, x.dtype, x.device)
    if x.shape[0] == 0:
        return out
    plat = platform.current()
    wgu, wdn = w_gate_up.view(torch.uint8).view(torch.int32), w_down.view(torch.uint8).view(torch.int32)
    return _launch(x, wgu, wdn, topk_weights, topk_ids, out, {**launch_config(plat), **(launch or {})},
                   swiglu_limit, (w_gate_up_scale, w_down_scale, block_size), ptx_decode(plat))


def bf16_words(w: torch.Tensor) -> torch.Tensor | None:
    """The int64 view of bf16 weights [.., rows, K] (4 values a word), or None where rows are not whole
    8-byte aligned words of contiguous values."""
    if w.dtype != torch.bfloat16 or w.shape[-1] % 4 or w.stride(-1) != 1 or w.data_ptr() % 8 \
            or any(st % 4 for st in w.stride()[:-1]):
        return None
    return w.view(torch.int64)


def fused_experts_bf16_words(x, wgu, wdn, topk_weights, topk_ids, out, swiglu_limit=None, launch=None):
    """One token on bf16 weights' word views (bf16_words of both: fused_experts_gemv_triton's T = 1 form)."""
    cfg = {**launch_config(platform.current(), fp8=False), **(launch or {})}
    return _launch(x, wgu, wdn, topk_weights, topk_ids, out, cfg, swiglu_limit)
