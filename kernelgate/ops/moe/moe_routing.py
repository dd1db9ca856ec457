"""MoE routing: biased grouped top-k (DeepSeek V3 / Kimi Linear / Kimi K2 / DeepSeek V4 router).

    s       = score(logits in fp32)          sigmoid | softmax (over E) | sqrtsoftplus = sqrt(softplus)
    c       = s + bias                       selection score; bias applied in fp32, never rounded down
    group   = sum of the top-2 c of each of the n_group contiguous groups of E // n_group experts
    keep the topk_group best groups (others -inf), pick the topk best c among the kept experts
    w       = s at the picked ids (UNBIASED), / sum(w) if renormalize (+1e-20, as HF), * routed_scaling_factor

Ties go to the lower expert (and group) index everywhere; picks are ordered by c, best first.
Outputs: weights fp32 [T, topk + S], ids int32 [T, topk + S], S = num_fused_shared_experts.

Fused shared experts (SGLang's convention, `biased_grouped_topk` with
`apply_routed_scaling_factor_on_output=True`): S extra columns are appended with ids
E, E+1, ..., E+S-1 and weight sum(routed w before the scaling) = 1.0 when renormalizing, so
`sum_j w_j * expert_j(x)` gives the shared expert(s) unit weight and the routed experts
`routed_scaling_factor` in total. SGLang draws the shared id at random among S replicas of one
shared expert and writes one column; here every shared expert gets its own deterministic column.

Gated shared experts (shared_gate="sigmoid"): logits has E + S columns, the last S being each
shared expert's own gate logit (x W_g, computed by the router GEMV beside the experts'); routing
reads the first E columns only, and shared column j gets weight sigmoid(logits[:, E + j]),
unscaled and outside the renormalisation.

Qwen MoE routers (Qwen2-MoE, Qwen3-MoE, Qwen3-Next, Qwen3.5-MoE) are the case scoring="softmax",
bias=None, n_group = topk_group = 1, renormalize = norm_topk_prob, routed_scaling_factor = 1.0:
softmax over all E experts in fp32, top-k, w / sum(w); their shared expert is gated:
num_fused_shared_experts=1, shared_gate="sigmoid" (one GEMV, one launch for both weights).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ... import checks
from ...registry import GPU_TRITON, Case, declare

OP = "biased_grouped_topk"
SCORINGS = ("sigmoid", "softmax", "sqrtsoftplus")
SHARED_GATES = (None, "sigmoid")
TRITON_MAX_EXPERTS = 1024   # one program holds a row of E fp32 scores in registers
TRITON_MAX_PICKS = 32       # topk + shared slots, one unrolled-free selection step each


def score(logits: torch.Tensor, scoring: str) -> torch.Tensor:
    """fp32 expert scores [T, E] from logits [T, E] (any float dtype)."""
    x = logits.float()
    if scoring == "sigmoid":
        return torch.sigmoid(x)
    if scoring == "softmax":
        return torch.softmax(x, dim=-1)
    return torch.sqrt(F.softplus(x))


def _topk_stable(x: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest along the last dim; equal values: lower index first."""
    return torch.sort(x, dim=-1, descending=True, stable=True).indices[..., :k]


