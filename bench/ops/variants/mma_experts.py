"""Variant probe (issue 37, not dispatched): the FP8 experts at one token on the matrix units -- mma_gemv.py's
16-row mma tiles over the slots' experts, in place of fused_experts_words_triton's word GEMVs (the dispatched
`triton_gemv` of fused_experts_fp8, 566 µs of Session 35's 1,948 µs full-depth FP8 step).

    prep             x [1, D] -> the token as the GEMVs read it                       (mma_gemv.prep)
    _gate_up_kernel  grid (k, I / 16): h[j, i] = swiglu(gate[e_j] x, up[e_j] x)        [k, I] x's dtype
    prep             h [k, I] -> each slot's row as the down GEMV reads it
    _down_kernel     grid (k, D / 16): y[j, o] = w_j * down[e_j][o, :] . h[j, :]       [k, D] fp32
    sum_slots        (fused_experts_triton) out = sum_j y[j]                             [1, D] x dtype

A program owns 16 rows of one slot's expert (gate/up: 16 gate rows, then the 16 up rows beside them, each
a mma_gemv.rows16 walk over K); ids outside [0, E) read expert 0's rows and contribute zeros. Both modes of
mma_gemv: F16 (the products exact, as the dispatched GEMV) and E4M3 (w8a8: x and h quantized per 128-group).
Two prep launches more than dispatch (x, then h), both PDL.

    install(mode="f16" | "e4m3", gate_up_warps=0, down_warps=0)   fused_experts_fp8's one-token GEMV -> this
    install(mode="wgmma", block_n=32, stages=4)   -> fp8 tl.dot kernels on 64-row token tiles (QGMMA on sm_90)
    uninstall()
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernelgate import alloc, platform
from kernelgate.ops.common.pdl import inputs_ready, pdl_args
from kernelgate.ops.moe import fused_experts_fp8 as fe8
from kernelgate.ops.moe import fused_experts_words_triton as ew
from kernelgate.ops.moe.fused_experts_triton import sum_slots
from kernelgate.ops.quant.fp8_weights import block_dims

import mma_gemv as mg


@triton.jit
def _slot(ids_ptr, j, E):
    e = tl.load(ids_ptr + j).to(tl.int64)
    valid = (e >= 0) & (e < E)
    return valid, tl.where(valid, e, 0)


@triton.jit
def _gate_up_kernel(w_ptr, s_ptr, x_ptr, xs_ptr, ids_ptr, h_ptr, I, E, swe, swn, sse, ssn, ssk, bn, n_sub, limit,
                    HAS_LIMIT: tl.constexpr, MODE: tl.constexpr, ONE_KBLOCK: tl.constexpr, SUBS: tl.constexpr,
                    NW: tl.constexpr, EMULATE: tl.constexpr, PDL: tl.constexpr):
    j = tl.program_id(0)
    i0 = tl.program_id(1) * 16
    inputs_ready(PDL)                                    # (the ids are the router's: no weight is known before)
    valid, e = _slot(ids_ptr, j, E)
    w_e = w_ptr + e * swe
    s_e = s_ptr + e * sse
    g0, _, g2, _ = mg.rows16(w_e, swn, i0, I, s_e + (i0 // bn).to(tl.int64) * ssn, ssk, x_ptr, 0, 1, xs_ptr, 0,
                             n_sub, MODE, ONE_KBLOCK, SUBS, NW, EMULATE)
    u0, _, u2, _ = mg.rows16(w_e + I * swn, swn, i0, I, s_e + ((i0 + I) // bn).to(tl.int64) * ssn, ssk, x_ptr, 0,
                             1, xs_ptr, 0, n_sub, MODE, ONE_KBLOCK, SUBS, NW, EMULATE)
    lane = tl.arange(0, 32)
    rows = i0 + lane // 4
    f = tl.load(xs_ptr)                                  # F16: the token's power of two; E4M3 one K block: its scale
    if ONE_KBLOCK:
        fg_a = f * tl.load(s_e + (tl.minimum(rows, I - 1) // bn) * ssn)
        fg_b = f * tl.load(s_e + (tl.minimum(rows + 8, I - 1) // bn) * ssn)
        fu_a = f * tl.load(s_e + ((tl.minimum(rows, I - 1) + I) // bn) * ssn)
        fu_b = f * tl.load(s_e + ((tl.minimum(rows + 8, I - 1) + I) // bn) * ssn)
    else:
        if MODE == 1:
            f = 1.0
        fg_a = f
        fg_b = f
        fu_a = f
        fu_b = f
    ga = g0 * fg_a
    gb = g2 * fg_b
    ua = u0 * fu_a
    ub = u2 * fu_b
    if HAS_LIMIT:
        ga = tl.minimum(ga, limit)
        gb = tl.minimum(gb, limit)
        ua = tl.minimum(tl.maximum(ua, -limit), limit)
        ub = tl.minimum(tl.maximum(ub, -limit), limit)
    ha = tl.where(valid, ga * tl.sigmoid(ga) * ua, 0.0)
    hb = tl.where(valid, gb * tl.sigmoid(gb) * ub, 0.0)
    first = lane % 4 == 0                                # token 0's column: lanes t = 0
    ty = h_ptr.dtype.element_ty
    tl.store(h_ptr + j * I + rows, ha.to(ty), mask=first & (rows < I))
    tl.store(h_ptr + j * I + rows + 8, hb.to(ty), mask=first & (rows + 8 < I))


@triton.jit
def _down_kernel(w_ptr, s_ptr, h_ptr, hs_ptr, ids_ptr, tw_ptr, y_ptr, D, E, swe, swn, sse, ssn, ssk, sht, shs, stw,
                 bn, n_sub, MODE: tl.constexpr, ONE_KBLOCK: tl.constexpr, SUBS: tl.constexpr, NW: tl.constexpr,
                 EMULATE: tl.constexpr, PDL: tl.constexpr):
    j = tl.program_id(0)
    o0 = tl.program_id(1) * 16
    inputs_ready(PDL)
    valid, e = _slot(ids_ptr, j, E)
    w_e = w_ptr + e * swe
    s_e = s_ptr + e * sse
    hs_j = hs_ptr + j * shs
    r0, _, r2, _ = mg.rows16(w_e, swn, o0, D, s_e + (o0 // bn).to(tl.int64) * ssn, ssk, h_ptr + j * sht, 0, 1, hs_j,
                             0, n_sub, MODE, ONE_KBLOCK, SUBS, NW, EMULATE)
    lane = tl.arange(0, 32)
    rows = o0 + lane // 4
    f = tl.load(hs_j)
    if ONE_KBLOCK:
        fa = f * tl.load(s_e + (tl.minimum(rows, D - 1) // bn) * ssn)
        fb = f * tl.load(s_e + (tl.minimum(rows + 8, D - 1) // bn) * ssn)
    else:
        if MODE == 1:
            f = 1.0
        fa = f
        fb = f
    wt = tl.where(valid, tl.load(tw_ptr + j * stw), 0.0)
    first = lane % 4 == 0
    tl.store(y_ptr + j * D + rows, r0 * fa * wt, mask=first & (rows < D))
    tl.store(y_ptr + j * D + rows + 8, r2 * fb * wt, mask=first & (rows + 8 < D))


# -- mode "wgmma": tl.dot on fp8 with the token padded to 64 rows (on sm_90: QGMMA, weight tiles staged by
# cp.async -- what the package's triton_w8a8 compiles to at 64-row tiles), x and h quantized as E4M3 does ------
@triton.jit
def _token_tile(q_row, k0, K, BLOCK_K: tl.constexpr):
    """[64, BLOCK_K] fp8: the token's codes at K offsets k0.. in row 0, zeros below."""
    offs_m = tl.arange(0, 64)
    offs_k = k0 + tl.arange(0, BLOCK_K)
    a = tl.load(q_row + offs_m[:, None] * 0 + offs_k[None, :], mask=(offs_m[:, None] == 0) & (offs_k < K)[None, :],
                other=0)
    return a.to(tl.float8e4nv, bitcast=True)


