"""Triton kernel: DeepSeek indexer logits over the paged fp8 key cache.

Grid (sequence b, context split). A program keeps the next_n * H query rows of its sequence
(fp8, [ROWS, 128], rows padded to a power of two >= 16 for tl.dot) and walks its split in
tiles of BLOCK_T tokens: gather the tile's keys ([BLOCK_T, 128] fp8, the cache's own
row-major layout, K-major as fp8 MMA wants) and their scales, one fp8 tl.dot keys x q^T
(fp32 accumulation; exact products) -> [BLOCK_T, ROWS], relu, weight per column, sum over
heads, times the key scale. Tokens on the MMA's M side keep the head sum inside a warp (no
cross-warp reduction per tile) and let BLOCK_T grow with the warps. Tiles past the context
length only store -inf.

When BLOCK_T divides block_size (ONE_BLOCK), a tile lies in one cache block: one block-table
load per tile, and keys and scales are contiguous runs (vector loads); otherwise each token
finds its block.

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
from .. import _fp8
from ..fp8_paged_mqa import OP_LOGITS, TOKEN_BYTES, cache_blocks
from .indexer_fp8 import as_fp8

# Launch choices (the lead sets the winners of bench/indexer_sweep.py here). `programs`: the
# grid aims at about this many (sequence, split) programs; a split is a whole number of tiles.
CONFIG = dict(block_t=64, num_warps=4, num_stages=3, programs=1056)
SMALL_BATCH = dict(programs=264)          # overrides when B * tiles is small (B=1 long context)
PORTABLE = dict(block_t=64, num_warps=4, num_stages=1, programs=2048)  # interpreter / others


@triton.jit
def _logits_tile(q, w, kv_ptr, kvs_ptr, bt_row, t0, ctx, block_size, blk_bytes, blk_words,
                 FNUZ: tl.constexpr, NQP: tl.constexpr, HP: tl.constexpr, BLOCK_T: tl.constexpr,
                 ONE_BLOCK: tl.constexpr):
    """[BLOCK_T, NQP] weighted relu scores of the tile of tokens t0 + [0, BLOCK_T) (no masking)."""
    t = t0 + tl.arange(0, BLOCK_T)
    tvalid = t < ctx
    d = tl.arange(0, 128)
    if ONE_BLOCK:
        blk = tl.load(bt_row + t0 // block_size).to(tl.int64)
        off = t0 % block_size + tl.arange(0, BLOCK_T)
        kb = tl.load(kv_ptr + blk * blk_bytes + off[:, None] * 128 + d[None, :], mask=tvalid[:, None], other=0)
        ks = tl.load(kvs_ptr + blk * blk_words + block_size * 32 + off, mask=tvalid, other=0.0)
    else:
        blk = tl.load(bt_row + t // block_size, mask=tvalid, other=0).to(tl.int64)
        off = t % block_size
        kb = tl.load(kv_ptr + (blk * blk_bytes + off * 128)[:, None] + d[None, :], mask=tvalid[:, None], other=0)
        ks = tl.load(kvs_ptr + blk * blk_words + block_size * 32 + off, mask=tvalid, other=0.0)
    s = tl.dot(as_fp8(kb, FNUZ), tl.trans(q))                      # [BLOCK_T, ROWS] fp32
    s = tl.maximum(s, 0.0) * w[None, :]
    if NQP == 1:
        acc = tl.sum(s, 1)[:, None]
    else:
        acc = tl.sum(tl.reshape(s, (BLOCK_T, NQP, HP)), 2)
    return acc * ks[:, None]


@triton.jit
def _logits_kernel(q_ptr, kv_ptr, kvs_ptr, w_ptr, ctx_ptr, bt_ptr, out_ptr,
                   H, next_n, max_len, s_bt, s_out, block_size, blk_bytes, blk_words, tiles_per_prog,
                   FNUZ: tl.constexpr, NQP: tl.constexpr, HP: tl.constexpr, BLOCK_T: tl.constexpr,
                   ONE_BLOCK: tl.constexpr):
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
    out_row = out_ptr + (b.to(tl.int64) * next_n + qn)[None, :] * s_out   # [1, NQP]
    omask_q = (qn < next_n)[None, :]

    n_tiles = tl.cdiv(max_len, BLOCK_T)
    start = tl.program_id(1) * tiles_per_prog
    end = tl.minimum(start + tiles_per_prog, n_tiles)
    busy_end = tl.maximum(tl.minimum(end, tl.cdiv(ctx, BLOCK_T)), start)
    for tile in range(start, busy_end):
        t = tile * BLOCK_T + tl.arange(0, BLOCK_T)
        acc = _logits_tile(q, w, kv_ptr, kvs_ptr, bt_row, tile * BLOCK_T, ctx, block_size, blk_bytes, blk_words,
                           FNUZ, NQP, HP, BLOCK_T, ONE_BLOCK)
        valid = (t < ctx)[:, None] & (t[:, None] <= q_pos[None, :])
        tl.store(out_row + t[:, None], tl.where(valid, acc, float("-inf")), mask=omask_q & (t < max_len)[:, None])
    for tile in range(busy_end, end):                              # past the context: -inf only
        t = tile * BLOCK_T + tl.arange(0, BLOCK_T)
        tl.store(out_row + t[:, None], tl.full((BLOCK_T, NQP), float("-inf"), tl.float32),
                 mask=omask_q & (t < max_len)[:, None])


def fp8_paged_mqa_logits_triton(q_fp8, kv_cache, weights, context_lens, block_tables, max_context_len):
    return launch(q_fp8, kv_cache, weights, context_lens, block_tables, max_context_len)


def launch(q_fp8, kv_cache, weights, context_lens, block_tables, max_context_len, **config):
    """The op, with launch choices (keys of CONFIG) overridable for bench/indexer_sweep.py."""
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
    gpu = q_fp8.device.type != "cpu"
    cfg = dict(CONFIG if gpu else PORTABLE)
    bt = config.get("block_t", cfg["block_t"])
    n_tiles = triton.cdiv(max_context_len, bt)
    if gpu and B * n_tiles < 4 * CONFIG["programs"]:
        cfg.update(SMALL_BATCH)
    cfg.update(config)
    nqp = triton.next_power_of_2(next_n)
    hp = max(triton.next_power_of_2(H), triton.cdiv(16, nqp))     # tl.dot needs >= 16 rows
    tiles_per_prog = max(1, triton.cdiv(B * n_tiles, cfg["programs"]))
    grid = (B, triton.cdiv(n_tiles, tiles_per_prog))
    _logits_kernel[grid](
        q_fp8.view(torch.uint8), kv, kv.view(torch.float32), weights, context_lens, block_tables, out,
        H, next_n, max_context_len, block_tables.stride(0), out.stride(0), block_size, kv.shape[1],
        kv.shape[1] // 4, tiles_per_prog, FNUZ=fnuz, NQP=nqp, HP=hp, BLOCK_T=bt,
        ONE_BLOCK=block_size % bt == 0, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return out
