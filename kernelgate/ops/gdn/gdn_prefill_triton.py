"""Portable Triton GDN prefill (CUDA, ROCm, XPU; CPU under TRITON_INTERPRET=1): chunked or token by token.

One kernel, grid (sequence, value head, V-block); each program holds its [K, BV] tile of the
fp32 state in registers, loads it once from state[slot, head], runs the sequence's tokens and
writes the tile back once. A sequence with a slot outside [0, pool) or bounds outside [0, T)
is skipped (no state read or written); its rows, and rows no sequence covers, stay zeros.
Every tensor is addressed through its strides.

BT == 1 (`gdn_prefill_recurrent`): token by token with KDA's delta-rule step (one decay per head).
BT = CHUNK (`gdn_prefill_chunk`): BT tokens at a time, the WY / UT form (gc = cumsum of g inside
the chunk; every decay factor exp(gc_i - gc_j), i >= j, is <= 1: no overflow for any decay):
    A[i, j] = beta_i (k_i . k_j) e^(gc_i - gc_j)   (j < i)      u = (I + A)^-1 (beta * (v - e^gc * (K S)))
    o = e^gc * (Q S) + ((Q K^T) * e^(gc_i - gc_j), j <= i) u    S = e^gc_last S + (K * e^(gc_last - gc))^T u
(I + A)^-1 by block doubling: the inverses of the diagonal s-blocks, B, give those of the
2s-blocks as B - B C B (C: A's lower-left s-block inside each 2s-block), log2(BT) steps of
two [BT, BT] dots instead of BT dependent row steps. 16-bit inputs: the [BT, K] x [K, *] dots
take 16-bit operands (fla's choice; not on XPU, see launch_config); the inverse and u, and every dot
of fp32 inputs, are fp32 (IEEE, not TF32: fp32 parity holds; on NVIDIA fla's kernels come first anyway).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ... import platform
from ..conv.short_conv_triton import _bounds
from ..kda.kda_decode_triton import delta_rule_step

# Tokens per chunk. 16: the (I + A)^-1 doubling is 4 steps of [16, 16] dots, q / k chunks stay
# small in registers; every [16, K] x [K, BV] dot maps onto MMA tiles.
CHUNK = 16


@triton.jit
def _bf16_rne(x):
    """fp32 x rounded to the nearest bf16 (ties to even), kept in fp32 (finite x)."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _dot(a, b, LOWP: tl.constexpr):
    """a @ b, fp32 accumulate, of fp32 a, b: as bf16 operands (LOWP 1), as fp32 ones rounded to
    bf16 as a GPU rounds them (LOWP 2: the interpreter, whose bf16 dot multiplies the raw bits and
    whose casts truncate), or as fp32 ones, exactly (LOWP 0: not TF32)."""
    if LOWP == 1:
        c = tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))
    elif LOWP == 2:
        c = tl.dot(_bf16_rne(a), _bf16_rne(b), input_precision="ieee")
    else:
        c = tl.dot(a, b, input_precision="ieee")
    return c