@triton.jit
def _rows_tile(w_rows, offs_n, n_ok, swn, k0, K, BLOCK_K: tl.constexpr):
    """[BLOCK_K, BLOCK_N] fp8: weight rows offs_n at K offsets k0.."""
    offs_k = k0 + tl.arange(0, BLOCK_K)
    w = tl.load(w_rows + offs_n[None, :].to(tl.int64) * swn + offs_k[:, None],
                mask=(offs_k < K)[:, None] & n_ok[None, :], other=0)
    return w.to(tl.float8e4nv, bitcast=True)


@triton.jit
def _row0(acc):
    """Row 0 of [64, BLOCK_N] (the token's)."""
    return tl.sum(tl.where((tl.arange(0, 64) == 0)[:, None], acc, 0.0), axis=0)


@triton.jit
def _wg_gate_up_kernel(q_ptr, qs_ptr, w_ptr, s_ptr, ids_ptr, h_ptr, I, D, E, swe, swn, sse, ssn, ssk, bn, bk, limit,
                       HAS_LIMIT: tl.constexpr, ONE_KBLOCK: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    j = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < I
    inputs_ready(PDL)
    valid, e = _slot(ids_ptr, j, E)
    w_e = w_ptr + e * swe
    s_e = s_ptr + e * sse
    sg_rows = s_e + (offs_n // bn) * ssn
    su_rows = s_e + ((offs_n + I) // bn) * ssn
    acc_g = tl.zeros([64, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([64, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, D, BLOCK_K):
        a = _token_tile(q_ptr, k0, D, BLOCK_K)
        wg = _rows_tile(w_e, offs_n, n_ok, swn, k0, D, BLOCK_K)
        wu = _rows_tile(w_e + I * swn, offs_n, n_ok, swn, k0, D, BLOCK_K)
        if ONE_KBLOCK:
            acc_g = tl.dot(a, wg, acc_g)
            acc_u = tl.dot(a, wu, acc_u)
        else:
            kb = k0 // bk
            sa = tl.load(qs_ptr + kb)
            acc_g += tl.dot(a, wg) * (sa * tl.load(sg_rows + kb * ssk, mask=n_ok, other=0.0))[None, :]
            acc_u += tl.dot(a, wu) * (sa * tl.load(su_rows + kb * ssk, mask=n_ok, other=0.0))[None, :]
    g = _row0(acc_g)
    u = _row0(acc_u)
    if ONE_KBLOCK:
        sa = tl.load(qs_ptr)
        g = g * sa * tl.load(sg_rows, mask=n_ok, other=0.0)
        u = u * sa * tl.load(su_rows, mask=n_ok, other=0.0)
    if HAS_LIMIT:
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
    h = tl.where(valid, g * tl.sigmoid(g) * u, 0.0)
    tl.store(h_ptr + j * I + offs_n, h.to(h_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def _wg_down_kernel(q_ptr, qs_ptr, w_ptr, s_ptr, ids_ptr, tw_ptr, y_ptr, D, I, E, sqt, sqs, swe, swn, sse, ssn, ssk,
                    stw, bn, bk, ONE_KBLOCK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    PDL: tl.constexpr):
    j = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < D
    inputs_ready(PDL)
    valid, e = _slot(ids_ptr, j, E)
    w_e = w_ptr + e * swe
    s_rows = s_ptr + e * sse + (offs_n // bn) * ssn
    q_row = q_ptr + j * sqt
    qs_row = qs_ptr + j * sqs
    acc = tl.zeros([64, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        a = _token_tile(q_row, k0, I, BLOCK_K)
        w = _rows_tile(w_e, offs_n, n_ok, swn, k0, I, BLOCK_K)
        if ONE_KBLOCK:
            acc = tl.dot(a, w, acc)
        else:
            kb = k0 // bk
            acc += tl.dot(a, w) * (tl.load(qs_row + kb) * tl.load(s_rows + kb * ssk, mask=n_ok, other=0.0))[None, :]
    y = _row0(acc)
    if ONE_KBLOCK:
        y = y * tl.load(qs_row) * tl.load(s_rows, mask=n_ok, other=0.0)
    y = tl.where(valid, y * tl.load(tw_ptr + j * stw), 0.0)
    tl.store(y_ptr + j * D + offs_n, y, mask=n_ok)


def _wgmma(x, w_gate_up, w_down, topk_weights, topk_ids, sg, sd, block_size, swiglu_limit, block_n, stages, parts):
    D = x.shape[1]
    E, I = w_down.shape[0], w_down.shape[2]
    k = topk_ids.shape[1]
    ids = topk_ids[0].contiguous()
    tw = topk_weights[0]
    out = alloc.empty(x.shape, x.dtype, x.device)
    gbn, gbk = block_dims(block_size, D)
    dbn, dbk = block_dims(block_size, I)
    xq, xs = mg.prep(x, mg.E4M3, gbk)
    h = alloc.empty((k, I), x.dtype, x.device)
    wgu = w_gate_up.view(torch.uint8)
    launch = dict(num_warps=4, num_stages=stages, **pdl_args())
    _wg_gate_up_kernel[(k, triton.cdiv(I, block_n))](
        xq, xs, wgu, sg, ids, h, I, D, E, wgu.stride(0), wgu.stride(1), sg.stride(0), sg.stride(1), sg.stride(2),
        gbn, gbk, float(swiglu_limit) if swiglu_limit is not None else 0.0, HAS_LIMIT=swiglu_limit is not None,
        ONE_KBLOCK=triton.cdiv(D, gbk) == 1, BLOCK_N=block_n, BLOCK_K=min(128, gbk, triton.next_power_of_2(D)),
        **launch)
    hq, hs = mg.prep(h, mg.E4M3, dbk)
    y = alloc.empty((k, D), torch.float32, x.device)
    wdn = w_down.view(torch.uint8)
    _wg_down_kernel[(k, triton.cdiv(D, block_n))](
        hq, hs, wdn, sd, ids, tw, y, D, I, E, hq.stride(0), hs.stride(0), wdn.stride(0), wdn.stride(1), sd.stride(0),
        sd.stride(1), sd.stride(2), tw.stride(0), dbn, dbk, ONE_KBLOCK=triton.cdiv(I, dbk) == 1, BLOCK_N=block_n,
        BLOCK_K=min(128, dbk, triton.next_power_of_2(I)), **launch)
    if parts is not None:
        parts.update(h=h, y=y)
    return sum_slots(y, topk_ids.contiguous(), out, E)


def unsupported(x, w_gate_up, w_down, block_size) -> str | None:
    """None, or why this probe does not take the call (the dispatched one-token GEMV takes it)."""
    T, D = x.shape
    I = w_down.shape[2]
    if T != 1:
        return f"T = {T}: the probe takes one token"
    if x.dtype not in (torch.bfloat16, torch.float16):
        return f"x dtype {x.dtype}: the probe takes 16-bit activations"
    if x.stride(1) != 1:
        return "x's columns are not contiguous (the prep reads rows of contiguous values)"
    for name, w, K in (("w_gate_up", w_gate_up, D), ("w_down", w_down, I)):
        if K % mg.STEP:
            return f"{name}: K = {K} is not a multiple of {mg.STEP}"
        if not w.is_contiguous() or w.data_ptr() % 8:
            return f"{name} is not contiguous on an 8-byte boundary"
        bn, bk = block_dims(block_size, K)
        if triton.cdiv(K, bk) > 1 and (bk % mg.STEP or bn % 16):
            return f"block_size {block_size}: the probe needs bk a multiple of {mg.STEP} and bn of 16"
    if triton.cdiv(D, block_dims(block_size, D)[1]) > 1 and I % 16:
        return f"I = {I} is not a multiple of 16 (a tile's up rows in one scale block)"
    return None


def _walk(K: int, block_size):
    """(bn, bk, one K block, 64-code steps an iteration, 64-code steps in K)."""
    bn, bk = block_dims(block_size, K)
    one = triton.cdiv(K, bk) == 1
    return bn, bk, one, 1 if one else bk // mg.STEP, K // mg.STEP


def fused_experts_fp8_mma(x, w_gate_up, w_down, topk_weights, topk_ids, w_gate_up_scale, w_down_scale,
                          block_size=(128, 128), activation="silu", swiglu_limit=None, mode: str = "f16",
                          gate_up_warps: int = 0, down_warps: int = 0, parts: dict | None = None,
                          block_n: int = 32, stages: int = 4):
    """One token (unsupported() is None): fused_experts_fp8 on the matrix units (module docstring); `parts`
    (tests): given a dict, h and y are left in it. mode "wgmma": the 64-row fp8 tl.dot kernels above (block_n
    rows a program, `stages` stages)."""
    if mode == "wgmma":
        return _wgmma(x, w_gate_up, w_down, topk_weights, topk_ids, w_gate_up_scale, w_down_scale, block_size,
                      swiglu_limit, block_n, stages, parts)
    D = x.shape[1]
    E, I = w_down.shape[0], w_down.shape[2]
    k = topk_ids.shape[1]
    md = mg.MODES[mode]
    emulate = platform.interpreting()
    out = alloc.empty(x.shape, x.dtype, x.device)
    ids = topk_ids[0].contiguous()
    tw = topk_weights[0]
    gbn, gbk, g_one, g_subs, g_sub = _walk(D, block_size)
    xq, xs = mg.prep(x, md, gbk)
    h = alloc.empty((k, I), x.dtype, x.device)
    wgu = w_gate_up.view(torch.uint8).view(torch.int64)
    nw = gate_up_warps or mg.warps_for(k * I, triton.cdiv(g_sub, g_subs))
    sg = w_gate_up_scale
    _gate_up_kernel[(k, triton.cdiv(I, 16))](
        wgu, sg, xq.view(torch.int64), xs, ids, h, I, E, wgu.stride(0), wgu.stride(1), sg.stride(0), sg.stride(1),
        sg.stride(2), gbn, g_sub, float(swiglu_limit) if swiglu_limit is not None else 0.0,
        HAS_LIMIT=swiglu_limit is not None, MODE=md, ONE_KBLOCK=g_one, SUBS=g_subs, NW=nw, EMULATE=emulate,
        num_warps=nw, **pdl_args())
    dbn, dbk, d_one, d_subs, d_sub = _walk(I, block_size)
    hq, hs = mg.prep(h, md, dbk)
    hw = hq.view(torch.int64)
    y = alloc.empty((k, D), torch.float32, x.device)
    wdn = w_down.view(torch.uint8).view(torch.int64)
    nw = down_warps or mg.warps_for(k * D, triton.cdiv(d_sub, d_subs))
    sd = w_down_scale
    _down_kernel[(k, triton.cdiv(D, 16))](
        wdn, sd, hw, hs, ids, tw, y, D, E, wdn.stride(0), wdn.stride(1), sd.stride(0), sd.stride(1), sd.stride(2),
        hw.stride(0), hs.stride(0), tw.stride(0), dbn, d_sub, MODE=md, ONE_KBLOCK=d_one, SUBS=d_subs, NW=nw,
        EMULATE=emulate, num_warps=nw, **pdl_args())
    if parts is not None:
        parts.update(h=h, y=y)
    return sum_slots(y, topk_ids.contiguous(), out, E)


# -- install in place of fused_experts_fp8's one-token GEMV ---------------------------------------------------
_ORIGINAL = {"gemv": ew.fused_experts_fp8_gemv}
_STATE: dict = {}


def _gemv(x, w_gate_up, w_down, topk_weights, topk_ids, w_gate_up_scale, w_down_scale, block_size=(128, 128),
          activation="silu", swiglu_limit=None, launch=None):
    if launch is None and unsupported(x, w_gate_up, w_down, block_size) is None:
        return fused_experts_fp8_mma(x, w_gate_up, w_down, topk_weights, topk_ids, w_gate_up_scale, w_down_scale,
                                     block_size, activation, swiglu_limit, **_STATE)
    return _ORIGINAL["gemv"](x, w_gate_up, w_down, topk_weights, topk_ids, w_gate_up_scale, w_down_scale,
                             block_size, activation, swiglu_limit, launch)


def _entry():
    return fe8.fused_experts_fp8.impls["triton_gemv"]


def install(mode: str = "f16", gate_up_warps: int = 0, down_warps: int = 0, block_n: int = 32, stages: int = 4) -> str:
    """Patch the function the registry's `triton_gemv` entry calls (its resolved function, the module
    attribute it resolves from, and the op's cached choices)."""
    if mode not in (*mg.MODES, "wgmma") or {gate_up_warps, down_warps} - {0, 1, 2, 4, 8, 16}:
        raise ValueError("mma_experts: mode must be f16, e4m3 or wgmma and warps 0 (by shape) or 1-16")
    _STATE.update(mode=mode, gate_up_warps=gate_up_warps, down_warps=down_warps, block_n=block_n, stages=stages)
    ew.fused_experts_fp8_gemv = _gemv
    _entry().resolve()
    _entry()._resolved = _gemv
    fe8.fused_experts_fp8._cache.clear()                 # (dispatch's cached choices hold the function)
    if mode == "wgmma":
        return (f"mma_experts: fused_experts_fp8 at one token as fp8 tl.dot on 64-row token tiles (wgmma on sm_90), "
                f"{block_n} rows a program, {stages} stages")
    return (f"mma_experts: fused_experts_fp8 at one token on mma.sync ({mode}), gate/up warps "
            f"{gate_up_warps or 'by shape'}, down {down_warps or 'by shape'}")


def uninstall() -> None:
    ew.fused_experts_fp8_gemv = _ORIGINAL["gemv"]
    _entry()._resolved = _ORIGINAL["gemv"]
    fe8.fused_experts_fp8._cache.clear()
    _STATE.clear()
