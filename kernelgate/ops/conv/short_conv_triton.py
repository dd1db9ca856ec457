"""Portable Triton short causal depthwise conv (+ SiLU) with slot-held context.

`short_conv_update`: one token per sequence, grid (sequence, D-block); the program reads its
context [BD, W-1] from conv_state[slot], writes y and the shifted context back in place.
`short_conv`: varlen; grid (sequence, D-block, T-block) computes y reading context from the
old state, then a second launch (after all reads) writes the last W-1 inputs to each slot.
Every input is addressed through its strides (views welcome); y is one buffer holding the
caller's `split` parts (q | k | v) one after another, each a contiguous [T, n]. A slot outside [0, S): zero
context, no state read or write. A sequence whose bounds are not 0 <= bos <= eos <= T is
skipped; the output is zero-filled first when cu_seqlens (seen on the host) leaves rows
uncovered.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ... import alloc
from ..common.pdl import inputs_ready, pdl_args


@triton.jit
def _conv_update_kernel(x, weight, bias, state, slots, y, sx0, sx1, sw0, sw1, sb, ssl, sy,
                        ss0, ss1, ss2, D, S,
                        W: tl.constexpr, BD: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
                        PDL: tl.constexpr):
    i_n = tl.program_id(0).to(tl.int64)
    o_d = tl.program_id(1) * BD + tl.arange(0, BD)
    md = o_d < D
    inputs_ready(PDL)
    slot = tl.load(slots + i_n * ssl).to(tl.int64)
    live = (slot >= 0) & (slot < S)
    ok = (tl.zeros([BD], dtype=tl.int64) + live.to(tl.int64)) > 0   # vector: a scalar mask term breaks the interpreter
    p_s = state + tl.where(live, slot, 0) * ss0 + o_d * ss1
    b_x = tl.load(x + i_n * sx0 + o_d * sx1, mask=md, other=0).to(tl.float32)
    acc = tl.load(weight + o_d * sw0 + (W - 1) * sw1, mask=md, other=0).to(tl.float32) * b_x
    if HAS_BIAS:
        acc += tl.load(bias + o_d * sb, mask=md, other=0).to(tl.float32)
    for j in tl.static_range(W - 1):
        c = tl.load(p_s + j * ss2, mask=md & ok, other=0)
        acc += tl.load(weight + o_d * sw0 + j * sw1, mask=md, other=0).to(tl.float32) * c.to(tl.float32)
        if j > 0:  # shift left: the context loses its oldest column
            tl.store(p_s + (j - 1) * ss2, c, mask=md & ok)
    tl.store(p_s + (W - 2) * ss2, b_x.to(state.dtype.element_ty), mask=md & ok)
    if SILU:
        acc = acc * tl.sigmoid(acc)
    tl.store(y + i_n * sy + o_d, acc.to(y.dtype.element_ty), mask=md)


@triton.jit
def _bounds(cu_seqlens, scu, i_n, T):
    """(bos, length) of sequence i_n; length -1 when its bounds are not 0 <= bos <= eos <= T."""
    bos = tl.load(cu_seqlens + i_n * scu).to(tl.int64)
    eos = tl.load(cu_seqlens + (i_n + 1) * scu).to(tl.int64)
    ok = (bos >= 0) & (bos <= eos) & (eos <= T)
    return tl.where(ok, bos, 0), tl.where(ok, eos - bos, -1)


@triton.jit
def _conv_varlen_kernel(x, weight, bias, state, cu_seqlens, slots, y, sx0, sx1, sw0, sw1, sb, scu, ssl,
                        P1, P2, ss0, ss1, ss2, D, S, T, W: tl.constexpr, BT: tl.constexpr,
                        BD: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr):
    i_n = tl.program_id(0).to(tl.int64)
    o_d = tl.program_id(1) * BD + tl.arange(0, BD)
    bos, L = _bounds(cu_seqlens, scu, i_n, T)
    o_t = tl.program_id(2) * BT + tl.arange(0, BT)                         # position in the sequence
    if tl.program_id(2) * BT >= L:
        return
    md = o_d < D
    mt = o_t < L
    acc = tl.zeros([BT, BD], dtype=tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias + o_d * sb, mask=md, other=0).to(tl.float32)[None, :]
    # only the sequence's first W - 1 positions read the slot's context: the other blocks skip its
    # loads and their [BT, BD] address math (bench/ops/short_conv_sweep.py)
    context = tl.program_id(2) * BT < W - 1
    slot = tl.load(slots + i_n * ssl).to(tl.int64)
    live = (slot >= 0) & (slot < S)
    ok = (tl.zeros([BT], dtype=tl.int64) + live.to(tl.int64)) > 0
    for j in tl.static_range(W):
        pos = o_t - (W - 1) + j                                            # input position, < 0: context
        xv = tl.load(x + (bos + pos)[:, None] * sx0 + o_d[None, :] * sx1,
                     mask=((pos >= 0) & mt)[:, None] & md[None, :], other=0).to(tl.float32)
        if context:
            xv += tl.load(state + tl.where(live, slot, 0) * ss0 + o_d[None, :] * ss1
                          + (W - 1 + pos)[:, None] * ss2,
                          mask=((pos < 0) & mt & ok)[:, None] & md[None, :], other=0).to(tl.float32)
        acc += tl.load(weight + o_d * sw0 + j * sw1, mask=md, other=0).to(tl.float32)[None, :] * xv
    if SILU:
        acc = acc * tl.sigmoid(acc)
    # y holds up to three contiguous [T, width] parts, channels [0, P1) | [P1, P2) | [P2, D)
    start = tl.where(o_d >= P2, P2, tl.where(o_d >= P1, P1, 0))
    width = tl.where(o_d >= P2, D - P2, tl.where(o_d >= P1, P2 - P1, P1))
    y_col = start.to(tl.int64) * T + (o_d - start)
    tl.store(y + (bos + o_t)[:, None] * width[None, :] + y_col[None, :], acc.to(y.dtype.element_ty),
             mask=mt[:, None] & md[None, :])


@triton.jit
def _conv_state_kernel(x, state, cu_seqlens, slots, sx0, sx1, scu, ssl, ss0, ss1, ss2, D, S, T,
                       W: tl.constexpr, BW: tl.constexpr, BD: tl.constexpr):
    i_n = tl.program_id(0).to(tl.int64)
    o_d = tl.program_id(1) * BD + tl.arange(0, BD)
    slot = tl.load(slots + i_n * ssl).to(tl.int64)
    bos, L = _bounds(cu_seqlens, scu, i_n, T)
    if (slot < 0) | (slot >= S) | (L <= 0):   # skipped slot or sequence; no tokens: context stays
        return
    o_w = tl.arange(0, BW)                                                 # new context column
    pos = L - (W - 1) + o_w
    mw = o_w < W - 1
    md = o_d < D
    p_s = state + slot * ss0 + o_d[None, :] * ss1
    xv = tl.load(x + (bos + pos)[:, None] * sx0 + o_d[None, :] * sx1,
                 mask=((pos >= 0) & mw)[:, None] & md[None, :], other=0)
    # a sequence shorter than W-1 keeps part of its old context (columns W-1+pos > column)
    cv = tl.load(p_s + (W - 1 + pos)[:, None] * ss2, mask=((pos < 0) & mw)[:, None] & md[None, :], other=0)
    new = tl.where((pos >= 0)[:, None], xv.to(state.dtype.element_ty), cv)
    tl.store(p_s + o_w[:, None] * ss2, new, mask=mw[:, None] & md[None, :])


def short_conv_update(x, weight, bias, conv_state, slots, activation="silu"):
    N, D = x.shape
    W = weight.shape[1]
    y = alloc.empty((N, D), x.dtype, x.device)
    if N == 0:
        return y
    BD = min(256, triton.next_power_of_2(D))
    _conv_update_kernel[(N, triton.cdiv(D, BD))](
        x, weight, bias if bias is not None else weight, conv_state, slots, y, *x.stride(), *weight.stride(),
        bias.stride(0) if bias is not None else 0, slots.stride(0), y.stride(0), *conv_state.stride(),
        D, conv_state.shape[0], W=W, BD=BD, HAS_BIAS=bias is not None, SILU=activation is not None,
        **pdl_args())
    return y


_LAST: list = [None, None]   # (host cu_seqlens, facts): the layers of one engine step share the hint


def _host_layout(cu, T, hint=False):
    """(longest sequence clipped to T, whether the sequences cover rows [0, T) exactly) from
    cu_seqlens: a hint is already on the host, a device tensor costs one copy (a sync). The
    T-block grid dim needs the first; without the second, uncovered rows are zero-filled."""
    if hint and cu is _LAST[0] and _LAST[1][2] == T:
        return _LAST[1][:2]
    host = cu.cpu()
    lens = host[1:] - host[:-1]
    covered = int(host[0]) == 0 and int(host[-1]) == T and bool((lens >= 0).all())
    facts = (min(int(lens.max()), T), covered, T)     # a longer sequence is out of bounds: skipped
    if hint:                                          # a hint is the caller's word, never written in place
        _LAST[0], _LAST[1] = cu, facts
    return facts[:2]


def short_conv(x, weight, bias, conv_state, cu_seqlens, slots, activation="silu", *, cu_seqlens_cpu=None,
               split=None):
    T, D = x.shape
    W = weight.shape[1]
    N = cu_seqlens.shape[0] - 1
    max_len, covered = _host_layout(cu_seqlens, T) if cu_seqlens_cpu is None else _host_layout(cu_seqlens_cpu, T, True)
    y = alloc.empty((T * D,), x.dtype, x.device) if covered else torch.zeros((T * D,), dtype=x.dtype, device=x.device)
    parts = split or (D,)
    bounds = [sum(parts[:i]) for i in range(1, len(parts))] + [D, D]        # P1, P2 (D: no such part)
    out = [y[T * s:T * (s + n)].view(T, n) for s, n in zip([0] + bounds[:len(parts) - 1], parts)]
    out = out[0] if split is None else tuple(out)
    if T == 0 or max_len <= 0:             # no tokens to convolve, no context to update
        return out
    # 16 x 64 tiles on 2 warps: the sweep's fastest at Kimi's prefill chunk (8,192 x 12,288 channels:
    # 0.21 ms on the H200, vs 0.40 at 16 x 128 on 4; bench/ops/short_conv_sweep.py, bench/RESULTS.md)
    BT, BD, WARPS = 16, min(64, triton.next_power_of_2(D)), 2
    S = conv_state.shape[0]
    strides = (*x.stride(), *weight.stride(), bias.stride(0) if bias is not None else 0,
               cu_seqlens.stride(0), slots.stride(0))
    _conv_varlen_kernel[(N, triton.cdiv(D, BD), triton.cdiv(max_len, BT))](
        x, weight, bias if bias is not None else weight, conv_state, cu_seqlens, slots, y, *strides,
        bounds[0], bounds[1], *conv_state.stride(), D, S, T, W=W, BT=BT, BD=BD, HAS_BIAS=bias is not None,
        SILU=activation is not None, num_warps=WARPS)
    _conv_state_kernel[(N, triton.cdiv(D, BD))](
        x, conv_state, cu_seqlens, slots, *x.stride(), cu_seqlens.stride(0), slots.stride(0),
        *conv_state.stride(), D, S, T, W=W, BW=max(2, triton.next_power_of_2(W - 1)), BD=BD)
    return out
