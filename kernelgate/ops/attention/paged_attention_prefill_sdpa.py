"""`paged_attention_prefill` through torch's scaled_dot_product_attention (every platform).

Per sequence with new tokens, the context's keys and values are gathered from the paged cache
([L, Hkv, D] each: GQA keeps them compact, no per-query-head copy) and attended:

- A chunk that starts its sequence and fits one piece (L <= PIECE, a prompt's first chunk): ONE
  public SDPA call over [0, L), causal, with grouped-query heads (`enable_gqa`); cuDNN only at
  planned lengths (below). 4-D [1, H, n, D] inputs: the fused kernels take only batched inputs.
- A chunk after a cached prefix, or a longer context: the prefix [0, p0) and the chunk [p0, L)
  are cut into pieces at p0 (no bottom-right causal mask: torch's builds on torch._dynamo,
  seconds to import in a request), as in
  `mla_prefill_sdpa` (its `prefix_pieces`: on NVIDIA a piece of unplanned length cut at its last
  multiple of CUDNN_MULTIPLE), attended by its `attend_lse` (torch's fused kernels that return the lse,
  fp32 math where none takes the call) and merged by log-sum-exp in fp32. A prefix piece needs
  no mask, so the G query heads of a KV head are stacked along the query axis ([1, Hkv, G n, D]
  against [1, Hkv, P, D]): no key / value copy per query head. A chunk piece is top-left causal
  for the queries from a - p0 on; its keys and values are repeated per query head (a piece of
  at most PIECE positions).

The host plans the loop from cu_seqlens_cpu / seq_lens_cpu where given (or from the tensors
themselves when they are on the host); otherwise one device -> host copy per call.
"""
from __future__ import annotations

import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from ... import alloc
from ..common.lse_merge import LseSum
from ..mla.mla_prefill_sdpa import CUDNN_MULTIPLE, attend_lse, device_kind, prefix_pieces
from . import paged

PIECE = 16384            # context positions attended at a time (beyond one SDPA call)
# cuDNN's attention builds an execution plan for every new shape (a fraction of a second each, in
# whichever request meets the shape first): a prompt takes it only at the planned lengths
# (multiples of CUDNN_MULTIPLE, as mla_prefill_sdpa does), every other length FlashAttention-2 /
# the memory-efficient kernel / math, whichever takes it.
_ANY = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
_UNPLANNED = _ANY[1:]


def _attend_one(q, k_cache, v_cache, table_row, t0, t1, L, scale, out):
    """Output rows [t0, t1) of one sequence of L positions, written into `out` [t1 - t0, Hq, D]."""
    n = t1 - t0
    p0 = L - n
    Hq, D = q.shape[1], q.shape[2]
    Hkv = k_cache.shape[2]
    G = Hq // Hkv
    qi = q[t0:t1].transpose(0, 1)[None]                                      # [1, Hq, n, D]
    if p0 == 0 and L <= PIECE:
        k = paged.gather(k_cache, table_row, L).transpose(0, 1)[None]        # [1, Hkv, L, D]
        v = paged.gather(v_cache, table_row, L).transpose(0, 1)[None]
        with sdpa_kernel(_ANY if L % CUDNN_MULTIPLE == 0 else _UNPLANNED):
            o = F.scaled_dot_product_attention(qi, k, v, is_causal=True, scale=scale, enable_gqa=G > 1)
        out.copy_(o[0].transpose(0, 1))
        return
    total = LseSum(Hq, n, D, q.device)
    q_grouped = qi.reshape(1, Hkv, G * n, D)                                 # head h = kv * G + g
    for a, b, _ in prefix_pieces(p0, device_kind(q), PIECE):                 # prefix: every query sees it
        k = paged.gather(k_cache, table_row, b, a).transpose(0, 1)[None]     # [1, Hkv, P, D]
        v = paged.gather(v_cache, table_row, b, a).transpose(0, 1)[None]
        po, plse = attend_lse(q_grouped, k, v, scale, causal=False)
        total.add(po.reshape(Hq, n, D), plse.reshape(Hq, n))
    for a in range(p0, L, PIECE):                                            # chunk: causal, from a - p0 on
        b, first = min(a + PIECE, L), a - p0
        k = paged.gather(k_cache, table_row, b, a).transpose(0, 1).repeat_interleave(G, dim=0)[None]
        v = paged.gather(v_cache, table_row, b, a).transpose(0, 1).repeat_interleave(G, dim=0)[None]
        po, plse = attend_lse(qi[:, :, first:], k, v, scale, causal=True)
        total.add(po[0], plse[0], first)
    total.finish(out)


def paged_attention_prefill_sdpa(q, k_cache, v_cache, block_table, cu_seqlens, seq_lens, scale,
                                 cu_seqlens_cpu=None, seq_lens_cpu=None):
    bounds = (cu_seqlens if cu_seqlens_cpu is None else cu_seqlens_cpu).tolist()   # host: no sync
    lens = (seq_lens if seq_lens_cpu is None else seq_lens_cpu).tolist()
    o = alloc.empty(q.shape, q.dtype, q.device)
    for i, L in enumerate(lens):
        t0, t1 = bounds[i], bounds[i + 1]
        if t1 > t0:
            _attend_one(q, k_cache, v_cache, block_table[i], t0, t1, L, scale, o[t0:t1])
    return o
