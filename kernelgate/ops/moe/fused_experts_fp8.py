"""Routed MoE experts with FP8 e4m3fn weights: fused_experts' math on dequantized weights.

    fused_experts_fp8(x [T, D], w_gate_up e4m3fn [E, 2I, D], w_down e4m3fn [E, D, I], topk_weights, topk_ids,
                      w_gate_up_scale, w_down_scale, block_size=(128, 128), activation="silu", swiglu_limit=None)

    block_size (bn, bk): w_gate_up_scale [E, ceil(2I/bn), ceil(D/bk)], w_down_scale [E, ceil(D/bn), ceil(I/bk)]
    block_size None:     w_gate_up_scale [E, 2I, 1], w_down_scale [E, D, 1]   (per output channel)

Definition: fused_experts(x, dequantize_fp8(w_gate_up, ...), dequantize_fp8(w_down, ...), ...) -- the
same routing (ids outside [0, E) skipped, a stacked shared expert is just expert E - 1 of the stack),
SwiGLU, swiglu_limit and fp32 math (fused_experts.py). The gate|up scale grid covers the fused [2I, D]
tensor: stacking separately quantized gate_proj / up_proj scales needs I % bn == 0 (every real model).
Implementations read the codes and apply the scales in the kernel (never a dequantized copy):
`triton` (grouped GEMM on expert-sorted pairs) and `triton_gemv` (one token: fused_experts_words_triton.py
says why not more).

Why an op of its own and not scale arguments on fused_experts: the weight format is fixed when a model
loads, so the MoE layer knows which op it calls (no platform test at the call site); each op keeps an
exact signature (scales required here, absent there) instead of "scales given iff weights are fp8" rules
checked in every implementation; grouped_mm and the bf16 kernels are not asked about fp8 calls; each
op's parity cases cover exactly its implementations; and doctor lists the fp8 choice per platform.
"""
from __future__ import annotations

import torch

from ...registry import GPU_TRITON, Case, declare
from ..common import index_checks
from ..quant.fp8_forms import experts_note
from ..quant.fp8_weights import (DEFAULT_BLOCK, FP8, block_dims, check_scale_values, check_weight,
                                 dequantize_fp8, quantize_fp8_block, quantize_fp8_channel)
from .fused_experts import _bytes as _bf16_bytes
from .fused_experts import check_experts, make_inputs as _make_bf16_inputs, routed_swiglu

OP = "fused_experts_fp8"


def fused_experts_fp8_native(x, w_gate_up, w_down, topk_weights, topk_ids, w_gate_up_scale, w_down_scale,
                             block_size=DEFAULT_BLOCK, activation="silu", swiglu_limit=None):
    """fused_experts on the dequantized weights (each hit expert dequantized once, in fp32)."""
    return routed_swiglu(x, topk_weights, topk_ids, w_down.shape[0], w_down.shape[2],
                         lambda e: dequantize_fp8(w_gate_up[e], w_gate_up_scale[e], block_size),
                         lambda e: dequantize_fp8(w_down[e], w_down_scale[e], block_size), swiglu_limit)


def validate(x, w_gate_up, w_down, topk_weights, topk_ids, w_gate_up_scale, w_down_scale,
             block_size=DEFAULT_BLOCK, activation="silu", swiglu_limit=None):
    check_experts(OP, x, w_gate_up, w_down, topk_weights, topk_ids, activation, swiglu_limit, FP8)
    check_weight(OP, "w_gate_up", w_gate_up, "w_gate_up_scale", w_gate_up_scale, block_size,
                 tuple(w_gate_up.shape), x.device)
    check_weight(OP, "w_down", w_down, "w_down_scale", w_down_scale, block_size, tuple(w_down.shape), x.device)


def check_values(x, w_gate_up, w_down, topk_weights, topk_ids, w_gate_up_scale, w_down_scale,
                 block_size=DEFAULT_BLOCK, activation="silu", swiglu_limit=None):
    index_checks.ids_below(OP, "topk_ids", topk_ids, w_down.shape[0], "expert ids")
    check_scale_values(OP, "w_gate_up_scale", w_gate_up_scale)
    check_scale_values(OP, "w_down_scale", w_down_scale)


def _triton_supports(x, w_gate_up, w_down, topk_weights, topk_ids, w_gate_up_scale, w_down_scale,
                     block_size=DEFAULT_BLOCK, activation="silu", swiglu_limit=None):
    from ..quant.fp8_gemv_triton import k_tile
    for name, K in (("w_gate_up", x.shape[1]), ("w_down", w_down.shape[2])):
        bk = block_dims(block_size, K)[1]
        if k_tile(bk, K, 64) < 16:
            return f"block_size {block_size}: {name}'s K tiles (powers of two >= 16) must divide bk = {bk}"
    return None


def _gemv_fp8_supports(x, w_gate_up, w_down, *args, **kwargs):
    from ..quant.fp8_gemv_triton import words_ok
    from .fused_experts_words_triton import MAX_TOKENS
    if x.shape[0] > MAX_TOKENS:
        return (f"T={x.shape[0]} tokens: the FP8 GEMV is for one token (from {MAX_TOKENS + 1} the grouped GEMM reads "
                "the FP8 experts faster)")
    block = kwargs.get("block_size", args[4] if len(args) > 4 else DEFAULT_BLOCK)
    for name, w in (("w_gate_up", w_gate_up), ("w_down", w_down)):
        why = words_ok(w.shape[-1], block, w)
        if why:
            return f"{name}: {why}"
    return _triton_supports(x, w_gate_up, w_down, *args, **kwargs)


