"""Multi-head latent attention (MLA) of Kimi Linear, NoPE: no rotary anywhere.

Per token the cache keeps one latent row [R + Dr]: c = rms(kv_a(x)[:R]) and the shared key
part k_r = kv_a(x)[R:] (called "rope" in DeepSeek, unrotated here). With W_uk [H, Dn, R] and
W_uv [H, Dv, R] from kv_b_proj, head h scores and outputs are

    s[t, j] = scale * (q_n[t] . W_uk c[j] + q_r[t] . k_r[j]),   o[t] = W_uv sum_j p[t, j] c[j]

Latents live in a paged cache (kernelgate/ops/mla/paged.py). Prefill chunks go through
`mla_prefill` (keys / values expanded per head, attending to the cached prefix); decode
through `mla_decode`: W_uk absorbed into the query and W_uv into the output, so it attends
directly over the latent cache (MQA with width R + Dr).
"""
from __future__ import annotations

import torch
from torch import nn

from .. import ops
from . import quant
from .layers import RMSNorm
from .parallel import SINGLE, column, fuse, row


class MLAttention(nn.Module):
    def __init__(self, c, layer_idx: int, par=SINGLE):
        """Tensor parallel: this rank's H / size heads (q, kv_b, o_proj's input); the latent
        projections (q_a, kv_a) and the latent cache are replicated; o_proj gives a partial sum."""
        super().__init__()
        self.layer_idx, self.par = layer_idx, par
        self.H = par.split(c.num_attention_heads, "num_attention_heads (MLA heads)")
        self.R, self.Dr = c.kv_lora_rank, c.qk_rope_head_dim
        self.Dn, self.Dv = c.qk_nope_head_dim, c.v_head_dim
        self.scale = c.qk_head_dim ** -0.5
        H, D, n = self.H, c.hidden_size, par.size
        if c.q_lora_rank is None:
            self.q_proj = column(D, n * H * c.qk_head_dim, par, "MLA q")
        else:
            self.q_a_proj = nn.Linear(D, c.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(c.q_lora_rank, c.rms_norm_eps)
            self.q_b_proj = column(c.q_lora_rank, n * H * c.qk_head_dim, par, "MLA q_b")
        self.kv_a_proj_with_mqa = nn.Linear(D, self.R + self.Dr, bias=False)
        self.kv_a_layernorm = RMSNorm(self.R, c.rms_norm_eps)
        # read as a tensor (absorbed into the query and output): stays in the model dtype in an FP8 model
        self.kv_b_proj = column(self.R, n * H * (self.Dn + self.Dv), par, "MLA kv_b", quantize=False)
        self.o_proj = row(n * H * self.Dv, D, par, "MLA o")
        # the query (or its low-rank half) and the latent projection read x in one matmul
        self.q_in = "q_proj" if c.q_lora_rank is None else "q_a_proj"
        fuse(self, "in_proj", [self.q_in, "kv_a_proj_with_mqa"])

    def _q(self, q_in):
        """The first projection's output -> q [T, H * (Dn + Dr)]."""
        if self.q_in == "q_proj":
            return q_in
        return self.q_b_proj(self.q_a_layernorm(q_in))

    def forward(self, x: torch.Tensor, batch, cache) -> torch.Tensor:
        """x [T, D] packed tokens of `batch`; their latents are written to this layer's paged
        cache (rows `batch.slot_mapping`) before attention reads them."""
        T = x.shape[0]
        kv = cache.mla_cache[self.layer_idx]                         # [NB, bs, R + Dr]
        q_in, c, k_r = quant.linear(x, self, "in_proj").split([getattr(self, self.q_in).weight.shape[0], self.R, self.Dr], dim=-1)
        q = self._q(q_in).view(T, self.H, self.Dn + self.Dr)         # [T, H, Dn + Dr]
        # the latent [normed c | k_r] written as its two parts into the cache's two column ranges, in one
        # launch (no concatenation); device-side rows: no host sync, capturable in a graph
        ops.paged_cache_write(batch.slot_mapping, self.kv_a_layernorm(c).to(kv.dtype), kv[..., :self.R],
                              k_r.to(kv.dtype), kv[..., self.R:])
        w_kv = self.kv_b_proj.weight.view(self.H, self.Dn + self.Dv, self.R)
        d = T if batch.decode else batch.leading_decodes
        if d == T:
            o = self._absorbed(q, kv, w_kv, batch.block_table, batch.seq_lens)
        else:
            # a mixed step: the decoding sequences (first in the batch) attend through the absorbed
            # kernel over their latents; expanding a long context per head for one query (the
            # prefill form) would cost a prefill chunk's attention per decode
            o = torch.empty(T, self.H, self.Dv, dtype=q.dtype, device=q.device)
            if d and batch.decode_view is not None:          # (padded to a captured graph's shape)
                table, lens = batch.decode_view
                q_d = torch.cat([q[:d], q.new_zeros(table.shape[0] - d, *q.shape[1:])])
                o[:d] = self._absorbed(q_d, kv, w_kv, table, lens)[:d]
            elif d:
                o[:d] = self._absorbed(q[:d], kv, w_kv, batch.block_table[:d], batch.seq_lens[:d])
            # host copies of the lengths where the engine has them: no device sync per layer
            cu = batch.cu_seqlens if batch.cu_seqlens_cpu is None else batch.cu_seqlens_cpu
            lens = batch.seq_lens if batch.seq_lens_cpu is None else batch.seq_lens_cpu
            o[d:] = ops.mla_prefill(q[d:], kv, batch.block_table[d:], cu[d:] - cu[d], lens[d:], w_kv,
                                    self.scale, self.Dv)                             # [T - d, H, Dv]
        return self.par.all_reduce(self.o_proj(o.reshape(T, self.H * self.Dv)))

    def _absorbed(self, q, kv, w_kv, block_table, seq_lens):
        """One new token per sequence: W_uk folded into the query, W_uv applied to the latent
        output -> [N, H, Dv]."""
        q_n, q_r = q.split([self.Dn, self.Dr], dim=-1)
        q_lat = torch.einsum("nhd,hdr->nhr", q_n, w_kv[:, :self.Dn])                    # [N, H, R]
        o_lat = ops.mla_decode(torch.cat([q_lat, q_r], dim=-1), kv, block_table, seq_lens, self.scale, self.R)
        return torch.einsum("nhr,hvr->nhv", o_lat, w_kv[:, self.Dn:])                   # [N, H, Dv]

