"""Gated DeltaNet layer (the "linear attention" layers of Qwen3-Next / Qwen3.5).

    q|k|v = conv_silu(in_proj_qkv(x))       short causal depthwise conv, per-sequence conv state
    z     = in_proj_z(x)                    [T, HV, V] output gate
    g     = -exp(A_log) * softplus(in_proj_a(x) + dt_bias)    [T, HV] fp32 log decay
    beta  = sigmoid(in_proj_b(x))                              [T, HV]
    o     = GDN(l2norm(q), l2norm(k), v, g, beta; state[slot])  [T, HV, V] (HV // HK v heads per q/k head)
    out   = out_proj(gated_rms_norm(o, norm, silu(z)))          per head over V

The four input projections are one matrix (`in_proj`: one matmul reads x once), each keeping
its parameter name (Qwen3.5's names; the loader de-interleaves Qwen3-Next's fused
in_proj_qkvz / in_proj_ba into them). Prefill goes through `short_conv` + `gdn_gate` +
`gdn_prefill` (varlen, cu_seqlens + slots); decode through `short_conv_update` +
`gdn_packed_decode`. The registry picks the kernels; nothing here looks at the platform.

Tensor parallel: this rank's HK / size key heads and HV / size value heads (their q | k | v rows
-- segments of unequal size, v being wider --, z / b / a rows, conv channels, decay and states;
value head j of a rank still reads its key head j // (HV / HK)); the norm is replicated;
out_proj's output is a partial sum, reduced once here.
"""
from __future__ import annotations

import torch
from torch import nn

from .. import ops
from . import quant
from .layers import _param
from .parallel import SINGLE, column, fuse, mark, row


class GatedDeltaNet(nn.Module):
    def __init__(self, c, layer_idx: int, par=SINGLE):
        super().__init__()
        self.layer_idx, self.par = layer_idx, par
        D = c.hidden_size
        HK, HV = c.linear_num_key_heads, c.linear_num_value_heads
        self.K, self.V = K, V = c.linear_key_head_dim, c.linear_value_head_dim
        self.HK = par.split(HK, "linear_num_key_heads (Gated DeltaNet key heads)")
        self.HV = par.split(HV, "linear_num_value_heads (Gated DeltaNet value heads)")
        self.eps = c.rms_norm_eps
        qkv = (HK * K, HK * K, HV * V)                                  # q | k | v rows (full sizes)
        self.C = sum(qkv) // par.size                                   # this rank's conv channels
        self.in_proj_qkv = column(D, sum(qkv), par, "Gated DeltaNet q|k|v", qkv)
        self.in_proj_z = column(D, HV * V, par, "Gated DeltaNet z")
        self.in_proj_b = column(D, HV, par, "Gated DeltaNet b")
        self.in_proj_a = column(D, HV, par, "Gated DeltaNet a")
        self.conv1d = nn.Module()
        self.conv1d.weight = _param(self.C, c.conv_kernel_size)         # [C, W] depthwise taps
        mark(self.conv1d, "weight", 0, qkv)
        self.A_log = _param(self.HV, dtype=torch.float32)
        self.dt_bias = _param(self.HV, dtype=torch.float32)
        mark(self, "A_log", 0)
        mark(self, "dt_bias", 0)
        self.norm = nn.Module()
        self.norm.weight = _param(self.V)
        self.out_proj = row(HV * V, D, par, "Gated DeltaNet out")
        fuse(self, "in_proj", ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"])

    def forward(self, x: torch.Tensor, batch, cache) -> torch.Tensor:
        """x [T, D] packed tokens of `batch`; states read from and written to `cache`'s slots
        (a prefill chunk starts from the state the previous chunk left there)."""
        HV, V = self.HV, self.V
        T = x.shape[0]
        conv_state = cache.conv_state[self.layer_idx]                  # [S, C, W-1]
        state = cache.gdn_state[self.layer_idx]                        # [S, HV, K, V] fp32
        mixed, z, b, a = quant.linear(x, self, "in_proj").split([self.C, HV * V, HV, HV], dim=-1)
        d = T if batch.decode else batch.leading_decodes
        if d == T:
            o = self._decode(mixed, a, b, conv_state, state, batch.slots)
        else:
            # a mixed step: its decoding sequences (first in the batch) take the one-token kernels;
            # through the chunked prefill each would cost a whole chunk of its kernels' work
            o = self._prefill(mixed[d:], a[d:], b[d:], conv_state, state, *batch.prefill_part(d))
            if d:
                o = torch.cat([self._decode(mixed[:d], a[:d], b[:d], conv_state, state, batch.slots[:d]), o])
        o = ops.gated_rms_norm(o, self.norm.weight, z.reshape(T, HV, V), self.eps, activation="silu")
        return self.par.all_reduce(self.out_proj(o.reshape(T, HV * V)))

    def _decode(self, mixed, a, b, conv_state, state, slots):
        """One new token per sequence: conv update + gate + delta rule in two launches -> [N, HV, V]."""
        qkv = ops.short_conv_update(mixed, self.conv1d.weight, None, conv_state, slots, "silu")
        return ops.gdn_packed_decode(qkv, a, b, self.A_log, self.dt_bias, state, slots, self.HK, self.HV, self.K)

    def _prefill(self, mixed, a, b, conv_state, state, cu, slots, cu_cpu, slots_cpu):
        """Varlen chunks (cu / slots: this part's own) -> [T, HV, V]."""
        T, HK, HV, K, V = mixed.shape[0], self.HK, self.HV, self.K, self.V
        q, k, v = ops.short_conv(mixed, self.conv1d.weight, None, conv_state, cu, slots, "silu",
                                 cu_seqlens_cpu=cu_cpu, split=(HK * K, HK * K, HV * V))   # contiguous parts
        g = ops.gdn_gate(a, self.A_log, self.dt_bias)                # [T, HV] fp32
        return ops.gdn_prefill(q.reshape(T, HK, K), k.reshape(T, HK, K), v.reshape(T, HV, V), g,
                               torch.sigmoid(b.float()).to(mixed.dtype), state, cu, slots,
                               cu_seqlens_cpu=cu_cpu, slots_cpu=slots_cpu)   # [T, HV, V]