@triton.jit
def _gdn_prefill_kernel(q, k, v, g, beta, state, cu_seqlens, slots, o,
                        sq0, sq1, sq2, sk0, sk1, sk2, sv0, sv1, sv2, sg0, sg1, sb0, sb1, scu, ssl,
                        ss0, ss1, ss2, ss3, so0, so1, T, pool, scale,
                        K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr,
                        LEVELS: tl.constexpr, GROUP: tl.constexpr, L2: tl.constexpr, LOWP: tl.constexpr):
    """BT == 1: token by token (the decode kernel's step); BT = 2^LEVELS > 1: chunked."""
    i_n = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1)
    i_v = tl.program_id(2)
    i_hk = i_h // GROUP
    bos, L = _bounds(cu_seqlens, scu, i_n, T)
    slot = tl.load(slots + i_n * ssl).to(tl.int64)
    if (slot < 0) | (slot >= pool) | (L <= 0):
        return
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    mk = o_k < K
    mv = o_v < V
    p_s = state + slot * ss0 + i_h * ss1 + o_k[:, None] * ss2 + o_v[None, :] * ss3
    ms = mk[:, None] & mv[None, :]
    b_s = tl.load(p_s, mask=ms, other=0)                                  # [BK, BV] fp32
    if BT == 1:
        for t in range(bos, bos + L):
            b_q = tl.load(q + t * sq0 + i_hk * sq1 + o_k * sq2, mask=mk, other=0).to(tl.float32)
            b_k = tl.load(k + t * sk0 + i_hk * sk1 + o_k * sk2, mask=mk, other=0).to(tl.float32)
            b_v = tl.load(v + t * sv0 + i_h * sv1 + o_v * sv2, mask=mv, other=0).to(tl.float32)
            b_g = tl.load(g + t * sg0 + i_h * sg1).to(tl.float32)
            b_beta = tl.load(beta + t * sb0 + i_h * sb1).to(tl.float32)
            b_s, b_o = delta_rule_step(b_s, b_q, b_k, b_v, b_g, b_beta, scale, True, L2)
            tl.store(o + t * so0 + i_h * so1 + o_v, b_o.to(o.dtype.element_ty), mask=mv)
    else:
        o_i = tl.arange(0, BT)
        eye = (o_i[:, None] == o_i[None, :]).to(tl.float32)
        lower = o_i[:, None] > o_i[None, :]
        for c0 in range(0, L, BT):
            t = bos + c0 + o_i                                                # rows of this chunk
            mt = (c0 + o_i) < L                                               # padded rows: k = v = g = beta = 0
            m_tk = mt[:, None] & mk[None, :]
            b_q = tl.load(q + t[:, None] * sq0 + i_hk * sq1 + o_k[None, :] * sq2, mask=m_tk, other=0).to(tl.float32)
            b_k = tl.load(k + t[:, None] * sk0 + i_hk * sk1 + o_k[None, :] * sk2, mask=m_tk, other=0).to(tl.float32)
            b_v = tl.load(v + t[:, None] * sv0 + i_h * sv1 + o_v[None, :] * sv2,
                          mask=mt[:, None] & mv[None, :], other=0).to(tl.float32)
            b_g = tl.load(g + t * sg0 + i_h * sg1, mask=mt, other=0).to(tl.float32)
            b_beta = tl.load(beta + t * sb0 + i_h * sb1, mask=mt, other=0).to(tl.float32)
            if L2:
                b_q = b_q / tl.sqrt(tl.sum(b_q * b_q, 1) + 1e-6)[:, None]
                b_k = b_k / tl.sqrt(tl.sum(b_k * b_k, 1) + 1e-6)[:, None]
            b_q = b_q * scale
            gc = tl.cumsum(b_g, 0)                                            # [BT]
            g_last = tl.sum(b_g, 0)
            causal = o_i[:, None] >= o_i[None, :]
            decay = tl.where(causal, tl.exp(tl.where(causal, gc[:, None] - gc[None, :], 0.0)), 0.0)   # [BT, BT]
            b_kt = tl.trans(b_k)                                              # [BK, BT]
            b_a = tl.where(lower, b_beta[:, None] * _dot(b_k, b_kt, LOWP) * decay, 0.0)
            b_p = _dot(b_q, b_kt, LOWP) * decay
            # (I + A)^-1, block doubling from the 1-blocks (B = I)
            b_inv = eye
            for lvl in tl.static_range(LEVELS):                             # BT = 2^LEVELS; s-blocks, s = 2^lvl
                # (i, j) in one 2s-block, i in its second half, j in its first
                blk = ((o_i[:, None] >> (lvl + 1)) == (o_i[None, :] >> (lvl + 1))) \
                    & (((o_i[:, None] >> lvl) & 1) == 1) & (((o_i[None, :] >> lvl) & 1) == 0)
                b_c = tl.where(blk, b_a, 0.0)
                b_inv = b_inv - _dot(_dot(b_inv, b_c, 0), b_inv, 0)
            e_gc = tl.exp(gc)
            b_r = b_beta[:, None] * (b_v - e_gc[:, None] * _dot(b_k, b_s, LOWP))      # [BT, BV]
            b_u = _dot(b_inv, b_r, 0)
            b_o = e_gc[:, None] * _dot(b_q, b_s, LOWP) + _dot(b_p, b_u, LOWP)
            tl.store(o + t[:, None] * so0 + i_h * so1 + o_v[None, :], b_o.to(o.dtype.element_ty),
                     mask=mt[:, None] & mv[None, :])
            # scale the rows, then transpose (Intel's backend rejects a product with the transposed layout)
            b_kd = tl.trans(b_k * tl.exp(g_last - gc)[:, None])               # [BK, BT]
            b_s = tl.exp(g_last) * b_s + _dot(b_kd, b_u, LOWP)
    tl.store(p_s, b_s, mask=ms)


