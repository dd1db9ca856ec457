"""Triton split-KV (flash-decoding) kernels for `paged_attention_decode` (CUDA, ROCm, XPU; CPU
tensors under TRITON_INTERPRET=1).

Grid (sequence n, KV head, split). A program holds the G = Hq / Hkv query heads that share its KV
head (rows padded to GP, a power of two >= 16: the tl.dot M axis) and walks its share of the
sequence's positions in tiles of BLOCK_N: one load of the tile's keys [BLOCK_N, D] and values
serves every head of the group (K/V are read once per group, not once per query head); scores
q k^T [GP, BLOCK_N], online softmax in base 2 in fp32, acc += p v [GP, D]. A tile loads one
block-table entry per position, so tiles may span cache blocks; each position's row is D
contiguous values of one KV head (stride Hkv * D between positions).

The split of a sequence is decided per sequence from its own length (ceil(tiles / splits) tiles
each). The split count comes from shapes only (sequences, KV heads, table width; never the
lengths: no host sync, one captured graph fits every length). With one split the program writes
o; otherwise fp32 partials (o normalised per split, lse) go to scratch and `_merge_kernel`
combines them by their lse. The splits past a sequence's length return at once and the merge
reads only the ones before (split_kv.live_splits): with the table sized for a long context, a
short one costs a few programs' work, not hundreds of empty partials merged 16 at a time.

Never out of bounds: positions past the length or past the table width are masked, and a block
id outside [0, num_blocks) is not read (its positions leave the softmax).
Under the interpreter, and for fp32 caches, operands go through fp32 and an IEEE fp32 dot (the
interpreter's bf16 dot is not reliable); on GPUs bf16 / fp16 tiles feed the MMA directly and p is
rounded to the cache dtype for the p v product (as flash attention does).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ... import alloc, platform
from ...platform import interpreting
from ..common.pdl import inputs_ready, pdl_args
from ..common.split_kv import live_splits, num_splits, split_len
from . import paged

OP = "paged_attention_decode"
# Launch choices by (platform, capability prefix); the first match wins, None matches any.
# programs: the grid aims at about this many (sequence, KV head, split) programs (a few per SM /
# CU / Xe core: each streams its tiles with little else to hide latency behind); min_split: no
# split gets fewer than this many positions of the table's capacity; tile_bytes: a K tile's size,
# which sets BLOCK_N (16..64 positions: bf16 D=256 -> 32, D=128 -> 64); max_split: no program gets
# more than this many positions of the longest sequence, while the fp32 partials stay within
# max_partials bytes (num_splits).
# Unmeasured starting points.
_SPLITS = dict(min_split=128, max_split=4096, max_partials=128 << 20)
CONFIGS = [
    (("cuda", "sm_9"), dict(programs=528, **_SPLITS, tile_bytes=16384, num_warps=4, num_stages=2)),
    (("cuda", "sm_10"), dict(programs=592, **_SPLITS, tile_bytes=16384, num_warps=4, num_stages=2)),
    (("cuda", None), dict(programs=432, **_SPLITS, tile_bytes=16384, num_warps=4, num_stages=2)),
    (("rocm", None), dict(programs=608, **_SPLITS, tile_bytes=16384, num_warps=4, num_stages=1)),
    (("xpu", None), dict(programs=512, **_SPLITS, tile_bytes=16384, num_warps=4, num_stages=1)),
    ((None, None), dict(programs=256, **_SPLITS, tile_bytes=16384, num_warps=4, num_stages=1)),
]
# The interpreter keeps each platform's tile shape but launches few programs (each costs Python
# time) with short splits, so tests still cross split boundaries.
INTERPRETER = dict(programs=8, min_split=32)
MERGE_VALUES = 4096      # a merge step's [splits, D] fp32 tile (32 registers a thread at 4 warps)


def launch_config(plat=None) -> dict:
    plat = plat or platform.current()
    for (name, cap), cfg in CONFIGS:
        if name in (None, plat.name) and (cap is None or (plat.capability or "").startswith(cap)):
            cfg = dict(cfg)
            if interpreting():
                cfg.update(INTERPRETER)
            return cfg
    raise AssertionError("unreachable: CONFIGS ends with a catch-all")


def block_n(cfg: dict, DP: int, element_size: int) -> int:
    """Positions per tile: tile_bytes of keys, a power of two in [16, 64]."""
    return max(16, min(64, triton.next_power_of_2(cfg["tile_bytes"] // (DP * element_size) + 1) // 2))


@triton.jit
def _dot(a, b, DOT_F32: tl.constexpr):
    if DOT_F32:
        c = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        c = tl.dot(a, b)
    return c


@triton.jit
def _sigmoid_gate(gate_ptr, n, h, s_gn, s_gh, d, mask):
    """sigmoid(gate[n, h, d]) in fp32 (h a head or a vector of them, d the head dim's lanes)."""
    g = tl.load(gate_ptr + n.to(tl.int64) * s_gn + h * s_gh + d, mask=mask, other=0.0)
    return tl.sigmoid(g.to(tl.float32))


@triton.jit
def _partial_kernel(q_ptr, k_ptr, v_ptr, bt_ptr, len_ptr, o_ptr, lse_ptr, gate_ptr,
                    s_qn, s_qh, s_kb, s_kt, s_kh, s_vb, s_vt, s_vh, s_bt, s_gn, s_gh,
                    num_blocks, max_blocks, block_size, Hq, G, D, qk_scale, splits,
                    GP: tl.constexpr, DP: tl.constexpr, BLOCK_N: tl.constexpr, DOT_F32: tl.constexpr,
                    HAS_GATE: tl.constexpr, PDL: tl.constexpr):
    n = tl.program_id(0)
    kh = tl.program_id(1)
    sp = tl.program_id(2)
    inputs_ready(PDL)
    L, per = split_len(tl.load(len_ptr + n), max_blocks * block_size, splits, BLOCK_N)
    start = sp * per * BLOCK_N
    end = tl.minimum(start + per * BLOCK_N, L)
    if (start >= end) & (splits > 1):   # past the sequence: nothing to write, the merge stops before it
        return

    g = tl.arange(0, GP)
    gmask = g < G
    h = kh * G + g                                                 # query heads of this KV head
    d = tl.arange(0, DP)
    dmask = d < D
    q = tl.load(q_ptr + n.to(tl.int64) * s_qn + h[:, None] * s_qh + d[None, :],
                mask=gmask[:, None] & dmask[None, :], other=0.0)   # [GP, DP]
    acc = tl.zeros([GP, DP], dtype=tl.float32)
    m_i = tl.full([GP], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GP], dtype=tl.float32)
    bt_row = bt_ptr + n.to(tl.int64) * s_bt
    k_head = k_ptr + kh.to(tl.int64) * s_kh
    v_head = v_ptr + kh.to(tl.int64) * s_vh
    for t0 in range(start, end, BLOCK_N):
        t = t0 + tl.arange(0, BLOCK_N)
        tmask = t < end
        blk = tl.load(bt_row + t // block_size, mask=tmask, other=-1)
        ok = tmask & (blk >= 0) & (blk < num_blocks)
        blk = blk.to(tl.int64)
        off = (t % block_size).to(tl.int64)
        kv_mask = ok[:, None] & dmask[None, :]
        k = tl.load(k_head + (blk * s_kb + off * s_kt)[:, None] + d[None, :], mask=kv_mask, other=0.0)
        s = _dot(q, tl.trans(k), DOT_F32) * qk_scale               # [GP, BLOCK_N], base 2
        s = tl.where(ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)      # a row that saw nothing yet
        p = tl.exp2(s - m_use[:, None])
        alpha = tl.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_head + (blk * s_vb + off * s_vt)[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if not DOT_F32:
            p = p.to(v.dtype)
        acc = acc * alpha[:, None] + _dot(p, v, DOT_F32)
        m_i = m_new

    has = l_i > 0.0
    l_use = tl.where(has, l_i, 1.0)                                # rows that saw nothing: o = 0, lse = -inf
    row = (n * splits + sp).to(tl.int64) * Hq + h
    tl.store(lse_ptr + row, tl.where(has, (m_i + tl.log2(l_use)) * 0.6931471805599453, float("-inf")),
             mask=gmask)
    # an empty split leaves its o unwritten (the merge skips it by its lse); with one split o = 0
    out = acc / l_use[:, None]
    if HAS_GATE:
        if splits == 1:   # o itself (more splits: partials, gated by the merge)
            out = out * _sigmoid_gate(gate_ptr, n, h[:, None], s_gn, s_gh, d[None, :], gmask[:, None] & dmask[None, :])
    if (start < end) | (splits == 1):
        tl.store(o_ptr + row[:, None] * D + d[None, :], out.to(o_ptr.dtype.element_ty),
                 mask=gmask[:, None] & dmask[None, :])


@triton.jit
def _merge_kernel(op_ptr, lsep_ptr, o_ptr, len_ptr, gate_ptr, s_gn, s_gh, cap, Hq, D, splits, BLOCK_N: tl.constexpr,
                  DP: tl.constexpr, SB: tl.constexpr, HAS_GATE: tl.constexpr, PDL: tl.constexpr):
    """Program (sequence n, query head h): one pass over the sequence's live splits (split_kv.live_splits:
    the partial kernel's programs past its length wrote nothing), SB at a time, rescaling the
    running sum to the largest lse seen so far; a split whose positions all missed the cache (lse
    -inf) weighs 0 and is not read."""
    n = tl.program_id(0)
    h = tl.program_id(1)
    d = tl.arange(0, DP)
    dmask = d < D
    first = n.to(tl.int64) * splits * Hq + h                       # partial row of split 0
    mx = tl.full([1], float("-inf"), dtype=tl.float32)
    den = tl.zeros([1], dtype=tl.float32)
    acc = tl.zeros([DP], dtype=tl.float32)
    inputs_ready(PDL)
    live_n = live_splits(tl.load(len_ptr + n), cap, splits, BLOCK_N)
    for s0 in range(0, live_n, SB):
        ss = s0 + tl.arange(0, SB)
        prow = first + ss * Hq                                     # [SB]
        ls = tl.load(lsep_ptr + prow, mask=ss < live_n, other=float("-inf"))
        live = ls > float("-inf")
        o = tl.load(op_ptr + prow[:, None] * D + d[None, :], mask=live[:, None] & dmask[None, :], other=0.0)
        mx_new = tl.maximum(mx, tl.max(ls, 0))
        mx_use = tl.where(mx_new == float("-inf"), 0.0, mx_new)
        alpha = tl.exp(mx - mx_use)                                # 0 while nothing was seen
        w = tl.exp(ls - mx_use)                                    # 0 for an empty split
        den = den * alpha + tl.sum(w, 0)
        acc = acc * alpha + tl.sum(w[:, None] * o, 0)
        mx = mx_new
    den = tl.where(den > 0.0, den, 1.0)                            # acc is 0 there: o = 0
    out = acc / den
    if HAS_GATE:
        out = out * _sigmoid_gate(gate_ptr, n, h, s_gn, s_gh, d, dmask)
    tl.store(o_ptr + (n.to(tl.int64) * Hq + h) * D + d, out.to(o_ptr.dtype.element_ty), mask=dmask)


def launch(q, k_cache, v_cache, block_table, seq_lens, scale, cfg=None, gate=None):
    """The kernels, without value checks (tests call this with their own cfg; cfg["splits"]
    forces a split count)."""
    cfg = cfg or launch_config()
    N, Hq, D = q.shape
    nb, bs, Hkv, _ = k_cache.shape
    G = Hq // Hkv
    max_blocks = block_table.shape[1]
    if q.stride(-1) != 1:
        q = q.contiguous()
    if block_table.stride(1) != 1:
        block_table = block_table.contiguous()
    seq_lens = seq_lens.contiguous()
    if gate is not None and gate.stride(-1) != 1:
        gate = gate.contiguous()
    g_args = (gate, gate.stride(0), gate.stride(1)) if gate is not None else (q, 0, 0)
    o = alloc.empty((N, Hq, D), q.dtype, q.device)
    if N == 0:
        return o
    splits = cfg.get("splits") or num_splits(N * Hkv, max_blocks, bs, cfg, (Hq // Hkv) * D * 4)
    o_part = o if splits == 1 else alloc.empty((N, splits, Hq, D), torch.float32, q.device)
    lse_part = alloc.empty((N, splits, Hq), torch.float32, q.device)
    GP = max(16, triton.next_power_of_2(G))
    DP = max(16, triton.next_power_of_2(D))
    bn = cfg.get("block_n") or block_n(cfg, DP, k_cache.element_size())
    _partial_kernel[(N, Hkv, splits)](
        q, k_cache, v_cache, block_table, seq_lens, o_part, lse_part, g_args[0],
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_table.stride(0), *g_args[1:],
        nb, max_blocks, bs, Hq, G, D, scale * math.log2(math.e), splits,
        GP=GP, DP=DP, BLOCK_N=bn, DOT_F32=interpreting() or k_cache.dtype == torch.float32,
        HAS_GATE=gate is not None, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **pdl_args())
    if splits > 1:
        sb = min(triton.next_power_of_2(splits), max(1, MERGE_VALUES // DP))
        _merge_kernel[(N, Hq)](o_part, lse_part, o, seq_lens, *g_args, max_blocks * bs, Hq, D, splits, BLOCK_N=bn,
                               DP=DP, SB=sb, HAS_GATE=gate is not None, num_warps=4, **pdl_args())
    return o


def paged_attention_decode_triton(q, k_cache, v_cache, block_table, seq_lens, scale, gate=None):
    if q.device.type == "cpu":   # host tensors: the values are free to check (a device never syncs here)
        paged.check_values(OP, k_cache, block_table, seq_lens)
    return launch(q, k_cache, v_cache, block_table, seq_lens, scale, gate=gate)
