"""A tiny HF transformers Kimi Linear, as the independent reference for the model tests.

With fla-core installed on a CPU-only machine, transformers' kimi_linear binds fla's Triton
kernels at import time and then crashes ("0 active drivers"). `hf_kimi_module()` imports a
private copy of the module while `import fla` fails, so transformers binds its own PyTorch
fallbacks (its documented behaviour when fla is absent); the global modules are untouched.
"""
from __future__ import annotations


import torch

from kernelgate.tools.testing import hf_kimi_linear_module

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
            num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32,
            q_lora_rank=None, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16,
            num_local_experts=8, num_experts_per_tok=2, n_group=1, topk_group=1,
            linear_attn_config={"head_dim": 16, "num_heads": 4, "short_conv_kernel_size": 4,
                                "kda_layers": [1, 2, 3], "full_attn_layers": [4]},
            first_k_dense_replace=1, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def hf_kimi_module():
    return hf_kimi_linear_module(mask_fla=True)


def tiny_hf_model(seed: int = 0, **overrides):
    """HF KimiLinearForCausalLM with seeded weights; norms and router bias perturbed so that
    every weight matters (HF initialises them to 1 / 0)."""
    from transformers import KimiLinearConfig
    mod = hf_kimi_module()
    torch.manual_seed(seed)
    model = mod.KimiLinearForCausalLM(KimiLinearConfig(**{**TINY, **overrides})).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters(remove_duplicate=False):
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            elif "e_score_correction_bias" in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
            elif "conv1d" in name:
                p.copy_(0.4 * torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():
            if "e_score_correction_bias" in name:
                b.copy_(0.05 * torch.randn(b.shape, generator=g))
    return model


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    """Greedy continuation by HF's own cached generation loop."""
    ids = torch.tensor([prompt])
    out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None,
                         pad_token_id=0)
    return out[0, len(prompt):].tolist()
