"""Routed MoE experts: SwiGLU expert MLPs over the (token, expert) pairs chosen by routing.

    out[t] = sum_j  w[t, j] * down[e] @ (act(gate[e] @ x[t]) * (up[e] @ x[t])),  e = ids[t, j]

Weights use HF transformers' fused layout (DeepseekV3Experts / KimiLinearExperts):
w_gate_up[E, 2I, D] with gate = rows [0, I) and up = rows [I, 2I); w_down[E, D, I].
`swiglu_limit` L (DeepSeek V4): gate.clamp(max=L), up.clamp(-L, L) before the product.
Negative ids are skipped (-1: no expert here, e.g. one living on another rank): that pair
adds nothing. Ids >= E are skipped the same way, and checked mode (KERNELGATE_CHECKS=1)
raises for them (an id past the weights is a routing / weight mismatch). Math in fp32,
output in x's dtype.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from ... import checks, platform
from ...registry import GPU_TRITON, Case, declare
from ..common import index_checks

OP = "fused_experts"
ACTIVATIONS = ("silu",)


def _swiglu(h: torch.Tensor, I: int, swiglu_limit) -> torch.Tensor:
    """[n, 2I] gate|up (fp32) -> [n, I]."""
    gate, up = h[:, :I], h[:, I:]
    if swiglu_limit is not None:
        gate = gate.clamp(max=swiglu_limit)
        up = up.clamp(-swiglu_limit, swiglu_limit)
    return F.silu(gate) * up


def _group_pairs(topk_ids: torch.Tensor, E: int):
    """Flattened (token, slot) pairs sorted by expert, invalid ids last.
    Returns (order [P] pair index, counts [E] pairs per expert, valid_sorted [P])."""
    flat = topk_ids.reshape(-1).long()
    key = torch.where((flat >= 0) & (flat < E), flat, E)
    order = torch.argsort(key, stable=True)
    counts = torch.bincount(key, minlength=E + 1)[:E]
    return order, counts, key[order] < E


def routed_swiglu(x, topk_weights, topk_ids, E, I, gate_up, down, swiglu_limit=None):
    """The reference loop, for any weight storage: tokens grouped by expert, one fp32 matmul pair per
    hit expert; gate_up(e) -> fp32 [2I, D] and down(e) -> fp32 [D, I] give expert e's weights."""
    T, D = x.shape
    k = topk_ids.shape[1]
    out = torch.zeros(T, D, dtype=torch.float32, device=x.device)
    order, counts, _ = _group_pairs(topk_ids, E)
    flat_w = topk_weights.reshape(-1).float()
    start = 0
    for e, n in enumerate(counts.tolist()):  # one host sync; experts without tokens cost nothing
        if n == 0:
            continue
        pairs = order[start:start + n]
        start += n
        tok = pairs // k
        h = x[tok].float() @ gate_up(e).t()                          # [n, 2I]
        y = _swiglu(h, I, swiglu_limit) @ down(e).t()                # [n, D]
        out.index_add_(0, tok, y * flat_w[pairs, None])
    return out.to(x.dtype)


def fused_experts_native(x, w_gate_up, w_down, topk_weights, topk_ids, activation="silu",
                         swiglu_limit=None):
    """Routed SwiGLU experts reference: tokens grouped by expert, one fp32 matmul pair per hit expert."""
    return routed_swiglu(x, topk_weights, topk_ids, w_down.shape[0], w_down.shape[2],
                         lambda e: w_gate_up[e].float(), lambda e: w_down[e].float(), swiglu_limit)


