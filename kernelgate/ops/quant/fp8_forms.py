"""Which form the FP8 ops' Triton kernels take on a platform, and why: a line for `kernelgate doctor`.

    w8a8   x quantized to e4m3fn per (token, K block), fp8 x fp8 dots on the matrix units
           (platform.fp8_mma: sm_89+, gfx942, gfx950)
    w8a16  the weight's e4m3fn codes decoded in the kernel (fp8 conversion instructions where the
           device has them, platform.fp8_hardware; exact integer ops elsewhere), fp16 dots (16-bit x
           scaled by a power of two per row: exact); the one-token GEMVs read 4-code words and decode
           them with NVIDIA's conversion instructions in inline PTX (sm_89+), exact integer ops elsewhere,
           fp32 FMAs

The GPU's capability decides; a platform simulated by name has none, so its line gives the rule.
"""
from __future__ import annotations

from ... import platform
from ...registry import GPU_TRITON

MMA = "sm_89+, gfx942, gfx950"                                        # platform.fp8_mma
MMA_GPUS = {"cuda": "sm_89+", "rocm": "gfx942 / gfx950"}              # the same, per platform name
CONVERT_GPUS = {"cuda": "sm_89+", "rocm": "gfx94x / gfx95x / gfx12"}  # platform.fp8_hardware, per name


def _w8a16(plat) -> str:
    cap = plat.capability
    if cap:
        how = "by fp8 conversion instructions" if platform.fp8_hardware(cap) else "with exact integer ops"
    elif plat.name in CONVERT_GPUS:
        how = f"by fp8 conversion on {CONVERT_GPUS[plat.name]}, with exact integer ops elsewhere"
    else:
        how = "with exact integer ops"
    gemv = "inline PTX conversion" if plat.name == "cuda" and (not cap or platform.fp8_hardware(cap)) else "integer ops"
    if plat.name == "cuda" and not cap:
        gemv = "inline PTX conversion on sm_89+, integer ops elsewhere"
    return (f"w8a16 (weight codes decoded {how}; fp16 dots, 16-bit x scaled exactly; one token: a GEMV on 4-code "
            f"words decoded by {gemv}, fp32 FMAs)")


def _where(plat) -> str:
    if plat.capability:
        return plat.capability
    return f"{plat.name} ({'simulated by name: ' if plat.simulated else ''}GPU unknown)"


def linear_note(plat, w8a8_tokens: int) -> str | None:
    """fp8_linear: w8a8 for 16-bit x of >= w8a8_tokens tokens where the GPU has fp8 MMA, else w8a16."""
    if plat.name not in GPU_TRITON:
        return None
    cap = plat.capability
    mma = cap if platform.fp8_mma(cap) else None if cap else MMA_GPUS.get(plat.name)
    if mma is None:
        return f"fp8 form on {_where(plat)}: {_w8a16(plat)}; w8a8 is taken only with fp8 matrix instructions ({MMA})"
    return (f"fp8 form on {_where(plat)}: w8a8 (x quantized to e4m3fn per token and K block, fp8 MMA) for 16-bit x "
            f"of >= {w8a8_tokens} tokens on {mma}, where the GEMM is compute bound and fp8 MMA doubles its rate; "
            f"{_w8a16(plat)} for fp32 x and fewer tokens{'' if cap else ' and on other GPUs'}: those stream the "
            f"same weight bytes in either form, and w8a8 would only add activation rounding")


def experts_note(plat) -> str | None:
    """fused_experts_fp8: w8a16 on every GPU (no w8a8 experts kernel is declared)."""
    if plat.name not in GPU_TRITON:
        return None
    cap = plat.capability
    mma = cap if platform.fp8_mma(cap) else None if cap else MMA_GPUS.get(plat.name)
    unused = f" ({mma}'s fp8 MMA would serve prefill batches)" if mma else ""
    return f"fp8 form on {_where(plat)}: {_w8a16(plat)} in both kernels: no w8a8 experts kernel is declared{unused}"
