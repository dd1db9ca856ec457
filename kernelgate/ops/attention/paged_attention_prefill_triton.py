"""Triton kernel for `paged_attention_prefill` (CUDA, ROCm, XPU; CPU tensors under
TRITON_INTERPRET=1): causal flash attention of packed chunks over the paged K/V cache, every
sequence in one launch, keys and values read in place from the cache (no gather).

Grid (query tile, KV head). A program holds BQ consecutive new tokens of one sequence times the
G = Hq / Hkv query heads of its KV head: M = BQ x GP rows (row m: token m // GP, head m % GP;
GP = G padded to a power of two), so one load of a key / value tile [BLOCK_N, D] serves every
head of the group and BQ tokens. It walks the keys from position 0 to its last token's position
in tiles of BLOCK_N (one block-table entry per position: tiles may span cache blocks), scores
q k^T [M, BLOCK_N] masked causally (row m sees positions <= seq_len - n + its token), online
softmax in base 2 in fp32, acc += p v.

Which program does what comes from shapes only (no host sync; capturable): sequence s owns the
virtual tiles cu[s] // BQ + s ... cu[s + 1] // BQ + s, which cover its ceil(n_s / BQ) tiles, so
T // BQ + N programs per KV head cover every sequence; a program finds its sequence by binary
search over cu_seqlens and leaves at once if its tile is past the sequence's tokens.

Never out of bounds: positions past a length or the table width are masked, a block id outside
[0, num_blocks) is not read (its positions leave the softmax), token rows outside [0, T) are
neither read nor written. Under the interpreter, and for fp32 caches, operands go through fp32 and
an IEEE fp32 dot; on GPUs bf16 / fp16 tiles feed the MMA and p is rounded to the cache dtype for
the p v product.
"""
from __future__ import annotations

import math

import triton
import triton.language as tl

from ... import alloc, platform
from ...platform import interpreting
from .paged_attention_decode_triton import _dot

# Launch choices by (platform, capability prefix); the first match wins, None matches any.
# rows: query rows (tokens x group heads) per program where the head dim allows (acc [rows, D]
# fp32: rows x D <= row_values); tile_bytes: a key tile's size, which sets BLOCK_N (16..64).
# Unmeasured starting points.
CONFIGS = [
    (("cuda", None), dict(rows=128, row_values=16384, tile_bytes=16384, num_warps=8, num_stages=2)),
    (("rocm", None), dict(rows=128, row_values=16384, tile_bytes=16384, num_warps=8, num_stages=1)),
    (("xpu", None), dict(rows=128, row_values=16384, tile_bytes=16384, num_warps=8, num_stages=1)),
    ((None, None), dict(rows=64, row_values=16384, tile_bytes=8192, num_warps=4, num_stages=1)),
]


def launch_config(plat=None) -> dict:
    plat = plat or platform.current()
    for (name, cap), cfg in CONFIGS:
        if name in (None, plat.name) and (cap is None or (plat.capability or "").startswith(cap)):
            return dict(cfg)
    raise AssertionError("unreachable: CONFIGS ends with a catch-all")


