"""Portable Triton KDA decode step (CUDA, ROCm, XPU; CPU under TRITON_INTERPRET=1).

One kernel serves `kda_decode` (g, beta given) and `kda_packed_decode` (PACKED: raw gate
input f and beta logits b; the gate, sigmoid and L2 norm are fused). Grid: (sequence, head,
V-block). Each program reads its [K, BV] tile of the fp32 state at state[slot, head] once,
decays it, applies the delta-rule update, writes it back in place and writes o[n, h, V-block].
slot < 0: only zeros are written to o; the state pool is not touched.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ... import alloc
from ...platform import KernelgateError
from .state_layout import layout_reason


@triton.jit
def _kda_step_kernel(q, k, v, g, beta, A_log, dt_bias, state, slots, o,
                     stride_q, stride_k, stride_v, stride_g, stride_b, stride_s, stride_o,
                     scale, lower_bound,
                     H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                     PACKED: tl.constexpr, USE_LB: tl.constexpr, HAS_BIAS: tl.constexpr, L2: tl.constexpr):
    i_n = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1)
    i_v = tl.program_id(2)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    mk = o_k < K
    mv = o_v < V
    p_o = o + i_n * stride_o + i_h * V + o_v
    slot = tl.load(slots + i_n).to(tl.int64)
    if slot < 0:
        tl.store(p_o, tl.zeros([BV], dtype=tl.float32).to(p_o.dtype.element_ty), mask=mv)
        return

    b_q = tl.load(q + i_n * stride_q + i_h * K + o_k, mask=mk, other=0).to(tl.float32)
    b_k = tl.load(k + i_n * stride_k + i_h * K + o_k, mask=mk, other=0).to(tl.float32)
    b_v = tl.load(v + i_n * stride_v + i_h * V + o_v, mask=mv, other=0).to(tl.float32)
    b_g = tl.load(g + i_n * stride_g + i_h * K + o_k, mask=mk, other=0).to(tl.float32)
    b_beta = tl.load(beta + i_n * stride_b + i_h).to(tl.float32)
    if L2:
        b_q = b_q / tl.sqrt(tl.sum(b_q * b_q) + 1e-6)
        b_k = b_k / tl.sqrt(tl.sum(b_k * b_k) + 1e-6)
    b_q = b_q * scale
    if PACKED:
        if HAS_BIAS:
            b_g += tl.load(dt_bias + i_h * K + o_k, mask=mk, other=0).to(tl.float32)
        a = tl.exp(tl.load(A_log + i_h).to(tl.float32))
        if USE_LB:
            b_g = lower_bound * tl.sigmoid(a * b_g)
        else:
            # softplus, linear above 20 like torch's
            b_g = -a * tl.where(b_g > 20.0, b_g, tl.log(1.0 + tl.exp(tl.minimum(b_g, 20.0))))
        b_beta = tl.sigmoid(b_beta)

    p_s = state + slot * stride_s + i_h * K * V + o_k[:, None] * V + o_v[None, :]
    ms = mk[:, None] & mv[None, :]
    b_s = tl.load(p_s, mask=ms, other=0)                                  # [BK, BV] fp32
    b_s = b_s * tl.exp(b_g)[:, None]
    b_u = b_beta * (b_v - tl.sum(b_s * b_k[:, None], 0))                  # [BV]
    b_s = b_s + b_k[:, None] * b_u[None, :]
    b_o = tl.sum(b_s * b_q[:, None], 0)
    tl.store(p_s, b_s, mask=ms)
    tl.store(p_o, b_o.to(p_o.dtype.element_ty), mask=mv)


def _launch(q, k, v, g, beta, A_log, dt_bias, state, slots, scale, lower_bound, packed, l2):
    N, H, K = q.shape
    V = v.shape[-1]
    why = layout_reason(state, ("q", q, K), ("k", k, K), ("v", v, V), ("g", g, K))
    if why:
        raise KernelgateError(f"kda_decode (triton): {why}")
    o = alloc.empty((N, H, V), v.dtype, v.device)
    if N == 0:
        return o
    BK = max(16, triton.next_power_of_2(K))
    # H200 sweep (bench/kda_packed_sweep.py, K=V=128): few programs -> narrow V tiles to fill
    # the device (N=1: BV=16, 3.3 us); many -> BV=64 with 4 warps (N=256: 0.90 of the state
    # floor vs 0.76 at BV=32)
    BV = min(max(16, triton.next_power_of_2(V)), 16 if N * H < 256 else 64)
    grid = (N, H, triton.cdiv(V, BV))
    _kda_step_kernel[grid](
        q, k, v, g, beta, A_log if A_log is not None else g, dt_bias if dt_bias is not None else g,
        state, slots, o, q.stride(0), k.stride(0), v.stride(0), g.stride(0), beta.stride(0),
        state.stride(0), o.stride(0), float(scale), float(lower_bound or 0.0),
        H=H, K=K, V=V, BK=BK, BV=BV, PACKED=packed, USE_LB=lower_bound is not None,
        HAS_BIAS=dt_bias is not None, L2=l2, num_warps=4)
    return o


def kda_decode(q, k, v, g, beta, state, slots, scale=None, qk_l2norm=True):
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return _launch(q, k, v, g, beta, None, None, state, slots, scale, None, False, qk_l2norm)


def kda_packed_decode(qkv, f, b, A_log, dt_bias, state, slots, num_heads, head_k_dim, scale=None,
                      lower_bound=None):
    N, H, K = qkv.shape[0], num_heads, head_k_dim
    q, k, v = qkv.split([H * K, H * K, qkv.shape[1] - 2 * H * K], dim=1)
    q, k, v = q.view(N, H, K), k.view(N, H, K), v.view(N, H, -1)
    scale = K ** -0.5 if scale is None else scale
    return _launch(q, k, v, f.view(N, H, K), b, A_log, dt_bias, state, slots, scale, lower_bound, True, True)
