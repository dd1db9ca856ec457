"""Qwen3-Next / Qwen3.5-MoE (text): decoder of Gated DeltaNet and gated full-attention layers
(3:1 in the released models) with sparse MoE MLPs (a gated shared expert each).

Same interface as kimi_linear.py: `model.step(tokens, batch, cache)` runs one engine step over
a varlen batch (GDN / conv states in slots, K/V in paged blocks of a LayerCache) and returns
the logits of each sequence's last token; `model(token_ids[B, T])` is a plain full-sequence
forward. Decoder norms are zero-centred (rms(x) * (1 + w)). Built only from registry ops and
plain torch: no platform branch here. Tensor / expert parallel as Kimi Linear (models/parallel.py:
each layer holds its rank's heads / experts, one all-reduce per block, vocab-parallel embedding
and logits).
"""
from __future__ import annotations

import torch
from torch import nn

from . import quant
from .batch import StepBatch
from .cache import LayerCache, spec_bytes
from .causal_lm import CausalLM, build_model, shared_recipes
from .gated_attention import GatedAttention, rotary, rotary_inv_freq
from .gdn import GatedDeltaNet
from .layers import MLP, OffsetRMSNorm
from .parallel import SINGLE, Parallel, VocabEmbedding
from .qwen3_next_config import Qwen3NextConfig
from .qwen_moe import SparseMoE


class DecoderLayer(nn.Module):
    def __init__(self, c: Qwen3NextConfig, i: int, par: Parallel = SINGLE):
        super().__init__()
        self.linear = c.layer_types[i] == "linear_attention"
        if self.linear:
            self.linear_attn = GatedDeltaNet(c, i, par)
        else:
            self.self_attn = GatedAttention(c, i, par)
        self.mlp = SparseMoE(c, par) if c.mlp_types[i] == "moe" else MLP(c.hidden_size, c.intermediate_size, par)
        self.input_layernorm = OffsetRMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = OffsetRMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, x, residual, batch, cache, rope):
        """-> (this layer's MLP output, the residual sum before it); adds folded into the norms."""
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.linear_attn(x, batch, cache) if self.linear else self.self_attn(x, batch, cache, rope)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class Backbone(nn.Module):
    def __init__(self, c: Qwen3NextConfig, par: Parallel = SINGLE):
        super().__init__()
        self.embed_tokens = VocabEmbedding(c.vocab_size, c.hidden_size, par)
        self.layers = nn.ModuleList(DecoderLayer(c, i, par) for i in range(c.num_hidden_layers))
        self.norm = OffsetRMSNorm(c.hidden_size, c.rms_norm_eps)


