"""Norm, dense MLP and MoE blocks of Kimi Linear, built from registry ops and plain torch.

Weights are plain parameters with the names `loader.py` produces; gate|up projections are
stored fused ([2I, D]: gate rows first) so a block does one matmul per projection.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .. import ops, streams
from . import quant
from .parallel import SINGLE, column, mark, row, stack


def _param(*shape, dtype=None) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = _param(dim)
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """rms(x) * w; with `residual`: (rms(x + residual) * w, x + residual) in one pass."""
        if residual is None:
            return ops.gated_rms_norm(x, self.weight, None, self.eps)
        return ops.gated_rms_norm(x, self.weight, None, self.eps, residual=residual, prenorm=True)


class OffsetRMSNorm(nn.Module):
    """Zero-centred RMSNorm (Qwen3-Next, Qwen3.5): rms(x) * (1 + w), over the last dim, w in fp32
    math (the weight is stored as trained: near 0)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = _param(dim)
        self.eps = eps
        self._scale = self._scale_of = None

    def scale(self) -> torch.Tensor:
        """1 + w in fp32, kept between calls while the weight is unchanged (two kernels fewer per
        norm in a decode step); recomputed when the weight's storage or version moves."""
        w = self.weight
        try:
            key = (w.data_ptr(), w._version)
        except RuntimeError:          # an inference tensor keeps no version: no reuse
            return w.float() + 1.0
        if self._scale_of != key:
            self._scale, self._scale_of = w.float() + 1.0, key
        return self._scale

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """rms(x) * (1 + w); with `residual`: (rms(x + residual) * (1 + w), x + residual) in one pass."""
        w = self.scale()
        if residual is None:
            return ops.gated_rms_norm(x, w, None, self.eps)
        return ops.gated_rms_norm(x, w, None, self.eps, residual=residual, prenorm=True)


class MLP(nn.Module):
    """SwiGLU MLP: down(silu(gate(x)) * up(x)); the dense first layer(s) and the shared expert."""

    def __init__(self, hidden: int, inter: int, par=SINGLE, reduce: bool = True):
        """Tensor parallel: gate|up column-split, down row-split; reduce=False leaves the partial
        sum to the caller (the MoE folds the shared expert into its one all-reduce)."""
        super().__init__()
        self.par, self.reduce = par, reduce
        self.inter = par.split(inter, "the MLP's intermediate size")
        self.gate_up_proj = column(hidden, 2 * inter, par, "MLP gate|up", 2)
        self.down_proj = row(inter, hidden, par, "MLP down")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.inter, dim=-1)   # [T, I] each
        out = self.down_proj(F.silu(gate) * up)
        return self.par.all_reduce(out) if self.reduce else out


class Router(nn.Module):
    """fp32 router logits + biased grouped top-k (the bias stays fp32, never rounded)."""

    def __init__(self, c):
        super().__init__()
        self.weight = _param(c.num_experts, c.hidden_size, dtype=torch.float32)
        self.e_score_correction_bias = _param(c.num_experts, dtype=torch.float32)
        self.c = c

    def forward(self, x: torch.Tensor, shared: int = 0):
        """-> (weights fp32 [T, k + shared], ids int32 [T, k + shared]); `shared` columns give
        experts E.. unit weight (biased_grouped_topk's fused shared experts; renormalized
        routing only)."""
        c = self.c
        logits = ops.router_logits(x, self.weight)                  # [T, E] fp32
        return ops.biased_grouped_topk(logits, self.e_score_correction_bias, c.num_experts_per_token,
                                       c.n_group, c.topk_group, c.moe_renormalize,
                                       c.routed_scaling_factor, c.scoring, num_fused_shared_experts=shared)


