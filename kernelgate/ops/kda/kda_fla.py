"""fla-core (flash-linear-attention) backed KDA implementations. The registry imports this module
only where fla imports (the implementations require "fla"), on first use or in registry.preload.

fla keeps one state per sequence of the call ([N, H, K, V], K-first like our pool), so the
wrappers gather the initial states from the slot pool and scatter the final states back.
Sequences with slot < 0 or >= the pool size, no tokens or out-of-range bounds are dropped
before the call; their outputs are zeros.
"""
from __future__ import annotations

import torch
from fla.ops.kda import chunk_kda, fused_recurrent_kda

from ... import alloc


def _kept(slots, pool, cu_seqlens=None, slots_cpu=None, cu_seqlens_cpu=None, total=0):
    """(indices of the sequences that run, slot list, bounds list or None), all host lists.
    From the host hints when given; else a device->host copy (a sync on GPUs). A sequence
    runs when its slot is in [0, pool) and its rows are a non-empty range inside [0, total)."""
    sl = (slots if slots_cpu is None else slots_cpu).tolist()
    if cu_seqlens is None:
        return [n for n, s in enumerate(sl) if 0 <= s < pool], sl, None
    cu = (cu_seqlens if cu_seqlens_cpu is None else cu_seqlens_cpu).tolist()
    return [n for n, s in enumerate(sl) if 0 <= s < pool and 0 <= cu[n] < cu[n + 1] <= total], sl, cu


_LONG: dict = {}


def memo_by_identity(cache: dict, t: torch.Tensor, make):
    """make(t), computed once per tensor object (batch metadata is never written in place; inference
    tensors have no version counter). The entry keeps t alive, so its id is not reused."""
    hit = cache.get(id(t))
    if hit is None or hit[0] is not t:
        if len(cache) >= 8:
            cache.clear()
        hit = cache[id(t)] = (t, make(t))
    return hit[1]


def _long(t: torch.Tensor) -> torch.Tensor:
    """t as int64, the same object for repeated calls with the same tensor: fla memoizes its chunk
    indices by argument identity, so the layers of one engine step (sharing the batch's cu_seqlens)
    compute them once, not once per layer."""
    return t if t.dtype == torch.long else memo_by_identity(_LONG, t, torch.Tensor.long)


def chunk_prefill(q, k, v, g, beta, state, cu_seqlens, slots, scale=None, qk_l2norm=True, *,
                  cu_seqlens_cpu=None, slots_cpu=None):
    """kda_prefill through fla `chunk_kda` (varlen, initial/final states via the slot pool)."""
    def run(q, k, v, g, beta, h0, cu, cu_cpu):
        # use_graph: fla builds its chunk list on the device (fixed size, ceil(T / 64) + N - 1 rows,
        # the unused ones skipped by the kernels) instead of on the host and uploading it with a
        # blocking copy: without it every eager step waits here for the device to drain
        return chunk_kda(q, k, v, g, beta, scale=scale, initial_state=h0, output_final_state=True,
                         use_qk_l2norm_in_kernel=qk_l2norm, cu_seqlens=cu, cu_seqlens_cpu=cu_cpu, use_graph=True)
    return varlen_prefill(run, q, k, v, g, beta, state, cu_seqlens, slots, cu_seqlens_cpu, slots_cpu)


def varlen_prefill(run, q, k, v, g, beta, state, cu_seqlens, slots, cu_seqlens_cpu, slots_cpu):
    """A delta-rule prefill through an fla varlen chunk kernel `run(q, k, v, g, beta, h0, cu_seqlens,
    cu_seqlens_cpu) -> (o, final states)` ([1, T, ...] inputs, int64 bounds, [N, H, K, V] states).

    fla takes neither skipped nor empty sequences, so when some are present the tokens of
    the others are compacted ([Tk] index `tok`), run, and scattered back into zeros."""
    kept, sl, cu = _kept(slots, state.shape[0], cu_seqlens, slots_cpu, cu_seqlens_cpu, q.shape[0])
    N = len(sl)
    # every sequence runs and together they cover [0, T) (kept ranges are non-decreasing)
    whole = len(kept) == N and cu[0] == 0 and cu[-1] == q.shape[0]
    if whole:
        run_cu = _long(cu_seqlens)
        run_cu_cpu = torch.tensor(cu, dtype=torch.long) if cu_seqlens_cpu is None else _long(cu_seqlens_cpu)
        idx = slots.long()
        qr, kr, vr, gr, br = q, k, v, g, beta
    else:
        if not kept:
            return torch.zeros(v.shape, dtype=v.dtype, device=v.device)
        lens = [cu[n + 1] - cu[n] for n in kept]
        run_cu_cpu = torch.tensor([0] + lens, dtype=torch.long).cumsum(0)                  # [Nk+1]
        tok = torch.cat([torch.arange(cu[n], cu[n + 1]) for n in kept])                    # [Tk]
        # one upload: token rows | compacted bounds | slots of the kept sequences
        tok, run_cu, idx = alloc.upload_parts([tok, run_cu_cpu, torch.tensor([sl[n] for n in kept])], q.device)
        qr, kr, vr, gr, br = (x.index_select(0, tok) for x in (q, k, v, g, beta))
    h0 = state.index_select(0, idx)                                                       # [Nk, H, K, V]
    o, ht = run(qr[None], kr[None], vr[None], gr[None].float(), br[None], h0, run_cu, run_cu_cpu)
    state.index_copy_(0, idx, ht.float())
    if whole:
        return o[0]
    return torch.zeros(v.shape, dtype=v.dtype, device=v.device).index_copy_(0, tok, o[0])


def fused_recurrent_decode(q, k, v, g, beta, state, slots, scale=None, qk_l2norm=True):
    """kda_decode through fla `fused_recurrent_kda` (one token per sequence)."""
    def run(q, k, v, g, beta, h0, cu):
        return fused_recurrent_kda(q, k, v, g, beta, scale=scale, initial_state=h0, output_final_state=True,
                                   use_qk_l2norm_in_kernel=qk_l2norm, cu_seqlens=cu)
    return slot_decode(run, q, k, v, g, beta, state, slots)


def slot_decode(run, q, k, v, g, beta, state, slots):
    """A delta-rule decode step through an fla varlen recurrent kernel `run(q, k, v, g, beta, h0,
    cu_seqlens) -> (o, final states)` on the sequences whose slots are in the pool."""
    N = q.shape[0]
    kept, _, _ = _kept(slots, state.shape[0])
    o = alloc.empty(v.shape, v.dtype, v.device)
    if len(kept) < N:
        o.zero_()
        if not kept:
            return o
    sel = torch.tensor(kept, dtype=torch.long, device=q.device)
    idx = slots.long().index_select(0, sel)
    pick = (lambda t: t.index_select(0, sel)) if len(kept) < N else (lambda t: t)
    cu = torch.arange(len(kept) + 1, dtype=torch.long, device=q.device)
    out, ht = run(pick(q)[None], pick(k)[None], pick(v)[None], pick(g)[None].float(), pick(beta)[None],
                  state.index_select(0, idx), cu)
    state.index_copy_(0, idx, ht.float())
    o.index_copy_(0, sel, out[0])
    return o
