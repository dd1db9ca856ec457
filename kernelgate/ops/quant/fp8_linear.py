"""FP8 linear layer: y = x @ W^T with W stored as e4m3fn codes and fp32 scales (fp8_weights.py).

    fp8_linear(x [T, K] fp32 / bf16 / fp16, weight e4m3fn [N, K], weight_scale fp32, block_size=(128, 128))
        -> y [T, N] in x's dtype
    block_size (bn, bk): weight_scale [ceil(N/bn), ceil(K/bk)]   block FP8 (DeepSeek-V3, Qwen FP8: weight_scale_inv)
    block_size None:     weight_scale [N, 1]                     per output channel (compressed-tensors)

Definition (native): y = x.float() @ dequantize_fp8(weight, weight_scale, block_size).T in fp32,
rounded to x's dtype. Implementations read the codes and apply the scales in the kernel:
- `triton` (w8a16): weights decoded in registers, fp16 tl.dot (16-bit x scaled exactly) with fp32
  accumulation; a GEMV for decode batches (T <= 8). In fp32 it is the definition to fp32 round-off.
- `triton_w8a8`: activations quantized per (token, scale block of K) to e4m3fn as well
  (quantize_fp8_groups; per token for per-channel weights), tl.dot on fp8 codes where the device
  has fp8 matrix instructions (sm_89+, gfx942, gfx950). It adds activation rounding (about 2-3 %
  relative error on random data): it takes 16-bit x of >= W8A8_MIN_TOKENS tokens on those devices
  only, where `triton` steps aside. Elsewhere it runs with the exact fp16 of the codes (never chosen
  there; forced, it gives the same numbers).
Scales are checked finite in checked mode (KERNELGATE_CHECKS=1); NaN weight codes are not supported.
"""
from __future__ import annotations

import torch

from ... import checks, platform
from ...registry import GPU_TRITON, Case, declare
from .fp8_forms import linear_note
from .fp8_weights import (DEFAULT_BLOCK, FP8, block_dims, check_scale_values, check_weight, dequantize_fp8,
                          quantize_fp8_block, quantize_fp8_channel)

OP = "fp8_linear"
# 16-bit x of at least this many tokens goes to the w8a8 form where the device has fp8 MMA: from about
# there the GEMM is compute bound (H200 spec sheet: 989 dense bf16 TFLOP/s over 4.8 TB/s of fp8 weight
# bytes is ~100 tokens) and fp8 MMA doubles its rate; below it both forms stream the same weight bytes
# and w8a8 only adds activation rounding. A spec-sheet estimate: the crossover wants measuring.
W8A8_MIN_TOKENS = 128


def fp8_linear_native(x, weight, weight_scale, block_size=DEFAULT_BLOCK):
    """y = x @ dequantize_fp8(weight).T in fp32, in x's dtype (the definition)."""
    w = dequantize_fp8(weight, weight_scale, block_size)                 # [N, K] fp32
    return (x.float() @ w.t()).to(x.dtype)


def validate(x, weight, weight_scale, block_size=DEFAULT_BLOCK):
    checks.tensor(OP, "x", x, ndim=2, dtype=checks.FLOATS)
    K = x.shape[1]
    checks.require(K > 0, OP, f"x must have K > 0 columns, got shape {tuple(x.shape)}")
    checks.tensor(OP, "weight", weight, ndim=2, dtype=FP8, device=x.device)
    check_weight(OP, "weight", weight, "weight_scale", weight_scale, block_size, (weight.shape[0], K), x.device)


def check_values(x, weight, weight_scale, block_size=DEFAULT_BLOCK):
    check_scale_values(OP, "weight_scale", weight_scale)


def _triton_supports(x, weight, weight_scale, block_size=DEFAULT_BLOCK):
    from .fp8_gemv_triton import k_tile
    K = x.shape[1]
    bk = block_dims(block_size, K)[1]
    if k_tile(bk, K, 64) < 16:
        return f"block_size {block_size}: K tiles (powers of two >= 16) must divide the block's bk = {bk}"
    cap = platform.current().capability
    if x.dtype != torch.float32 and x.shape[0] >= W8A8_MIN_TOKENS and platform.fp8_mma(cap):
        return (f"{cap} has fp8 matrix instructions: 16-bit x of >= {W8A8_MIN_TOKENS} tokens takes the w8a8 form "
                "(triton_w8a8)")
    return None


