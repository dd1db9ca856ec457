"""Kimi Linear: decoder of KDA and MLA layers (3:1) with dense-then-MoE MLPs.

`model.step(tokens, batch, cache)` runs one engine step over a varlen batch (prefill chunks
and / or decodes, states and latents in a `KVCache`) and returns the logits of each sequence's last token;
`model(token_ids[B, T])` is a plain full-sequence forward returning logits [B, T, V] (both from
causal_lm.py: this file is the layers and the cache).
Built only from registry ops and plain torch: no platform branch here.
"""
from __future__ import annotations

import torch
from torch import nn

from .batch import StepBatch
from .cache import KVCache, block_bytes, slot_bytes
from .causal_lm import CausalLM, build_model
from .config import KimiLinearConfig
from .kda import KimiDeltaAttention
from .layers import MLP, MoE, RMSNorm
from .mla import MLAttention
from . import quant
from .parallel import SINGLE, Parallel, VocabEmbedding


class DecoderLayer(nn.Module):
    def __init__(self, c: KimiLinearConfig, i: int, par: Parallel = SINGLE):
        super().__init__()
        self.self_attn = KimiDeltaAttention(c, i, par) if c.layer_types[i] == "kda" else MLAttention(c, i, par)
        self.mlp = MoE(c, par) if c.mlp_types[i] == "moe" else MLP(c.hidden_size, c.intermediate_size, par)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, x, residual, batch, cache):
        """x: the previous block's output, residual: the sum before it (None at the first layer)
        -> (this layer's MLP output, the residual sum before it). Each add is folded into the
        norm after it (one pass, no separate add kernel)."""
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x, residual = self.post_attention_layernorm(self.self_attn(x, batch, cache), residual)
        return self.mlp(x), residual


class Backbone(nn.Module):
    def __init__(self, c: KimiLinearConfig, par: Parallel = SINGLE):
        super().__init__()
        self.embed_tokens = VocabEmbedding(c.vocab_size, c.hidden_size, par)
        self.layers = nn.ModuleList(DecoderLayer(c, i, par) for i in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class KimiLinearForCausalLM(CausalLM):
    def __init__(self, config: KimiLinearConfig, par: Parallel = SINGLE):
        super().__init__(config, Backbone(config, par), par)

    def new_cache(self, num_slots: int, num_blocks: int, block_size: int, num_snapshots: int = 0) -> KVCache:
        return KVCache(self.config, num_slots, num_blocks, block_size, self.device, self.dtype, self.par.size,
                       num_snapshots)

    def block_bytes(self, block_size: int) -> int:
        """Bytes of one cache block (block_size positions) over all attention layers."""
        return block_bytes(self.config, block_size, self.dtype)

    def slot_bytes(self) -> int:
        """Bytes of one sequence's recurrent + conv states over all KDA layers (this rank's heads)."""
        return slot_bytes(self.config, self.dtype, self.par.size)

    def hidden(self, tokens: torch.Tensor, batch: StepBatch, cache: KVCache) -> torch.Tensor:
        """tokens [T] packed -> final normed hidden states [T, D]."""
        h, residual = self.model.embed_tokens(tokens), None
        for layer in self.model.layers:
            h, residual = layer(h, residual, batch, cache)
        return self.model.norm(h, residual)[0] if residual is not None else self.model.norm(h)


def random_weights(model: KimiLinearForCausalLM, seed: int = 0, std: float = 0.02) -> KimiLinearForCausalLM:
    """Seeded random weights shaped like a trained checkpoint (norms ~1, KDA decay in range),
    drawn in place on the model's device in each parameter's own dtype (fast at 48B). An FP8
    weight is drawn as its model-dtype twin's would be and quantized (models/quant.py)."""
    g = torch.Generator(device=model.device).manual_seed(seed)
    fp8, scales = quant.fp8_tensors(model)
    for name, p in model.named_parameters():
        if name in scales:      # filled with their weights
            continue
        if name in fp8:         # one parameter's model-dtype temporary
            w = torch.empty(p.shape, dtype=model.dtype, device=p.device).normal_(0.0, std, generator=g)
            quant.quantize_into(w, p, *fp8[name])
        elif "norm" in name:
            p.normal_(1.0, 0.1, generator=g)
        elif name.endswith("A_log"):
            p.uniform_(1, 16, generator=g).log_()
        elif name.endswith("dt_bias"):
            dt = p.uniform_(-6.9, -2.3, generator=g).exp_()
            p.copy_(dt + torch.log(-torch.expm1(-dt)))                 # inverse softplus
        elif name.endswith("e_score_correction_bias"):
            p.normal_(0.0, 0.01, generator=g)
        elif "conv1d" in name:
            p.normal_(0.0, 0.3, generator=g)
        else:
            p.normal_(0.0, std, generator=g)
    return model


FP32_PARAMS = ("A_log", "dt_bias", "gate.weight", "e_score_correction_bias")


def build(config: KimiLinearConfig, device=None, dtype=torch.float32, seed: int | None = 0,
          par: Parallel = SINGLE, quantization=None):
    """A model with `config`; seeded random weights unless seed is None (then uninitialised), every
    parameter allocated once in its final dtype on `device` (router / decay parameters in fp32:
    FP32_PARAMS; causal_lm.build_model). par: build this rank's shard (parameters at their shard's
    size; fill it with the loader). quantization: "fp8" (or a quant.Fp8): projections and experts
    as FP8 codes + scales, activations in `dtype` (models/quant.py)."""
    return build_model(KimiLinearForCausalLM, config, device, dtype, seed, par, quantization, FP32_PARAMS, random_weights)
