"""Multi-head latent attention (MLA) of Kimi Linear, NoPE: no rotary anywhere.

Per token the cache keeps one latent row [R + Dr]: c = rms(kv_a(x)[:R]) and the shared key
part k_r = kv_a(x)[R:] (called "rope" in DeepSeek, unrotated here). With W_uk [H, Dn, R] and
W_uv [H, Dv, R] from kv_b_proj, head h scores and outputs are

    s[t, j] = scale * (q_n[t] . W_uk c[j] + q_r[t] . k_r[j]),   o[t] = W_uv sum_j p[t, j] c[j]

Prefill expands keys/values per head and uses SDPA; decode absorbs W_uk into the query and
W_uv into the output, so it attends directly over the latent cache (MQA with width R + Dr).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .layers import RMSNorm


class MLAttention(nn.Module):
    def __init__(self, c, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.H, self.R, self.Dr = c.num_attention_heads, c.kv_lora_rank, c.qk_rope_head_dim
        self.Dn, self.Dv = c.qk_nope_head_dim, c.v_head_dim
        self.scale = c.qk_head_dim ** -0.5
        H, D = self.H, c.hidden_size
        if c.q_lora_rank is None:
            self.q_proj = nn.Linear(D, H * c.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(D, c.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(c.q_lora_rank, c.rms_norm_eps)
            self.q_b_proj = nn.Linear(c.q_lora_rank, H * c.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(D, self.R + self.Dr, bias=False)
        self.kv_a_layernorm = RMSNorm(self.R, c.rms_norm_eps)
        self.kv_b_proj = nn.Linear(self.R, H * (self.Dn + self.Dv), bias=False)
        self.o_proj = nn.Linear(H * self.Dv, D, bias=False)

    def _q(self, x):
        if hasattr(self, "q_proj"):
            return self.q_proj(x)
        return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))

    def forward(self, x: torch.Tensor, batch, pool) -> torch.Tensor:
        """x [T, D] packed tokens of `batch`; latents written to pool.mla_cache at their positions."""
        T = x.shape[0]
        cache = pool.mla_cache[self.layer_idx]                       # [S, L, R + Dr]
        q = self._q(x).view(T, self.H, self.Dn + self.Dr)            # [T, H, Dn + Dr]
        c, k_r = self.kv_a_proj_with_mqa(x).split([self.R, self.Dr], dim=-1)
        latent = torch.cat([self.kv_a_layernorm(c), k_r], dim=-1)    # [T, R + Dr]
        if batch.decode:   # device-side positions: no host sync, capturable in a graph
            cache[batch.slots.long(), batch.starts_dev.long()] = latent.to(cache.dtype)
            o = self._decode(q, cache, batch)
        else:
            o = torch.empty(T, self.H, self.Dv, dtype=x.dtype, device=x.device)
            # host copies of the metadata where the engine has them: no device sync per layer
            bounds = (batch.cu_seqlens if batch.cu_seqlens_cpu is None else batch.cu_seqlens_cpu).tolist()
            slots = (batch.slots if batch.slots_cpu is None else batch.slots_cpu).tolist()
            for i, (s, n) in enumerate(zip(slots, batch.lengths)):
                t0, t1, p0 = bounds[i], bounds[i + 1], batch.starts[i]
                cache[s, p0:p0 + n] = latent[t0:t1].to(cache.dtype)
                o[t0:t1] = self._prefill(q[t0:t1], cache[s, :p0 + n], p0)
        return self.o_proj(o.reshape(T, self.H * self.Dv))

    def _prefill(self, q, ctx, p0):
        """q [n, H, Dn+Dr] at positions p0..p0+n-1; ctx [p0+n, R+Dr] cached latents -> [n, H, Dv]."""
        n, L = q.shape[0], ctx.shape[0]
        kv = self.kv_b_proj(ctx[:, :self.R].to(q.dtype)).view(L, self.H, self.Dn + self.Dv)
        k_n, v = kv.split([self.Dn, self.Dv], dim=-1)                # [L, H, Dn], [L, H, Dv]
        k_r = ctx[:, self.R:].to(q.dtype)[:, None].expand(L, self.H, self.Dr)
        k = torch.cat([k_n, k_r], dim=-1)                            # [L, H, Dn + Dr]
        mask = None
        if p0:  # queries start mid-sequence: row t sees keys 0..p0+t
            mask = torch.ones(n, L, dtype=torch.bool, device=q.device).tril(p0)
        # 4-D [1, H, n, D]: the fused SDPA kernels (flash / memory-efficient / cuDNN) take only
        # batched inputs; 3-D falls back to the unfused math path (measured 10x slower at 8k)
        o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                           attn_mask=mask, is_causal=mask is None, scale=self.scale)
        return o[0].transpose(0, 1)

    def _decode(self, q, cache, batch):
        """q [N, H, Dn+Dr], one token per sequence -> [N, H, Dv], attending over the latent cache."""
        w = self.kv_b_proj.weight.view(self.H, self.Dn + self.Dv, self.R)
        w_uk, w_uv = w[:, :self.Dn], w[:, self.Dn:]                  # [H, Dn, R], [H, Dv, R]
        q_n, q_r = q.split([self.Dn, self.Dr], dim=-1)
        q_lat = torch.einsum("nhd,hdr->nhr", q_n, w_uk)              # [N, H, R]
        q_all = torch.cat([q_lat, q_r], dim=-1)                      # [N, H, R + Dr]
        L = batch.context_len                                        # >= every position + 1
        ctx = cache[batch.slots.long(), :L].to(q.dtype)              # [N, L, R + Dr]
        scores = torch.einsum("nhc,nlc->nhl", q_all, ctx).float() * self.scale
        valid = torch.arange(L, device=q.device)[None] <= batch.starts_dev[:, None]
        scores = scores.masked_fill(~valid[:, None], float("-inf"))
        p = torch.softmax(scores, dim=-1).to(q.dtype)                # [N, H, L]
        o_lat = torch.einsum("nhl,nlr->nhr", p, ctx[..., :self.R])   # [N, H, R]
        return torch.einsum("nhr,hvr->nhv", o_lat, w_uv)             # [N, H, Dv]
