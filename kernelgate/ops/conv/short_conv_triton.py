"""Portable Triton short causal depthwise conv (+ SiLU) with slot-held context.

`short_conv_update`: one token per sequence, grid (sequence, D-block); the program reads its
context [BD, W-1] from conv_state[slot], writes y and the shifted context back in place.
`short_conv`: varlen; grid (sequence, D-block, T-block) computes y reading context from the
old state, then a second launch (after all reads) writes the last W-1 inputs to each slot.
slot < 0: zero context, no state read or write.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ... import alloc
from ...platform import KernelgateError


@triton.jit
def _conv_update_kernel(x, weight, bias, state, slots, y, stride_x, stride_y, stride_s0, stride_s1, stride_s2,
                        D, W: tl.constexpr, BD: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr):
    i_n = tl.program_id(0).to(tl.int64)
    o_d = tl.program_id(1) * BD + tl.arange(0, BD)
    md = o_d < D
    slot = tl.load(slots + i_n).to(tl.int64)
    ok = (tl.zeros([BD], dtype=tl.int64) + slot) >= 0     # vector: a scalar mask term breaks the interpreter
    p_s = state + tl.maximum(slot, 0) * stride_s0 + o_d * stride_s1
    b_x = tl.load(x + i_n * stride_x + o_d, mask=md, other=0).to(tl.float32)
    acc = tl.load(weight + o_d * W + (W - 1), mask=md, other=0).to(tl.float32) * b_x
    if HAS_BIAS:
        acc += tl.load(bias + o_d, mask=md, other=0).to(tl.float32)
    for j in tl.static_range(W - 1):
        c = tl.load(p_s + j * stride_s2, mask=md & ok, other=0)
        acc += tl.load(weight + o_d * W + j, mask=md, other=0).to(tl.float32) * c.to(tl.float32)
        if j > 0:  # shift left: the context loses its oldest column
            tl.store(p_s + (j - 1) * stride_s2, c, mask=md & ok)
    tl.store(p_s + (W - 2) * stride_s2, b_x.to(state.dtype.element_ty), mask=md & ok)
    if SILU:
        acc = acc * tl.sigmoid(acc)
    tl.store(y + i_n * stride_y + o_d, acc.to(y.dtype.element_ty), mask=md)


@triton.jit
def _conv_varlen_kernel(x, weight, bias, state, cu_seqlens, slots, y, stride_x, stride_y,
                        stride_s0, stride_s1, stride_s2, D, W: tl.constexpr, BT: tl.constexpr,
                        BD: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr):
    i_n = tl.program_id(0).to(tl.int64)
    o_d = tl.program_id(1) * BD + tl.arange(0, BD)
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    L = tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos
    o_t = tl.program_id(2) * BT + tl.arange(0, BT)                         # position in the sequence
    if tl.program_id(2) * BT >= L:
        return
    md = o_d < D
    mt = o_t < L
    slot = tl.load(slots + i_n).to(tl.int64)
    ok = (tl.zeros([BT], dtype=tl.int64) + slot) >= 0
    acc = tl.zeros([BT, BD], dtype=tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias + o_d, mask=md, other=0).to(tl.float32)[None, :]
    for j in tl.static_range(W):
        pos = o_t - (W - 1) + j                                            # input position, < 0: context
        in_x = (pos >= 0) & mt
        xv = tl.load(x + (bos + pos)[:, None] * stride_x + o_d[None, :],
                     mask=in_x[:, None] & md[None, :], other=0).to(tl.float32)
        cv = tl.load(state + tl.maximum(slot, 0) * stride_s0 + o_d[None, :] * stride_s1
                     + (W - 1 + pos)[:, None] * stride_s2,
                     mask=((pos < 0) & mt & ok)[:, None] & md[None, :], other=0).to(tl.float32)
        acc += tl.load(weight + o_d * W + j, mask=md, other=0).to(tl.float32)[None, :] * (xv + cv)
    if SILU:
        acc = acc * tl.sigmoid(acc)
    tl.store(y + (bos + o_t)[:, None] * stride_y + o_d[None, :], acc.to(y.dtype.element_ty),
             mask=mt[:, None] & md[None, :])


@triton.jit
def _conv_state_kernel(x, state, cu_seqlens, slots, stride_x, stride_s0, stride_s1, stride_s2, D,
                       W: tl.constexpr, BW: tl.constexpr, BD: tl.constexpr):
    i_n = tl.program_id(0).to(tl.int64)
    o_d = tl.program_id(1) * BD + tl.arange(0, BD)
    slot = tl.load(slots + i_n).to(tl.int64)
    if slot < 0:
        return
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    L = tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos
    o_w = tl.arange(0, BW)                                                 # new context column
    pos = L - (W - 1) + o_w
    mw = o_w < W - 1
    md = o_d < D
    p_s = state + slot * stride_s0 + o_d[None, :] * stride_s1
    xv = tl.load(x + (bos + pos)[:, None] * stride_x + o_d[None, :],
                 mask=((pos >= 0) & mw)[:, None] & md[None, :], other=0)
    # a sequence shorter than W-1 keeps part of its old context (columns W-1+pos > column)
    cv = tl.load(p_s + (W - 1 + pos)[:, None] * stride_s2, mask=((pos < 0) & mw)[:, None] & md[None, :], other=0)
    new = tl.where((pos >= 0)[:, None], xv.to(state.dtype.element_ty), cv)
    tl.store(p_s + o_w[:, None] * stride_s2, new, mask=mw[:, None] & md[None, :])


def _check(x, weight):
    if x.stride(-1) != 1 or not weight.is_contiguous():
        raise KernelgateError("short_conv (triton): x rows and weight must be dense in the last dim")


def short_conv_update(x, weight, bias, conv_state, slots, activation="silu"):
    _check(x, weight)
    N, D = x.shape
    W = weight.shape[1]
    y = alloc.empty((N, D), x.dtype, x.device)
    if N == 0:
        return y
    BD = min(256, triton.next_power_of_2(D))
    _conv_update_kernel[(N, triton.cdiv(D, BD))](
        x, weight, bias if bias is not None else weight, conv_state, slots, y, x.stride(0), y.stride(0),
        *conv_state.stride(), D, W=W, BD=BD, HAS_BIAS=bias is not None, SILU=activation is not None)
    return y


def short_conv(x, weight, bias, conv_state, cu_seqlens, slots, activation="silu", *, cu_seqlens_cpu=None):
    _check(x, weight)
    T, D = x.shape
    W = weight.shape[1]
    N = cu_seqlens.shape[0] - 1
    y = alloc.empty((T, D), x.dtype, x.device)
    if T == 0:
        return y
    # the T-block grid dim needs the longest sequence on the host: from the hint, else a sync
    cu_host = cu_seqlens if cu_seqlens_cpu is None else cu_seqlens_cpu
    max_len = int((cu_host[1:] - cu_host[:-1]).max())
    BT, BD = 16, min(128, triton.next_power_of_2(D))
    _conv_varlen_kernel[(N, triton.cdiv(D, BD), triton.cdiv(max_len, BT))](
        x, weight, bias if bias is not None else weight, conv_state, cu_seqlens, slots, y, x.stride(0),
        y.stride(0), *conv_state.stride(), D, W=W, BT=BT, BD=BD, HAS_BIAS=bias is not None,
        SILU=activation is not None)
    _conv_state_kernel[(N, triton.cdiv(D, BD))](
        x, conv_state, cu_seqlens, slots, x.stride(0), *conv_state.stride(), D, W=W,
        BW=max(2, triton.next_power_of_2(W - 1)), BD=BD)
    return y
