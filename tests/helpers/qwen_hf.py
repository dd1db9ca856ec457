"""Tiny HF transformers Qwen3-Next / Qwen3.5-MoE models, the independent reference of the
Gated DeltaNet family's tests: their modeling modules imported with fla masked, so they run
transformers' own PyTorch Gated DeltaNet (transformers up to 5.24 binds fla's Triton kernels
whenever fla imports, which fail on CPU tensors on a machine with a GPU)."""
from __future__ import annotations

import torch

from kernelgate.tools.testing import hf_modeling_masked, hf_modeling_module

TINY = {"vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
            "linear_value_head_dim": 8, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 48, "max_position_embeddings": 512, "pad_token_id": 0, "bos_token_id": 1,
            "eos_token_id": 2}


def _perturb(model, seed: int):
    """Norms, decay and conv weights away from HF's init (ones / zeros), so every weight matters."""
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn(p.shape, generator=g))
            elif "conv1d" in name:
                p.copy_(0.4 * torch.randn(p.shape, generator=g))
            elif name.endswith("dt_bias"):
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            elif name.endswith("mlp.gate.weight"):
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    return model.eval()


def tiny_qwen3_next(seed: int = 0, **overrides):
    """HF Qwen3NextForCausalLM (3 GDN layers + 1 full attention, GVA 2 -> 4 heads, a dense
    MLP layer when mlp_only_layers says so)."""
    from transformers import Qwen3NextConfig
    torch.manual_seed(seed)
    kw = {**TINY, "intermediate_size": 96, **overrides}
    return _perturb(hf_modeling_module("qwen3_next").Qwen3NextForCausalLM(Qwen3NextConfig(**kw)), seed)


def tiny_qwen3_5_moe(seed: int = 0, multimodal: bool = True):
    """HF Qwen3.5-MoE: the multimodal ForConditionalGeneration (a one-block vision tower) or
    the text-only ForCausalLM."""
    from transformers import Qwen3_5MoeConfig, Qwen3_5MoeTextConfig
    torch.manual_seed(seed)
    text = {k: v for k, v in TINY.items()}
    with hf_modeling_masked("qwen3_5_moe") as hf:     # the multimodal model builds its text model by AutoModel
        if multimodal:
            vision = {"depth": 1, "hidden_size": 32, "num_heads": 2, "intermediate_size": 32, "out_hidden_size": 64}
            model = hf.Qwen3_5MoeForConditionalGeneration(Qwen3_5MoeConfig(text_config=text, vision_config=vision))
            if not isinstance(model.model.language_model, hf.Qwen3_5MoeTextModel):
                # AutoModel resolved it from the module imported before the mask (transformers keeps
                # the modules its lazy mapping loaded): the masked copy's own text model instead
                model.model.language_model = hf.Qwen3_5MoeTextModel(model.config.text_config)
        else:
            model = hf.Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**text))
    return _perturb(model, seed)


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    """Greedy continuation by HF's own cached generation loop."""
    ids = torch.tensor([prompt])
    out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None,
                         pad_token_id=0)
    return out[0, len(prompt):].tolist()
