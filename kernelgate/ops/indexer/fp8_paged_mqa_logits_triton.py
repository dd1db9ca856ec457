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

Key loads (`keys`: default "plain"; CONFIG on NVIDIA takes "tma2": 51.6 vs 63.3 µs plain at
B32 ctx32k on the H200, bench/RESULTS.md). Triton's pipeliner (sm_80+)
turns a tile's key load into cp.async, but the key address depends on a block-table load in
the same iteration (indirection level 1), so num_stages S buys (S - 1) // 2 tiles of lookahead
(one at S 3 in the sm_90 TTGIR, waited with async_wait 0); the scales stay a synchronous load:
- "plain": the loop above.
- "prefetch": tile i + 1's keys and scales are loaded into registers while tile i computes
  (loop-carried values, which the pipeliner leaves alone); any tile size.
- "ahead": the block-table entry is loaded one tile ahead (a loop-carried scalar), so the key
  load depends on no load of its own iteration: the pipeliner gives it S - 1 tiles of
  lookahead (cp.async ring of S - 1 buffers). Carrying more (the entry two tiles ahead, the
  scales one tile ahead) made Triton 3.6 skip pipelining the loop altogether (sm_90 TTGIR).
- "tma": "ahead" with the keys read by TMA from a host-side descriptor over the cache viewed
  as [num_blocks, block_size, 128] uint8, strides (block_size * 132, 128, 1): a tile is the
  box [1, BLOCK_T, 128] at (block, offset, 0); pipelined as cp.async.bulk.tensor + mbarriers.
- "tma2": "tma" with the scales loaded one tile ahead into registers (a loop-carried [BLOCK_T]),
  so no load in the loop is waited on in its own iteration. (Scales through a second TMA
  descriptor are not pipelined by Triton 3.6 -- they feed no dot -- and were issued and waited in
  the same iteration in the sm_90 TTGIR; the register prefetch keeps the key ring intact.)
"ahead" and "tma(2)" need ONE_BLOCK (a tile inside one cache block); elsewhere they run "plain".
"tma(2)" needs sm_90+ and 16-byte aligned strides (block_size % 4 == 0); elsewhere (AMD, XPU,
older NVIDIA) it runs "ahead". The interpreter runs TensorDescriptor loads (Triton 3.9).

Under the interpreter (DOT_F32) fp8 -> bf16 conversion and bf16 tl.dot are not reliable
(Triton 3.9): the upcast operands go through fp32 and an IEEE fp32 dot -- the same exact
products and an fp32 sum -- so CPU tests check every orientation and decode.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ... import alloc, platform, triton_utils
from ...checks import require
from ..common import fp8 as _fp8
from .k_cache import TOKEN_BYTES, cache_blocks

OP_LOGITS = "fp8_paged_mqa_logits"
from ..common.fp8_triton import as_fp8

OPERANDS = {"fp8": 0, "bf16": 1, "f16": 2, "f16bits": 3, "fp8promote": 4}
# Launch choices on NVIDIA GPUs (the lead sets the winners of bench/logits_sweep.py here).
# programs: the grid aims at about this many (sequence, split) programs; min_tiles: at least
# this many tiles per program (q is loaded and upcast once per program). keys "tma2" (H200, 2026-11-29
# session 4, bench/logits_sweep.py): 51.6 / 79.3 / 8.5 us (B32 ctx32k next_n 1 / 2, B1 ctx128k) against
# keys "tma" 52.7 / 84.9 / 8.6.
CONFIG = dict(kq=True, operand="f16", hsum="mask", block_t=64, num_warps=4, num_stages=3,
              programs=1056, min_tiles=4, keys="tma2", maxnreg="auto")
# maxnreg "auto": MAXNREG by the padded next_n. At next_n 1 the kernel takes 114 registers (4 programs of
# 4 warps per SM; ncu: 3.65 warps per scheduler, 46 % issue); capped at 96, 5 programs fit: 51.3 -> 47.5 us
# at B32 ctx32k, 8.5 -> 8.1 at B1 ctx128k (H200, session 4). At next_n 2 (153 registers) any cap spills
# (96: 78.4 -> 96.1 us; 104: 137), so none there; 80 is slower at next_n 1 (62.9) and fails ptxas at 2.
MAXNREG = {1: 96}
# The kernel before the keys x q^T work (fp8 q x K^T): the choice on other GPUs.
QK_FP8 = dict(kq=False, operand="fp8", hsum="reshape", block_t=64, num_warps=4, num_stages=3,
              programs=2048, min_tiles=2)
