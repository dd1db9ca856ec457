"""Gated full attention of Qwen3-Next / Qwen3.5 (GQA over a paged K/V cache).

    q, gate = q_proj(x) per head [Dh | Dh]          (each head's query, then its output gate)
    q, k    = rope(q_norm(q)), rope(k_norm(k_proj(x)))   per-head zero-centred RMSNorm (1 + w),
                                                          rotary on the first rotary_dim dims
                                                          (`rms_norm_rope`: one launch each)
    o       = o_proj(attn(q, K, V) * sigmoid(gate))

Rotary is the rotate-half form over the first `rotary_dim` = partial_rotary_factor * Dh dims
(cos / sin per token come from the model, once per step: `rotary`), applied with the norm by
the `rms_norm_rope` op (fp32 math, one rounding). The step's keys and values
are written into this layer's paged cache (layout: kernelgate/ops/attention/paged.py) by
`paged_cache_write` before attention reads them; decode steps use `paged_attention_decode`,
which applies the output gate itself (in fp32, one rounding), all others
`paged_attention_prefill` (chunks attend to their cached prefix).

Tensor parallel: this rank's H / size query heads (each with its gate) and Hkv / size K/V heads
(and their cache); the q / k norms are replicated; o_proj's output is a partial sum.
"""
from __future__ import annotations

import torch
from torch import nn

from .. import ops
from . import quant
from .layers import OffsetRMSNorm
from .parallel import SINGLE, column, fuse, row


def rotary_inv_freq(rotary_dim: int, theta: float, device) -> torch.Tensor:
    """The rotary frequencies fp32 [rotary_dim // 2]: theta ** -(2i / rotary_dim)."""
    return 1.0 / theta ** (torch.arange(0, rotary_dim, 2, device=device, dtype=torch.float32) / rotary_dim)


def rotary(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple:
    """positions [T], inv_freq (rotary_inv_freq) -> (cos, sin) fp32 [T, rotary_dim // 2]."""
    freqs = positions.float()[:, None] * inv_freq[None, :]
    return freqs.cos(), freqs.sin()


class GatedAttention(nn.Module):
    def __init__(self, c, layer_idx: int, par=SINGLE):
        super().__init__()
        self.layer_idx, self.par = layer_idx, par
        D, H, Hkv, Dh = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.H = par.split(H, "num_attention_heads")
        self.Hkv = par.split(Hkv, "num_key_value_heads (K/V heads are split, not replicated)")
        self.Dh = Dh
        self.scale = Dh ** -0.5
        self.q_proj = column(D, H * 2 * Dh, par, "attention q|gate")     # per head: [q_h | gate_h]
        self.k_proj = column(D, Hkv * Dh, par, "attention k")
        self.v_proj = column(D, Hkv * Dh, par, "attention v")
        self.o_proj = row(H * Dh, D, par, "attention o")
        self.q_norm = OffsetRMSNorm(Dh, c.rms_norm_eps)
        self.k_norm = OffsetRMSNorm(Dh, c.rms_norm_eps)
        fuse(self, "qkv_proj", ["q_proj", "k_proj", "v_proj"])

    def forward(self, x: torch.Tensor, batch, cache, rope: tuple) -> torch.Tensor:
        """x [T, D] packed tokens of `batch`; rope: (cos, sin) [T, rotary_dim // 2] of their positions."""
        H, Hkv, Dh = self.H, self.Hkv, self.Dh
        T = x.shape[0]
        qg, k, v = quant.linear(x, self, "qkv_proj").split([2 * H * Dh, Hkv * Dh, Hkv * Dh], dim=-1)
        qg = qg.view(T, H, 2 * Dh)
        gate = qg[..., Dh:]                                                                       # [T, H, Dh] view
        # per-head zero-centred norm + rotary in one launch each, q read in place from the projection
        q = ops.rms_norm_rope(qg[..., :Dh], self.q_norm.scale(), *rope, self.q_norm.eps)          # [T, H, Dh]
        k = ops.rms_norm_rope(k.view(T, Hkv, Dh), self.k_norm.scale(), *rope, self.k_norm.eps)    # [T, Hkv, Dh]
        k_cache, v_cache = cache.k_cache[self.layer_idx], cache.v_cache[self.layer_idx]   # [NB, bs, Hkv, Dh]
        # both caches in one launch, rows from the device-side mapping (no host sync, capturable)
        ops.paged_cache_write(batch.slot_mapping, k.to(k_cache.dtype), k_cache, v.to(v_cache.dtype), v_cache)
        if batch.decode:   # the output gate applied where the attention output is final
            o = ops.paged_attention_decode(q, k_cache, v_cache, batch.block_table, batch.seq_lens, self.scale,
                                           gate=gate)
        else:
            o = ops.paged_attention_prefill(q, k_cache, v_cache, batch.block_table, batch.cu_seqlens,
                                            batch.seq_lens, self.scale, cu_seqlens_cpu=batch.cu_seqlens_cpu,
                                            seq_lens_cpu=batch.seq_lens_cpu) * torch.sigmoid(gate)   # [T, H, Dh]
        return self.par.all_reduce(self.o_proj(o.reshape(T, H * Dh)))