def biased_grouped_topk_native(logits, bias, topk, n_group, topk_group, renormalize,
                               routed_scaling_factor, scoring="sigmoid", num_fused_shared_experts=0,
                               shared_gate=None):
    """Biased grouped top-k MoE routing reference: (weights fp32 [T, k+S], ids int32 [T, k+S])."""
    S = num_fused_shared_experts
    gate_logits = None
    if shared_gate is not None:
        logits, gate_logits = logits[:, :logits.shape[1] - S], logits[:, logits.shape[1] - S:]
    T, E = logits.shape
    s = score(logits, scoring)                                        # [T, E]
    c = s + bias.float() if bias is not None else s                   # selection scores
    if n_group > 1:
        gs = c.view(T, n_group, E // n_group).topk(2, dim=-1).values.sum(-1)   # [T, G]
        keep = torch.zeros(T, n_group, dtype=torch.bool, device=c.device)
        keep.scatter_(1, _topk_stable(gs, topk_group), True)
        c = c.masked_fill(~keep.repeat_interleave(E // n_group, dim=1), float("-inf"))
    ids = _topk_stable(c, topk)                                       # [T, k]
    w = s.gather(1, ids)
    if renormalize:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    shared_w = w.sum(-1, keepdim=True)                                # [T, 1]
    w = w * routed_scaling_factor
    if S:
        shared_ids = torch.arange(E, E + S, device=ids.device).expand(T, S)
        ids = torch.cat([ids, shared_ids], dim=1)
        shared_w = torch.sigmoid(gate_logits.float()) if gate_logits is not None else shared_w.expand(T, S)
        w = torch.cat([w, shared_w], dim=1)
    return w.float().contiguous(), ids.to(torch.int32).contiguous()


def validate(logits, bias, topk, n_group, topk_group, renormalize, routed_scaling_factor,
             scoring="sigmoid", num_fused_shared_experts=0, shared_gate=None):
    checks.tensor(OP, "logits", logits, ndim=2, dtype=checks.FLOATS)
    checks.require(isinstance(num_fused_shared_experts, int) and not isinstance(num_fused_shared_experts, bool)
                   and num_fused_shared_experts >= 0, OP,
                   f"num_fused_shared_experts must be an int >= 0, got {num_fused_shared_experts!r}")
    checks.require(shared_gate in SHARED_GATES, OP, f"shared_gate {shared_gate!r} not in {SHARED_GATES}")
    checks.require(shared_gate is None or num_fused_shared_experts >= 1, OP,
                   f"shared_gate={shared_gate!r} gates fused shared experts: num_fused_shared_experts must be >= 1")
    E = logits.shape[1] - (num_fused_shared_experts if shared_gate else 0)
    checks.require(E >= 1, OP, f"logits has {logits.shape[1]} columns: no routed expert before the "
                   f"{num_fused_shared_experts} shared gate logits")
    checks.tensor(OP, "bias", bias, shape=(E,), dtype=checks.FLOATS, device=logits.device, optional=True)
    checks.require(scoring in SCORINGS, OP, f"scoring {scoring!r} not in {SCORINGS}")
    for name, v in (("topk", topk), ("n_group", n_group), ("topk_group", topk_group)):
        checks.require(isinstance(v, int) and not isinstance(v, bool) and v >= 1, OP,
                       f"{name} must be an int >= 1, got {v!r}")
    checks.require(E >= 1 and E % n_group == 0, OP, f"n_group {n_group} must divide the expert count {E}")
    checks.require(topk_group <= n_group, OP, f"topk_group {topk_group} must be <= n_group {n_group}")
    G = E // n_group
    checks.require(n_group == 1 or G >= 2, OP,
                   f"groups of {G} expert: the group score needs >= 2 experts per group (E={E}, n_group={n_group})")
    checks.require(topk <= topk_group * G, OP,
                   f"topk {topk} > experts in the kept groups (topk_group {topk_group} x {G} per group)")
    checks.require(isinstance(routed_scaling_factor, (int, float)) and math.isfinite(routed_scaling_factor),
                   OP, f"routed_scaling_factor must be a finite number, got {routed_scaling_factor!r}")
    checks.require(isinstance(renormalize, bool), OP, f"renormalize must be a bool, got {renormalize!r}")


# -- vendor slot: sgl_kernel.moe_fused_gate ----------------------------------------------
# Limits from sgl-kernel/csrc/moe/moe_fused_gate.cu: sigmoid only, always renormalizes,
# power-of-two E, E / n_group <= 32 (MAX_VPT), n_group <= 32 (one warp per row), the bias is
# read in the logits' dtype (SGLang calls it with fp32 logits and the fp32 bias), fused
# shared experts replace the last column (so at most one here).
SGL_MAX_VPT = 32


def sgl_kernel_limits(logits, bias, topk, n_group, topk_group, renormalize, routed_scaling_factor,
                      scoring="sigmoid", num_fused_shared_experts=0, shared_gate=None):
    """Why moe_fused_gate cannot route this call (None if it can); no import needed."""
    T, E = logits.shape
    if shared_gate is not None:
        return f"moe_fused_gate gives shared experts a fixed weight (shared_gate={shared_gate!r})"
    if T == 0:
        return "moe_fused_gate would launch an empty grid for an empty batch (T=0)"
    if scoring != "sigmoid":
        return f"moe_fused_gate scores with sigmoid only (scoring={scoring})"
    if not renormalize:
        return "moe_fused_gate always renormalizes (renormalize=False)"
    if bias is None:
        return "moe_fused_gate needs a correction bias (bias=None)"
    if E & (E - 1):
        return f"moe_fused_gate needs a power-of-two expert count (E={E})"
    if E // n_group > SGL_MAX_VPT:
        return f"moe_fused_gate needs E / n_group <= {SGL_MAX_VPT} experts per group (got {E // n_group})"
    if n_group > 32:
        return f"moe_fused_gate maps a row's groups onto one warp: n_group <= 32 (got {n_group})"
    if num_fused_shared_experts > 1:
        return f"moe_fused_gate fuses one shared slot (num_fused_shared_experts={num_fused_shared_experts})"
    return None


def sgl_kernel_supports(*args, **kwargs):
    import inspect

    import sgl_kernel

    gate = getattr(sgl_kernel, "moe_fused_gate", None)
    if gate is None:
        return "this sgl_kernel build has no moe_fused_gate"
    try:
        params = inspect.signature(gate).parameters
    except (TypeError, ValueError):
        params = {}
    if "apply_routed_scaling_factor_on_output" not in params:
        return "this sgl_kernel's moe_fused_gate predates apply_routed_scaling_factor_on_output (fixed 1/2.5 shared weight)"
    return sgl_kernel_limits(*args, **kwargs)


def sgl_kernel_adapt(args, kwargs):
    """moe_fused_gate reads the bias in the logits' dtype: upcast both to fp32 at the call
    (never the stored weight), so bias entries closer than bf16 resolution still order experts."""
    a = biased_grouped_topk.bind(args, kwargs)
    a["logits"] = a["logits"].float()
    a["bias"] = a["bias"].float()
    return (), a


def sgl_kernel_fused_gate(logits, bias, topk, n_group, topk_group, renormalize, routed_scaling_factor,
                          scoring="sigmoid", num_fused_shared_experts=0, shared_gate=None):
    import sgl_kernel

    S = num_fused_shared_experts
    w, ids = sgl_kernel.moe_fused_gate(logits, bias, n_group, topk_group, topk + S, S,
                                       float(routed_scaling_factor), True)
    return w.float(), ids.to(torch.int32)


# -- parity cases ----------------------------------------------------------------------
def _case(T, E, n_group, topk_group, topk, scoring="sigmoid", renorm=True, rsf=2.5, bias=True,
          shared=0, gate=None, dtypes=(torch.float32, torch.bfloat16)):
    def make(device, dtype, gen):
        cols = E + (shared if gate else 0)     # gated shared experts: their gate logits after the E
        logits = (2 * torch.randn(T, cols, generator=gen)).to(device=device, dtype=dtype)
        b = (0.1 * torch.randn(E, generator=gen)).to(device) if bias else None   # fp32 bias
        return (logits, b, topk, n_group, topk_group, renorm, rsf), dict(
            scoring=scoring, num_fused_shared_experts=shared, **({"shared_gate": gate} if gate else {}))
    parts = [f"T{T}", f"E{E}", f"G{n_group}g{topk_group}" if n_group > 1 else "G1", f"k{topk}", scoring,
             "renorm" if renorm else "raw", "" if bias else "nobias", f"shared{shared}" if shared else "",
             f"gate-{gate}" if gate else ""]
    return Case("-".join(p for p in parts if p), make, dtypes=dtypes)


def cases():
    return [
        _case(1, 256, 8, 4, 8),                                           # DeepSeek V3 decode
        _case(63, 256, 1, 1, 8, rsf=2.446, shared=1),                     # Kimi Linear
        _case(65, 384, 1, 1, 8, rsf=2.827),                               # Kimi K2
        _case(65, 512, 8, 4, 16, scoring="softmax", renorm=False, rsf=1.0),
        _case(17, 64, 4, 2, 1, scoring="sqrtsoftplus", bias=False),
        _case(33, 256, 1, 1, 6, scoring="sqrtsoftplus", rsf=1.5, shared=2),  # DeepSeek V4-like
        _case(9, 96, 3, 2, 8, renorm=False, rsf=1.0),                     # non-power-of-two groups
        _case(7, 60, 4, 3, 5, scoring="softmax"),                         # odd E, 15 per group
        _case(0, 256, 8, 4, 8, dtypes=(torch.bfloat16,)),                 # empty batch
        # Qwen3-Next-80B-A3B / Qwen3.5-35B-A3B: softmax over all experts, no bias, top-k renormalised,
        # the shared slot weighted by the sigmoid of its own gate logit (column E)
        _case(65, 512, 1, 1, 10, scoring="softmax", rsf=1.0, bias=False, shared=1, gate="sigmoid"),
        _case(1, 256, 1, 1, 8, scoring="softmax", rsf=1.0, bias=False, shared=1, gate="sigmoid",
              dtypes=(torch.bfloat16,)),
        _case(5, 256, 1, 1, 8, scoring="softmax", rsf=1.0, bias=False, shared=1),   # ungated shared slot
        _case(9, 96, 3, 2, 4, rsf=1.5, shared=2, gate="sigmoid"),         # two gated shared experts, groups
    ]


def _bytes(args, kwargs):
    logits, bias, topk = args[0], args[1], args[2]
    k = topk + kwargs.get("num_fused_shared_experts", 0)
    return logits.numel() * logits.element_size() + (bias.numel() * 4 if bias is not None else 0) \
        + logits.shape[0] * k * 8


def bench_cases():
    def make(T, E, n_group, topk_group):
        def f(device, dtype, gen):
            logits = torch.randn(T, E, generator=gen).to(device=device, dtype=dtype)
            bias = (0.1 * torch.randn(E, generator=gen)).to(device)
            return (logits, bias, 8, n_group, topk_group, True, 2.5), dict(scoring="sigmoid")
        return f
    out = []
    for name, E, G, tg in (("dsv3", 256, 8, 4), ("kimi", 256, 1, 1), ("k2", 384, 1, 1)):
        for T in (1, 64, 4096):
            out.append(Case(f"{name}-T{T}-E{E}-G{G}-k8", make(T, E, G, tg), dtypes=(torch.bfloat16,),
                            bytes=_bytes))
    return out


biased_grouped_topk = declare(OP, biased_grouped_topk_native, validate=validate, cases=cases,
                              bench_cases=bench_cases)

biased_grouped_topk.implementation(
    "triton", ".moe_routing_triton:biased_grouped_topk", provider="triton",
    platforms=GPU_TRITON, requires=("triton",), priority=10,
    supports=lambda *a, **k: _triton_supports(*a, **k),  # defined below the declarations
    doc="one fused launch: score, bias, group top-2, group and expert selection, weights")

biased_grouped_topk.implementation(
    "sgl_kernel", sgl_kernel_fused_gate, provider="sgl_kernel", platforms=("cuda", "rocm"),
    requires=("sgl_kernel",), supports=sgl_kernel_supports, adapt=sgl_kernel_adapt, priority=20,
    doc="sgl_kernel.moe_fused_gate (fp32 logits and bias at the call)")


def _triton_supports(logits, bias, topk, n_group, topk_group, renormalize, routed_scaling_factor,
                     scoring="sigmoid", num_fused_shared_experts=0, shared_gate=None):
    E = logits.shape[1] - (num_fused_shared_experts if shared_gate else 0)
    if E > TRITON_MAX_EXPERTS:
        return f"more than {TRITON_MAX_EXPERTS} experts (E={E}) do not fit one program's registers"
    if topk + num_fused_shared_experts > TRITON_MAX_PICKS:
        return f"topk + shared slots {topk + num_fused_shared_experts} > {TRITON_MAX_PICKS}"
    return None
