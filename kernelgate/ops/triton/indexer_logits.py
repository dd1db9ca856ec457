"""Triton kernel: DeepSeek indexer logits over the paged fp8 key cache.

Grid (sequence b, context split). A program keeps the next_n * H query rows of its sequence
(fp8, [ROWS, 128], rows padded to a power of two >= 16 for tl.dot) and walks its split in
tiles of BLOCK_T tokens: gather the tile's physical blocks from block_tables, load the keys
transposed ([128, BLOCK_T] fp8, contiguous along the head dim) and their scales, one fp8
tl.dot (fp32 accumulation; exact products), relu, weight per row, sum over heads, times the
key scale. Tiles past the context length only store -inf.

fp8 operands go straight into tl.dot: Triton lowers it to fp8 MMA on sm89+ / MI300 and
upcasts elsewhere, and the interpreter computes it exactly (its fp8 -> bf16 conversion and
bf16 dot are not reliable in Triton 3.9, so the kernel avoids them).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ... import alloc
from ...checks import require
from ...triton_utils import autotune_or_fixed
from .. import _fp8
from ..fp8_paged_mqa import OP_LOGITS, TOKEN_BYTES, cache_blocks
from .indexer_fp8 import as_fp8

BLOCK_T = 64            # tokens per tile under the interpreter; autotuned on GPUs
SPLIT_UNIT = 128        # a program's context split is a multiple of every BLOCK_T tried
TARGET_PROGRAMS = 2048


@triton.jit
def _logits_tile(q, w, kv_ptr, kvs_ptr, bt_row, t, ctx, block_size, blk_bytes,
                 FNUZ: tl.constexpr, NQP: tl.constexpr, HP: tl.constexpr, BLOCK_T: tl.constexpr):
    """[NQP, BLOCK_T] weighted relu scores of one tile of tokens `t` (no masking)."""
    tvalid = t < ctx
    blk = tl.load(bt_row + t // block_size, mask=tvalid, other=0).to(tl.int64)
    off = t % block_size
    d = tl.arange(0, 128)
    kb = tl.load(kv_ptr + (blk * blk_bytes + off * 128)[None, :] + d[:, None], mask=tvalid[None, :], other=0)
    ks = tl.load(kvs_ptr + blk * (blk_bytes // 4) + block_size * 32 + off, mask=tvalid, other=0.0)
    s = tl.dot(q, as_fp8(kb, FNUZ))                                # [ROWS, BLOCK_T] fp32
    s = tl.maximum(s, 0.0) * w[:, None]
    if NQP == 1:
        acc = tl.sum(s, 0)[None, :]
    else:
        acc = tl.sum(tl.reshape(s, (NQP, HP, BLOCK_T)), 1)
    return acc * ks[None, :]


@autotune_or_fixed(
    [triton.Config({"BLOCK_T": t}, num_warps=w, num_stages=s)
     for t in (64, 128) for w in (4, 8) for s in (2, 3, 4)],
    key=["H", "next_n", "block_size"], fixed={"BLOCK_T": BLOCK_T})
@triton.jit
def _logits_kernel(q_ptr, kv_ptr, kvs_ptr, w_ptr, ctx_ptr, bt_ptr, out_ptr,
                   H, next_n, max_len, s_bt, s_out, block_size, blk_bytes, split_tokens,
                   FNUZ: tl.constexpr, NQP: tl.constexpr, HP: tl.constexpr, BLOCK_T: tl.constexpr):
    b = tl.program_id(0)
    ctx = tl.load(ctx_ptr + b)
    rows = tl.arange(0, NQP * HP)                                  # row = query i * HP + head h
    qi = rows // HP
    h = rows % HP
    rmask = (qi < next_n) & (h < H)
    qrow = (b * next_n + qi) * H + h
    d = tl.arange(0, 128)
    q = tl.load(q_ptr + qrow.to(tl.int64)[:, None] * 128 + d[None, :], mask=rmask[:, None], other=0)
    q = as_fp8(q, FNUZ)
    w = tl.load(w_ptr + qrow, mask=rmask, other=0.0)
    bt_row = bt_ptr + b.to(tl.int64) * s_bt
    qn = tl.arange(0, NQP)
    q_pos = ctx - next_n + qn                                      # query i is token ctx - next_n + i
    out_row = out_ptr + (b.to(tl.int64) * next_n + qn)[:, None] * s_out
    omask_q = (qn < next_n)[:, None]

    n_tiles = tl.cdiv(max_len, BLOCK_T)
    tiles_per_prog = split_tokens // BLOCK_T
    start = tl.program_id(1) * tiles_per_prog
    end = tl.minimum(start + tiles_per_prog, n_tiles)
    busy_end = tl.maximum(tl.minimum(end, tl.cdiv(ctx, BLOCK_T)), start)
    for tile in range(start, busy_end):
        t = tile * BLOCK_T + tl.arange(0, BLOCK_T)
        acc = _logits_tile(q, w, kv_ptr, kvs_ptr, bt_row, t, ctx, block_size, blk_bytes,
                           FNUZ, NQP, HP, BLOCK_T)
        valid = (t < ctx)[None, :] & (t[None, :] <= q_pos[:, None])
        tl.store(out_row + t[None, :], tl.where(valid, acc, float("-inf")), mask=omask_q & (t < max_len)[None, :])
    for tile in range(busy_end, end):                              # past the context: -inf only
        t = tile * BLOCK_T + tl.arange(0, BLOCK_T)
        tl.store(out_row + t[None, :], tl.full((NQP, BLOCK_T), float("-inf"), tl.float32),
                 mask=omask_q & (t < max_len)[None, :])


def fp8_paged_mqa_logits_triton(q_fp8, kv_cache, weights, context_lens, block_tables, max_context_len):
    B, next_n, H, D = q_fp8.shape
    require(q_fp8.is_contiguous(), OP_LOGITS, "q_fp8 must be contiguous")
    require(weights.is_contiguous(), OP_LOGITS, "weights must be contiguous")
    require(block_tables.stride(1) == 1, OP_LOGITS, "block_tables must be contiguous along its rows")
    kv = cache_blocks(kv_cache)
    block_size = kv.shape[1] // TOKEN_BYTES
    fnuz = _fp8.DTYPE_FORMAT[q_fp8.dtype] == "e4m3fnuz"
    out = alloc.empty((B * next_n, max_context_len), torch.float32, q_fp8.device)
    if B == 0:
        return out
    nqp = triton.next_power_of_2(next_n)
    hp = max(triton.next_power_of_2(H), triton.cdiv(16, nqp))     # tl.dot needs >= 16 rows
    units = triton.cdiv(max_context_len, SPLIT_UNIT)
    split_tokens = SPLIT_UNIT * max(1, min(32, triton.cdiv(B * units, TARGET_PROGRAMS)))
    grid = (B, triton.cdiv(max_context_len, split_tokens))
    _logits_kernel[grid](
        q_fp8.view(torch.uint8), kv, kv.view(torch.float32), weights, context_lens, block_tables, out,
        H, next_n, max_context_len, block_tables.stride(0), out.stride(0), block_size, kv.shape[1],
        split_tokens, FNUZ=fnuz, NQP=nqp, HP=hp)
    return out
