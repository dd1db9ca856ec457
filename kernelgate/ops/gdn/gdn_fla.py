"""fla-core (flash-linear-attention) backed GDN implementations, on KDA's slot-pool wrappers
(kda/kda_fla.py: states gathered from / scattered to the pool, skipped and empty sequences
dropped before the call, their outputs zeros). Imported only where fla imports.

fla 0.6.0's `chunk_gated_delta_rule` / `fused_recurrent_gated_delta_rule` take what gdn_prefill /
gdn_decode define: GVA (q, k [1, T, HK, K], v [1, T, HV, V], v head h reads q/k head
h // (HV // HK)), varlen `cu_seqlens` with one initial / final state per sequence ([N, HV, K, V]
fp32, K-first), L2 norm of q and k in the kernel (x / sqrt(sum x^2 + 1e-6)), g [1, T, HV] log
decay, beta [1, T, HV]. Its chunk kernels take K <= 256 and one dtype for q, k, v (the
implementations' supports say so).
"""
from __future__ import annotations

import torch
from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

from ... import alloc
from ..kda.kda_fla import memo_by_identity, slot_decode, varlen_prefill

CHUNK = 64
_CHUNKS: dict = {}


def chunk_indices(cu: torch.Tensor, cu_cpu: torch.Tensor) -> torch.Tensor:
    """fla's [chunks, 2] (sequence, chunk within it) list, built on the host from cu_cpu and
    uploaded without a sync (fla 0.6.0 has no on-device build for GDN: its own upload is a
    blocking pageable copy); once per cu_seqlens object, shared by the layers of a step."""
    def make(_):
        counts = (cu_cpu[1:] - cu_cpu[:-1] + CHUNK - 1) // CHUNK
        seq = torch.repeat_interleave(torch.arange(counts.numel()), counts)
        first = torch.repeat_interleave(counts.cumsum(0) - counts, counts)
        return alloc.upload(torch.stack([seq, torch.arange(seq.numel()) - first], 1), cu.device)
    return memo_by_identity(_CHUNKS, cu, make)


def chunk_prefill(q, k, v, g, beta, state, cu_seqlens, slots, scale=None, qk_l2norm=True, *,
                  cu_seqlens_cpu=None, slots_cpu=None):
    """gdn_prefill through fla `chunk_gated_delta_rule` (varlen, GVA, initial/final states via the slot pool)."""
    def run(q, k, v, g, beta, h0, cu, cu_cpu):
        return chunk_gated_delta_rule(q, k, v, g, beta, scale=scale, initial_state=h0, output_final_state=True,
                                      use_qk_l2norm_in_kernel=qk_l2norm, cu_seqlens=cu, cu_seqlens_cpu=cu_cpu,
                                      chunk_indices=chunk_indices(cu, cu_cpu))
    return varlen_prefill(run, q, k, v, g, beta, state, cu_seqlens, slots, cu_seqlens_cpu, slots_cpu)


def fused_recurrent_decode(q, k, v, g, beta, state, slots, scale=None, qk_l2norm=True):
    """gdn_decode through fla `fused_recurrent_gated_delta_rule` (one token per sequence)."""
    def run(q, k, v, g, beta, h0, cu):
        return fused_recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, scale=scale, initial_state=h0,
                                                output_final_state=True, use_qk_l2norm_in_kernel=qk_l2norm,
                                                cu_seqlens=cu)
    return slot_decode(run, q, k, v, g, beta, state, slots)
