"""Portable Triton FP8 linear (CUDA, ROCm, XPU; CPU under TRITON_INTERPRET=1): the e4m3fn weight is
read as bytes and its scales are applied in the kernel -- no dequantized copy is ever made.

w8a16 (implementation `triton`): _w8a16_kernel. Weight tiles [BLOCK_K, BLOCK_N] decoded in registers
    (fp8_triton: fp8 conversion where the device has it, integer ops elsewhere) to fp16, x tiles to
    fp16 scaled by a power of two per row (fp8_triton.fp16_rows: exact), tl.dot into fp32 (fp32 x: fp32
    operands). A K tile lies inside one scale block (BLOCK_K divides bk), so
        acc += (x_tile @ w_tile) * x_factor[m] * scale[n // bn, k0 // bk]       (w8a16_part)
    and with a single K block (per-channel scales, or K <= bk) the scale multiplies once at the end.
    One token (T <= GEMV_TOKENS, weights readable as 4-code words) takes the GEMV of fp8_gemv_triton.py:
    programs of a few weight rows, codes decoded and multiplied with FMAs -- a 16-row tl.dot tile
    wastes 15 rows of work for one token (H200, Session 30: 16-row tl.dot tiles 1.5-3x slower). Other decode batches (T <= DECODE_TOKENS) take one 16-row tile, narrow N tiles and
    a K range split over SPLIT programs (fp32 partials summed in a fixed order by _sum_splits_kernel),
    so the call spreads its weight bytes over the whole device; the GEMV would read the weights once
    per token (H200, T = 8: 54 µs for the KDA in_proj where this launch takes ~13). SPLIT follows from
    (N, K) only: a token gets the same bits at any T in 2..DECODE_TOKENS.
w8a8 (implementation `triton_w8a8`): _act_quant_kernel turns x into e4m3fn codes with one scale per
    (token, scale block of K) -- per token for per-channel weights -- as quantize_fp8_groups does;
    _w8a8_kernel multiplies codes by codes (fp8 MMA on sm_89+ / gfx942 / gfx950; elsewhere the exact
    fp16 of the codes) and applies both scales per K tile:
        acc += (xq_tile @ wq_tile) * x_scale[m, k0 // bk] * w_scale[n // bn, k0 // bk]
Accumulation is fp32 throughout; fp32 x uses IEEE dots (no TF32): it matches the definition to fp32
round-off on every platform.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ... import alloc, platform
from ...platform import interpreting
from .fp8_triton import MODES, SCALE, dot, fp16_operand, fp16_rows, fp8_operand, mma_mode_for, mode_for
from ..common.fp8_triton import encode_e4m3
from .fp8_gemv_triton import fp8_gemv, k_tile, words_ok
from .fp8_weights import AMAX_FLOOR, FP8_MAX, block_dims

GEMV_TOKENS = 1         # up to this many tokens: the GEMV (fp8_gemv_triton)
DECODE_TOKENS = 8       # up to this many tokens: the split-K decode launch of the w8a16 kernel

# Launch choices per platform name (platform.current(), so a simulated platform takes its own).
_GEMM = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=3)
_W8A8 = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=3)
# (Session 19's split-K sweep, T = 1, the best of 48 launches at Kimi's shapes: bench/RESULTS.md)
_DECODE = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=3, programs=528)
LAUNCH = {
    # AMD GPUs have 64 KiB of LDS per workgroup: three fp32 x stages of 64 x 64 plus the weight bytes do not fit
    "rocm": dict(gemm=dict(_GEMM, num_stages=2), decode=dict(_DECODE, num_stages=2), w8a8=dict(_W8A8, num_stages=2)),
}
_DEFAULT = dict(gemm=_GEMM, decode=_DECODE, w8a8=_W8A8)
# The interpreter pays per program and per op: few, wide programs; a small split still exercised.
_INTERP = dict(gemm=dict(_GEMM, BLOCK_K=64), decode=dict(_DECODE, BLOCK_N=64, BLOCK_K=64, programs=8),
               w8a8=dict(_W8A8, BLOCK_K=64))
_TUNE_MIN_WEIGHTS = 1 << 20   # N * K from which a prefill GEMM is autotuned (on a GPU)
_FLOOR = tl.constexpr(AMAX_FLOOR)
_FMAX = tl.constexpr(FP8_MAX)


def launch_config(plat, form: str = "gemm") -> dict:
    """Launch choices of `form` ("gemm", "decode", "w8a8") on platform `plat`, plus the operand mode
    that the device's capability allows (fp8_triton.mode_for / mma_mode_for)."""
    table = _INTERP if plat.triton_mode != "compiled" else LAUNCH.get(plat.name, _DEFAULT)
    cfg = dict(table[form])
    cfg["mode"] = (mma_mode_for(plat.capability) or "int") if form == "w8a8" else mode_for(plat.capability)
    return cfg


