"""Triton split-KV (flash-decoding) kernels for `mla_decode` (CUDA, ROCm, XPU; CPU tensors
under TRITON_INTERPRET=1).

Grid (sequence n, split s). A program holds the M = next_n * H query rows of its sequence
(row m = j * H + h: query token j, head h; padded to a power of two >= 16, the tl.dot M axis)
and walks its share of the sequence's positions in tiles of BLOCK_N: one load of the tile's
latent rows [BLOCK_N, R] (+ the shared-key part [BLOCK_N, Dr]) serves every head, as both the
keys (scores = q_lat kv^T + q_r k_r^T, [M, BLOCK_N]) and the values (o += p kv, [M, R]);
R + Dr = 576 is not a power of two, hence the two parts. Online softmax in base 2, fp32.

Two ways to load a tile (launch choice `keys`):
- "ptr" (`_partial_kernel`, every backend): masked pointer loads, one block-table entry per
  position, so tiles may span cache blocks.
- "tma" (`_partial_tma_kernel`, NVIDIA sm_90+): tiles inside one cache block, the tile's rows
  brought into shared memory by TMA (descriptors over the cache; a box is at most 256 columns,
  so R is taken in NC <= 2 chunks) and fed to the MMA from there: no pointer tensors, no
  register pass. A sequence's partial last tile is the only one masked in registers.

The split of a sequence is decided per sequence from its own length (ceil(tiles / splits)
tiles each), so a wide block table (the engine's max context) does not pile a short
sequence's work onto one program. The split count comes from shapes only (sequences, table
width; never the lengths: no host sync, one graph fits every length). With one split the
program writes o and lse; otherwise fp32 partials (o normalised per split, lse) go to a
scratch buffer and `_merge_kernel` combines them by their lse. The splits past a sequence's
length return at once and the merge reads only the ones before (split_kv.live_splits): a short
context under a table sized for 32k costs a few programs, not a hundred empty partials merged.
A split whose positions all missed the cache writes lse = -inf and weighs 0. On sm_90+ the merge may be launched as a programmatic dependent
(PDL): it starts while the partials finish and waits for their grid (griddepcontrol.wait) before
it reads them.

Never out of bounds: positions past the length or past the table width are masked, and a
block id outside [0, num_blocks) is not read (its positions leave the softmax; the TMA kernel
loads such a tile from past the descriptor's end, which reads as zeros).
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
from ..common.pdl import gdc_wait, inputs_ready, pdl_args
from ..common.split_kv import live_splits, num_splits, split_len
from . import paged

OP = "mla_decode"
# Launch choices by (platform, capability prefix); the first match wins, None matches any.
# programs: the grid aims at about this many (sequence, split) programs (splits per sequence:
# programs // sequences); min_split: no split gets fewer than this many positions of the table's
# capacity (each split writes M x R fp32 partials: 64 KiB for Kimi); max_split (LOOP): no program
# gets more than this many positions of the longest sequence, while the partials stay within
# max_partials bytes (num_splits). keys: "tma" takes
# _partial_tma_kernel where the cache allows (tma_route), else _partial_kernel ("ptr").
# The entries other than sm_90's are starting points: `bench/ops/mla_decode.py --sweep` times the
# alternatives on a GPU.
CONFIGS = [
    # sm_90: 64-token tiles by TMA, kv-major: scores (M = 64 tokens) and the p kv product
    # (M = 256 latent columns) both on wgmma from shared memory, 4 warps, 2 stages of 72 KB + q:
    # one program per SM (its registers and shared memory leave no room for a second). Smaller
    # tiles, two programs per SM, are bound by each tile's serial chain (mma.sync scores, softmax)
    # rather than by the stream of tiles. Not 1 stage: under Triton 3.6 it computes wrong results.
    # prefetch 1 (prefetch_block): L2 is asked for the next tile, one request per tile, at the top of
    # the iteration -- earlier than the pipeline's own TMA load of it; further ahead, the tiles in
    # flight outgrow what L2 keeps. pdl: the merge is launched as a programmatic dependent, so it
    # starts while the partials finish.
    # min_split 64: a short context still spreads over the GPU. ptr: the tile of the pointer kernel,
    # for caches the TMA kernel does not take (fp32 latents, unaligned strides): sm_80's, because an
    # fp32 kv-major 64-token tile is twice the FMA code (IEEE fp32 dots) and slow to compile.
    (("cuda", "sm_9"), dict(block_n=64, num_warps=4, num_stages=2, programs=132, min_split=64,
                            kv_major=True, keys="tma", prefetch=1, prefetch_block=True, pdl=True,
                            ptr=dict(block_n=32, kv_major=False))),
    (("cuda", "sm_10"), dict(block_n=32, num_warps=8, num_stages=2, programs=296, min_split=256)),
    (("cuda", None), dict(block_n=32, num_warps=4, num_stages=2, programs=216, min_split=256)),
    (("rocm", None), dict(block_n=32, num_warps=8, num_stages=1, programs=608, min_split=256)),
    (("xpu", None), dict(block_n=32, num_warps=8, num_stages=1, programs=256, min_split=256)),
    ((None, None), dict(block_n=32, num_warps=4, num_stages=1, programs=128, min_split=256)),
]
# The merge of the splits: programs of merge_rows query rows x merge_br latent columns (None and
# None: the largest blocks giving about merge_programs programs), reading merge_sb splits per step
# (None: merge_step's choice).
MERGE = dict(merge_rows=None, merge_br=None, merge_programs=528, merge_sb=None)
# Loop shape defaults (see _partial_kernel): heads-major, whose 32 x 8 warps x 2 stages tile at Kimi
# shapes compiles without spills to cp.async tiles and mma.sync (kv-major puts the p kv product on
# wgmma, at more registers); ahead off, because with it Triton does not pipeline the loop (no
# cp.async).
LOOP = dict(kv_major=False, ahead=False, keys="ptr", prefetch=0, prefetch_block=False, pdl=False,
            max_split=4096, max_partials=128 << 20)
# The interpreter keeps each platform's tile shape but launches few programs (each costs
# Python time) with short splits, so tests still cross split boundaries; simulated CUDA takes
# the TMA kernel (as sm_90 does) wherever the cache's blocks allow it.
INTERPRETER = dict(programs=8, min_split=32, merge_rows=None, merge_br=None, merge_programs=0, merge_sb=4)


def config(plat=None, num_seqs: int = 1) -> dict:
    plat = plat or platform.current()
    for (name, cap), cfg in CONFIGS:
        if name in (None, plat.name) and (cap is None or (plat.capability or "").startswith(cap)):
            cfg = {**MERGE, **LOOP, **cfg}
            if interpreting():
                cfg.update(INTERPRETER, keys="tma" if plat.name == "cuda" else cfg["keys"])
            return cfg
    raise AssertionError("unreachable: CONFIGS ends with a catch-all")


@triton.jit
def _dot(a, b, DOT_F32: tl.constexpr):
    if DOT_F32:
        c = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        c = tl.dot(a, b)
    return c


@triton.jit
def _scores(kv0, kv1, kr, q0, q1, qr, qk_scale, NC: tl.constexpr, DR: tl.constexpr, KV_MAJOR: tl.constexpr,
            DOT_F32: tl.constexpr):
    """Scaled scores of one tile: latent columns in NC chunks (kv0 | kv1) plus the shared-key
    part, each product scaled on its own before the sum -- which keeps them independent MMA
    chains (Triton folds `dot + x` into one dot accumulating onto x: a single K = R + Dr chain).
    KV_MAJOR: [BLOCK_N, MP] from q^T operands [cols, MP]; else [MP, BLOCK_N] from q [MP, cols]."""
    if KV_MAJOR:
        s = _dot(kv0, q0, DOT_F32) * qk_scale
        if NC == 2:
            s += _dot(kv1, q1, DOT_F32) * qk_scale
        if DR > 0:
            s += _dot(kr, qr, DOT_F32) * qk_scale
    else:
        s = _dot(q0, tl.trans(kv0), DOT_F32) * qk_scale
        if NC == 2:
            s += _dot(q1, tl.trans(kv1), DOT_F32) * qk_scale
        if DR > 0:
            s += _dot(qr, tl.trans(kr), DOT_F32) * qk_scale
    return s


@triton.jit
def _visible(t, ok, last, KV_MAJOR: tl.constexpr):
    """Which (position, query row) pairs count: the position's block is real and row m sees it."""
    if KV_MAJOR:
        v = ok[:, None] & (t[:, None] <= last[None, :])
    else:
        v = ok[None, :] & (t[None, :] <= last[:, None])
    return v


