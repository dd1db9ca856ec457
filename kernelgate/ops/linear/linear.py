"""A bias-free dense projection in the model dtype.

    linear(x [T, K] fp32 / bf16 / fp16, weight [N, K] the same dtype) -> y [T, N] = x @ weight.T

The reference is PyTorch's (cuBLAS / hipBLAS / oneDNN): the right kernel for every T but one. At
one token a decode step's projection is a matrix-vector product that reads the weight once, and
cuBLAS's GEMV runs the small ones at about half of the copy floor, with a split-K reduce launch of
its own (Qwen3.5-MoE's GDN out_proj, 2,048 x 4,096: 7.0 + 1.8 µs on the H200, bench/RESULTS.md
Session 24). `triton` is a GEMV for one token (linear_gemv_triton.py): fp32 accumulation, one
launch, written for programmatic dependent launch (ops/common/pdl.py) so it joins the step's chain
of kernels. The models call it through their projection modules (models/parallel.py).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ... import checks
from ...registry import GPU_TRITON, Case, declare

OP = "linear"
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def linear_native(x, weight):
    """y = x @ weight.T (PyTorch's matmul)."""
    return F.linear(x, weight)


def validate(x, weight):
    checks.tensor(OP, "x", x, ndim=2, dtype=DTYPES)
    checks.require(x.shape[1] > 0, OP, f"x must have K > 0 columns, got shape {tuple(x.shape)}")
    checks.tensor(OP, "weight", weight, ndim=2, dtype=x.dtype, shape=(None, x.shape[1]), device=x.device)


def _triton_supports(x, weight):
    from .linear_gemv_triton import MAX_TOKENS
    if x.shape[0] > MAX_TOKENS:
        return (f"T={x.shape[0]} tokens: the GEMV reads the weight once per token; from {MAX_TOKENS + 1} "
                "on the GEMM (native) reads it once")
    return None


# -- cases ---------------------------------------------------------------------------------
def _case(T, N, K, strided=False):
    def make(device, dtype, gen):
        w = (torch.randn(N, K, generator=gen) * K ** -0.5).to(device=device, dtype=dtype)
        x = torch.randn(T, 2 * K if strided else K, generator=gen).to(device=device, dtype=dtype)
        return (x[:, ::2] if strided else x, w), {}
    return Case(f"T{T}-N{N}-K{K}" + ("-strided" if strided else ""), make)


def cases():
    # N = 37 / K = 300: partial row and K tiles; K = 1100: more than one long-row step; a strided x
    # (a column slice of a wider activation); T = 3: beyond the GEMV (native); T = 0
    return [_case(1, 37, 300), _case(1, 64, 1100), _case(1, 24, 96, strided=True), _case(3, 16, 64),
            _case(0, 8, 64)]


def _bytes(args, kwargs):
    x, w = args
    return w.numel() * w.element_size() + x.numel() * x.element_size() * (1 + w.shape[0] / x.shape[1])


# The one-token projections of the two families at real width (N x K).
SHAPES = {"qwen3.5 gdn in_proj": (12352, 2048), "qwen3.5 gdn out_proj": (2048, 4096),
          "qwen3.5 attn qkv": (9216, 2048), "kimi kda in_proj": (12576, 2304), "kimi kda o_proj": (2304, 4096),
          "kimi mla q_proj": (6144, 2304), "kimi mla kv_a": (576, 2304)}


def bench_cases():
    def make(N, K):
        def f(device, dtype, gen):
            g = torch.Generator(device=device).manual_seed(0)
            return (torch.randn(1, K, generator=g, device=device, dtype=dtype),
                    torch.randn(N, K, generator=g, device=device, dtype=dtype) * K ** -0.5), {}
        return f
    return [Case(name.replace(" ", "-"), make(N, K), dtypes=(torch.bfloat16,), bytes=_bytes)
            for name, (N, K) in SHAPES.items()]


linear = declare(OP, linear_native, validate=validate, cases=cases, bench_cases=bench_cases)
linear.implementation(
    "triton", ".linear_gemv_triton:linear_gemv", provider="triton", platforms=GPU_TRITON, dtypes=DTYPES,
    requires=("triton",), supports=_triton_supports, priority=10,
    doc="portable Triton GEMV for one token: rows of the weight per program, fp32 FMAs, one launch (PDL on sm_90+)")
