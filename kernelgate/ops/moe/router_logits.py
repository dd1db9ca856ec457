"""fp32 router logits: the MoE gate's matrix-vector product.

    router_logits(x [T, D] fp32 / bf16 / fp16, weight fp32 [E, D]) -> fp32 [T, E] = x.float() @ weight.T

The routers of Kimi Linear and Qwen3.5-MoE / Qwen3-Next keep their weight in fp32 and score in
fp32 (a near-tie between experts must not be decided by bf16 rounding). In PyTorch that is a cast
kernel and an fp32 GEMM: at decode two launches for 1-2 MB of weights, ~5.6 µs a layer at one token
and ~13 at 4-8 on the H200, where one kernel that reads x in its own dtype takes 2.5-4 (bench/RESULTS.md
Session 25). The products are exact in fp32 (a 16-bit value times an fp32 one, rounded once), the
sum an fp32 sum in another order: the reference to fp32 round-off. Prefill chunks of bf16 x take
`triton_bf16x3`: the same products on the bf16 matrix units (the weight split exactly into three bf16
parts, router_logits_triton.py), instead of the cast and a SIMT fp32 GEMM.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ... import checks
from ...registry import GPU_TRITON, Case, declare

OP = "router_logits"


def router_logits_native(x, weight):
    return F.linear(x.float(), weight)


def validate(x, weight):
    checks.tensor(OP, "x", x, ndim=2, dtype=checks.FLOATS)
    checks.tensor(OP, "weight", weight, ndim=2, dtype=torch.float32, shape=(None, x.shape[1]), device=x.device)


def _case(T, E, D, strided=False):
    def make(device, dtype, gen):
        w = (torch.randn(E, D, generator=gen) * D ** -0.5).to(device)
        x = torch.randn(T, 2 * D if strided else D, generator=gen).to(device=device, dtype=dtype)
        return (x[:, ::2] if strided else x, w), {}
    return Case(f"T{T}-E{E}-D{D}" + ("-strided" if strided else ""), make)


def cases():
    # E = 37 and D = 100: partial expert and reduction tiles; T = 9 and 20: more than one token block
    return [_case(1, 37, 100), _case(3, 8, 64), _case(9, 37, 100, strided=True), _case(20, 5, 300), _case(0, 8, 64),
            _case(70, 40, 72)]   # beyond the decode form


def _bytes(args, kwargs):
    x, w = args
    return x.numel() * x.element_size() + w.numel() * 4 + x.shape[0] * w.shape[0] * 4


def bench_cases():
    def make(T, E, D):
        def f(device, dtype, gen):
            g = torch.Generator(device=device).manual_seed(0)
            return (torch.randn(T, D, generator=g, device=device, dtype=dtype),
                    torch.randn(E, D, generator=g, device=device) * D ** -0.5), {}
        return f
    return [Case(f"{name}-T{T}", make(T, E, D), dtypes=(torch.bfloat16,), bytes=_bytes)
            for name, E, D in (("qwen3.5", 257, 2048), ("kimi", 256, 2304)) for T in (1, 4, 8, 16, 64, 8192)]


def _triton_supports(x, weight):
    from .router_logits_triton import MAX_TOKENS
    if x.shape[0] > MAX_TOKENS:
        return f"T={x.shape[0]} tokens: the one-launch GEMV is for decode steps of at most {MAX_TOKENS}"
    return None


router_logits = declare(OP, router_logits_native, validate=validate, cases=cases, bench_cases=bench_cases)
router_logits.implementation(
    "triton", ".router_logits_triton:router_logits_triton", provider="triton", platforms=GPU_TRITON,
    dtypes=(torch.float32, torch.bfloat16, torch.float16), requires=("triton",), supports=_triton_supports,
    priority=10, doc="portable Triton GEMV for decode steps: x read in its own dtype, fp32 FMAs, one launch")
router_logits.implementation(
    "triton_bf16x3", ".router_logits_triton:router_logits_bf16x3", provider="triton", platforms=GPU_TRITON,
    dtypes=(torch.bfloat16,), requires=("triton",), priority=5,
    doc="portable Triton GEMM for bf16 x (prefill): the fp32 weight split exactly into three bf16 parts in "
        "registers, 16-bit dots with fp32 accumulation")