class Experts(nn.Module):
    """Expert parallel: this rank's E / size experts, whole (ids first_expert..); otherwise every
    expert with its intermediate size split (gate|up rows, down columns)."""

    fp8_params = {"gate_up_proj": 2, "down_proj": 1}   # may be FP8 (models/quant.py): {name: parts along N}

    def __init__(self, c, par=SINGLE):
        super().__init__()
        E, D, I = c.num_experts, c.hidden_size, c.moe_intermediate_size
        if par.expert_parallel:
            E = par.split(E, "num_experts (enable_expert_parallel)")
            mark(self, "gate_up_proj", 0)
            mark(self, "down_proj", 0)
        else:
            I = par.split(I, "moe_intermediate_size (expert-internal tensor parallel)")
            mark(self, "gate_up_proj", 1, 2)
            mark(self, "down_proj", 2)
        self.first_expert = par.rank * E if par.expert_parallel else 0
        self.gate_up_proj = _param(E, 2 * I, D)                     # gate rows first, then up
        self.down_proj = _param(E, D, I)


class MoE(nn.Module):
    """Routed experts + shared expert.

    One shared expert of the experts' width, renormalized routing, no expert parallel (Kimi
    Linear, DeepSeek V3): the shared expert is expert E of one stacked weight tensor (its
    parameters are views into it) and routing gives every token a unit-weight slot for it, so
    one fused_experts call runs both -- at decode that is one pass over 9 experts' weights
    instead of the routed kernels plus four small GEMM / elementwise launches. Otherwise the
    shared expert is a separate MLP on a side stream where the platform has one
    (kernelgate.streams), serially elsewhere."""

    def __init__(self, c, par=SINGLE):
        """Tensor / expert parallel: the router is replicated (every rank routes identically);
        routed and shared experts give partial sums, reduced by one all-reduce."""
        super().__init__()
        self.par = par
        self.gate = Router(c)
        self.experts = Experts(c, par)
        self.shared_experts = MLP(c.hidden_size, c.moe_intermediate_size * c.num_shared_experts, par,
                                  reduce=False) if c.num_shared_experts else None
        self.stacked = c.num_shared_experts == 1 and c.moe_renormalize and not par.expert_parallel
        if self.stacked:
            stack(self, "gate_up", [("experts", "gate_up_proj"), ("shared_experts.gate_up_proj", "weight")])
            stack(self, "down", [("experts", "down_proj"), ("shared_experts.down_proj", "weight")])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.stacked:
            weights, ids = self.gate(x, shared=1)                   # [T, k + 1]: slot k is expert E
            return self.par.all_reduce(self._experts(x, weights, ids, self, "gate_up", "down"))
        side = streams.side_stream(x.device) if self.shared_experts is not None else None
        shared = None
        if self.shared_experts is not None:
            with streams.on(side):
                shared = self.shared_experts(x)                     # [T, D]
        weights, ids = self.gate(x)                                 # [T, k] fp32, [T, k] int32
        if self.par.expert_parallel:   # other ranks' experts become -1: skipped by fused_experts
            local = ids - self.experts.first_expert
            ids = torch.where((local >= 0) & (local < self.experts.down_proj.shape[0]), local, -1)
        out = self._experts(x, weights, ids, self.experts, "gate_up_proj", "down_proj")
        if shared is not None:
            streams.join(side)
            out = out + shared
        return self.par.all_reduce(out)

    def _experts(self, x, weights, ids, owner, gate_up: str, down: str) -> torch.Tensor:
        return run_experts(x, weights, ids, owner, gate_up, down, self.experts)


def run_experts(x, weights, ids, owner, gate_up: str, down: str, experts: Experts) -> torch.Tensor:
    """fused_experts over `owner`'s tensors `gate_up` / `down` (an Experts module's, or the stacked
    ones of an MoE block); FP8 ones through fused_experts_fp8 with their scales."""
    w1, w2 = getattr(owner, gate_up), getattr(owner, down)
    if not quant.is_fp8(w1):
        return ops.fused_experts(x, w1, w2, weights, ids)
    return ops.fused_experts_fp8(x, w1, w2, weights, ids, quant.scale(owner, gate_up), quant.scale(owner, down),
                                 block_size=experts.fp8_block)
