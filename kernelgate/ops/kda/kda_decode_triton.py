"""Portable Triton delta-rule decode step for KDA and GDN (CUDA, ROCm, XPU; CPU under TRITON_INTERPRET=1).

One kernel serves `kda_decode` / `gdn_decode` (g, beta given) and `kda_packed_decode` /
`gdn_packed_decode` (PACKED: raw gate input and beta logits; the gate, sigmoid and L2 norm are
fused). The two families differ in two constexprs: SCALAR_G (GDN: one log-decay per head,
A_log / dt_bias per head; KDA: one per channel, dt_bias [H*K]) and GROUP (value heads per
q/k head: v head h reads q/k head h // GROUP; 1 for KDA). Grid: (sequence, value head,
V-block). Each program reads its [K, BV] tile of the fp32 state at state[slot, head] once,
decays it, applies the delta-rule update, writes it back in place and writes o[n, h, V-block].
slot < 0 or >= the pool size: only zeros are written to o; the state pool is not touched.
Every tensor (q, k, v, g, beta, A_log, dt_bias, the state pool, the slots) is addressed
through its strides: views of any layout are read as they are.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ... import alloc
from ..common.pdl import inputs_ready, pdl_args
from .kda_decode import unpack


@triton.jit
def delta_rule_step(b_s, b_q, b_k, b_v, b_g, b_beta, scale, SCALAR_G: tl.constexpr, L2: tl.constexpr):
    """One token on the fp32 state tile b_s [BK, BV]: S = exp(g) S; S += k (beta (v - S^T k))^T;
    o = S^T (scale q), q and k L2-normalised first when L2. b_g is [BK] per channel, or a
    scalar (SCALAR_G). Returns (S, o [BV])."""
    if L2:
        b_q = b_q / tl.sqrt(tl.sum(b_q * b_q) + 1e-6)
        b_k = b_k / tl.sqrt(tl.sum(b_k * b_k) + 1e-6)
    b_q = b_q * scale
    if SCALAR_G:
        b_s = b_s * tl.exp(b_g)
    else:
        b_s = b_s * tl.exp(b_g)[:, None]
    b_u = b_beta * (b_v - tl.sum(b_s * b_k[:, None], 0))                  # [BV]
    b_s = b_s + b_k[:, None] * b_u[None, :]
    b_o = tl.sum(b_s * b_q[:, None], 0)
    return b_s, b_o


@triton.jit
def _kda_step_kernel(q, k, v, g, beta, A_log, dt_bias, state, slots, o,
                     sq0, sq1, sq2, sk0, sk1, sk2, sv0, sv1, sv2, sg0, sg1, sg2, sb0, sb1, sa, sdb, ssl,
                     ss0, ss1, ss2, ss3, so0, pool, scale, lower_bound,
                     H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                     PACKED: tl.constexpr, USE_LB: tl.constexpr, HAS_BIAS: tl.constexpr, L2: tl.constexpr,
                     GROUP: tl.constexpr, SCALAR_G: tl.constexpr, PDL: tl.constexpr):
    i_n = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1)
    i_v = tl.program_id(2)
    i_hk = i_h // GROUP
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    mk = o_k < K
    mv = o_v < V
    p_o = o + i_n * so0 + i_h * V + o_v
    inputs_ready(PDL)
    slot = tl.load(slots + i_n * ssl).to(tl.int64)
    if (slot < 0) | (slot >= pool):
        tl.store(p_o, tl.zeros([BV], dtype=tl.float32).to(p_o.dtype.element_ty), mask=mv)
        return

    b_q = tl.load(q + i_n * sq0 + i_hk * sq1 + o_k * sq2, mask=mk, other=0).to(tl.float32)
    b_k = tl.load(k + i_n * sk0 + i_hk * sk1 + o_k * sk2, mask=mk, other=0).to(tl.float32)
    b_v = tl.load(v + i_n * sv0 + i_h * sv1 + o_v * sv2, mask=mv, other=0).to(tl.float32)
    b_beta = tl.load(beta + i_n * sb0 + i_h * sb1).to(tl.float32)
    if SCALAR_G:
        b_g = tl.load(g + i_n * sg0 + i_h * sg1).to(tl.float32)
    else:
        b_g = tl.load(g + i_n * sg0 + i_h * sg1 + o_k * sg2, mask=mk, other=0).to(tl.float32)
    if PACKED:
        if HAS_BIAS:
            if SCALAR_G:
                b_g += tl.load(dt_bias + i_h * sdb).to(tl.float32)
            else:
                b_g += tl.load(dt_bias + (i_h * K + o_k) * sdb, mask=mk, other=0).to(tl.float32)
        a = tl.exp(tl.load(A_log + i_h * sa).to(tl.float32))
        if USE_LB:
            b_g = lower_bound * tl.sigmoid(a * b_g)
        else:
            # softplus, linear above 20 like torch's
            b_g = -a * tl.where(b_g > 20.0, b_g, tl.log(1.0 + tl.exp(tl.minimum(b_g, 20.0))))
        b_beta = tl.sigmoid(b_beta)

    p_s = state + slot * ss0 + i_h * ss1 + o_k[:, None] * ss2 + o_v[None, :] * ss3
    ms = mk[:, None] & mv[None, :]
    b_s, b_o = delta_rule_step(tl.load(p_s, mask=ms, other=0), b_q, b_k, b_v, b_g, b_beta, scale, SCALAR_G, L2)
    tl.store(p_s, b_s, mask=ms)
    tl.store(p_o, b_o.to(p_o.dtype.element_ty), mask=mv)


def launch_step(q, k, v, g, beta, A_log, dt_bias, state, slots, scale, lower_bound, packed, l2, bv=None,
                num_warps=4):
    """q, k [N, HK, K], v [N, H, V], g [N, H, K] (KDA) or [N, H] (GDN: one decay per head),
    beta [N, H]; H % HK == 0. -> o [N, H, V] in v's dtype; the state updated in place.
    bv, num_warps: launch overrides (sweeps)."""
    N, HK, K = q.shape
    H, V = v.shape[1:]
    o = alloc.empty((N, H, V), v.dtype, v.device)
    if N == 0:
        return o
    scalar_g = g.dim() == 2
    BK = max(16, triton.next_power_of_2(K))
    # few (sequence, head) pairs: narrow V tiles, so that enough programs run to fill the device;
    # many: 64-wide tiles with 4 warps, fewer and longer programs that read the state nearer its floor
    BV = bv or min(max(16, triton.next_power_of_2(V)), 16 if N * H < 256 else 64)
    grid = (N, H, triton.cdiv(V, BV))
    # every tensor through its strides (unit strides are specialised by Triton: no cost when dense)
    _kda_step_kernel[grid](
        q, k, v, g, beta, A_log if A_log is not None else g, dt_bias if dt_bias is not None else g,
        state, slots, o, *q.stride(), *k.stride(), *v.stride(), *g.stride(), *((0,) if scalar_g else ()),
        *beta.stride(), A_log.stride(0) if A_log is not None else 0, dt_bias.stride(0) if dt_bias is not None else 0,
        slots.stride(0), *state.stride(), o.stride(0), state.shape[0], float(scale), float(lower_bound or 0.0),
        H=H, K=K, V=V, BK=BK, BV=BV, PACKED=packed, USE_LB=lower_bound is not None,
        HAS_BIAS=dt_bias is not None, L2=l2, GROUP=H // HK, SCALAR_G=scalar_g, num_warps=num_warps,
        **pdl_args())
    return o


def kda_decode(q, k, v, g, beta, state, slots, scale=None, qk_l2norm=True):
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return launch_step(q, k, v, g, beta, None, None, state, slots, scale, None, False, qk_l2norm)


def kda_packed_decode(qkv, f, b, A_log, dt_bias, state, slots, num_heads, head_k_dim, scale=None,
                      lower_bound=None):
    N, H, K = qkv.shape[0], num_heads, head_k_dim
    q, k, v = unpack(qkv, H, K)
    scale = K ** -0.5 if scale is None else scale
    return launch_step(q, k, v, f.view(N, H, K), b, A_log, dt_bias, state, slots, scale, lower_bound, True, True)
