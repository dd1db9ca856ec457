"""Kimi Delta Attention layer (the "linear attention" layers of Kimi Linear).

    qkv = conv_silu([q|k|v](x))           short causal depthwise conv, per-sequence conv state
    g   = -exp(A_log) * softplus(f_b(f_a(x)) + dt_bias)         [T, H, K] fp32 log decay
    beta = sigmoid(b(x))                                        [T, H]
    o   = KDA(l2norm(q), l2norm(k), v, g, beta; state[slot])    [T, H, V]
    out = o_proj(gated_rms_norm(o, o_norm, sigmoid gate g_b(g_a(x))))

q|k|v, f_a, g_a and b are one matrix (`in_proj`: one matmul reads x once), f_b and g_b one
batched matmul (`up_proj`); each keeps its own parameter name, a view into the matrix.

Prefill goes through `short_conv` + `kda_gate` + `kda_prefill` (varlen, cu_seqlens + slots);
decode through `short_conv_update` + `kda_packed_decode` (gate, beta, l2norm, update and
output in one op). The registry picks the kernels; nothing here looks at the platform.
The batch's host copies of cu_seqlens / slots go to the prefill ops as hints (no syncs).
"""
from __future__ import annotations

import torch
from torch import nn

from .. import ops
from . import quant
from .layers import _param
from .parallel import SINGLE, column, fuse, mark, row


class KimiDeltaAttention(nn.Module):
    def __init__(self, c, layer_idx: int, par=SINGLE):
        """Tensor parallel: this rank's H / size heads (projections, conv channels, decay and
        states); f_a / g_a (D -> K) and the norm are replicated; o_proj's output is a partial sum."""
        super().__init__()
        self.layer_idx, self.par = layer_idx, par
        K, D = c.linear_head_dim, c.hidden_size
        H = par.split(c.linear_num_heads, "linear_num_heads (KDA heads)")
        self.H, self.K, self.eps = H, K, c.rms_norm_eps
        self.qkv_proj = column(D, 3 * H * K * par.size, par, "KDA q|k|v", 3)   # q | k | v rows
        self.conv1d = nn.Module()
        self.conv1d.weight = _param(3 * H * K, c.conv_kernel_size)  # [3HK, W] depthwise taps
        mark(self.conv1d, "weight", 0, 3)
        self.f_a_proj = nn.Linear(D, K, bias=False)
        # f_b / g_b ([HK, K], 1 MB each in bf16) stay in the model dtype in an FP8 model too: at one
        # token two FP8 launches cost more than the one batched matmul below reads
        self.f_b_proj = column(K, H * K * par.size, par, "KDA f_b", quantize=False)
        self.dt_bias = _param(H * K, dtype=torch.float32)
        self.A_log = _param(H, dtype=torch.float32)
        mark(self, "dt_bias", 0)
        mark(self, "A_log", 0)
        self.b_proj = column(D, H * par.size, par, "KDA b")
        self.g_a_proj = nn.Linear(D, K, bias=False)
        self.g_b_proj = column(K, H * K * par.size, par, "KDA g_b", quantize=False)
        self.o_norm = nn.Module()
        self.o_norm.weight = _param(K)
        self.o_proj = row(H * K * par.size, D, par, "KDA o")
        # every projection of x in one matmul, f_b and g_b in one batched matmul (a decode step of
        # few tokens is bound by launches, not bytes: 4 small GEMMs fewer per layer)
        fuse(self, "in_proj", ["qkv_proj", "f_a_proj", "g_a_proj", "b_proj"])
        fuse(self, "up_proj", ["f_b_proj", "g_b_proj"])

    def forward(self, x: torch.Tensor, batch, cache) -> torch.Tensor:
        """x [T, D] packed tokens of `batch`; states read from and written to `cache`'s slots
        (a prefill chunk starts from the state the previous chunk left there)."""
        H, K = self.H, self.K
        T = x.shape[0]
        conv_state = cache.conv_state[self.layer_idx]                # [S, 3HK, W-1]
        state = cache.kda_state[self.layer_idx]                      # [S, H, K, V] fp32
        y = quant.linear(x, self, "in_proj")                        # [T, 3HK + K + K + H]
        mixed, fg_a, b = y.split([3 * H * K, 2 * K, H], dim=-1)     # q|k|v, f_a|g_a, beta logits
        f, gate = self._up(fg_a)                                    # raw decay input, output gate
        d = T if batch.decode else batch.leading_decodes
        if d == T:
            o = self._decode(mixed, f, b, conv_state, state, batch.slots)
        else:
            # a mixed step: its decoding sequences (first in the batch) take the one-token kernels;
            # through the chunked prefill each would cost a whole chunk of its kernels' work
            o = self._prefill(mixed[d:], f[d:], b[d:], conv_state, state, *batch.prefill_part(d))
            if d:
                o = torch.cat([self._decode(mixed[:d], f[:d], b[:d], conv_state, state, batch.slots[:d]), o])
        o = ops.gated_rms_norm(o, self.o_norm.weight, gate, self.eps, activation="sigmoid")
        return self.par.all_reduce(self.o_proj(o.reshape(T, H * K)))

    def _up(self, fg_a):
        """f_b(f_a) [T, HK] and g_b(g_a) [T, H, K] from fg_a = f_a | g_a [T, 2K]: one batched matmul."""
        T, H, K = fg_a.shape[0], self.H, self.K
        fg = torch.bmm(fg_a.view(T, 2, K).transpose(0, 1), self.up_proj.view(2, H * K, K).transpose(1, 2))
        return fg[0], fg[1].view(T, H, K)

    def _decode(self, mixed, f, b, conv_state, state, slots):
        """One new token per sequence: conv update + gate + delta rule in two launches -> [N, H, V]."""
        qkv = ops.short_conv_update(mixed, self.conv1d.weight, None, conv_state, slots, "silu")
        return ops.kda_packed_decode(qkv, f, b, self.A_log, self.dt_bias, state, slots, self.H, self.K)

    def _prefill(self, mixed, f, b, conv_state, state, cu, slots, cu_cpu, slots_cpu):
        """Varlen chunks (cu / slots: this part's own) -> [T, H, V]."""
        T, H, K = mixed.shape[0], self.H, self.K
        qkv = ops.short_conv(mixed, self.conv1d.weight, None, conv_state, cu, slots, "silu", cu_seqlens_cpu=cu_cpu,
                             split=(H * K,) * 3)                    # q, k, v contiguous: no copy of a view
        q, k, v = (t.view(T, H, K) for t in qkv)
        g = ops.kda_gate(f, self.A_log, self.dt_bias)               # [T, H, K] fp32
        return ops.kda_prefill(q, k, v, g, torch.sigmoid(b.float()).to(mixed.dtype), state, cu, slots,
                               cu_seqlens_cpu=cu_cpu, slots_cpu=slots_cpu)
