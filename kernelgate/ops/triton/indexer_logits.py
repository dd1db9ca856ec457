"""Triton kernel: DeepSeek indexer logits over the paged fp8 key cache.

Grid (sequence b, context split). A program keeps the ROWS = next_n * H query rows of its
sequence (rows padded to NQP * HP, a power of two >= 16 for tl.dot) and walks its split in
tiles of BLOCK_T tokens: gather the tile's keys and scales, one tl.dot of keys and queries,
relu, weight per row, sum over heads per query, times the key scale, masks, store. Tiles past
the context length only store -inf. Two orientations (`kq`):

- q x K^T (kq=False): acc [ROWS, BLOCK_T], heads on the MMA's M axis, so the head sum
  reduces across warps every tile (measured epilogue-bound on the H200: time doubles with
  next_n).
- K x q^T (kq=True): acc [BLOCK_T, ROWS], heads on the N axis, the head sum mostly within a
  thread; the key tile is [BLOCK_T, 128] row-major (128 contiguous bytes per token) and is
  the MMA's A operand, upcast in registers.

Operands (`operand`): "fp8" feeds the codes to tl.dot (fp8 MMA on sm89+; Hopper's fp8 MMA
accumulates with too few bits for the 2e-4 bound: 2.3e-4 typical, 4e-3 on a one-token
context). "bf16" / "f16" upcast with Triton's conversion: every e4m3 / e4m3fnuz value is
exact in both, products are exact and the MMA accumulates in fp32. "f16bits" decodes the
byte with integer ops -- sign << 15 | magnitude << 7 is the fp16 whose value is the code's
times 2^-(15 - bias), subnormals included -- and folds the power of two into the key scale;
it needs no fp8 conversion instruction (so it also decodes e4m3fnuz on NVIDIA).
"fp8promote" keeps fp8 MMA but passes max_num_imprecise_acc=32: on sm90 Triton's default
(2^30) never promotes the tensor core's reduced-precision partial sums; 32 promotes them to
fp32 after every 32 products, as DeepGEMM does.

Under the interpreter (DOT_F32) fp8 -> bf16 conversion and bf16 tl.dot are not reliable
(Triton 3.9): the upcast operands go through fp32 and an IEEE fp32 dot -- the same exact
products and an fp32 sum -- so CPU tests check every orientation and decode.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ... import alloc, platform
from ...checks import require
from .. import _fp8
from ..fp8_paged_mqa import OP_LOGITS, TOKEN_BYTES, cache_blocks
from .indexer_fp8 import as_fp8

OPERANDS = {"fp8": 0, "bf16": 1, "f16": 2, "f16bits": 3, "fp8promote": 4}
# Launch choices on NVIDIA GPUs (the lead sets the winners of bench/logits_sweep.py here).
# programs: the grid aims at about this many (sequence, split) programs; min_tiles: at least
# this many tiles per program (q is loaded and upcast once per program).
CONFIG = dict(kq=True, operand="f16", hsum="mask", block_t=64, num_warps=4, num_stages=3,
              programs=1056, min_tiles=4)
# The kernel before the keys x q^T work (fp8 q x K^T): the choice on other GPUs.
QK_FP8 = dict(kq=False, operand="fp8", hsum="reshape", block_t=64, num_warps=4, num_stages=3,
              programs=2048, min_tiles=2)
PORTABLE = dict(CONFIG, operand="f16bits", num_stages=1, programs=64, min_tiles=1)  # interpreter


@triton.jit
def _upcast(byte, FNUZ: tl.constexpr, OPERAND: tl.constexpr, DOT_F32: tl.constexpr):
    """uint8 codes -> tl.dot operand (f16bits: value * 2^-(15 - bias), see the docstring)."""
    if OPERAND == 3:
        u = byte.to(tl.uint16)
        x = (((u & 0x80) << 8) | ((u & 0x7F) << 7)).to(tl.float16, bitcast=True)
        if DOT_F32:
            x = x.to(tl.float32)
    elif DOT_F32:
        x = as_fp8(byte, FNUZ).to(tl.float32)
    elif OPERAND == 0 or OPERAND == 4:
        x = as_fp8(byte, FNUZ)
    elif OPERAND == 1:
        x = as_fp8(byte, FNUZ).to(tl.bfloat16)
    else:
        x = as_fp8(byte, FNUZ).to(tl.float16)
    return x


@triton.jit
def _dot(a, b, DOT_F32: tl.constexpr, OPERAND: tl.constexpr):
    if DOT_F32:
        acc = tl.dot(a, b, input_precision="ieee")
    elif OPERAND == 4:   # fp8 MMA, partial sums promoted to fp32 every 32 products along K (sm90)
        acc = tl.dot(a, b, max_num_imprecise_acc=32)
    else:
        acc = tl.dot(a, b)
    return acc


@triton.jit
def _head_sum(s, NQP: tl.constexpr, HP: tl.constexpr, BLOCK_T: tl.constexpr, HSUM_MASK: tl.constexpr):
    """s [BLOCK_T, NQP * HP] (column = query i * HP + head) -> [BLOCK_T, NQP]."""
    if NQP == 1:
        acc = tl.sum(s, 1)[:, None]
    elif HSUM_MASK:  # NQP full-width sums, no reshape (which may convert layouts through SMEM)
        col = tl.arange(0, NQP * HP)[None, :] // HP
        qn = tl.arange(0, NQP)[None, :]
        acc = tl.zeros((BLOCK_T, NQP), tl.float32)
        for i in tl.static_range(NQP):
            acc = tl.where(qn == i, tl.sum(tl.where(col == i, s, 0.0), 1)[:, None], acc)
    else:
        acc = tl.sum(tl.reshape(s, (BLOCK_T, NQP, HP)), 2)
    return acc


@triton.jit
def _load_tile(kv_ptr, kvs_ptr, bt_row, t0, ctx, block_size, blk_bytes, blk_words,
               BLOCK_T: tl.constexpr, ONE_BLOCK: tl.constexpr, KQ: tl.constexpr):
    """Codes of tokens t0 + [0, BLOCK_T): [BLOCK_T, 128] (KQ) or [128, BLOCK_T] uint8, and scales [BLOCK_T]."""
    t = t0 + tl.arange(0, BLOCK_T)
    tvalid = t < ctx
    d = tl.arange(0, 128)
    if ONE_BLOCK:   # the tile lies in one cache block: one table load, contiguous runs
        blk = tl.load(bt_row + t0 // block_size).to(tl.int64)
        off = t0 % block_size + tl.arange(0, BLOCK_T)
        base = blk * blk_bytes + off * 128
        ks = tl.load(kvs_ptr + blk * blk_words + block_size * 32 + off, mask=tvalid, other=0.0)
    else:
        blk = tl.load(bt_row + t // block_size, mask=tvalid, other=0).to(tl.int64)
        off = t % block_size
        base = blk * blk_bytes + off * 128
        ks = tl.load(kvs_ptr + blk * blk_words + block_size * 32 + off, mask=tvalid, other=0.0)
    if KQ:
        kb = tl.load(kv_ptr + base[:, None] + d[None, :], mask=tvalid[:, None], other=0)
    else:
        kb = tl.load(kv_ptr + base[None, :] + d[:, None], mask=tvalid[None, :], other=0)
    return kb, ks


@triton.jit
def _logits_kernel(q_ptr, kv_ptr, kvs_ptr, w_ptr, ctx_ptr, bt_ptr, out_ptr,
                   H, next_n, max_len, s_bt, s_out, block_size, blk_bytes, blk_words, tiles_per_prog,
                   kscale, FNUZ: tl.constexpr, NQP: tl.constexpr, HP: tl.constexpr, BLOCK_T: tl.constexpr,
                   ONE_BLOCK: tl.constexpr, KQ: tl.constexpr, OPERAND: tl.constexpr,
                   DOT_F32: tl.constexpr, HSUM_MASK: tl.constexpr):
    b = tl.program_id(0)
    ctx = tl.load(ctx_ptr + b)
    rows = tl.arange(0, NQP * HP)                                  # row = query i * HP + head h
    qi = rows // HP
    h = rows % HP
    rmask = (qi < next_n) & (h < H)
    qrow = ((b * next_n + qi) * H + h).to(tl.int64)
    d = tl.arange(0, 128)
    if KQ:   # q^T [128, ROWS], loaded and upcast once per program
        q = _upcast(tl.load(q_ptr + qrow[None, :] * 128 + d[:, None], mask=rmask[None, :], other=0),
                    FNUZ, OPERAND, DOT_F32)
    else:    # q [ROWS, 128]
        q = _upcast(tl.load(q_ptr + qrow[:, None] * 128 + d[None, :], mask=rmask[:, None], other=0),
                    FNUZ, OPERAND, DOT_F32)
    w = tl.load(w_ptr + qrow, mask=rmask, other=0.0)
    bt_row = bt_ptr + b.to(tl.int64) * s_bt
    qn = tl.arange(0, NQP)
    q_pos = ctx - next_n + qn                                      # query i is token ctx - next_n + i
    out_q = out_ptr + (b.to(tl.int64) * next_n + qn) * s_out       # [NQP] row pointers
    qmask = qn < next_n

    n_tiles = tl.cdiv(max_len, BLOCK_T)
    start = tl.program_id(1) * tiles_per_prog
    end = tl.minimum(start + tiles_per_prog, n_tiles)
    busy_end = tl.maximum(tl.minimum(end, tl.cdiv(ctx, BLOCK_T)), start)
    for tile in range(start, busy_end):
        t = tile * BLOCK_T + tl.arange(0, BLOCK_T)
        kb, ks = _load_tile(kv_ptr, kvs_ptr, bt_row, tile * BLOCK_T, ctx, block_size, blk_bytes, blk_words,
                            BLOCK_T, ONE_BLOCK, KQ)
        k = _upcast(kb, FNUZ, OPERAND, DOT_F32)
        ks = ks * kscale                                           # 1, or the f16bits decode's 2^(30 - 2 bias)
        if KQ:
            s = _dot(k, q, DOT_F32, OPERAND)                                # [BLOCK_T, ROWS] fp32
            s = tl.maximum(s, 0.0) * w[None, :]
            acc = _head_sum(s, NQP, HP, BLOCK_T, HSUM_MASK) * ks[:, None]     # [BLOCK_T, NQP]
            valid = (t < ctx)[:, None] & (t[:, None] <= q_pos[None, :])
            tl.store(out_q[None, :] + t[:, None], tl.where(valid, acc, float("-inf")),
                     mask=qmask[None, :] & (t < max_len)[:, None])
        else:
            s = _dot(q, k, DOT_F32, OPERAND)                                # [ROWS, BLOCK_T] fp32
            s = tl.maximum(s, 0.0) * w[:, None]
            if NQP == 1:
                acc = tl.sum(s, 0)[None, :]
            else:
                acc = tl.sum(tl.reshape(s, (NQP, HP, BLOCK_T)), 1)
            acc = acc * ks[None, :]                                # [NQP, BLOCK_T]
            valid = (t < ctx)[None, :] & (t[None, :] <= q_pos[:, None])
            tl.store(out_q[:, None] + t[None, :], tl.where(valid, acc, float("-inf")),
                     mask=qmask[:, None] & (t < max_len)[None, :])
    for tile in range(busy_end, end):                              # past the context: -inf only
        t = tile * BLOCK_T + tl.arange(0, BLOCK_T)
        tl.store(out_q[:, None] + t[None, :], tl.full((NQP, BLOCK_T), float("-inf"), tl.float32),
                 mask=qmask[:, None] & (t < max_len)[None, :])


def _nvidia(device: torch.device) -> bool:
    return device.type == "cuda" and torch.version.hip is None and not platform.interpreting()


def fp8_paged_mqa_logits_triton(q_fp8, kv_cache, weights, context_lens, block_tables, max_context_len):
    return launch(q_fp8, kv_cache, weights, context_lens, block_tables, max_context_len)


def launch(q_fp8, kv_cache, weights, context_lens, block_tables, max_context_len, **config):
    """The op, with launch choices (keys of CONFIG) overridable for bench/logits_sweep.py."""
    B, next_n, H, D = q_fp8.shape
    require(q_fp8.is_contiguous(), OP_LOGITS, "q_fp8 must be contiguous")
    require(weights.is_contiguous(), OP_LOGITS, "weights must be contiguous")
    require(block_tables.stride(1) == 1, OP_LOGITS, "block_tables must be contiguous along its rows")
    interp = platform.interpreting()
    cfg = {**(PORTABLE if interp else CONFIG if _nvidia(q_fp8.device) else QK_FP8), **config}
    require(set(cfg) == set(CONFIG), OP_LOGITS, f"unknown launch options {sorted(set(cfg) - set(CONFIG))}")
    operand = OPERANDS[cfg["operand"]]
    kv = cache_blocks(kv_cache)
    block_size = kv.shape[1] // TOKEN_BYTES
    fnuz = _fp8.DTYPE_FORMAT[q_fp8.dtype] == "e4m3fnuz"
    require(not (fnuz and _nvidia(q_fp8.device) and operand != 3), OP_LOGITS,
            f"operand {cfg['operand']!r}: NVIDIA GPUs have no e4m3fnuz conversion (use 'f16bits')")
    out = alloc.empty((B * next_n, max_context_len), torch.float32, q_fp8.device)
    if B == 0:
        return out
    bt = cfg["block_t"]
    n_tiles = triton.cdiv(max_context_len, bt)
    tiles_per_prog = max(cfg["min_tiles"], triton.cdiv(B * n_tiles, cfg["programs"]))
    nqp = triton.next_power_of_2(next_n)
    hp = max(triton.next_power_of_2(H), triton.cdiv(16, nqp))     # tl.dot needs >= 16 rows
    # f16bits: q and k decoded as value * 2^-(15 - bias) each (bias 7 for e4m3fn, 8 for fnuz)
    kscale = float(2 ** (2 * (15 - (8 if fnuz else 7)))) if operand == 3 else 1.0
    extra = {} if interp else dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    _logits_kernel[(B, triton.cdiv(n_tiles, tiles_per_prog))](
        q_fp8.view(torch.uint8), kv, kv.view(torch.float32), weights, context_lens, block_tables, out,
        H, next_n, max_context_len, block_tables.stride(0), out.stride(0), block_size, kv.shape[1],
        kv.shape[1] // 4, tiles_per_prog, kscale, FNUZ=fnuz, NQP=nqp, HP=hp, BLOCK_T=bt,
        ONE_BLOCK=block_size % bt == 0, KQ=bool(cfg["kq"]), OPERAND=operand, DOT_F32=interp,
        HSUM_MASK=cfg["hsum"] == "mask", **extra)
    return out