def _gemm_configs(kmax: int, fp8: bool):
    shapes = ((128, 128, 128, 8, 3), (64, 128, 128, 4, 4), (128, 64, 128, 4, 4), (128, 256, 128, 8, 3)) if fp8 else \
        ((64, 64, 64, 4, 4), (64, 128, 64, 4, 3), (128, 64, 64, 4, 3), (128, 128, 64, 8, 3), (64, 128, 128, 4, 3),
         (128, 128, 128, 8, 3))
    shapes = dict.fromkeys((bm, bn, min(bk, kmax), w, s) for bm, bn, bk, w, s in shapes)   # K tiles <= kmax
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=s)
            for bm, bn, bk, w, s in shapes]


@functools.cache
def _tuned(kernel, kmax: int, fp8: bool):
    """The autotuned kernel (GPU only), its BLOCK_K at most kmax (tiles inside one scale block);
    keyed on the weight shape and the power-of-two bucket of the token count."""
    return triton.autotune(configs=_gemm_configs(kmax, fp8), key=["N", "K", "M_BUCKET"])(kernel)


# M (tokens) is not specialised on: every token count shares one compiled program
@triton.jit
def w8a16_part(a, wb, acc, s, MODE: tl.constexpr, X16: tl.constexpr, SCALED: tl.constexpr, F32: tl.constexpr,
               PER_TILE: tl.constexpr):
    """acc + a [M, K] @ dequant(wb [K, N] codes) for one K tile, times the tile's per-column scales s
    if PER_TILE. X16 (16-bit a): fp16 x fp16 dot (fp8_triton.fp16_rows: a scaled per row, exact);
    else (fp32 a) the codes as fp32."""
    if X16:
        a16, a_mul = fp16_rows(a, SCALED)
        part = dot(a16, fp16_operand(wb, MODE), tl.zeros_like(acc), F32) * a_mul[:, None]
        if PER_TILE:
            part = part * s[None, :]
        acc += part
    elif PER_TILE:
        acc += dot(a, fp8_operand(wb, MODE), tl.zeros_like(acc), F32) * s[None, :]
    else:
        acc = dot(a, fp8_operand(wb, MODE), acc, F32)
    return acc