@triton.jit
def _update(s, visible, acc0, acc1, m_i, l_i, kv0, kv1, NC: tl.constexpr, KV_MAJOR: tl.constexpr,
            DOT_F32: tl.constexpr):
    """One tile of the online softmax (s: scaled scores, base 2, fp32): rescale the accumulators of latent chunks
    0 and 1 (acc1 is not touched when NC == 1) and add p kv. On GPUs p is rounded to the cache
    dtype for the p kv product, as flash attention does. -> (acc0, acc1, m, l)."""
    if KV_MAJOR:
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 0))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)          # a row that saw nothing yet
        p = tl.exp2(s - m_use[None, :])
        alpha = tl.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 0)
        if not DOT_F32:
            p = p.to(kv0.dtype)
        acc0 = acc0 * alpha[None, :] + _dot(tl.trans(kv0), p, DOT_F32)
        if NC == 2:
            acc1 = acc1 * alpha[None, :] + _dot(tl.trans(kv1), p, DOT_F32)
    else:
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_use[:, None])
        alpha = tl.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        if not DOT_F32:
            p = p.to(kv0.dtype)
        acc0 = acc0 * alpha[:, None] + _dot(p, kv0, DOT_F32)
        if NC == 2:
            acc1 = acc1 * alpha[:, None] + _dot(p, kv1, DOT_F32)
    return acc0, acc1, m_new, l_i