class Qwen3NextForCausalLM(CausalLM):
    def __init__(self, config: Qwen3NextConfig, par: Parallel = SINGLE):
        super().__init__(config, Backbone(config, par), par)
        self._inv_freq = None            # the rotary frequencies, made once on the model's device (_rope)

    def cache_specs(self, dtype: torch.dtype | None = None) -> tuple:
        """(slot_specs, block_specs) of the LayerCache: per GDN layer its recurrent state
        [HV, K, V] fp32 and conv state [C, W-1]; per full-attention layer K and V [Hkv, Dh]
        (this rank's heads and channels)."""
        c, dt, n = self.config, dtype or self.dtype, self.par.size
        gdn = [i for i, t in enumerate(c.layer_types) if t == "linear_attention"]
        attn = [i for i, t in enumerate(c.layer_types) if t == "full_attention"]
        slot = {"gdn_state": {i: ((c.linear_num_value_heads // n, c.linear_key_head_dim, c.linear_value_head_dim),
                                  torch.float32) for i in gdn},
                "conv_state": {i: ((c.conv_dim // n, c.conv_kernel_size - 1), dt) for i in gdn}}
        kv = ((c.num_key_value_heads // n, c.head_dim), dt)
        block = {"k_cache": {i: kv for i in attn}, "v_cache": {i: kv for i in attn}}
        return slot, block

    def new_cache(self, num_slots: int, num_blocks: int, block_size: int, num_snapshots: int = 0) -> LayerCache:
        return LayerCache(*self.cache_specs(), num_slots, num_blocks, block_size, self.device, self.dtype,
                          num_snapshots)

    def block_bytes(self, block_size: int) -> int:
        """Bytes of one cache block (block_size positions) over all full-attention layers."""
        return block_size * spec_bytes(self.cache_specs()[1])

    def slot_bytes(self) -> int:
        """Bytes of one sequence's recurrent + conv states over all GDN layers."""
        return spec_bytes(self.cache_specs()[0])

    def _rope(self, batch: StepBatch, T: int) -> tuple:
        """(cos, sin) of every new token's position (starts[i] + its offset in the sequence)."""
        if batch.decode:
            pos = batch.starts_dev
        else:
            t = torch.arange(T, device=self.device, dtype=batch.cu_seqlens.dtype)
            seq = torch.searchsorted(batch.cu_seqlens[1:], t, right=True).clamp_(max=batch.num_seqs - 1)
            pos = t - batch.cu_seqlens[seq] + batch.starts_dev[seq]
        if self._inv_freq is None or self._inv_freq.device != self.device:   # five kernels fewer a step
            self._inv_freq = rotary_inv_freq(self.config.rotary_dim, self.config.rope_theta, self.device)
        return rotary(pos, self._inv_freq)

    def hidden(self, tokens: torch.Tensor, batch: StepBatch, cache: LayerCache) -> torch.Tensor:
        """tokens [T] packed -> final normed hidden states [T, D]."""
        rope = self._rope(batch, tokens.shape[0])
        h, residual = self.model.embed_tokens(tokens), None
        for layer in self.model.layers:
            h, residual = layer(h, residual, batch, cache, rope)
        return self.model.norm(h, residual)[0]


def random_weights(model: Qwen3NextForCausalLM, seed: int = 0, std: float = 0.02) -> Qwen3NextForCausalLM:
    """Seeded random weights shaped like a trained checkpoint (zero-centred norms near 0, GDN
    decay in range), drawn in place on the model's device in each parameter's own dtype."""
    g = torch.Generator(device=model.device).manual_seed(seed)
    fp8, scales = quant.fp8_tensors(model)
    for name, p in model.named_parameters():
        if name in scales:      # filled with their weights
            continue
        if name in fp8:         # one parameter's model-dtype temporary, quantized
            w = torch.empty(p.shape, dtype=model.dtype, device=p.device).normal_(0.0, std, generator=g)
            quant.quantize_into(w, p, *fp8[name])
        elif name.endswith("linear_attn.norm.weight"):
            p.normal_(1.0, 0.1, generator=g)
        elif "norm" in name:
            p.normal_(0.0, 0.1, generator=g)
        elif name.endswith("A_log"):
            p.uniform_(1, 16, generator=g).log_()
        elif name.endswith("dt_bias"):
            p.normal_(0.0, 0.5, generator=g)
        elif "conv1d" in name:
            p.normal_(0.0, 0.3, generator=g)
        else:
            p.normal_(0.0, std, generator=g)
    return model


FP32_PARAMS = ("A_log", "dt_bias", "mlp.gate.weight")


def build(config: Qwen3NextConfig, device=None, dtype=torch.float32, seed: int | None = 0,
          par: Parallel = SINGLE, quantization=None) -> Qwen3NextForCausalLM:
    """A model with `config`; seeded random weights unless seed is None (then uninitialised), every
    parameter allocated once in its final dtype on `device` (router and decay parameters in fp32:
    FP32_PARAMS; causal_lm.build_model). quantization: "fp8" (or a quant.Fp8): projections and
    experts as FP8 codes + scales, activations in `dtype` (models/quant.py)."""
    return build_model(Qwen3NextForCausalLM, config, device, dtype, seed, par, quantization, FP32_PARAMS, random_weights)


def recipes(name: str, shape: tuple, c: Qwen3NextConfig) -> list:
    """Ways to fill parameter `name` from checkpoint tensors (loader.py's format; an entry may
    name rows (a, b) of its source). Qwen3.5 stores in_proj_qkv / _z / _b / _a as they are here;
    Qwen3-Next fuses them per key head (in_proj_qkvz: [q_h | k_h | v_h | z_h] for each of the HK
    heads, v_h and z_h holding its HV // HK value heads; in_proj_ba: [b_h | a_h]). Experts come
    fused ([E, 2I, D]) or one tensor per expert and projection."""
    HK, HV, K, V = c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
    G = HV // HK
    base = name.rsplit(".", 2)[0] + "."
    if name.endswith(("linear_attn.in_proj_qkv.weight", "linear_attn.in_proj_z.weight")):
        P, src = 2 * K + 2 * G * V, base + "in_proj_qkvz.weight"
        if name.endswith("qkv.weight"):
            parts = [(h * K, h * P, K) for h in range(HK)] + [(HK * K + h * K, h * P + K, K) for h in range(HK)] \
                + [(2 * HK * K + h * G * V, h * P + 2 * K, G * V) for h in range(HK)]
        else:
            parts = [(h * G * V, h * P + 2 * K + G * V, G * V) for h in range(HK)]
        return [[(name, ())], [(src, (slice(d, d + n),), (s, s + n)) for d, s, n in parts]]
    if name.endswith(("linear_attn.in_proj_b.weight", "linear_attn.in_proj_a.weight")):
        off = 0 if name.endswith("in_proj_b.weight") else G
        return [[(name, ())], [(base + "in_proj_ba.weight", (slice(h * G, (h + 1) * G),),
                                (h * 2 * G + off, h * 2 * G + off + G)) for h in range(HK)]]
    return shared_recipes(name, shape, c, lambda e, w: f"{e}.{w}_proj.weight")