# M (tokens) is not specialised on: every token count shares one compiled program
@triton.jit(do_not_specialize=["M", "M_BUCKET"])
def _w8a16_kernel(x_ptr, w_ptr, s_ptr, y_ptr, M, N, K, M_BUCKET, k_split, bn, bk,
                  sxm, sxk, swn, swk, ssn, ssk, sys, sym, syn, out_mul,
                  MODE: tl.constexpr, ONE_KBLOCK: tl.constexpr, X16: tl.constexpr, SCALED: tl.constexpr,
                  F32: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * sxm
    w_cols = w_ptr + offs_n[None, :].to(tl.int64) * swn
    s_cols = s_ptr + (offs_n // bn).to(tl.int64) * ssn                  # [BLOCK_N] scale rows
    k_lo = pid_s * k_split
    k_hi = tl.minimum(K, k_lo + k_split)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < k_hi
        a = tl.load(x_rows + offs_k[None, :] * sxk, mask=m_ok[:, None] & k_ok[None, :], other=0.0)  # [BM, BK]
        wb = tl.load(w_cols + offs_k[:, None] * swk, mask=k_ok[:, None] & n_ok[None, :], other=0)   # [BK, BN]
        if ONE_KBLOCK:   # (the scale multiplies once at the end)
            acc = w8a16_part(a, wb, acc, None, MODE, X16, SCALED, F32, False)
        else:
            s = tl.load(s_cols + (k0 // bk) * ssk, mask=n_ok, other=0.0)
            acc = w8a16_part(a, wb, acc, s, MODE, X16, SCALED, F32, True)
    if ONE_KBLOCK:
        acc = acc * tl.load(s_cols, mask=n_ok, other=0.0)[None, :]
    acc = acc * out_mul
    tl.store(y_ptr + pid_s * sys + offs_m[:, None].to(tl.int64) * sym + offs_n[None, :] * syn,
             acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _sum_splits_kernel(ws_ptr, y_ptr, N, SPLIT, sws, swm, sym, syn, BLOCK: tl.constexpr):
    m = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < N
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in range(SPLIT):   # fixed order: deterministic
        acc += tl.load(ws_ptr + s * sws + m * swm + offs, mask=ok, other=0.0)
    tl.store(y_ptr + m * sym + offs * syn, acc.to(y_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _act_quant_kernel(x_ptr, q_ptr, s_ptr, M, K, group, sxm, sxk, sqm, ssm,
                      ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """Rows [ROWS], group g of x -> e4m3fn codes (uint8) and one scale per row: max(amax, floor) / 448."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    r_ok = rows < M
    x_rows = x_ptr + rows[:, None].to(tl.int64) * sxm
    g = tl.program_id(1)
    k_lo = g * group
    k_hi = tl.minimum(K, k_lo + group)
    amax = tl.zeros([ROWS, BLOCK], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK):
        offs = k0 + tl.arange(0, BLOCK)
        v = tl.load(x_rows + offs[None, :] * sxk, mask=r_ok[:, None] & (offs < k_hi)[None, :], other=0.0)
        amax = tl.maximum(amax, tl.abs(v.to(tl.float32)))
    scale = tl.math.div_rn(tl.maximum(tl.max(amax, 1), _FLOOR), tl.full([ROWS], _FMAX, tl.float32))   # [ROWS]
    for k0 in range(k_lo, k_hi, BLOCK):
        offs = k0 + tl.arange(0, BLOCK)
        ok = r_ok[:, None] & (offs < k_hi)[None, :]
        v = tl.load(x_rows + offs[None, :] * sxk, mask=ok, other=0.0).to(tl.float32)
        y = tl.math.div_rn(v, tl.zeros([ROWS, BLOCK], dtype=tl.float32) + scale[:, None])
        tl.store(q_ptr + rows[:, None].to(tl.int64) * sqm + offs[None, :],
                 encode_e4m3(tl.minimum(tl.maximum(y, -_FMAX), _FMAX), False), mask=ok)
    tl.store(s_ptr + rows.to(tl.int64) * ssm + g, scale, mask=r_ok)


@triton.jit(do_not_specialize=["M", "M_BUCKET"])
def _w8a8_kernel(q_ptr, qs_ptr, w_ptr, s_ptr, y_ptr, M, N, K, M_BUCKET, bn, bk,
                 sqm, sqsm, swn, swk, ssn, ssk, sym, syn, out_mul,
                 MODE: tl.constexpr, ONE_KBLOCK: tl.constexpr, F32: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    q_rows = q_ptr + offs_m[:, None].to(tl.int64) * sqm
    qs_rows = qs_ptr + offs_m.to(tl.int64) * sqsm                         # [BLOCK_M] x scale rows
    w_cols = w_ptr + offs_n[None, :].to(tl.int64) * swn
    s_cols = s_ptr + (offs_n // bn).to(tl.int64) * ssn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        a = fp8_operand(tl.load(q_rows + offs_k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0), MODE)
        w = fp8_operand(tl.load(w_cols + offs_k[:, None] * swk, mask=k_ok[:, None] & n_ok[None, :], other=0), MODE)
        if ONE_KBLOCK:
            acc = dot(a, w, acc, F32)
        else:
            kb = k0 // bk
            sa = tl.load(qs_rows + kb, mask=m_ok, other=0.0)
            sw = tl.load(s_cols + kb * ssk, mask=n_ok, other=0.0)
            acc += dot(a, w, tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), F32) * sa[:, None] * sw[None, :]
    if ONE_KBLOCK:
        acc = acc * tl.load(qs_rows, mask=m_ok, other=0.0)[:, None] * tl.load(s_cols, mask=n_ok, other=0.0)[None, :]
    acc = acc * out_mul
    tl.store(y_ptr + offs_m[:, None].to(tl.int64) * sym + offs_n[None, :] * syn,
             acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def operand_flags(dtype, f32: bool) -> dict:
    """The w8a16 kernels' operand flags for activations of `dtype` (w8a16_part)."""
    return dict(X16=dtype != torch.float32, SCALED=dtype == torch.bfloat16, F32=f32)


def _split(N: int, K: int, cfg: dict) -> tuple[int, int]:
    """(SPLIT, k_split): the K range of a decode launch cut so that about cfg['programs'] programs run
    (or into cfg['split'] parts), each part a whole number of K tiles."""
    k_tiles = triton.cdiv(K, cfg["BLOCK_K"])
    split = cfg.get("split") or max(1, min(k_tiles, cfg["programs"] // triton.cdiv(N, cfg["BLOCK_N"])))
    per = triton.cdiv(k_tiles, split)
    return triton.cdiv(k_tiles, per), per * cfg["BLOCK_K"]


def fp8_linear_triton(x, weight, weight_scale, block_size=(128, 128), **config):
    """w8a16; `config` overrides launch_config entries (tests and bench sweeps: form, mode, split, tile sizes)."""
    T, K = x.shape
    N = weight.shape[0]
    y = alloc.empty((T, N), x.dtype, x.device)
    if T == 0 or N == 0:
        return y
    plat = platform.current()
    bn, bk = block_dims(block_size, K)
    gemv = T <= GEMV_TOKENS and words_ok(K, block_size, weight) is None
    form = config.pop("form", "gemv" if gemv else "decode" if T <= DECODE_TOKENS else "gemm")
    if form == "gemv":                            # (config: the GEMV's own R, C, num_warps)
        return fp8_gemv(x, weight, weight_scale, block_size, y, config)
    cfg = {**launch_config(plat, form), **config}
    mode = MODES[cfg.pop("mode")]
    f32 = x.dtype == torch.float32 or interpreting()
    w, s = weight.view(torch.uint8), weight_scale
    common = (T, N, K, triton.next_power_of_2(T))
    flags = dict(MODE=mode, ONE_KBLOCK=triton.cdiv(K, bk) == 1, **operand_flags(x.dtype, f32))
    cfg["BLOCK_K"] = k_tile(bk, K, cfg["BLOCK_K"])
    if form == "gemm":
        kmax = k_tile(bk, K, 128)
        if not interpreting() and N * K >= _TUNE_MIN_WEIGHTS and "BLOCK_M" not in config:
            kern, meta = _tuned(_w8a16_kernel, kmax, False), {}
        else:
            kern = _w8a16_kernel
            meta = {k: cfg[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages")}
        kern[lambda META: (triton.cdiv(T, META["BLOCK_M"]), triton.cdiv(N, META["BLOCK_N"]), 1)](
            x, w, s, y, *common, K, bn, bk, *x.stride(), *w.stride(), *s.stride(), 0, *y.stride(),
            SCALE[mode], **flags, **meta)
        return y
    split, k_split = _split(N, K, cfg)
    out = y if split == 1 else alloc.empty((split, T, N), torch.float32, x.device)
    so = (0, *y.stride()) if split == 1 else out.stride()
    meta = {k: cfg[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages")}
    _w8a16_kernel[(triton.cdiv(T, cfg["BLOCK_M"]), triton.cdiv(N, cfg["BLOCK_N"]), split)](
        x, w, s, out, *common, k_split, bn, bk, *x.stride(), *w.stride(), *s.stride(), *so,
        SCALE[mode], **flags, **meta)
    if split > 1:
        block = min(1024, triton.next_power_of_2(N))
        _sum_splits_kernel[(T, triton.cdiv(N, block))](out, y, N, split, out.stride(0), out.stride(1),
                                                        *y.stride(), BLOCK=block)
    return y


def quantize_groups(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] -> (e4m3fn codes as uint8 [T, K], scales fp32 [T, ceil(K / group)]): quantize_fp8_groups."""
    T, K = x.shape
    groups = triton.cdiv(K, group)
    xq = alloc.empty((T, K), torch.uint8, x.device)
    xs = alloc.empty((T, groups), torch.float32, x.device)
    if T:
        _act_quant_kernel[(triton.cdiv(T, 16), groups)](x, xq, xs, T, K, group, *x.stride(), xq.stride(0),
                                                        xs.stride(0), ROWS=16, BLOCK=128, num_warps=4)
    return xq, xs


def fp8_linear_w8a8(x, weight, weight_scale, block_size=(128, 128), **config):
    """w8a8 (x 16-bit); `config` overrides launch_config entries (tests: mode, tile sizes)."""
    T, K = x.shape
    N = weight.shape[0]
    y = alloc.empty((T, N), x.dtype, x.device)
    if T == 0 or N == 0:
        return y
    plat = platform.current()
    bn, bk = block_dims(block_size, K)
    cfg = {**launch_config(plat, "w8a8"), **config}
    mode = MODES[cfg.pop("mode")]
    xq, xs = quantize_groups(x, bk)
    groups = xs.shape[1]
    # the interpreter's fp8 x fp8 dot is exact; its 16-bit dot is not (the integer mode goes through fp32)
    f32 = interpreting() and mode == MODES["int"]
    w, s = weight.view(torch.uint8), weight_scale
    args = (xq, xs, w, s, y, T, N, K, triton.next_power_of_2(T), bn, bk, xq.stride(0), xs.stride(0),
            *w.stride(), *s.stride(), *y.stride(), SCALE[mode] ** 2)
    flags = dict(MODE=mode, ONE_KBLOCK=groups == 1, F32=f32)
    kmax = k_tile(bk, K, 128)
    if not interpreting() and N * K >= _TUNE_MIN_WEIGHTS and "BLOCK_M" not in config:
        grid = lambda META: (triton.cdiv(T, META["BLOCK_M"]), triton.cdiv(N, META["BLOCK_N"]))  # noqa: E731
        _tuned(_w8a8_kernel, kmax, True)[grid](*args, **flags)
    else:
        meta = {k: cfg[k] for k in ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages")}
        _w8a8_kernel[(triton.cdiv(T, meta["BLOCK_M"]), triton.cdiv(N, meta["BLOCK_N"]))](
            *args, **flags, **meta, BLOCK_K=k_tile(bk, K, cfg["BLOCK_K"]))
    return y