def tile_shape(cfg: dict, G: int, D: int, element_size: int) -> tuple[int, int, int, int]:
    """(BQ tokens, GP padded group, DP padded head dim, BLOCK_N keys) of a program."""
    GP = triton.next_power_of_2(G)
    DP = max(16, triton.next_power_of_2(D))
    rows = max(16, min(cfg["rows"], cfg["row_values"] // DP))
    BQ = max(1, rows // GP)
    bn = max(16, min(64, triton.next_power_of_2(cfg["tile_bytes"] // (DP * element_size) + 1) // 2))
    return BQ, GP, DP, bn


@triton.jit
def _sequence_of(cu_ptr, i, N, BQ: tl.constexpr):
    """The largest s in [0, N) whose first virtual tile cu[s] // BQ + s is <= i (-1 if none)."""
    lo = 0
    hi = N
    while lo < hi:
        mid = (lo + hi) // 2
        first = tl.load(cu_ptr + mid) // BQ + mid
        lo = tl.where(first <= i, mid + 1, lo)
        hi = tl.where(first <= i, hi, mid)
    return lo - 1


@triton.jit
def _prefill_kernel(q_ptr, k_ptr, v_ptr, bt_ptr, cu_ptr, len_ptr, o_ptr,
                    s_qt, s_qh, s_kb, s_kt, s_kh, s_vb, s_vt, s_vh, s_bt, s_ot, s_oh,
                    T, N, num_blocks, max_blocks, block_size, G, D, qk_scale,
                    BQ: tl.constexpr, GP: tl.constexpr, DP: tl.constexpr, BLOCK_N: tl.constexpr,
                    DOT_F32: tl.constexpr):
    i = tl.program_id(0)
    kh = tl.program_id(1)
    s = _sequence_of(cu_ptr, i, N, BQ)
    if s < 0:
        return
    c0 = tl.load(cu_ptr + s)
    n = tl.load(cu_ptr + s + 1) - c0
    j0 = (i - (c0 // BQ + s)) * BQ                                 # this tile's first token
    if j0 >= n:
        return
    L = tl.load(len_ptr + s)
    L = tl.minimum(tl.maximum(L, 0), max_blocks * block_size)    # never past the table row
    p0 = L - n                                                     # position of the chunk's token 0

    m = tl.arange(0, BQ * GP)
    j = j0 + m // GP
    g = m % GP
    tok = c0 + j
    row_ok = (j < n) & (g < G) & (tok >= 0) & (tok < T)
    tok = tok.to(tl.int64)
    h = kh * G + g
    d = tl.arange(0, DP)
    dmask = d < D
    q = tl.load(q_ptr + tok[:, None] * s_qt + h[:, None] * s_qh + d[None, :],
                mask=row_ok[:, None] & dmask[None, :], other=0.0)  # [M, DP]
    last = p0 + j                                                  # last position row m sees
    kend = tl.minimum(L, p0 + tl.minimum(j0 + BQ, n))              # keys the tile's last token sees
    acc = tl.zeros([BQ * GP, DP], dtype=tl.float32)
    m_i = tl.full([BQ * GP], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BQ * GP], dtype=tl.float32)
    bt_row = bt_ptr + s.to(tl.int64) * s_bt
    k_head = k_ptr + kh.to(tl.int64) * s_kh
    v_head = v_ptr + kh.to(tl.int64) * s_vh
    for t0 in range(0, kend, BLOCK_N):
        t = t0 + tl.arange(0, BLOCK_N)
        tmask = t < kend
        blk = tl.load(bt_row + t // block_size, mask=tmask, other=-1)
        ok = tmask & (blk >= 0) & (blk < num_blocks)
        blk = blk.to(tl.int64)
        off = (t % block_size).to(tl.int64)
        kv_mask = ok[:, None] & dmask[None, :]
        k = tl.load(k_head + (blk * s_kb + off * s_kt)[:, None] + d[None, :], mask=kv_mask, other=0.0)
        sc = _dot(q, tl.trans(k), DOT_F32) * qk_scale              # [M, BLOCK_N], base 2
        sc = tl.where(ok[None, :] & (t[None, :] <= last[:, None]), sc, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)      # a row that saw nothing yet
        p = tl.exp2(sc - m_use[:, None])
        alpha = tl.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_head + (blk * s_vb + off * s_vt)[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if not DOT_F32:
            p = p.to(v.dtype)
        acc = acc * alpha[:, None] + _dot(p, v, DOT_F32)
        m_i = m_new
    l_use = tl.where(l_i > 0.0, l_i, 1.0)                          # a row that saw nothing: o = 0
    tl.store(o_ptr + tok[:, None] * s_ot + h[:, None] * s_oh + d[None, :],
             (acc / l_use[:, None]).to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & dmask[None, :])


def launch(q, k_cache, v_cache, block_table, cu_seqlens, seq_lens, scale, cfg=None):
    """The kernel, without value checks (tests call this with their own cfg; cfg["bq"] /
    cfg["block_n"] force a tile)."""
    cfg = cfg or launch_config()
    T, Hq, D = q.shape
    nb, bs, Hkv, _ = k_cache.shape
    N, max_blocks = block_table.shape
    G = Hq // Hkv
    if q.stride(-1) != 1:
        q = q.contiguous()
    if block_table.stride(1) != 1:
        block_table = block_table.contiguous()
    cu_seqlens = alloc.upload(cu_seqlens, q.device).contiguous()   # host lengths: an async copy
    seq_lens = alloc.upload(seq_lens, q.device).contiguous()
    o = alloc.empty((T, Hq, D), q.dtype, q.device)
    if T == 0 or N == 0:
        return o
    BQ, GP, DP, bn = tile_shape(cfg, G, D, k_cache.element_size())
    BQ, bn = cfg.get("bq", BQ), cfg.get("block_n", bn)
    BQ = max(BQ, 16 // GP)                                          # tl.dot needs >= 16 rows
    _prefill_kernel[(T // BQ + N, Hkv)](
        q, k_cache, v_cache, block_table, cu_seqlens, seq_lens, o,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_table.stride(0), o.stride(0), o.stride(1),
        T, N, nb, max_blocks, bs, G, D, scale * math.log2(math.e),
        BQ=BQ, GP=GP, DP=DP, BLOCK_N=bn, DOT_F32=interpreting() or q.dtype.itemsize == 4,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return o


def paged_attention_prefill_triton(q, k_cache, v_cache, block_table, cu_seqlens, seq_lens, scale,
                                   cu_seqlens_cpu=None, seq_lens_cpu=None):
    return launch(q, k_cache, v_cache, block_table, cu_seqlens, seq_lens, scale)