# -- cases ---------------------------------------------------------------------------------
def make_inputs(T, D, I, E, k, dtype, device, gen, *, ids="random", limit=None, block=DEFAULT_BLOCK):
    """fused_experts.make_inputs, weights varied in magnitude per row and column (so scale blocks
    differ) and quantized with `block` (None: per channel). ids="shared": the last slot of every
    token is expert E - 1 with weight 1 (a stacked shared expert) and a few other slots are -1."""
    (x, gu, dn, tw, ti), kw = _make_bf16_inputs(T, D, I, E, k, torch.float32, device, gen,
                                                ids="random" if ids == "shared" else ids, limit=limit)
    gd = gen.device

    def quant(w):   # expert by expert: bench-sized stacks quantize without fp32 copies of the whole stack
        E_, R, C = w.shape
        w = w.to(gd).mul_((0.5 * torch.randn(E_, R, 1, generator=gen, device=gd)).exp())
        w.mul_((0.5 * torch.randn(E_, 1, C, generator=gen, device=gd)).exp())
        parts = [quantize_fp8_channel(w[e]) if block is None else quantize_fp8_block(w[e], block) for e in range(E_)]
        return torch.stack([q for q, _ in parts]), torch.stack([sc for _, sc in parts])
    (gu, gus), (dn, dns) = quant(gu), quant(dn)
    if ids == "shared":
        ti = ti.clone()
        ti[:, -1] = E - 1
        ti[:, :-1] = torch.where(ti[:, :-1] == E - 1, -1, ti[:, :-1])
        if T > 2:
            ti[2, 0] = -1
        tw = tw.clone()
        tw[:, -1] = 1.0
    args = (x.to(dtype), gu.to(device), dn.to(device), tw, ti, gus.to(device), dns.to(device))
    return args, {"block_size": block, **kw}


def _case(T, D, I, E, k, ids="random", limit=None, block=DEFAULT_BLOCK, dtypes=(torch.float32, torch.bfloat16)):
    def make(device, dtype, gen):
        return make_inputs(T, D, I, E, k, dtype, device, gen, ids=ids, limit=limit, block=block)
    parts = [f"T{T}-D{D}-I{I}-E{E}-k{k}", "channel" if block is None else "",
             ids if ids != "random" else "", f"lim{limit}" if limit else ""]
    return Case("-".join(p for p in parts if p), make, dtypes=dtypes)


def cases():
    # D = 160 and 2I = 144: two scale blocks along each, partial; gate and up rows share a block.
    # Few distinct kernel specialisations (compile_targets builds each for six GPUs).
    return [
        _case(1, 160, 72, 8, 2),                                  # GEMV / 16-row blocks
        _case(7, 160, 72, 6, 3, ids="shared"),                    # shared-expert slot, -1 ids
        _case(1, 160, 72, 6, 3, ids="shared", dtypes=(torch.bfloat16,)),   # the same for the one-token GEMV
        # 64-row blocks; I = 136: two K blocks in down. bf16 only: the fp32 64-row programs (FMA dots)
        # cost ~10 s per GPU target to compile; tests/ops/moe/test_fused_experts_fp8.py checks D 96, I 136 in fp32
        _case(33, 96, 136, 8, 4, ids="invalid", dtypes=(torch.bfloat16,)),
        _case(5, 96, 40, 8, 2, limit=0.5, block=None),            # per channel
        _case(1, 96, 40, 8, 2, limit=0.5, block=None),            # per channel, the one-token GEMV
        _case(0, 64, 32, 4, 2),
    ]


def _bytes(args, kwargs):
    """Weight-bandwidth floor: each hit expert's codes and scales once, plus x and out."""
    x, gu, dn, tw, ti, gus, dns = args
    hit = torch.unique(ti[(ti >= 0) & (ti < gu.shape[0])]).numel()
    return _bf16_bytes(args[:5], kwargs) + hit * (gus[0].numel() + dns[0].numel()) * 4


def bench_cases():
    # Kimi Linear: hidden 2304, expert width 1024, 256 experts, 8 per token; uniform routing.
    def make(T):
        def f(device, dtype, gen):
            gen = torch.Generator(device=device).manual_seed(0)
            return make_inputs(T, 2304, 1024, 256, 8, dtype, device, gen)
        return f
    return [Case(f"kimi-T{T}", make(T), dtypes=(torch.bfloat16,), bytes=_bytes) for T in (1, 2, 4, 8, 16, 64, 512)]


fused_experts_fp8 = declare(OP, fused_experts_fp8_native, validate=validate, check_values=check_values,
                            cases=cases, bench_cases=bench_cases, rtol={torch.bfloat16: 2e-2}, note=experts_note)

fused_experts_fp8.implementation(
    "triton", ".fused_experts_fp8_triton:fused_experts_fp8_triton", provider="triton", platforms=GPU_TRITON,
    dtypes=(torch.float32, torch.bfloat16, torch.float16), requires=("triton",), supports=_triton_supports,
    priority=10, doc="portable Triton grouped GEMM on fp8 experts: codes decoded in registers, scales per K tile")

fused_experts_fp8.implementation(
    "triton_gemv", ".fused_experts_words_triton:fused_experts_fp8_gemv", provider="triton", platforms=GPU_TRITON,
    dtypes=(torch.float32, torch.bfloat16, torch.float16), requires=("triton",), supports=_gemv_fp8_supports,
    priority=20,
    doc="portable Triton GEMV on fp8 experts for one token: each pair streams its expert's bytes once")