def check_experts(op, x, w_gate_up, w_down, topk_weights, topk_ids, activation, swiglu_limit,
                  weight_dtype=None):
    """Shapes, dtypes and devices of an experts call whose weights are stored as `weight_dtype` (None: x's)."""
    checks.tensor(op, "x", x, ndim=2, dtype=checks.FLOATS)
    T, D = x.shape
    weight_dtype = weight_dtype or x.dtype
    checks.tensor(op, "w_gate_up", w_gate_up, ndim=3, dtype=weight_dtype, device=x.device)
    E, I2 = w_gate_up.shape[0], w_gate_up.shape[1]
    checks.require(I2 % 2 == 0 and I2 > 0, op, f"w_gate_up dim 1 must be 2*I (even, > 0), got shape "
                   f"{tuple(w_gate_up.shape)}")
    checks.tensor(op, "w_gate_up", w_gate_up, shape=(E, I2, D))
    checks.tensor(op, "w_down", w_down, ndim=3, dtype=weight_dtype, shape=(E, D, I2 // 2), device=x.device)
    checks.tensor(op, "topk_ids", topk_ids, ndim=2, dtype=(torch.int32, torch.int64), device=x.device)
    k = topk_ids.shape[1]
    checks.require(topk_ids.shape[0] == T, op, f"topk_ids shape {tuple(topk_ids.shape)} != (T={T}, k)")
    checks.tensor(op, "topk_weights", topk_weights, dtype=torch.float32, shape=(T, k), device=x.device)
    checks.require(activation in ACTIVATIONS, op, f"activation {activation!r} not in {ACTIVATIONS}")
    if swiglu_limit is not None:
        checks.require(isinstance(swiglu_limit, (int, float)) and not isinstance(swiglu_limit, bool)
                       and swiglu_limit > 0, op,
                       f"swiglu_limit must be None or a number > 0, got {swiglu_limit!r}")


def validate(x, w_gate_up, w_down, topk_weights, topk_ids, activation="silu", swiglu_limit=None):
    check_experts(OP, x, w_gate_up, w_down, topk_weights, topk_ids, activation, swiglu_limit)


def check_values(x, w_gate_up, w_down, topk_weights, topk_ids, activation="silu", swiglu_limit=None):
    index_checks.ids_below(OP, "topk_ids", topk_ids, w_down.shape[0], "expert ids")


# -- torch._grouped_mm: PyTorch's grouped GEMM (CUTLASS on sm90, a loop elsewhere) -------------
@functools.cache
def _grouped_mm_runs(device_type: str, dtype: torch.dtype) -> str | None:
    """None if torch._grouped_mm computes correctly on this device type and dtype, else why not."""
    if not hasattr(torch, "_grouped_mm"):
        return f"torch {torch.__version__} has no torch._grouped_mm"
    try:
        a = torch.ones(4, 16, dtype=dtype, device=device_type)
        b = torch.ones(2, 16, 16, dtype=dtype, device=device_type)
        y = torch._grouped_mm(a, b, offs=torch.tensor([1, 4], dtype=torch.int32, device=device_type))
        ok = bool((y.float() == 16).all())
    except Exception as e:  # noqa: BLE001 - unsupported device/dtype is a reason
        return f"torch._grouped_mm fails on {device_type} {dtype}: {type(e).__name__}: {str(e)[:120]}"
    return None if ok else f"torch._grouped_mm gives wrong results on {device_type} {dtype}"


def grouped_mm_supports(x, w_gate_up, w_down, topk_weights, topk_ids, activation="silu",
                        swiglu_limit=None):
    dev = x.device.type
    D, I, es = x.shape[1], w_down.shape[2], x.element_size()
    if (D * es) % 16 or (I * es) % 16:
        return f"torch._grouped_mm needs 16-byte aligned rows (D={D}, I={I} in {x.dtype})"
    for name, w in (("w_gate_up", w_gate_up), ("w_down", w_down)):
        if not w.is_contiguous() or w.data_ptr() % 16:
            return f"torch._grouped_mm needs {name} contiguous and 16-byte aligned"
    if dev == "cuda":
        if x.dtype != torch.bfloat16:
            return "torch._grouped_mm on CUDA takes bf16 only"
        cap = platform.current().capability or ""
        if cap.startswith("sm_") and int(cap[3:]) < 90:
            return f"torch._grouped_mm fast path needs sm90+ (this device: {cap})"
    elif dev != "cpu":
        return f"torch._grouped_mm not verified on {dev}"
    return _grouped_mm_runs(dev, x.dtype)


def fused_experts_grouped_mm(x, w_gate_up, w_down, topk_weights, topk_ids, activation="silu",
                             swiglu_limit=None):
    """Sort pairs by expert, two torch._grouped_mm calls, weighted index_add in fp32 (no host sync)."""
    T, D = x.shape
    E, I = w_down.shape[0], w_down.shape[2]
    k = topk_ids.shape[1]
    order, counts, valid = _group_pairs(topk_ids, E)
    offs = torch.cumsum(counts, 0).to(torch.int32)               # [E]; invalid pairs sit past offs[-1]
    tok = order // k
    h = torch._grouped_mm(x[tok], w_gate_up.transpose(1, 2), offs=offs)          # [P, 2I]
    a = _swiglu(h.float(), I, swiglu_limit).to(x.dtype)
    y = torch._grouped_mm(a, w_down.transpose(1, 2), offs=offs).float()          # [P, D]
    wt = torch.where(valid, topk_weights.reshape(-1)[order], 0.0)
    y = torch.where(valid[:, None], y * wt[:, None], 0.0)  # rows past offs[-1] are garbage
    out = torch.zeros(T, D, dtype=torch.float32, device=x.device).index_add_(0, tok, y)
    return out.to(x.dtype)


# -- cases ---------------------------------------------------------------------------------
def make_inputs(T, D, I, E, k, dtype, device, gen, *, ids="random", limit=None):
    """Random experts and routing. ids: 'random' (distinct per token), 'skewed' (slot 0 of
    every token is expert 0), 'invalid' (some ids < 0 or >= E, one token fully invalid)."""
    gd = gen.device  # a device generator makes bench-sized weights without a host round trip

    def r(*s, scale=1.0):
        return (scale * torch.randn(*s, generator=gen, device=gd)).to(device=device, dtype=dtype)
    x = r(T, D)
    w_gate_up = r(E, 2 * I, D, scale=D ** -0.5)
    w_down = r(E, D, I, scale=I ** -0.5)
    topk_ids = torch.rand(T, E, generator=gen, device=gd).argsort(dim=1)[:, :k]
    if ids == "skewed":
        topk_ids = torch.where(topk_ids == 0, topk_ids[:, :1], topk_ids)  # keep ids distinct
        topk_ids[:, 0] = 0
    elif ids == "invalid":
        bad = torch.rand(T, k, generator=gen, device=gd) < 0.3
        far = torch.randint(E, 2 * E, (T, k), generator=gen, device=gd)
        topk_ids = torch.where(bad, torch.where(far % 2 == 0, -1 - far, far), topk_ids)
        if T > 1:
            topk_ids[1] = -1
    topk_weights = torch.rand(T, k, generator=gen, device=gd) + 0.1
    args = (x, w_gate_up, w_down, topk_weights.to(device),
            topk_ids.to(device=device, dtype=torch.int32))
    return args, ({"swiglu_limit": limit} if limit is not None else {})


def _case(T, D, I, E, k, ids="random", limit=None):
    def make(device, dtype, gen):
        return make_inputs(T, D, I, E, k, dtype, device, gen, ids=ids, limit=limit)
    parts = [f"T{T}-D{D}-I{I}-E{E}-k{k}", ids if ids != "random" else "", f"lim{limit}" if limit else ""]
    return Case("-".join(p for p in parts if p), make)


def cases():
    return [
        _case(1, 96, 80, 8, 2),
        _case(7, 96, 80, 16, 8),
        _case(65, 64, 48, 8, 1),
        _case(63, 60, 40, 6, 2),
        _case(65, 96, 80, 8, 2, ids="skewed"),
        _case(33, 64, 32, 8, 4, ids="invalid"),
        _case(17, 64, 48, 4, 2, limit=0.5),
        _case(0, 64, 32, 4, 2),
        _case(8, 64, 48, 8, 4, ids="invalid"),          # decode sizes: the GEMV path
        _case(5, 96, 80, 16, 2, limit=0.5),
    ]


def _bytes(args, kwargs):
    """Weight-bandwidth floor: each distinct hit expert's weights read once, plus x and out."""
    x, w_gate_up, w_down, _, topk_ids = args
    E = w_down.shape[0]
    hit = torch.unique(topk_ids[(topk_ids >= 0) & (topk_ids < E)]).numel()
    per_expert = (w_gate_up[0].numel() + w_down[0].numel()) * w_down.element_size()
    return hit * per_expert + 2 * x.numel() * x.element_size() + topk_ids.numel() * 8


def bench_cases():
    # Kimi Linear: hidden 2304, expert width 1024, 256 experts, 8 per token; uniform routing.
    def make(T):
        def f(device, dtype, gen):
            gen = torch.Generator(device=device).manual_seed(0)
            return make_inputs(T, 2304, 1024, 256, 8, dtype, device, gen)
        return f
    return [Case(f"kimi-T{T}", make(T), dtypes=(torch.bfloat16,), bytes=_bytes) for T in (1, 4, 16, 64, 512)]


fused_experts = declare(OP, fused_experts_native, validate=validate, check_values=check_values, cases=cases,
                        bench_cases=bench_cases,
                        rtol={torch.bfloat16: 2e-2})

fused_experts.implementation(
    "grouped_mm", fused_experts_grouped_mm, provider="torch", platforms=("cuda", "cpu"),
    dtypes=(torch.float32, torch.bfloat16), supports=grouped_mm_supports, priority=5,
    doc="torch._grouped_mm grouped GEMM (CUTLASS on sm90; verified on CPU with torch 2.13)")

fused_experts.implementation(
    "triton", ".fused_experts_triton:fused_experts_triton", provider="triton",
    platforms=GPU_TRITON, dtypes=(torch.float32, torch.bfloat16, torch.float16), requires=("triton",),
    priority=10, doc="portable Triton grouped GEMM: expert-sorted pairs, gate_up+SwiGLU, down+weight, sum over k")


def _gemv_supports(x, *args, **kwargs):
    from .fused_experts_gemv_triton import MAX_TOKENS
    if x.shape[0] > MAX_TOKENS:
        return f"T={x.shape[0]} tokens: the GEMV path is for decode batches of at most {MAX_TOKENS}"
    return None


fused_experts.implementation(
    "triton_gemv", ".fused_experts_gemv_triton:fused_experts_gemv", provider="triton",
    platforms=GPU_TRITON, dtypes=(torch.float32, torch.bfloat16, torch.float16), requires=("triton",),
    supports=_gemv_supports, priority=20,
    doc="portable Triton GEMV for decode (T <= 8): each pair streams its expert's rows once, SwiGLU fused; "
        "one token on bf16 weights reads rows as 4-value words")
