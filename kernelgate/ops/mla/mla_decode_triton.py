"""Portable Triton split-KV (flash-decoding) kernel for `mla_decode` (CUDA, ROCm, XPU; CPU
tensors under TRITON_INTERPRET=1).

Grid (sequence n, split s). A program holds the M = next_n * H query rows of its sequence
(row m = j * H + h: query token j, head h; padded to a power of two >= 16, the tl.dot M axis)
and walks its share of the sequence's positions in tiles of BLOCK_N: one load of the tile's
latent rows [BLOCK_N, R] (+ the shared-key part [BLOCK_N, Dr]) serves every head, as both the
keys (scores = q_lat kv^T + q_r k_r^T, [M, BLOCK_N]) and the values (o += p kv, [M, R]);
R + Dr = 576 is not a power of two, hence the two parts. Online softmax in base 2, fp32.

The split of a sequence is decided per sequence from its own length (ceil(tiles / splits)
tiles each), so a wide block table (the engine's max context) does not pile a short
sequence's work onto one program. The split count comes from shapes only (sequences, table
width; never the lengths: no host sync, one graph fits every length). With one split the
program writes o and lse; otherwise fp32 partials (o normalised per split, lse) go to a
scratch buffer and `_merge_kernel` combines them by their lse (an empty split writes lse =
-inf only and is skipped).

Never out of bounds: positions past the length or past the table width are masked, and a
block id outside [0, num_blocks) is not read (its positions leave the softmax).
Under the interpreter, and for fp32 caches, operands go through fp32 and an IEEE fp32 dot
(the interpreter's bf16 dot is not reliable); on GPUs bf16 / fp16 tiles feed the MMA
directly and p is rounded to the cache dtype for the p kv product (as flash attention does).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ... import alloc, platform
from ...platform import interpreting
from . import paged

OP = "mla_decode"
# Launch choices by (platform, capability prefix); the first match wins, None matches any.
# programs: the grid aims at about this many (sequence, split) programs (about 2 per SM / CU);
# min_split: no split gets fewer than this many positions of the table's capacity (each split
# writes M x R fp32 partials: 64 KiB for Kimi). Unmeasured starting points: bench/mla_decode.py
# --sweep times the alternatives on a GPU.
CONFIGS = [
    # H100/H200, measured (H200, 2026-11-30, bench/mla_decode.py --sweep, CUDA graph): small
    # batches take 16-token tiles in the kv-major orientation, 4 warps, 3 stages, the table entry
    # loaded a tile ahead (B1 128k 102.5 us = 0.35 of the floor, was 181.4 with 32 x 8 warps x 2
    # stages; B8 32k 148.9 us = 0.48, was 285.1); SM_9_LARGE_N below for wide batches.
    (("cuda", "sm_9"), dict(block_n=16, num_warps=4, num_stages=3, programs=264, min_split=256,
                            kv_major=True, ahead=True)),
    (("cuda", "sm_10"), dict(block_n=32, num_warps=8, num_stages=2, programs=296, min_split=256)),
    (("cuda", None), dict(block_n=32, num_warps=4, num_stages=2, programs=216, min_split=256)),
    (("rocm", None), dict(block_n=32, num_warps=8, num_stages=1, programs=608, min_split=256)),
    (("xpu", None), dict(block_n=32, num_warps=8, num_stages=1, programs=256, min_split=256)),
    ((None, None), dict(block_n=32, num_warps=4, num_stages=1, programs=128, min_split=256)),
]
# The merge of the splits: programs of merge_rows query rows x merge_br latent columns (None:
# all), reading merge_sb splits per step.
MERGE = dict(merge_rows=1, merge_br=128, merge_sb=16)
# Loop shape defaults (see _partial_kernel). Compiled for sm_90 without a GPU (Triton 3.9,
# `bench/mla_decode.py --aot`), Kimi shapes, next_n 1: heads-major 32 x 8 warps x 2 stages takes
# 239 registers, no spills, 86 KB shared, cp.async tiles, mma.sync; kv-major the same tile puts
# the p kv product on wgmma (252 registers); tiles of 64 spill in both orientations. With
# ahead=True Triton did not pipeline the loop (no cp.async), so it is off by default.
LOOP = dict(kv_major=False, ahead=False)
# The interpreter keeps each platform's tile shape but launches few programs (each costs
# Python time) with short splits, so tests still cross split boundaries.
INTERPRETER = dict(programs=8, min_split=32, merge_rows=None, merge_br=None, merge_sb=4)


# B >= 32 on sm_90: 64-token tiles, heads as the MMA rows, 8 warps, 3 stages, about 4 programs per
# SM (B64 32k 1,144 us = 0.50 of the floor; 1,250 at 264 programs, the small-batch choice 1,626).
SM_9_LARGE_N = dict(block_n=64, num_warps=8, num_stages=3, kv_major=False, ahead=True, programs=1056)


def config(plat=None, num_seqs: int = 1) -> dict:
    plat = plat or platform.current()
    for (name, cap), cfg in CONFIGS:
        if name in (None, plat.name) and (cap is None or (plat.capability or "").startswith(cap)):
            if cap == "sm_9" and num_seqs >= 32:
                cfg = {**cfg, **SM_9_LARGE_N}
            return {**MERGE, **LOOP, **cfg, **(INTERPRETER if interpreting() else {})}
    raise AssertionError("unreachable: CONFIGS ends with a catch-all")


def num_splits(N: int, max_blocks: int, block_size: int, cfg: dict) -> int:
    cap = -(-max_blocks * block_size // cfg["min_split"])
    return max(1, min(-(-cfg["programs"] // max(N, 1)), cap))


@triton.jit
def _dot(a, b, DOT_F32: tl.constexpr):
    if DOT_F32:
        c = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        c = tl.dot(a, b)
    return c


@triton.jit
def _partial_kernel(q_ptr, kv_ptr, bt_ptr, len_ptr, o_ptr, lse_ptr,
                    s_qt, s_qh, s_cb, s_ct, s_bt, num_blocks, max_blocks, block_size, next_n, H, M,
                    qk_scale,
                    R: tl.constexpr, DR: tl.constexpr, RP: tl.constexpr, DRP: tl.constexpr, MP: tl.constexpr,
                    BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, DOT_F32: tl.constexpr,
                    KV_MAJOR: tl.constexpr, AHEAD: tl.constexpr):
    """KV_MAJOR=False: scores [MP, BLOCK_N] = q kv^T, acc [MP, RP] (heads on the MMA's M axis).
    KV_MAJOR=True: the transposes, scores^T = kv q^T [BLOCK_N, MP] and acc^T [RP, MP] += kv^T p^T:
    the MMA's M axis is BLOCK_N / R (>= 64: Hopper's wgmma shapes) instead of the head count.
    AHEAD: the block-table entries of the next tile are loaded one iteration early, so no cache
    load waits on a load of its own iteration (Triton's pipeliner can then prefetch tiles)."""
    n = tl.program_id(0)
    sp = tl.program_id(1)
    L = tl.load(len_ptr + n)
    L = tl.minimum(tl.maximum(L, 0), max_blocks * block_size)   # never past the table row
    tiles = tl.cdiv(L, BLOCK_N)
    per = tl.cdiv(tiles, SPLITS)
    start = sp * per * BLOCK_N
    end = tl.minimum(start + per * BLOCK_N, L)

    m = tl.arange(0, MP)
    j = m // H
    mmask = m < M
    last = L - next_n + j                                          # last position row m sees
    qrow = (n * next_n + j).to(tl.int64) * s_qt + (m % H) * s_qh
    r = tl.arange(0, RP)
    rmask = r < R
    d = tl.arange(0, DRP)
    dmask = d < DR
    if KV_MAJOR:   # q^T [RP, MP], [DRP, MP]
        qn = tl.load(q_ptr + qrow[None, :] + r[:, None], mask=mmask[None, :] & rmask[:, None], other=0.0)
        qr = tl.load(q_ptr + qrow[None, :] + R + d[:, None], mask=mmask[None, :] & dmask[:, None], other=0.0)
        acc = tl.zeros([RP, MP], dtype=tl.float32)
    else:
        qn = tl.load(q_ptr + qrow[:, None] + r[None, :], mask=mmask[:, None] & rmask[None, :], other=0.0)
        qr = tl.load(q_ptr + qrow[:, None] + R + d[None, :], mask=mmask[:, None] & dmask[None, :], other=0.0)
        acc = tl.zeros([MP, RP], dtype=tl.float32)
    m_i = tl.full([MP], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([MP], dtype=tl.float32)
    bt_row = bt_ptr + n.to(tl.int64) * s_bt
    t = start + tl.arange(0, BLOCK_N)
    blk_next = tl.load(bt_row + t // block_size, mask=t < end, other=-1)
    for t0 in range(start, end, BLOCK_N):
        t = t0 + tl.arange(0, BLOCK_N)
        tmask = t < end
        if AHEAD:
            blk = blk_next
            tn = t + BLOCK_N
            blk_next = tl.load(bt_row + tn // block_size, mask=tn < end, other=-1)
        else:
            blk = tl.load(bt_row + t // block_size, mask=tmask, other=-1)
        ok = tmask & (blk >= 0) & (blk < num_blocks)
        base = blk.to(tl.int64) * s_cb + (t % block_size).to(tl.int64) * s_ct
        kv = tl.load(kv_ptr + base[:, None] + r[None, :], mask=ok[:, None] & rmask[None, :], other=0.0)   # [BLOCK_N, RP]
        kr = tl.load(kv_ptr + base[:, None] + R + d[None, :], mask=ok[:, None] & dmask[None, :], other=0.0)
        if KV_MAJOR:
            s = _dot(kv, qn, DOT_F32)                                       # [BLOCK_N, MP]
            if DR > 0:
                s += _dot(kr, qr, DOT_F32)
            s = tl.where(ok[:, None] & (t[:, None] <= last[None, :]), s * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 0))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)          # a row that saw nothing yet
            p = tl.exp2(s - m_use[None, :])
            alpha = tl.exp2(m_i - m_use)
            l_i = l_i * alpha + tl.sum(p, 0)
            if not DOT_F32:   # the p kv product in the cache dtype (fp32 accumulator), as flash attention
                p = p.to(kv.dtype)
            acc = acc * alpha[None, :] + _dot(tl.trans(kv), p, DOT_F32)
        else:
            s = _dot(qn, tl.trans(kv), DOT_F32)                             # [MP, BLOCK_N]
            if DR > 0:
                s += _dot(qr, tl.trans(kr), DOT_F32)
            s = tl.where(ok[None, :] & (t[None, :] <= last[:, None]), s * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp2(s - m_use[:, None])
            alpha = tl.exp2(m_i - m_use)
            l_i = l_i * alpha + tl.sum(p, 1)
            if not DOT_F32:
                p = p.to(kv.dtype)
            acc = acc * alpha[:, None] + _dot(p, kv, DOT_F32)
        m_i = m_new

    has = l_i > 0.0
    l_use = tl.where(has, l_i, 1.0)                               # rows that saw nothing: o = 0, lse = -inf
    lse = tl.where(has, (m_i + tl.log2(l_use)) * 0.6931471805599453, float("-inf"))   # natural log
    row = (n * SPLITS + sp).to(tl.int64) * M + m                 # [N, SPLITS, M] (SPLITS 1: the output rows)
    tl.store(lse_ptr + row, lse, mask=mmask)
    if KV_MAJOR:
        o = acc / l_use[None, :]
        optr = o_ptr + row[None, :] * R + r[:, None]
        omask = mmask[None, :] & rmask[:, None]
    else:
        o = acc / l_use[:, None]
        optr = o_ptr + row[:, None] * R + r[None, :]
        omask = mmask[:, None] & rmask[None, :]
    if start < end:   # an empty split leaves its o unwritten; the merge skips it by its lse
        tl.store(optr, o.to(o_ptr.dtype.element_ty), mask=omask)
    elif SPLITS == 1:
        tl.store(optr, (o * 0.0).to(o_ptr.dtype.element_ty), mask=omask)


@triton.jit
def _merge_kernel(op_ptr, lsep_ptr, o_ptr, lse_ptr, M,
                  R: tl.constexpr, SPLITS: tl.constexpr, ROWS: tl.constexpr, BR: tl.constexpr, SB: tl.constexpr):
    """Program (sequence n, block of ROWS query rows, block of BR latent columns): two passes over
    the splits, SB at a time: the max lse per row, then the lse-weighted sum of the partials."""
    n = tl.program_id(0)
    m = tl.program_id(1) * ROWS + tl.arange(0, ROWS)
    mmask = m < M
    first = n.to(tl.int64) * SPLITS * M + m                      # [ROWS] partial rows of split 0
    mx = tl.full([ROWS], float("-inf"), dtype=tl.float32)
    for s0 in range(0, SPLITS, SB):
        ss = s0 + tl.arange(0, SB)
        ls = tl.load(lsep_ptr + first[None, :] + ss[:, None] * M, mask=(ss < SPLITS)[:, None] & mmask[None, :],
                     other=float("-inf"))                       # [SB, ROWS]
        mx = tl.maximum(mx, tl.max(ls, 0))
    mx_use = tl.where(mx == float("-inf"), 0.0, mx)
    r = tl.program_id(2) * BR + tl.arange(0, BR)
    rmask = r < R
    den = tl.zeros([ROWS], dtype=tl.float32)
    acc = tl.zeros([ROWS, BR], dtype=tl.float32)
    for s0 in range(0, SPLITS, SB):
        ss = s0 + tl.arange(0, SB)
        prow = first[None, :] + ss[:, None] * M                  # [SB, ROWS]
        ls = tl.load(lsep_ptr + prow, mask=(ss < SPLITS)[:, None] & mmask[None, :], other=float("-inf"))
        w = tl.exp(ls - mx_use[None, :])                         # 0 for an empty split
        den += tl.sum(w, 0)
        live = (ls > float("-inf"))[:, :, None] & rmask[None, None, :]
        o = tl.load(op_ptr + prow[:, :, None] * R + r[None, None, :], mask=live, other=0.0)   # [SB, ROWS, BR]
        acc += tl.sum(w[:, :, None] * o, 0)
    has = den > 0.0
    den = tl.where(has, den, 1.0)                                # acc is 0 there: o = 0, lse = -inf
    out_row = n.to(tl.int64) * M + m
    tl.store(o_ptr + out_row[:, None] * R + r[None, :], (acc / den[:, None]).to(o_ptr.dtype.element_ty),
             mask=mmask[:, None] & rmask[None, :])
    if tl.program_id(2) == 0:
        tl.store(lse_ptr + out_row, tl.where(has, mx + tl.log(den), float("-inf")), mask=mmask)


def launch(q, cache, block_table, seq_lens, scale, kv_lora_rank, next_n=1, return_lse=False, cfg=None):
    """The kernels, without value checks (the bench and tests call this with their own cfg)."""
    cfg = cfg or config(num_seqs=block_table.shape[0])
    R = kv_lora_rank
    Dr = cache.shape[2] - R
    H = q.shape[1]
    N, max_blocks = block_table.shape
    M = next_n * H
    nb, bs = cache.shape[0], cache.shape[1]
    if q.stride(-1) != 1:
        q = q.contiguous()
    if block_table.stride(1) != 1:
        block_table = block_table.contiguous()
    seq_lens = seq_lens.contiguous()
    o = alloc.empty((q.shape[0], H, R), q.dtype, q.device)
    lse = alloc.empty((q.shape[0], H), torch.float32, q.device)
    if N == 0:
        return (o, lse) if return_lse else o
    splits = cfg.get("splits") or num_splits(N, max_blocks, bs, cfg)
    if splits == 1:
        o_part, lse_part = o, lse
    else:
        o_part = torch.empty((N, splits, M, R), dtype=torch.float32, device=q.device)
        lse_part = torch.empty((N, splits, M), dtype=torch.float32, device=q.device)
    RP, MP = max(16, triton.next_power_of_2(R)), max(16, triton.next_power_of_2(M))
    dot_f32 = interpreting() or cache.dtype == torch.float32
    _partial_kernel[(N, splits)](
        q, cache, block_table, seq_lens, o_part, lse_part,
        q.stride(0), q.stride(1), cache.stride(0), cache.stride(1), block_table.stride(0),
        nb, max_blocks, bs, next_n, H, M, scale * math.log2(math.e),
        R=R, DR=Dr, RP=RP, DRP=max(16, triton.next_power_of_2(max(Dr, 1))), MP=MP, BLOCK_N=cfg["block_n"], SPLITS=splits, DOT_F32=dot_f32,
        KV_MAJOR=cfg["kv_major"], AHEAD=cfg["ahead"],
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    if splits > 1:
        rows = min(cfg["merge_rows"] or MP, MP)
        br = min(cfg["merge_br"] or RP, RP)
        _merge_kernel[(N, triton.cdiv(M, rows), triton.cdiv(R, br))](
            o_part, lse_part, o, lse, M, R=R, SPLITS=splits, ROWS=rows, BR=br,
            SB=min(cfg["merge_sb"], triton.next_power_of_2(splits)), num_warps=4)
    return (o, lse) if return_lse else o


def mla_decode_triton(q, cache, block_table, seq_lens, scale, kv_lora_rank, next_n=1, return_lse=False):
    if q.device.type == "cpu":   # host tensors: the values are free to check (a device never syncs here)
        paged.check_values(OP, cache, block_table, seq_lens, min_len=next_n)
    return launch(q, cache, block_table, seq_lens, scale, kv_lora_rank, next_n, return_lse)
