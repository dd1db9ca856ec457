"""Biased grouped top-k routing as one portable Triton launch (CUDA, ROCm, XPU; CPU interpreter).

A program routes BLOCK_T tokens. Each token's E scores are held as a [NG_PAD, GS_PAD] tile
(group x expert-in-group, padded to powers of two), so any n_group dividing E works,
including non-power-of-two E and group counts. Selection is iterative argmax: take the max,
then the lowest index holding it (ties -> lower group / expert id), mask it, repeat.
Semantics: kernelgate/ops/moe_routing.py (the native reference).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ... import alloc, platform
from ..common.pdl import inputs_ready, pdl_args
from ..common.triton_math import log1p

SCORINGS = ("sigmoid", "softmax", "sqrtsoftplus")   # the op's scoring names, by kernel code 0, 1, 2

_NO_KEY = tl.constexpr(-(2**63))   # below every real selection key


@triton.jit
def _biased_grouped_topk_kernel(
    logits_ptr, bias_ptr, w_ptr, ids_ptr,
    T, stride_t, stride_o, rsf,
    E: tl.constexpr, N_GROUP: tl.constexpr, GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr,
    TOPK: tl.constexpr, SHARED: tl.constexpr, SHARED_GATE: tl.constexpr, SCORING: tl.constexpr,
    RENORM: tl.constexpr,
    HAS_BIAS: tl.constexpr, BLOCK_T: tl.constexpr, NG_PAD: tl.constexpr, GS_PAD: tl.constexpr,
    K_PAD: tl.constexpr, PDL: tl.constexpr,
):
    inputs_ready(PDL)
    route_block(tl.program_id(0), logits_ptr, bias_ptr, w_ptr, ids_ptr, T, stride_t, stride_o, rsf, E, N_GROUP, GROUP,
                TOPK_GROUP, TOPK, SHARED, SHARED_GATE, SCORING, RENORM, HAS_BIAS, BLOCK_T, NG_PAD, GS_PAD, K_PAD)


@triton.jit
def route_block(
    pid, logits_ptr, bias_ptr, w_ptr, ids_ptr,
    T, stride_t, stride_o, rsf,
    E: tl.constexpr, N_GROUP: tl.constexpr, GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr,
    TOPK: tl.constexpr, SHARED: tl.constexpr, SHARED_GATE: tl.constexpr, SCORING: tl.constexpr,
    RENORM: tl.constexpr,
    HAS_BIAS: tl.constexpr, BLOCK_T: tl.constexpr, NG_PAD: tl.constexpr, GS_PAD: tl.constexpr,
    K_PAD: tl.constexpr,
):
    """The routing of tokens [pid * BLOCK_T, (pid + 1) * BLOCK_T) (the kernel's program pid): scores, group
    and expert selection, weights and ids stored."""
    rows = pid * BLOCK_T + tl.arange(0, BLOCK_T)                       # [BT]
    row_ok = rows < T
    g = tl.arange(0, NG_PAD)                                           # [NG]
    j = tl.arange(0, GS_PAD)                                           # [GS]
    eid = g[:, None] * GROUP + j[None, :]                              # [NG, GS] expert id
    e_ok = (g[:, None] < N_GROUP) & (j[None, :] < GROUP)
    valid = row_ok[:, None, None] & e_ok[None, :, :]                   # [BT, NG, GS]

    x = tl.load(logits_ptr + rows[:, None, None].to(tl.int64) * stride_t + eid[None, :, :],
                mask=valid, other=0.0).to(tl.float32)
    if SCORING == 0:      # sigmoid
        s = tl.sigmoid(x)
    elif SCORING == 1:    # softmax over the E experts of the row
        xm = tl.where(valid, x, float("-inf"))
        m = tl.max(tl.max(xm, axis=2), axis=1)                         # [BT]
        m = tl.where(row_ok, m, 0.0)
        p = tl.where(valid, tl.exp(xm - m[:, None, None]), 0.0)
        den = tl.sum(tl.sum(p, axis=2), axis=1)
        s = p / tl.where(row_ok, den, 1.0)[:, None, None]
    else:                 # sqrtsoftplus: sqrt(max(x, 0) + log1p(exp(-|x|)))
        s = tl.sqrt(tl.maximum(x, 0.0) + log1p(tl.exp(-tl.abs(x))))

    c = s
    if HAS_BIAS:          # fp32 bias, added in fp32 (the dtype contract)
        b = tl.load(bias_ptr + eid, mask=e_ok, other=0.0).to(tl.float32)
        c = s + b[None, :, :]
    c = tl.where(valid, c, float("-inf"))

    avail = valid
    if N_GROUP > 1 and TOPK_GROUP < N_GROUP:
        # group score = top-2 sum; the second max excludes only the first occurrence of the max
        m1 = tl.max(c, axis=2)                                         # [BT, NG]
        first = tl.min(tl.where(c == m1[:, :, None], j[None, None, :], GS_PAD), axis=2)
        m2 = tl.max(tl.where(j[None, None, :] == first[:, :, None], float("-inf"), c), axis=2)
        gscore = m1 + m2
        g_ok = (g < N_GROUP)[None, :]
        keep = tl.zeros([BLOCK_T, NG_PAD], dtype=tl.int1)
        for _ in range(TOPK_GROUP):
            gfree = g_ok & (keep == 0)
            gm = tl.where(gfree, gscore, float("-inf"))
            best = tl.max(gm, axis=1)
            pick = tl.min(tl.where(gfree & (gm == best[:, None]), g[None, :], NG_PAD), axis=1)
            keep = keep | (g[None, :] == pick[:, None])
        avail = avail & keep[:, :, None]

    # One reduction per pick: key = (order-preserving int32 of c) << 32 | (E - 1 - id), so the
    # max key is the best score and, among equal scores, the lowest expert id.
    c = tl.where(c == 0.0, 0.0, c)                                     # -0.0 and +0.0 tie, as in torch
    bits = c.to(tl.int32, bitcast=True)
    ordered = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    key = (ordered.to(tl.int64) << 32) | (E - 1 - eid[None, :, :]).to(tl.int64)
    key = tl.where(avail, key, _NO_KEY)
    kk = tl.arange(0, K_PAD)                                           # [K]
    id_acc = tl.zeros([BLOCK_T, K_PAD], dtype=tl.int32)
    for k in range(TOPK):
        best = tl.max(tl.max(key, axis=2), axis=1)                     # [BT]
        pick = (E - 1) - best.to(tl.int32)                             # low 32 bits
        key = tl.where(eid[None, :, :] == pick[:, None, None], _NO_KEY, key)
        id_acc = tl.where(kk[None, :] == k, pick[:, None], id_acc)

    # weights: unbiased scores of the picks, re-read from the row (L1/L2-resident) and re-scored
    picked = row_ok[:, None] & (kk < TOPK)[None, :]
    xp = tl.load(logits_ptr + rows[:, None].to(tl.int64) * stride_t + id_acc, mask=picked,
                 other=0.0).to(tl.float32)
    if SCORING == 0:
        w_acc = tl.sigmoid(xp)
    elif SCORING == 1:
        w_acc = tl.exp(xp - m[:, None]) / tl.where(row_ok, den, 1.0)[:, None]
    else:
        w_acc = tl.sqrt(tl.maximum(xp, 0.0) + log1p(tl.exp(-tl.abs(xp))))
    w_acc = tl.where(picked, w_acc, 0.0)

    wsum = tl.sum(w_acc, axis=1)                                       # padded columns are 0
    if RENORM:
        w_acc = w_acc / (wsum + 1e-20)[:, None]
        shared_w = tl.sum(w_acc, axis=1)
    else:
        shared_w = wsum
    w_acc = w_acc * rsf
    is_shared = (kk >= TOPK) & (kk < TOPK + SHARED)
    if SHARED_GATE:       # sigmoid of each shared expert's own gate logit, in columns E.. of the row
        gmask = row_ok[:, None] & is_shared[None, :]
        xg = tl.load(logits_ptr + rows[:, None].to(tl.int64) * stride_t + (E + kk - TOPK)[None, :],
                     mask=gmask, other=0.0).to(tl.float32)
        w_acc = tl.where(is_shared[None, :], tl.sigmoid(xg), w_acc)
    else:
        w_acc = tl.where(is_shared[None, :], shared_w[:, None], w_acc)
    id_acc = tl.where(is_shared[None, :], (E + kk - TOPK)[None, :], id_acc)

    out = rows[:, None].to(tl.int64) * stride_o + kk[None, :]
    omask = row_ok[:, None] & (kk < TOPK + SHARED)[None, :]
    tl.store(w_ptr + out, w_acc, mask=omask)
    tl.store(ids_ptr + out, id_acc, mask=omask)


def _launch_config(T: int, e_pad: int) -> tuple[int, int]:
    """(BLOCK_T, num_warps). GPU: one token per program on one warp up to 512 padded experts,
    so every reduction is a warp shuffle (no shared memory, no barrier) and T=4096 is one
    wave. Interpreter: many tokens per program, since its cost is per program, not per element.
    bench/ops/moe_routing.py sweeps the alternatives on a GPU."""
    if platform.interpreting():
        return 16, 1
    return 1, (1 if e_pad <= 512 else 2)


def launch(logits, bias, topk, n_group, topk_group, renormalize, routed_scaling_factor, scoring,
           num_fused_shared_experts, w, ids, block_t: int, num_warps: int, shared_gate=None) -> None:
    """Run the kernel into preallocated w / ids [T, topk + shared] with an explicit config."""
    T, E = logits.shape
    E -= num_fused_shared_experts if shared_gate else 0
    G = E // n_group
    _biased_grouped_topk_kernel[(triton.cdiv(T, block_t),)](
        logits, bias if bias is not None else logits, w, ids,
        T, logits.stride(0), w.stride(0), float(routed_scaling_factor),
        E=E, N_GROUP=n_group, GROUP=G, TOPK_GROUP=topk_group, TOPK=topk,
        SHARED=num_fused_shared_experts, SHARED_GATE=shared_gate is not None,
        SCORING=SCORINGS.index(scoring), RENORM=bool(renormalize),
        HAS_BIAS=bias is not None, BLOCK_T=block_t, NG_PAD=triton.next_power_of_2(n_group),
        GS_PAD=triton.next_power_of_2(G), K_PAD=max(2, triton.next_power_of_2(w.shape[1])),
        num_warps=num_warps, **pdl_args(),
    )


def biased_grouped_topk(logits, bias, topk, n_group, topk_group, renormalize, routed_scaling_factor,
                        scoring="sigmoid", num_fused_shared_experts=0, shared_gate=None):
    T, E = logits.shape
    E -= num_fused_shared_experts if shared_gate else 0
    K = topk + num_fused_shared_experts
    w = alloc.empty((T, K), torch.float32, logits.device)
    ids = alloc.empty((T, K), torch.int32, logits.device)
    if T == 0:
        return w, ids
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    if bias is not None and bias.stride(0) != 1:
        bias = bias.contiguous()
    e_pad = triton.next_power_of_2(n_group) * triton.next_power_of_2(E // n_group)
    block_t, num_warps = _launch_config(T, e_pad)
    launch(logits, bias, topk, n_group, topk_group, renormalize, routed_scaling_factor, scoring,
           num_fused_shared_experts, w, ids, block_t, num_warps, shared_gate)
    return w, ids