@triton.jit
def _load_q(q_ptr, qrow, mmask, c0, width, CP: tl.constexpr, KV_MAJOR: tl.constexpr):
    """Query columns c0 .. c0 + width of the program's rows, padded to CP: [CP, MP] (kv-major) or [MP, CP]."""
    c = tl.arange(0, CP)
    if KV_MAJOR:
        x = tl.load(q_ptr + qrow[None, :] + c0 + c[:, None], mask=mmask[None, :] & (c < width)[:, None], other=0.0)
    else:
        x = tl.load(q_ptr + qrow[:, None] + c0 + c[None, :], mask=mmask[:, None] & (c < width)[None, :], other=0.0)
    return x


@triton.jit
def _load_kv(kv_ptr, base, ok, c0, width, CP: tl.constexpr):
    """Cache columns c0 .. c0 + width of a tile's rows (row bases `base`), padded to CP; rows not ok: 0."""
    c = tl.arange(0, CP)
    return tl.load(kv_ptr + base[:, None] + c0 + c[None, :], mask=ok[:, None] & (c < width)[None, :], other=0.0)


@triton.jit
def _store_o(o_ptr, row, acc, l_use, mmask, c0, R, CP: tl.constexpr, KV_MAJOR: tl.constexpr):
    """o columns c0 .. c0 + CP (those < R) of the program's rows: acc / l."""
    c = c0 + tl.arange(0, CP)
    if KV_MAJOR:
        tl.store(o_ptr + row[None, :] * R + c[:, None], (acc / l_use[None, :]).to(o_ptr.dtype.element_ty),
                 mask=mmask[None, :] & (c < R)[:, None])
    else:
        tl.store(o_ptr + row[:, None] * R + c[None, :], (acc / l_use[:, None]).to(o_ptr.dtype.element_ty),
                 mask=mmask[:, None] & (c < R)[None, :])


@triton.jit
def _split_range(len_ptr, n, sp, splits, max_blocks, block_size, BLOCK_N: tl.constexpr):
    """-> (L, start, end): the sequence's length (cut to the table) and this split's positions."""
    L, per = split_len(tl.load(len_ptr + n), max_blocks * block_size, splits, BLOCK_N)
    start = sp * per * BLOCK_N
    return L, start, tl.minimum(start + per * BLOCK_N, L)


