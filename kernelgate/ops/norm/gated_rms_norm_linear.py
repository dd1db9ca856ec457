"""A gated RMSNorm per head followed by the output projection (the linear-attention layers' tail).

    gated_rms_norm_linear(x [T, H, V], norm_weight [V], gate [T, H, V], weight [N, H * V], eps=1e-6,
                          activation="sigmoid") -> [T, N] in x's dtype
    = linear(gated_rms_norm(x, norm_weight, gate, eps, activation=activation).reshape(T, H * V), weight)

The norm is `gated_rms_norm`'s (rms over each head's V channels, fp32 math, times the weight, times
act(gate), rounded to x's dtype), the projection a bias-free linear in fp32 math rounded to x's
dtype. KDA (sigmoid gate, Kimi Linear) and Gated DeltaNet (silu gate, Qwen3-Next / Qwen3.5) end
every layer with it.

Why one op: at a decode step of one token the norm is a launch of its own (~2.3 µs on the H200, for
16 KB) and cuBLAS's GEMV splits K and reduces in a second launch (7 + 1.8 µs for Qwen's 2,048 x
4,096). The `triton` form normalises each head as it reads its columns of the weight: one launch.
Larger steps take `chain`: the registry's gated_rms_norm, then the matmul library's GEMM.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ... import checks
from ...registry import ALL_PLATFORMS, GPU_TRITON, Case, declare
from .gated_rms_norm import ACTIVATIONS, gated_rms_norm_native

OP = "gated_rms_norm_linear"


def gated_rms_norm_linear_native(x, norm_weight, gate, weight, eps=1e-6, activation="sigmoid"):
    T, H, V = x.shape
    y = gated_rms_norm_native(x, norm_weight, gate, eps, activation=activation)
    return F.linear(y.reshape(T, H * V).float(), weight.float()).to(x.dtype)


def gated_rms_norm_linear_chain(x, norm_weight, gate, weight, eps=1e-6, activation="sigmoid"):
    """gated_rms_norm through the registry (its best implementation), then F.linear."""
    from .gated_rms_norm import gated_rms_norm
    T, H, V = x.shape
    return F.linear(gated_rms_norm(x, norm_weight, gate, eps, activation=activation).reshape(T, H * V), weight)


def validate(x, norm_weight, gate, weight, eps=1e-6, activation="sigmoid"):
    checks.tensor(OP, "x", x, ndim=3, dtype=checks.FLOATS)
    T, H, V = x.shape
    checks.require(V > 0, OP, f"x's head dim (channels) must be > 0, got shape {tuple(x.shape)}")
    checks.tensor(OP, "norm_weight", norm_weight, shape=(V,), dtype=checks.FLOATS, device=x.device)
    checks.tensor(OP, "gate", gate, dtype=checks.FLOATS, device=x.device)
    checks.same_shape(OP, "gate", gate, "x", x)
    checks.tensor(OP, "weight", weight, ndim=2, dtype=x.dtype, shape=(None, H * V), device=x.device)
    checks.require(activation in ACTIVATIONS, OP, f"activation {activation!r} not in {ACTIVATIONS}")
    checks.require(isinstance(eps, (int, float)) and not isinstance(eps, bool) and eps > 0, OP,
                   f"eps must be a number > 0, got {eps!r}")


def _case(T, H, V, N, act="sigmoid", strided_gate=False):
    def make(device, dtype, gen):
        r = lambda *s: torch.randn(*s, generator=gen).to(device=device, dtype=dtype)  # noqa: E731
        x = r(T, H, V)
        # the models' gate is a column slice of the input projection's output: rows strided
        gate = r(T, H * V + 7)[:, 3:3 + H * V].reshape(T, H, V) if strided_gate else r(T, H, V)
        nw = (1 + 0.1 * torch.randn(V, generator=gen)).to(device=device, dtype=dtype)
        w = (torch.randn(N, H * V, generator=gen) * (H * V) ** -0.5).to(device=device, dtype=dtype)
        return (x, nw, gate, w), dict(eps=1e-6, activation=act)
    return Case(f"T{T}-H{H}-V{V}-N{N}-{act}" + ("-strided" if strided_gate else ""), make)


def cases():
    # V = 40: a head narrower than its power-of-two tile; H = 3: a partial head block; N = 37: a
    # partial row block; T = 3: padded token rows; T = 9: beyond the one-launch form (chain, native)
    return [_case(1, 4, 64, 48, "silu", strided_gate=True), _case(3, 3, 40, 37), _case(2, 5, 128, 100, "silu"),
            _case(9, 2, 32, 16), _case(0, 2, 32, 16)]


def _bytes(args, kwargs):
    x, nw, gate, w = args
    return 2 * x.numel() * x.element_size() + w.numel() * w.element_size() + x.shape[0] * w.shape[0] * x.element_size()


def bench_cases():
    def make(T, H, V, N, act):
        def f(device, dtype, gen):
            g = torch.Generator(device=device).manual_seed(0)
            r = lambda *s: torch.randn(*s, generator=g, device=device, dtype=dtype)  # noqa: E731
            return (r(T, H, V), 1 + 0.1 * r(V), r(T, H, V), r(N, H * V) * (H * V) ** -0.5), dict(activation=act)
        return f
    # Qwen3.5-MoE's Gated DeltaNet out_proj (32 heads x 128 -> 2,048, silu) and Kimi's KDA o_proj (-> 2,304, sigmoid)
    return [Case(f"{name}-T{T}", make(T, 32, 128, N, act), dtypes=(torch.bfloat16,), bytes=_bytes)
            for name, N, act in (("qwen3.5-gdn", 2048, "silu"), ("kimi-kda", 2304, "sigmoid")) for T in (1, 4)]


def _triton_supports(x, *args, **kwargs):
    from .gated_rms_norm_linear_triton import MAX_TOKENS
    if x.shape[0] > MAX_TOKENS:
        return f"T={x.shape[0]} tokens: the one-launch form is for decode steps of at most {MAX_TOKENS}"
    return None


gated_rms_norm_linear = declare(OP, gated_rms_norm_linear_native, validate=validate, cases=cases,
                                bench_cases=bench_cases)
gated_rms_norm_linear.implementation(
    "triton", ".gated_rms_norm_linear_triton:gated_rms_norm_linear_triton", provider="triton",
    platforms=GPU_TRITON, requires=("triton",), supports=_triton_supports, priority=10,
    doc="one launch for decode steps: each program normalises the heads as it reads their weight columns")
gated_rms_norm_linear.implementation(
    "chain", gated_rms_norm_linear_chain, provider="native", platforms=ALL_PLATFORMS, priority=5,
    doc="gated_rms_norm through the registry, then F.linear")
