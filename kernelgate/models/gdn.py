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
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .. import ops
from .layers import _param
from .parallel import fuse


class GatedDeltaNet(nn.Module):
    def __init__(self, c, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        D = c.hidden_size
        self.HK, self.HV = c.linear_num_key_heads, c.linear_num_value_heads
        self.K, self.V = c.linear_key_head_dim, c.linear_value_head_dim
        self.eps = c.rms_norm_eps
        self.C = c.conv_dim                                             # q | k | v channels
        self.in_proj_qkv = nn.Linear(D, self.C, bias=False)
        self.in_proj_z = nn.Linear(D, self.HV * self.V, bias=False)
        self.in_proj_b = nn.Linear(D, self.HV, bias=False)
        self.in_proj_a = nn.Linear(D, self.HV, bias=False)
        self.conv1d = nn.Module()
        self.conv1d.weight = _param(self.C, c.conv_kernel_size)         # [C, W] depthwise taps
        self.A_log = _param(self.HV, dtype=torch.float32)
        self.dt_bias = _param(self.HV, dtype=torch.float32)
        self.norm = nn.Module()
        self.norm.weight = _param(self.V)
        self.out_proj = nn.Linear(self.HV * self.V, D, bias=False)
        fuse(self, "in_proj", ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"])

    def forward(self, x: torch.Tensor, batch, cache) -> torch.Tensor:
        """x [T, D] packed tokens of `batch`; states read from and written to `cache`'s slots
        (a prefill chunk starts from the state the previous chunk left there)."""
        HK, HV, K, V = self.HK, self.HV, self.K, self.V
        T = x.shape[0]
        conv_state = cache.conv_state[self.layer_idx]                  # [S, C, W-1]
        state = cache.gdn_state[self.layer_idx]                        # [S, HV, K, V] fp32
        mixed, z, b, a = F.linear(x, self.in_proj).split([self.C, HV * V, HV, HV], dim=-1)
        if batch.decode:
            qkv = ops.short_conv_update(mixed, self.conv1d.weight, None, conv_state, batch.slots, "silu")
            o = ops.gdn_packed_decode(qkv, a, b, self.A_log, self.dt_bias, state, batch.slots, HK, HV, K)
        else:
            cu_cpu, slots_cpu = batch.cu_seqlens_cpu, batch.slots_cpu   # host copies (None: ops sync)
            qkv = ops.short_conv(mixed, self.conv1d.weight, None, conv_state, batch.cu_seqlens,
                                 batch.slots, "silu", cu_seqlens_cpu=cu_cpu)
            q, k, v = qkv.split([HK * K, HK * K, HV * V], dim=-1)
            g = ops.gdn_gate(a, self.A_log, self.dt_bias)              # [T, HV] fp32
            o = ops.gdn_prefill(q.reshape(T, HK, K), k.reshape(T, HK, K), v.reshape(T, HV, V), g,
                                torch.sigmoid(b.float()).to(x.dtype), state, batch.cu_seqlens, batch.slots,
                                cu_seqlens_cpu=cu_cpu, slots_cpu=slots_cpu)  # [T, HV, V]
        o = ops.gated_rms_norm(o, self.norm.weight, z.reshape(T, HV, V), self.eps, activation="silu")
        return self.out_proj(o.reshape(T, HV * V))
