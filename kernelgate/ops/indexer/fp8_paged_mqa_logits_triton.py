"""Triton kernels: DeepSeek indexer logits over the paged fp8 key cache.

Grid (sequence b, context split). A program keeps the ROWS = next_n * H query rows of its
sequence (rows padded to NQP * HP, a power of two >= 16 for tl.dot), loaded and upcast once, and
walks its split in tiles of BLOCK_T tokens: gather the tile's keys and scales, one tl.dot of keys
and queries, relu, weight per row, sum over heads per query, times the key scale, masks, store.
Tiles past the context length only store -inf. Two forms (two implementations):

- keys x q^T (`triton_kq`, NVIDIA): acc [BLOCK_T, ROWS], heads on the MMA's N axis so the head sum
  stays mostly within a thread (a full-width masked sum per query: no reshape through shared
  memory). The key tile [BLOCK_T, 128] (128 contiguous bytes per token) is the MMA's A operand.
  Key loads ("keys"): when a tile lies in one cache block, the block-table entry is loaded one tile
  ahead ("ahead"), so the key load depends on no load of its own iteration and Triton's pipeliner
  gives it num_stages - 1 tiles of lookahead; on sm_90+ the keys come by TMA from a descriptor over
  the cache viewed as [num_blocks, block_size, 128] uint8 (box [1, BLOCK_T, 128]) and the scales are
  loaded one tile ahead into registers ("tma"), so nothing in the loop waits on its own iteration.
  A tile spanning cache blocks loads one table entry per token ("plain").
- q x K^T (`triton`, portable): acc [ROWS, BLOCK_T], heads on the M axis (the head sum reduces
  across warps every tile), plain key loads: the form every Triton backend compiles.

Operands: "fp8" feeds the codes to tl.dot (fp8 MMA; on ROCm only: Hopper's fp8 MMA accumulates with
too few bits for the op's 2e-4 bound). "f16" upcasts with Triton's conversion: every e4m3 / e4m3fnuz
value is exact in fp16, products are exact and the MMA accumulates in fp32. "f16bits" decodes the
byte with integer ops -- sign << 15 | magnitude << 7 is the fp16 whose value is the code's times
2^-(15 - bias), subnormals included -- and folds the power of two into the key scale: it needs no fp8
conversion instruction (sm_80, gfx90a, XPU; e4m3fnuz on NVIDIA). Under the interpreter (DOT_F32)
fp8 -> bf16 conversion and bf16 tl.dot are not reliable: operands go through fp32 and an IEEE fp32
dot -- the same exact products and an fp32 sum.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ... import alloc, platform
from ...checks import require
from ..common import fp8 as _fp8
from ..common.fp8_triton import as_fp8
from .k_cache import TOKEN_BYTES, cache_blocks

OP_LOGITS = "fp8_paged_mqa_logits"
OPERANDS = {"fp8": 0, "f16": 2, "f16bits": 3}
KEYS = {"plain": 0, "ahead": 1, "tma": 2}
# maxnreg by padded next_n (keys x q^T on NVIDIA): uncapped, four programs of the next_n 1 kernel fit
# an SM; capped at 96 registers, five fit and the fifth hides more of the key loads' latency. At
# next_n 2 any cap spills: no cap.
MAXNREG = {1: 96}


def _sm(plat) -> int:
    """NVIDIA compute capability as 80, 90, ...; 0 for other ISAs (gfx..., none)."""
    cap = plat.capability or ""
    return int(cap[3:]) if cap.startswith("sm_") else 0


def launch_config_kq(plat: platform.Platform, fnuz: bool = False, block_size: int | None = None) -> dict:
    """Launch choices of the keys x q^T kernel on `plat` (block_size: the cache's, if known, which
    decides whether tiles lie in one block). Compiled NVIDIA: fp16 upcast where the device converts
    the format, else the integer decode; TMA keys on sm_90+, else the table entry ahead; a register cap.
    (ISA-level choices -- fp8 conversion, TMA, register caps -- follow the capability, so a platform
    simulated on another vendor's GPU still compiles.)"""
    interp = plat.triton_mode != "compiled"
    nvidia = plat.name == "cuda" and not interp
    exact_cast = platform.fp8_hardware(plat.capability) and not (fnuz and _sm(plat))
    cfg = dict(form="kq", block_t=64, num_warps=4, num_stages=3, programs=1056, min_tiles=4,
               operand="f16" if exact_cast and not interp else "f16bits",
               keys="tma" if interp or (nvidia and _sm(plat) >= 90) else "ahead",
               maxnreg="auto" if nvidia and _sm(plat) else None)
    if interp:   # a few programs of one tile each: small grids stay cheap to interpret
        cfg.update(num_stages=1, programs=64, min_tiles=1)
    return _route_keys(cfg, block_size)


def _route_keys(cfg: dict, block_size: int | None) -> dict:
    """"ahead" / "tma" need a tile inside one cache block; else "plain" (one table entry per token)."""
    if block_size is not None and cfg["keys"] != "plain" and block_size % cfg["block_t"]:
        cfg = dict(cfg, keys="plain")
    return cfg


def launch_config(plat: platform.Platform, fnuz: bool = False, block_size: int | None = None) -> dict:
    """Launch choices of the portable q x K^T kernel on `plat`: fp8 MMA on ROCm GPUs with fp8
    hardware, exact fp16 upcast on other fp8 GPUs (NVIDIA: e4m3fn only), the integer decode elsewhere."""
    interp = plat.triton_mode != "compiled"
    fp8_hw = platform.fp8_hardware(plat.capability) and not interp
    if fp8_hw and plat.name == "rocm" and not _sm(plat):
        operand = "fp8"
    elif fp8_hw and not (fnuz and _sm(plat)):
        operand = "f16"
    else:
        operand = "f16bits"
    cfg = dict(form="qk", block_t=64, num_warps=4, num_stages=3, programs=2048, min_tiles=2,
               operand=operand, keys="plain", maxnreg=None)
    if interp:
        cfg.update(num_stages=1, programs=64, min_tiles=1)
    return cfg


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
    elif OPERAND == 0:
        x = as_fp8(byte, FNUZ)
    else:
        x = as_fp8(byte, FNUZ).to(tl.float16)
    return x


@triton.jit
def _dot(a, b, DOT_F32: tl.constexpr):
    if DOT_F32:
        acc = tl.dot(a, b, input_precision="ieee")
    else:
        acc = tl.dot(a, b)
    return acc


@triton.jit
def _head_sum(s, NQP: tl.constexpr, HP: tl.constexpr, BLOCK_T: tl.constexpr):
    """s [BLOCK_T, NQP * HP] (column = query i * HP + head) -> [BLOCK_T, NQP], NQP full-width sums."""
    if NQP == 1:
        acc = tl.sum(s, 1)[:, None]
    else:
        col = tl.arange(0, NQP * HP)[None, :] // HP
        qn = tl.arange(0, NQP)[None, :]
        acc = tl.zeros((BLOCK_T, NQP), tl.float32)
        for i in tl.static_range(NQP):
            acc = tl.where(qn == i, tl.sum(tl.where(col == i, s, 0.0), 1)[:, None], acc)
    return acc


@triton.jit
def _in_cache(blk, n_blocks, BLOCK_T: tl.constexpr):
    """[BLOCK_T] mask: the block id (scalar or per token) lies inside the cache. A vector, since a
    scalar term in a load mask breaks the interpreter."""
    b = tl.zeros([BLOCK_T], tl.int64) + blk.to(tl.int64)
    return (b >= 0) & (b < n_blocks)


@triton.jit
def _load_tile(kv_ptr, kvs_ptr, bt_row, s_btc, n_blocks, t0, ctx, block_size, blk_bytes, blk_words,
               BLOCK_T: tl.constexpr, ONE_BLOCK: tl.constexpr, KQ: tl.constexpr):
    """Codes of tokens t0 + [0, BLOCK_T): [BLOCK_T, 128] (KQ) or [128, BLOCK_T] uint8, scales [BLOCK_T],
    and which tokens have a block inside the cache (the others are -inf, nothing read for them)."""
    t = t0 + tl.arange(0, BLOCK_T)
    d = tl.arange(0, 128)
    if ONE_BLOCK:   # the tile lies in one cache block: one table load, contiguous runs
        blk = tl.load(bt_row + (t0 // block_size) * s_btc, mask=t0 < ctx, other=0).to(tl.int64)
        off = t0 % block_size + tl.arange(0, BLOCK_T)
    else:
        blk = tl.load(bt_row + (t // block_size) * s_btc, mask=t < ctx, other=0).to(tl.int64)
        off = t % block_size
    in_cache = _in_cache(blk, n_blocks, BLOCK_T)
    tvalid = (t < ctx) & in_cache
    base = blk * blk_bytes + off * 128
    ks = tl.load(kvs_ptr + blk * blk_words + block_size * 32 + off, mask=tvalid, other=0.0)
    if KQ:
        kb = tl.load(kv_ptr + base[:, None] + d[None, :], mask=tvalid[:, None], other=0)
    else:
        kb = tl.load(kv_ptr + base[None, :] + d[:, None], mask=tvalid[None, :], other=0)
    return kb, ks, in_cache


@triton.jit
def _tile_out(kb, ks, q, w, t, ok, ctx, q_pos, out_q, qmask, max_len, FNUZ: tl.constexpr, NQP: tl.constexpr,
              HP: tl.constexpr, BLOCK_T: tl.constexpr, KQ: tl.constexpr, OPERAND: tl.constexpr,
              DOT_F32: tl.constexpr):
    """One tile: codes kb (as _load_tile), scales ks [BLOCK_T] (times kscale) -> logits stored at tokens t."""
    k = _upcast(kb, FNUZ, OPERAND, DOT_F32)
    if KQ:
        s = _dot(k, q, DOT_F32)                                        # [BLOCK_T, ROWS] fp32
        s = tl.maximum(s, 0.0) * w[None, :]
        acc = _head_sum(s, NQP, HP, BLOCK_T) * ks[:, None]             # [BLOCK_T, NQP]
        valid = ((t < ctx) & ok)[:, None] & (t[:, None] <= q_pos[None, :])
        tl.store(out_q[None, :] + t[:, None], tl.where(valid, acc, float("-inf")),
                 mask=qmask[None, :] & (t < max_len)[:, None])
    else:
        s = _dot(q, k, DOT_F32)                                        # [ROWS, BLOCK_T] fp32
        s = tl.maximum(s, 0.0) * w[:, None]
        if NQP == 1:
            acc = tl.sum(s, 0)[None, :]
        else:
            acc = tl.sum(tl.reshape(s, (NQP, HP, BLOCK_T)), 1)
        acc = acc * ks[None, :]                                        # [NQP, BLOCK_T]
        valid = ((t < ctx) & ok)[None, :] & (t[None, :] <= q_pos[:, None])
        tl.store(out_q[:, None] + t[None, :], tl.where(valid, acc, float("-inf")),
                 mask=qmask[:, None] & (t < max_len)[None, :])


@triton.jit
def _logits_kernel(q_ptr, kv_ptr, kvs_ptr, w_ptr, ctx_ptr, bt_ptr, out_ptr, kdesc,
                   H, next_n, max_len, s_ctx, s_bt, s_btc, n_blocks, cover, s_out, block_size, blk_bytes,
                   blk_words, tiles_per_prog,
                   kscale, FNUZ: tl.constexpr, NQP: tl.constexpr, HP: tl.constexpr, BLOCK_T: tl.constexpr,
                   ONE_BLOCK: tl.constexpr, KQ: tl.constexpr, OPERAND: tl.constexpr,
                   DOT_F32: tl.constexpr, KEYS: tl.constexpr):
    b = tl.program_id(0)
    ctx = tl.load(ctx_ptr + b.to(tl.int64) * s_ctx)
    # a context length outside [0, tokens the table row maps]: the sequence's rows are all -inf
    ctx = tl.where((ctx >= 0) & (ctx <= cover), ctx, 0)
    rows = tl.arange(0, NQP * HP)                                  # row = query i * HP + head h
    qi = rows // HP
    h = rows % HP
    rmask = (qi < next_n) & (h < H)
    qrow = ((b * next_n + qi) * H + h).to(tl.int64)
    d = tl.arange(0, 128)
    if KQ:   # q^T [128, ROWS]
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
    if KEYS >= 1:    # KQ and ONE_BLOCK: the table entry loaded one tile ahead (a loop-carried scalar)
        t0 = start * BLOCK_T
        blk = tl.load(bt_row + (t0 // block_size) * s_btc, mask=t0 < ctx, other=0)
        if KEYS == 2:
            ks_n = tl.load(kvs_ptr + blk.to(tl.int64) * blk_words + block_size * 32 + t0 % block_size + i,
                           mask=(t0 + i < ctx) & _in_cache(blk, n_blocks, BLOCK_T), other=0.0)
        for tile in range(start, busy_end):
            t0 = tile * BLOCK_T
            blk_n = tl.load(bt_row + ((t0 + BLOCK_T) // block_size) * s_btc, mask=t0 + BLOCK_T < ctx, other=0)
            off = t0 % block_size
            # a block id outside the cache: nothing read, its tokens -inf
            in_cache = _in_cache(blk, n_blocks, BLOCK_T)
            if KEYS == 2:    # scales of this tile were loaded last iteration; load the next tile's
                ks = ks_n
                t1 = t0 + BLOCK_T
                ks_n = tl.load(kvs_ptr + blk_n.to(tl.int64) * blk_words + block_size * 32 + t1 % block_size + i,
                               mask=(t1 + i < ctx) & _in_cache(blk_n, n_blocks, BLOCK_T), other=0.0)
                # TMA box [1, BLOCK_T, 128] at (block, offset, 0); tokens past ctx: -inf below
                kb = tl.reshape(kdesc.load([tl.where((blk >= 0) & (blk < n_blocks), blk, 0), off, 0]),
                                (BLOCK_T, 128))
            else:
                ks = tl.load(kvs_ptr + blk.to(tl.int64) * blk_words + block_size * 32 + off + i,
                             mask=(t0 + i < ctx) & in_cache, other=0.0)
                kb = tl.load(kv_ptr + blk.to(tl.int64) * blk_bytes + (off + i)[:, None] * 128 + d[None, :],
                             mask=((t0 + i < ctx) & in_cache)[:, None], other=0)
            _tile_out(kb, ks * kscale, q, w, t0 + i, in_cache, ctx, q_pos, out_q, qmask, max_len,
                      FNUZ, NQP, HP, BLOCK_T, KQ, OPERAND, DOT_F32)
            blk = blk_n
    else:
        for tile in range(start, busy_end):
            kb, ks, in_cache = _load_tile(kv_ptr, kvs_ptr, bt_row, s_btc, n_blocks, tile * BLOCK_T, ctx, block_size,
                                          blk_bytes, blk_words, BLOCK_T, ONE_BLOCK, KQ)
            _tile_out(kb, ks * kscale, q, w, tile * BLOCK_T + i, in_cache, ctx, q_pos, out_q, qmask, max_len,
                      FNUZ, NQP, HP, BLOCK_T, KQ, OPERAND, DOT_F32)
    for tile in range(busy_end, end):                              # past the context: -inf only
        t = tile * BLOCK_T + tl.arange(0, BLOCK_T)
        tl.store(out_q[:, None] + t[None, :], tl.full((NQP, BLOCK_T), float("-inf"), tl.float32),
                 mask=qmask[:, None] & (t < max_len)[None, :])


def fp8_paged_mqa_logits_triton(q_fp8, kv_cache, weights, context_lens, block_tables, max_context_len):
    return launch(q_fp8, kv_cache, weights, context_lens, block_tables, max_context_len, form="qk")


def fp8_paged_mqa_logits_triton_kq(q_fp8, kv_cache, weights, context_lens, block_tables, max_context_len):
    return launch(q_fp8, kv_cache, weights, context_lens, block_tables, max_context_len, form="kq")


def launch(q_fp8, kv_cache, weights, context_lens, block_tables, max_context_len, form="kq", **config):
    """The op by the `form` kernel ("kq" or "qk"); `config` overrides its launch_config (bench sweeps)."""
    B, next_n, H, D = q_fp8.shape
    q_fp8, weights = q_fp8.contiguous(), weights.contiguous()   # no copy when dense (the engine's case)
    require(form in ("kq", "qk"), OP_LOGITS, f"form must be 'kq' or 'qk', got {form!r}")
    plat = platform.current()
    fnuz = _fp8.DTYPE_FORMAT[q_fp8.dtype] == "e4m3fnuz"
    kv = cache_blocks(kv_cache)
    block_size = kv.shape[1] // TOKEN_BYTES
    table = launch_config_kq if form == "kq" else launch_config
    base = table(plat, fnuz)
    unknown = sorted(set(config) - set(base))
    require(not unknown, OP_LOGITS, f"unknown launch options {unknown}")
    cfg = {**base, **config}
    require(cfg["keys"] in KEYS, OP_LOGITS, f"keys must be one of {sorted(KEYS)}, got {cfg['keys']!r}")
    require(cfg["operand"] in OPERANDS, OP_LOGITS,
            f"operand must be one of {sorted(OPERANDS)}, got {cfg['operand']!r}")
    require(cfg["keys"] == "plain" or form == "kq", OP_LOGITS,
            f"keys {cfg['keys']!r} needs the keys x q^T form (form 'kq')")
    cfg = _route_keys(cfg, block_size)
    operand = OPERANDS[cfg["operand"]]
    interp = plat.triton_mode != "compiled"
    nvidia = plat.name == "cuda" and not interp
    require(not (fnuz and _sm(plat) and operand != 3), OP_LOGITS,
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
    if maxnreg and nvidia and _sm(plat):
        extra["maxnreg"] = maxnreg
    kdesc = None
    if cfg["keys"] == "tma":   # TMA needs a 16-byte aligned base (strides are: block_size % 16 == 0)
        if kv.data_ptr() % 16:
            cfg["keys"] = "ahead"
        else:
            from triton.tools.tensor_descriptor import TensorDescriptor
            kdesc = TensorDescriptor(kv, [kv.shape[0], block_size, 128], [kv.stride(0), 128, 1], [1, bt, 128])
    _logits_kernel[(B, triton.cdiv(n_tiles, tiles_per_prog))](
        q_fp8.view(torch.uint8), kv, kv.view(torch.float32), weights, context_lens, block_tables, out, kdesc,
        H, next_n, max_context_len, context_lens.stride(0), *block_tables.stride(), kv.shape[0],
        block_tables.shape[1] * block_size, out.stride(0), block_size, kv.shape[1],
        kv.shape[1] // 4, tiles_per_prog, kscale, FNUZ=fnuz, NQP=nqp, HP=hp, BLOCK_T=bt,
        ONE_BLOCK=block_size % bt == 0, KQ=form == "kq", OPERAND=operand, DOT_F32=interp,
        KEYS=KEYS[cfg["keys"]], **extra)
    return out