def _w8a8_supports(x, weight, weight_scale, block_size=DEFAULT_BLOCK):
    from .fp8_gemv_triton import k_tile
    K = x.shape[1]
    bk = block_dims(block_size, K)[1]
    if k_tile(bk, K, 128) < 32:
        return f"block_size {block_size}: fp8 K tiles (powers of two >= 32) must divide the block's bk = {bk}"
    return None


# -- cases ---------------------------------------------------------------------------------
def make_inputs(T, N, K, block, dtype, device, gen):
    """x [T, K] and a weight whose rows and columns vary in magnitude (so scale blocks differ),
    quantized with `block` (None: per channel)."""
    gd = gen.device

    def r(*s):
        return torch.randn(*s, generator=gen, device=gd)
    w = r(N, K) * K ** -0.5 * (0.5 * r(N, 1)).exp() * (0.5 * r(1, K)).exp()
    wq, s = quantize_fp8_channel(w) if block is None else quantize_fp8_block(w, block)
    x = r(T, K).to(device=device, dtype=dtype)
    return (x, wq.to(device), s.to(device)), {"block_size": block}


def _case(T, N, K, block=DEFAULT_BLOCK):
    def make(device, dtype, gen):
        return make_inputs(T, N, K, block, dtype, device, gen)
    b = "channel" if block is None else f"b{block[0]}x{block[1]}"
    return Case(f"T{T}-N{N}-K{K}-{b}", make)


def cases():
    return [
        _case(1, 150, 200),                 # decode: the GEMV; partial edge blocks in N and K
        _case(1, 72, 96, (8, 64)),          # the GEMV with rows of several scale blocks in one program
        _case(65, 150, 200),                # GEMM
        _case(7, 96, 160, None),            # per-channel (one scale per row)
        _case(33, 72, 96, (32, 64)),        # small blocks: scales vary inside an N tile
        _case(0, 64, 96),
    ]


def _bytes(args, kwargs):
    x, w, s = args
    return w.numel() + s.numel() * 4 + x.numel() * x.element_size() * (1 + w.shape[0] / x.shape[1])


def bench_cases():
    # Kimi Linear projections: hidden 2304 -> 32 heads x 128 (q / k / v), and back (o_proj)
    def make(T, N, K):
        def f(device, dtype, gen):
            gen = torch.Generator(device=device).manual_seed(0)
            return make_inputs(T, N, K, DEFAULT_BLOCK, dtype, device, gen)
        return f
    return [Case(f"N{N}-K{K}-T{T}", make(T, N, K), dtypes=(torch.bfloat16,), bytes=_bytes)
            for N, K in ((4096, 2304), (2304, 4096)) for T in (1, 8, 64, 512, 4096)]


fp8_linear = declare(OP, fp8_linear_native, validate=validate, check_values=check_values, cases=cases,
                     bench_cases=bench_cases, note=lambda plat: linear_note(plat, W8A8_MIN_TOKENS))

fp8_linear.implementation(
    "triton", ".fp8_linear_triton:fp8_linear_triton", provider="triton", platforms=GPU_TRITON,
    dtypes=(torch.float32, torch.bfloat16, torch.float16), requires=("triton",), supports=_triton_supports,
    priority=10, doc="portable Triton w8a16: fp8 weights decoded in registers, scales per K tile, a GEMV for decode")

fp8_linear.implementation(
    "triton_w8a8", ".fp8_linear_triton:fp8_linear_w8a8", provider="triton", platforms=GPU_TRITON,
    dtypes=(torch.bfloat16, torch.float16), requires=("triton",), supports=_w8a8_supports, priority=5,
    rtol={torch.bfloat16: 5e-2, torch.float16: 5e-2},
    doc="portable Triton w8a8: activations quantized per token group of bk, fp8 x fp8 tl.dot (fp8 MMA on "
        "sm_89+ / gfx942 / gfx950); dispatch takes it where `triton` steps aside")