def launch_config(plat: platform.Platform, programs: int, V: int) -> dict:
    """Launch choices: V tile, warps, 16-bit dots.
    Each program runs its sequence's chunks (tokens) one after another, so the device fills only
    through (sequence, head, V-block) programs: narrow V tiles when few (one 8k-token sequence at
    HV=32, V=128: 256 programs of BV=16), as the decode step does. XPU: fp32 dots only (Intel's
    backend, triton-xpu 3.3, fails to lower a kernel that mixes bf16 DPAS dots with fp32 ones:
    "Unsupported dpas type"); at BT=16 they are [16, K] x [K, BV] FMA tiles."""
    BV = max(16, triton.next_power_of_2(V))
    if plat.triton_mode == "compiled":      # (the interpreter runs programs one by one: fewest is fastest)
        BV = min(BV, 16 if programs < 256 else 32)
    return dict(BV=BV, num_warps=4, lowp_dots=plat.name != "xpu")


def _launch(q, k, v, g, beta, state, cu_seqlens, slots, scale, qk_l2norm, chunk):
    T, HK, K = q.shape
    HV, V = v.shape[1:]
    o = torch.zeros(v.shape, dtype=v.dtype, device=v.device)       # skipped rows stay zeros
    N = slots.shape[0]
    if T == 0 or N == 0:
        return o
    cfg = launch_config(platform.current(), N * HV, V)
    # chunked, 16-bit inputs: bf16 dot operands (rounded as a GPU rounds them under the interpreter)
    lowp = chunk > 1 and cfg["lowp_dots"] and q.element_size() == 2 and k.element_size() == 2
    _gdn_prefill_kernel[(N, HV, triton.cdiv(V, cfg["BV"]))](
        q, k, v, g, beta, state, cu_seqlens, slots, o, *q.stride(), *k.stride(), *v.stride(), *g.stride(),
        *beta.stride(), cu_seqlens.stride(0), slots.stride(0), *state.stride(), *o.stride()[:2],
        T, state.shape[0], float(K ** -0.5 if scale is None else scale), K=K, V=V,
        BK=max(16, triton.next_power_of_2(K)), BV=cfg["BV"], BT=chunk, LEVELS=chunk.bit_length() - 1,
        GROUP=HV // HK, L2=qk_l2norm, LOWP=(2 if platform.interpreting() else 1) if lowp else 0,
        num_warps=cfg["num_warps"])
    return o


def gdn_prefill_chunk(q, k, v, g, beta, state, cu_seqlens, slots, scale=None, qk_l2norm=True, *,
                      cu_seqlens_cpu=None, slots_cpu=None):
    return _launch(q, k, v, g, beta, state, cu_seqlens, slots, scale, qk_l2norm, CHUNK)


def gdn_prefill_recurrent(q, k, v, g, beta, state, cu_seqlens, slots, scale=None, qk_l2norm=True, *,
                          cu_seqlens_cpu=None, slots_cpu=None):
    return _launch(q, k, v, g, beta, state, cu_seqlens, slots, scale, qk_l2norm, 1)
