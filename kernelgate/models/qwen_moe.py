"""Sparse MoE block of Qwen3-Next / Qwen3.5: softmax top-k routing and a gated shared expert.

    w, ids = topk(softmax(router(x)), k)  (renormalised over the k when norm_topk_prob)
    out    = fused_experts(x, w, ids) + sigmoid(shared_expert_gate(x)) * shared_expert(x)

Routing is `biased_grouped_topk` with softmax scoring, one group and no bias (the same
selection: ties go to the lower expert id); router logits in fp32 (the router weight is
kept fp32). Experts use the fused [E, 2I, D] / [E, D, I] layout of layers.Experts.

When the shared expert is as wide as a routed one (the released Qwen3-Next / Qwen3.5 models)
it is expert E of one stacked weight tensor (its parameters are views into it), and its gate is
row E of the router (`router` [E + 1, D] fp32: gate.weight and shared_expert_gate.weight are
views into it): one GEMV gives the expert logits and the gate logit, one routing launch the top-k
weights and the gate's sigmoid in slot k, one fused_experts call runs both (at decode, one pass
over k + 1 experts' weights instead of the routed kernels plus the shared MLP's launches).

Tensor / expert parallel (as layers.MoE): the router and the shared expert's gate are replicated
(every rank routes identically); the experts are split along their intermediate size, or whole
experts per rank with expert parallel (then the shared expert is a tensor-parallel MLP beside
them, not stacked); every rank's output is a partial sum, reduced by one all-reduce.
"""
from __future__ import annotations

import torch
from torch import nn

from .. import ops
from .layers import MLP, Experts, _param, run_experts
from .parallel import SINGLE, fuse, stack


class SparseMoE(nn.Module):
    def __init__(self, c, par=SINGLE):
        super().__init__()
        self.par = par
        self.k, self.renormalize = c.num_experts_per_token, c.norm_topk_prob
        self.gate = nn.Module()
        self.gate.weight = _param(c.num_experts, c.hidden_size, dtype=torch.float32)
        self.experts = Experts(c, par)
        self.shared_expert = None
        if c.shared_expert_intermediate_size:
            self.shared_expert = MLP(c.hidden_size, c.shared_expert_intermediate_size, par, reduce=False)
            self.shared_expert_gate = nn.Linear(c.hidden_size, 1, bias=False)
        self.stacked = c.shared_expert_intermediate_size == c.moe_intermediate_size and not par.expert_parallel
        if self.stacked:
            stack(self, "gate_up", [("experts", "gate_up_proj"), ("shared_expert.gate_up_proj", "weight")])
            stack(self, "down", [("experts", "down_proj"), ("shared_expert.down_proj", "weight")])
            self.gate._dtypes = {"weight": torch.float32}       # the fused router is fp32 (parallel.param_dtype)
            self.shared_expert_gate._no_fp8 = True
            fuse(self, "router", ["gate", "shared_expert_gate"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.stacked:
            logits = ops.router_logits(x, self.router)                               # [T, E + 1] fp32
            weights, ids = ops.biased_grouped_topk(logits, None, self.k, 1, 1, self.renormalize, 1.0, "softmax",
                                                   num_fused_shared_experts=1, shared_gate="sigmoid")
            return self.par.all_reduce(run_experts(x, weights, ids, self, "gate_up", "down", self.experts))  # slot k: E
        logits = ops.router_logits(x, self.gate.weight)                              # [T, E] fp32
        weights, ids = ops.biased_grouped_topk(logits, None, self.k, 1, 1, self.renormalize, 1.0, "softmax")
        if self.par.expert_parallel:   # other ranks' experts become -1: skipped by fused_experts
            local = ids - self.experts.first_expert
            ids = torch.where((local >= 0) & (local < self.experts.down_proj.shape[0]), local, -1)
        out = run_experts(x, weights, ids, self.experts, "gate_up_proj", "down_proj", self.experts)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return self.par.all_reduce(out)