@triton.jit
def _finish(o_ptr, lse_ptr, acc0, acc1, m_i, l_i, n, sp, splits, m, mmask, M, R, start, end,
            RC: tl.constexpr, NC: tl.constexpr, KV_MAJOR: tl.constexpr):
    """Write the split's lse and its normalised o ([N, splits, M] rows; one split: the output)."""
    has = l_i > 0.0
    l_use = tl.where(has, l_i, 1.0)                               # rows that saw nothing: o = 0, lse = -inf
    lse = tl.where(has, (m_i + tl.log2(l_use)) * 0.6931471805599453, float("-inf"))   # natural log
    row = (n * splits + sp).to(tl.int64) * M + m
    tl.store(lse_ptr + row, lse, mask=mmask)
    # an empty split leaves its o unwritten (the merge skips it by its lse); with one split o = 0
    if (start < end) | (splits == 1):
        _store_o(o_ptr, row, acc0, l_use, mmask, 0, R, RC, KV_MAJOR)
        if NC == 2:
            _store_o(o_ptr, row, acc1, l_use, mmask, RC, R, RC, KV_MAJOR)


@triton.jit
def _partial_kernel(q_ptr, kv_ptr, bt_ptr, len_ptr, o_ptr, lse_ptr,
                    s_qt, s_qh, s_cb, s_ct, s_bt, num_blocks, max_blocks, block_size, next_n, H, M,
                    qk_scale, splits,
                    R: tl.constexpr, DR: tl.constexpr, RP: tl.constexpr, DRP: tl.constexpr, MP: tl.constexpr,
                    BLOCK_N: tl.constexpr, DOT_F32: tl.constexpr,
                    KV_MAJOR: tl.constexpr, AHEAD: tl.constexpr, PDL: tl.constexpr):
    """Pointer loads, one table entry per position (tiles may span cache blocks).
    KV_MAJOR=False: scores [MP, BLOCK_N] = q kv^T, acc [MP, RP] (heads on the MMA's M axis).
    KV_MAJOR=True: the transposes, scores^T = kv q^T [BLOCK_N, MP] and acc^T [RP, MP] += kv^T p^T:
    the MMA's M axis is BLOCK_N / R (>= 64: Hopper's wgmma shapes) instead of the head count.
    AHEAD: the block-table entries of the next tile are loaded one iteration early, so no cache
    load waits on a load of its own iteration (Triton's pipeliner can then prefetch tiles).
    PDL: as in _partial_tma_kernel."""
    n = tl.program_id(0)
    sp = tl.program_id(1)
    inputs_ready(PDL)
    L, start, end = _split_range(len_ptr, n, sp, splits, max_blocks, block_size, BLOCK_N)
    if (start >= end) & (splits > 1):   # past the sequence: nothing to write, the merge stops before it
        return
    m = tl.arange(0, MP)
    j = m // H
    mmask = m < M
    last = L - next_n + j                                          # last position row m sees
    qrow = (n * next_n + j).to(tl.int64) * s_qt + (m % H) * s_qh
    qn = _load_q(q_ptr, qrow, mmask, 0, R, RP, KV_MAJOR)          # kv-major: q^T [RP, MP]
    qr = _load_q(q_ptr, qrow, mmask, R, DR, DRP, KV_MAJOR)
    acc = tl.zeros([RP, MP] if KV_MAJOR else [MP, RP], dtype=tl.float32)
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
        kv = _load_kv(kv_ptr, base, ok, 0, R, RP)                 # [BLOCK_N, RP]
        kr = _load_kv(kv_ptr, base, ok, R, DR, DRP)
        s = _scores(kv, kv, kr, qn, qn, qr, qk_scale, 1, DR, KV_MAJOR, DOT_F32)
        acc, _, m_i, l_i = _update(s, _visible(t, ok, last, KV_MAJOR), acc, acc, m_i, l_i, kv, kv,
                                   1, KV_MAJOR, DOT_F32)
    _finish(o_ptr, lse_ptr, acc, acc, m_i, l_i, n, sp, splits, m, mmask, M, R, start, end, RP, 1, KV_MAJOR)