PORTABLE = dict(CONFIG, operand="f16bits", num_stages=1, programs=64, min_tiles=1)  # interpreter
KEYS = {"plain": 0, "prefetch": 1, "ahead": 2, "tma": 3, "tma2": 4}
OPTIONAL = dict(keys="plain", maxnreg=None)   # launch options with a default, settable in CONFIG too
# (maxnreg: a cap on registers per thread on NVIDIA, for more resident warps; an int, None or "auto")


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
        blk = tl.load(bt_row + t0 // block_size, mask=t0 < ctx, other=0).to(tl.int64)  # prefetch: past ctx
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
def _tile_out(kb, ks, q, w, t, ctx, q_pos, out_q, qmask, max_len, FNUZ: tl.constexpr, NQP: tl.constexpr,
              HP: tl.constexpr, BLOCK_T: tl.constexpr, KQ: tl.constexpr, OPERAND: tl.constexpr,
              DOT_F32: tl.constexpr, HSUM_MASK: tl.constexpr):
    """One tile: codes kb (as _load_tile), scales ks [BLOCK_T] (times kscale) -> logits stored at tokens t."""
    k = _upcast(kb, FNUZ, OPERAND, DOT_F32)
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


@triton.jit
def _logits_kernel(q_ptr, kv_ptr, kvs_ptr, w_ptr, ctx_ptr, bt_ptr, out_ptr, kdesc,
                   H, next_n, max_len, s_bt, s_out, block_size, blk_bytes, blk_words, tiles_per_prog,
                   kscale, FNUZ: tl.constexpr, NQP: tl.constexpr, HP: tl.constexpr, BLOCK_T: tl.constexpr,
                   ONE_BLOCK: tl.constexpr, KQ: tl.constexpr, OPERAND: tl.constexpr,
                   DOT_F32: tl.constexpr, HSUM_MASK: tl.constexpr, KEYS: tl.constexpr):
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
    i = tl.arange(0, BLOCK_T)
    if KEYS == 1:    # registers double-buffered: tile + 1 is loading while tile computes
        kb_n, ks_n = _load_tile(kv_ptr, kvs_ptr, bt_row, start * BLOCK_T, ctx, block_size, blk_bytes, blk_words,
                                BLOCK_T, ONE_BLOCK, KQ)
        for tile in range(start, busy_end):
            kb, ks = kb_n, ks_n
            kb_n, ks_n = _load_tile(kv_ptr, kvs_ptr, bt_row, (tile + 1) * BLOCK_T, ctx, block_size, blk_bytes,
                                    blk_words, BLOCK_T, ONE_BLOCK, KQ)
            _tile_out(kb, ks * kscale, q, w, tile * BLOCK_T + i, ctx, q_pos, out_q, qmask, max_len,
                      FNUZ, NQP, HP, BLOCK_T, KQ, OPERAND, DOT_F32, HSUM_MASK)
    elif KEYS >= 2:  # ONE_BLOCK: the table entry loaded one tile ahead (a loop-carried scalar)
        t0 = start * BLOCK_T
        blk = tl.load(bt_row + t0 // block_size, mask=t0 < ctx, other=0)
        if KEYS == 4:
            ks_n = tl.load(kvs_ptr + blk.to(tl.int64) * blk_words + block_size * 32 + t0 % block_size + i,
                           mask=t0 + i < ctx, other=0.0)
        for tile in range(start, busy_end):
            t0 = tile * BLOCK_T
            blk_n = tl.load(bt_row + (t0 + BLOCK_T) // block_size, mask=t0 + BLOCK_T < ctx, other=0)
            off = t0 % block_size
            if KEYS == 4:    # scales of this tile were loaded last iteration; load the next tile's
                ks = ks_n
                t1 = t0 + BLOCK_T
                ks_n = tl.load(kvs_ptr + blk_n.to(tl.int64) * blk_words + block_size * 32 + t1 % block_size + i,
                               mask=t1 + i < ctx, other=0.0)
            else:
                ks = tl.load(kvs_ptr + blk.to(tl.int64) * blk_words + block_size * 32 + off + i,
                             mask=t0 + i < ctx, other=0.0)
            if KEYS >= 3:    # TMA box [1, BLOCK_T, 128] at (block, offset, 0); tokens past ctx: -inf below
                kb = tl.reshape(kdesc.load([blk, off, 0]), (BLOCK_T, 128))
            else:
                kb = tl.load(kv_ptr + blk.to(tl.int64) * blk_bytes + (off + i)[:, None] * 128 + d[None, :],
                             mask=(t0 + i < ctx)[:, None], other=0)
            if not KQ:
                kb = tl.trans(kb)                                  # [128, BLOCK_T]
            _tile_out(kb, ks * kscale, q, w, t0 + i, ctx, q_pos, out_q, qmask, max_len,
                      FNUZ, NQP, HP, BLOCK_T, KQ, OPERAND, DOT_F32, HSUM_MASK)
            blk = blk_n
    else:
        for tile in range(start, busy_end):
            kb, ks = _load_tile(kv_ptr, kvs_ptr, bt_row, tile * BLOCK_T, ctx, block_size, blk_bytes, blk_words,
                                BLOCK_T, ONE_BLOCK, KQ)
            _tile_out(kb, ks * kscale, q, w, tile * BLOCK_T + i, ctx, q_pos, out_q, qmask, max_len,
                      FNUZ, NQP, HP, BLOCK_T, KQ, OPERAND, DOT_F32, HSUM_MASK)
    for tile in range(busy_end, end):                              # past the context: -inf only
        t = tile * BLOCK_T + tl.arange(0, BLOCK_T)
        tl.store(out_q[:, None] + t[None, :], tl.full((NQP, BLOCK_T), float("-inf"), tl.float32),
                 mask=qmask[:, None] & (t < max_len)[None, :])


def _defaults(device: torch.device, fnuz: bool) -> dict:
    """Launch choices for `device`: PORTABLE under the interpreter, CONFIG on NVIDIA, QK_FP8 elsewhere,
    with the integer fp8 decode ("f16bits") where the device has no conversion for the format:
    no fp8 at all (sm_80, gfx90a, XPU: Triton refuses, or LLVM cannot lower, the casts) or
    e4m3fnuz on NVIDIA."""
    if platform.interpreting():
        return PORTABLE
    nvidia = triton_utils.nvidia(device)
    cfg = CONFIG if nvidia else QK_FP8
    if not triton_utils.fp8_hardware() or (fnuz and nvidia):
        cfg = dict(cfg, operand="f16bits")
    return cfg


def _key_loads(keys: str, kv: torch.Tensor, block_size: int, block_t: int):
    """-> (KEYS code the device can run, TMA descriptor or None); routing as in the docstring."""
    if keys in ("ahead", "tma", "tma2") and block_size % block_t:
        return KEYS["plain"], None          # a tile spans cache blocks: one table entry per token
    if keys in ("tma", "tma2"):
        interp = platform.interpreting()
        hopper = triton_utils.nvidia(kv.device) and triton_utils.sm() >= 90
        if (interp or hopper) and block_size % 4 == 0 and kv.data_ptr() % 16 == 0:
            from triton.tools.tensor_descriptor import TensorDescriptor
            return KEYS[keys], TensorDescriptor(kv, [kv.shape[0], block_size, 128],
                                                [kv.stride(0), 128, 1], [1, block_t, 128])
        return KEYS["ahead"], None
    return KEYS[keys], None


def fp8_paged_mqa_logits_triton(q_fp8, kv_cache, weights, context_lens, block_tables, max_context_len):
    return launch(q_fp8, kv_cache, weights, context_lens, block_tables, max_context_len)


def launch(q_fp8, kv_cache, weights, context_lens, block_tables, max_context_len, **config):
    """The op, with launch choices (keys of CONFIG) overridable for bench/logits_sweep.py."""
    B, next_n, H, D = q_fp8.shape
    require(q_fp8.is_contiguous(), OP_LOGITS, "q_fp8 must be contiguous")
    require(weights.is_contiguous(), OP_LOGITS, "weights must be contiguous")
    require(block_tables.stride(1) == 1, OP_LOGITS, "block_tables must be contiguous along its rows")
    interp = platform.interpreting()
    fnuz = _fp8.DTYPE_FORMAT[q_fp8.dtype] == "e4m3fnuz"
    cfg = {**OPTIONAL, **_defaults(q_fp8.device, fnuz), **config}
    known = set(CONFIG) | set(OPTIONAL)
    require(set(cfg) == known, OP_LOGITS, f"unknown launch options {sorted(set(cfg) - known)}")
    require(cfg["keys"] in KEYS, OP_LOGITS, f"keys must be one of {sorted(KEYS)}, got {cfg['keys']!r}")
    operand = OPERANDS[cfg["operand"]]
    kv = cache_blocks(kv_cache)
    block_size = kv.shape[1] // TOKEN_BYTES
    require(not (fnuz and triton_utils.nvidia(q_fp8.device) and operand != 3), OP_LOGITS,
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
    maxnreg = MAXNREG.get(nqp) if cfg["maxnreg"] == "auto" else cfg["maxnreg"]
    if maxnreg and triton_utils.nvidia(q_fp8.device):
        extra["maxnreg"] = maxnreg
    keys, kdesc = _key_loads(cfg["keys"], kv, block_size, bt)
    _logits_kernel[(B, triton.cdiv(n_tiles, tiles_per_prog))](
        q_fp8.view(torch.uint8), kv, kv.view(torch.float32), weights, context_lens, block_tables, out, kdesc,
        H, next_n, max_context_len, block_tables.stride(0), out.stride(0), block_size, kv.shape[1],
        kv.shape[1] // 4, tiles_per_prog, kscale, FNUZ=fnuz, NQP=nqp, HP=hp, BLOCK_T=bt,
        ONE_BLOCK=block_size % bt == 0, KQ=bool(cfg["kq"]), OPERAND=operand, DOT_F32=interp,
        HSUM_MASK=cfg["hsum"] == "mask", KEYS=keys, **extra)
    return out
