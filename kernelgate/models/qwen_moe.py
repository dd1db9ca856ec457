"""Sparse MoE block of Qwen3-Next / Qwen3.5: softmax top-k routing and a gated shared expert.

    w, ids = topk(softmax(router(x)), k)  (renormalised over the k when norm_topk_prob)
    out    = fused_experts(x, w, ids) + sigmoid(shared_expert_gate(x)) * shared_expert(x)

Routing is `biased_grouped_topk` with softmax scoring, one group and no bias (the same
selection: ties go to the lower expert id); router logits in fp32 (the router weight is
kept fp32). Experts use the fused [E, 2I, D] / [E, D, I] layout of layers.Experts.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .. import ops
from .layers import MLP, Experts, _param


class SparseMoE(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.k, self.renormalize = c.num_experts_per_token, c.norm_topk_prob
        self.gate = nn.Module()
        self.gate.weight = _param(c.num_experts, c.hidden_size, dtype=torch.float32)
        self.experts = Experts(c)
        self.shared_expert = None
        if c.shared_expert_intermediate_size:
            self.shared_expert = MLP(c.hidden_size, c.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(c.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = F.linear(x.float(), self.gate.weight)                               # [T, E] fp32
        weights, ids = ops.biased_grouped_topk(logits, None, self.k, 1, 1, self.renormalize, 1.0, "softmax")
        out = ops.fused_experts(x, self.experts.gate_up_proj, self.experts.down_proj, weights, ids)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out