@triton.jit
def _prefetch_l2(kv_ptr, blk, row0, s_cb, s_ct, row_bytes, BLOCK_N: tl.constexpr):
    """Ask L2 for a tile's rows (one bulk prefetch per row, sm_90: `cp.async.bulk.prefetch`), so
    that the TMA load issued for it later finds them there; nothing waits on it."""
    rows = (blk.to(tl.int64) * s_cb + (row0 + tl.arange(0, BLOCK_N)).to(tl.int64) * s_ct)
    tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2;\n mov.u32 $0, 0;", "=r,l,r",
                              [kv_ptr + rows, tl.full([BLOCK_N], row_bytes, tl.int32)], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def _prefetch_l2_tile(kv_ptr, blk, row0, s_cb, s_ct, tile_bytes):
    """Ask L2 for a whole tile whose rows are contiguous: one bulk prefetch, issued by thread 0."""
    tl.inline_asm_elementwise(
        "{ .reg .pred p; .reg .u32 t; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0;\n"
        "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [kv_ptr + (blk.to(tl.int64) * s_cb + row0.to(tl.int64) * s_ct), tile_bytes],
        dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _partial_tma_kernel(q_ptr, kv_ptr, desc_c, desc_r, bt_ptr, len_ptr, o_ptr, lse_ptr,
                        s_qt, s_qh, s_cb, s_ct, s_bt, num_blocks, max_blocks, block_size, next_n, H, M,
                        qk_scale, splits,
                        R: tl.constexpr, DR: tl.constexpr, RC: tl.constexpr, NC: tl.constexpr, DRP: tl.constexpr,
                        MP: tl.constexpr, BLOCK_N: tl.constexpr, DOT_F32: tl.constexpr,
                        KV_MAJOR: tl.constexpr, PREFETCH: tl.constexpr, PF_TILE: tl.constexpr,
                        PDL: tl.constexpr):
    """Tiles inside one cache block (block_size % BLOCK_N == 0): one table entry per tile, loaded a
    tile ahead, and the tile's latents by TMA from descriptors over the cache viewed as
    [num_blocks, block_size, R] (box [1, BLOCK_N, RC], NC boxes: a box is at most 256 wide) and
    [num_blocks, block_size, Dr] -- into shared memory, the MMA operands, with no register pass.
    A block id outside the cache loads at row num_blocks: past the descriptor, zero-filled.
    A sequence's partial last tile is loaded shifted back so that it ends at the length: the rows
    past the length (they hold anything, NaN included, and 0 x NaN would reach o) are never read;
    the rows it gains in front lie before the block (negative coordinates: zero-filled) or were
    the previous tile's, and leave the softmax. Every tile takes the same path, so the loop is
    one pipeline and q sits in shared memory once. Orientation as in _partial_kernel.
    PREFETCH > 0 (GPU only): each iteration also asks L2 for the tile PREFETCH tiles ahead (its
    table entry read one iteration earlier still): more of the cache in flight than the shared
    memory's stages hold; PF_TILE: one prefetch of the whole tile (its rows are contiguous) from
    one thread, instead of one per row.
    PDL (ops/common/pdl.py): wait for the previous kernel's writes before reading anything, then let
    the next PDL kernel (the merge) launch; it waits for this grid's completion before it reads."""
    n = tl.program_id(0)
    sp = tl.program_id(1)
    inputs_ready(PDL)
    L, start, end = _split_range(len_ptr, n, sp, splits, max_blocks, block_size, BLOCK_N)
    if (start >= end) & (splits > 1):   # past the sequence: nothing to write, the merge stops before it
        return
    m = tl.arange(0, MP)
    j = m // H
    mmask = m < M
    last = L - next_n + j
    qrow = (n * next_n + j).to(tl.int64) * s_qt + (m % H) * s_qh
    bt_row = bt_ptr + n.to(tl.int64) * s_bt
    blk = tl.load(bt_row + start // block_size, mask=start < end, other=0)
    row_bytes = (R + DR) * kv_ptr.dtype.element_ty.primitive_bitwidth // 8
    q0 = _load_q(q_ptr, qrow, mmask, 0, tl.minimum(R, RC), RC, KV_MAJOR)
    q1 = _load_q(q_ptr, qrow, mmask, RC, R - RC, RC, KV_MAJOR)    # (NC == 1: all masked, unused)
    qr = _load_q(q_ptr, qrow, mmask, R, DR, DRP, KV_MAJOR)
    acc0 = tl.zeros([RC, MP] if KV_MAJOR else [MP, RC], dtype=tl.float32)
    acc1 = tl.zeros([RC, MP] if KV_MAJOR else [MP, RC], dtype=tl.float32)
    m_i = tl.full([MP], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([MP], dtype=tl.float32)
    pf = start + PREFETCH * BLOCK_N
    blk_pf = tl.load(bt_row + pf // block_size, mask=(pf < end) & (PREFETCH > 0), other=-1)
    for t0 in range(start, end, BLOCK_N):
        blk_n = tl.load(bt_row + (t0 + BLOCK_N) // block_size, mask=t0 + BLOCK_N < end, other=0)
        if PREFETCH > 0:
            pf = t0 + PREFETCH * BLOCK_N
            ok_pf = (pf < end) & (blk_pf >= 0) & (blk_pf < num_blocks)
            if PF_TILE:
                _prefetch_l2_tile(kv_ptr, tl.where(ok_pf, blk_pf, 0), tl.where(ok_pf, pf, 0) % block_size,
                                  s_cb, s_ct, row_bytes * BLOCK_N)
            else:
                _prefetch_l2(kv_ptr, tl.where(ok_pf, blk_pf, 0), tl.where(ok_pf, pf, 0) % block_size,
                             s_cb, s_ct, row_bytes, BLOCK_N)   # (nothing to fetch: block 0, a valid address)
            blk_pf = tl.load(bt_row + (pf + BLOCK_N) // block_size, mask=pf + BLOCK_N < end, other=-1)
        inb = (blk >= 0) & (blk < num_blocks)
        b = tl.where(inb, blk, num_blocks)
        shift = tl.maximum(t0 + BLOCK_N - L, 0)                   # > 0 only for the partial last tile
        off = t0 % block_size - shift
        kv0 = tl.reshape(desc_c.load([b, off, 0]), (BLOCK_N, RC))
        kv1 = kv0
        if NC == 2:
            kv1 = tl.reshape(desc_c.load([b, off, RC]), (BLOCK_N, RC))
        kr = kv0
        if DR > 0:
            kr = tl.reshape(desc_r.load([b, off, 0]), (BLOCK_N, DRP))
        t = t0 - shift + tl.arange(0, BLOCK_N)
        s = _scores(kv0, kv1, kr, q0, q1, qr, qk_scale, NC, DR, KV_MAJOR, DOT_F32)
        ok = (t >= t0) & inb
        acc0, acc1, m_i, l_i = _update(s, _visible(t, ok, last, KV_MAJOR), acc0, acc1, m_i, l_i, kv0, kv1,
                                       NC, KV_MAJOR, DOT_F32)
        blk = blk_n
    _finish(o_ptr, lse_ptr, acc0, acc1, m_i, l_i, n, sp, splits, m, mmask, M, R, start, end, RC, NC, KV_MAJOR)


@triton.jit
def _merge_kernel(op_ptr, lsep_ptr, o_ptr, lse_ptr, len_ptr, cap, M, splits,
                  R: tl.constexpr, ROWS: tl.constexpr, BR: tl.constexpr, SB: tl.constexpr, BLOCK_N: tl.constexpr,
                  PDL: tl.constexpr):
    """Program (sequence n, block of ROWS query rows, block of BR latent columns): one pass over
    the sequence's live splits (split_kv.live_splits: the partial programs past its length wrote
    nothing), SB at a time (all of them in one step where SB covers them), rescaling the running
    sum to the largest lse seen so far; a split that saw no position (lse -inf) weighs 0 and is not read.
    PDL: launched as a programmatic dependent of the partial kernel: wait for its grid first."""
    inputs_ready(PDL)
    n = tl.program_id(0)
    m = tl.program_id(1) * ROWS + tl.arange(0, ROWS)
    mmask = m < M
    first = n.to(tl.int64) * splits * M + m                      # [ROWS] partial rows of split 0
    r = tl.program_id(2) * BR + tl.arange(0, BR)
    rmask = r < R
    mx = tl.full([ROWS], float("-inf"), dtype=tl.float32)
    den = tl.zeros([ROWS], dtype=tl.float32)
    acc = tl.zeros([ROWS, BR], dtype=tl.float32)
    live_n = live_splits(tl.load(len_ptr + n), cap, splits, BLOCK_N)
    for s0 in range(0, live_n, SB):
        ss = s0 + tl.arange(0, SB)
        prow = first[None, :] + ss[:, None] * M                  # [SB, ROWS]
        ls = tl.load(lsep_ptr + prow, mask=(ss < live_n)[:, None] & mmask[None, :], other=float("-inf"))
        live = (ls > float("-inf"))[:, :, None] & rmask[None, None, :]
        o = tl.load(op_ptr + prow[:, :, None] * R + r[None, None, :], mask=live, other=0.0)   # [SB, ROWS, BR]
        mx_new = tl.maximum(mx, tl.max(ls, 0))
        mx_use = tl.where(mx_new == float("-inf"), 0.0, mx_new)
        alpha = tl.exp(mx - mx_use)                              # 0 while nothing was seen
        w = tl.exp(ls - mx_use[None, :])                         # 0 for an empty split
        den = den * alpha + tl.sum(w, 0)
        acc = acc * alpha[:, None] + tl.sum(w[:, :, None] * o, 0)
        mx = mx_new
    has = den > 0.0
    den = tl.where(has, den, 1.0)                                # acc is 0 there: o = 0, lse = -inf
    out_row = n.to(tl.int64) * M + m
    tl.store(o_ptr + out_row[:, None] * R + r[None, :], (acc / den[:, None]).to(o_ptr.dtype.element_ty),
             mask=mmask[:, None] & rmask[None, :])
    if tl.program_id(2) == 0:
        tl.store(lse_ptr + out_row, tl.where(has, mx + tl.log(den), float("-inf")), mask=mmask)


def tma_route(cfg: dict, cache, R: int) -> tuple[str | None, int]:
    """(why the TMA kernel cannot take this cache, or None; the tile it takes): tiles inside one
    block, boxes of at most 256 columns (R <= 512), 16-byte aligned bases and rows, 16-bit
    elements on a GPU (a box of fp32 latents would not fit shared memory with its stages)."""
    bs = cache.shape[1]
    es = cache.element_size()
    bn = cfg["block_n"]
    if bs % bn:
        bn = bs   # a smaller cache block: one tile per block
    if bn < 16 or bn & (bn - 1):
        return f"block_size {bs}: no power-of-two tile >= 16 inside a block", bn
    if not 16 <= R <= 512 or (R * es) % 16:
        return f"kv_lora_rank {R}: TMA boxes need 16 <= R <= 512 and 16-byte aligned columns", bn
    if cache.data_ptr() % 16 or (cache.stride(0) * es) % 16 or (cache.stride(1) * es) % 16:
        return "cache base or strides not 16-byte aligned", bn
    if es != 2 and not interpreting():
        return f"{cache.dtype} latents", bn
    return None, bn


def prefetch_tiles(cfg: dict, cache) -> int:
    """How many tiles ahead the TMA kernel asks L2 for (cfg's `prefetch`): none under the interpreter
    (inline PTX), for an empty cache, or where a row of latents is not a whole number of 16 bytes."""
    if interpreting() or cache.shape[0] == 0 or (cache.shape[2] * cache.element_size()) % 16:
        return 0
    return cfg.get("prefetch", 0)


def pointer_choice(cfg: dict) -> dict:
    """The launch choice of the pointer kernel: cfg, with its `ptr` overrides where it has them (a
    choice made for the TMA kernel names the tile its fallback takes)."""
    return {**cfg, **cfg.get("ptr", {})}


def prefetch_whole_tile(cfg: dict, cache) -> bool:
    """Whether that prefetch is one request per tile (cfg's `prefetch_block`; a tile's rows must be
    contiguous) rather than one per row."""
    return bool(cfg.get("prefetch_block")) and cache.stride(1) == cache.shape[2]


def dependent_merge(cfg: dict, splits: int) -> bool:
    """Whether the merge is launched as a programmatic dependent of the partial kernel (cfg's `pdl`;
    NVIDIA sm_90+, never under the interpreter): its launch and start overlap the partials' tail."""
    if not cfg.get("pdl") or splits == 1 or interpreting():
        return False
    plat = platform.current()
    return plat.name == "cuda" and (plat.capability or "").startswith("sm_") and int(plat.capability[3:]) >= 90


def _descriptors(cache, R: int, Dr: int, bn: int, RC: int, DRP: int):
    from triton.tools.tensor_descriptor import TensorDescriptor
    nb, bs = cache.shape[0], cache.shape[1]
    strides = [cache.stride(0), cache.stride(1), 1]
    desc_c = TensorDescriptor(cache, [nb, bs, R], strides, [1, bn, RC])
    desc_r = TensorDescriptor(cache[:, :, R:], [nb, bs, Dr], strides, [1, bn, DRP]) if Dr else None
    return desc_c, desc_r


def merge_grid(N: int, M: int, R: int, MP: int, RP: int, cfg: dict) -> tuple[int, int]:
    """(query rows, latent columns) per merge program: cfg's, or (None) the largest blocks that
    still give about merge_programs programs."""
    rows, br = cfg["merge_rows"], cfg["merge_br"]
    if rows is None and br is None and cfg.get("merge_programs"):
        rows, br = MP, RP
        while N * triton.cdiv(M, rows) * triton.cdiv(R, br) < cfg["merge_programs"] and (rows > 1 or br > 32):
            if br > 32:
                br //= 2
            else:
                rows //= 2
        return rows, br
    return min(rows or MP, MP), min(br or RP, RP)


def merge_step(splits: int, rows: int, br: int, cfg: dict) -> int:
    """Splits a merge program reads per step: merge_sb, or (None) as many as cover them all while
    a step's [splits, rows, br] fp32 tile stays within 8,192 values (64 registers a thread)."""
    sb = cfg["merge_sb"] or max(1, 8192 // (rows * br))
    return min(triton.next_power_of_2(splits), 1 << (sb.bit_length() - 1))   # powers of two


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
    splits = cfg.get("splits") or num_splits(N, max_blocks, bs, cfg, M * R * 4)
    if splits == 1:
        o_part, lse_part = o, lse
    else:
        o_part = alloc.empty((N, splits, M, R), torch.float32, q.device)
        lse_part = alloc.empty((N, splits, M), torch.float32, q.device)
    RP, MP = max(16, triton.next_power_of_2(R)), max(16, triton.next_power_of_2(M))
    DRP = max(16, triton.next_power_of_2(max(Dr, 1)))
    dot_f32 = interpreting() or cache.dtype == torch.float32
    common = (q.stride(0), q.stride(1), cache.stride(0), cache.stride(1), block_table.stride(0),
              nb, max_blocks, bs, next_n, H, M, scale * math.log2(math.e), splits)
    pdl = pdl_args()                      # every kernel a programmatic dependent where PDL is on
    if dependent_merge(cfg, splits) and gdc_wait is not None:   # cfg's pdl: the merge one in any case
        pdl_partial, pdl_merge = {**pdl, "PDL": True}, {"PDL": True, "launch_pdl": True}
    else:
        pdl_partial = pdl_merge = pdl
    why, bn = tma_route(cfg, cache, R) if cfg.get("keys") == "tma" else ("keys", 0)
    if why is None:
        RC = min(RP, 256)
        desc_c, desc_r = _descriptors(cache, R, Dr, bn, RC, DRP)
        _partial_tma_kernel[(N, splits)](
            q, cache, desc_c, desc_r, block_table, seq_lens, o_part, lse_part, *common,
            R=R, DR=Dr, RC=RC, NC=RP // RC, DRP=DRP, MP=MP, BLOCK_N=bn, DOT_F32=dot_f32,
            KV_MAJOR=cfg["kv_major"], PREFETCH=prefetch_tiles(cfg, cache),
            PF_TILE=prefetch_whole_tile(cfg, cache), num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
            **pdl_partial)
    else:
        cfg = pointer_choice(cfg)
        bn = cfg["block_n"]
        _partial_kernel[(N, splits)](
            q, cache, block_table, seq_lens, o_part, lse_part, *common,
            R=R, DR=Dr, RP=RP, DRP=DRP, MP=MP, BLOCK_N=bn, DOT_F32=dot_f32,
            KV_MAJOR=cfg["kv_major"], AHEAD=cfg["ahead"], num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
            **pdl_partial)
    if splits > 1:
        rows, br = merge_grid(N, M, R, MP, RP, cfg)
        _merge_kernel[(N, triton.cdiv(M, rows), triton.cdiv(R, br))](
            o_part, lse_part, o, lse, seq_lens, max_blocks * bs, M, splits, R=R, ROWS=rows, BR=br,
            SB=merge_step(splits, rows, br, cfg), BLOCK_N=bn, num_warps=4, **pdl_merge)
    return (o, lse) if return_lse else o


def mla_decode_triton(q, cache, block_table, seq_lens, scale, kv_lora_rank, next_n=1, return_lse=False):
    if q.device.type == "cpu":   # host tensors: the values are free to check (a device never syncs here)
        paged.check_values(OP, cache, block_table, seq_lens, min_len=next_n)
    return launch(q, cache, block_table, seq_lens, scale, kv_lora_rank, next_n, return_lse)
