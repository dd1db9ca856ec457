"""FP8 e4m3fn weight (and activation) bytes as operands of Triton kernels.

A kernel loads the codes as uint8 and turns them into a tl.dot / FMA operand in one of three
exact ways (the operand MODE, chosen per device by the launchers):

    INT   fp16 built with integer ops: sign << 15 | magnitude << 7 is the fp16 whose value is the
          code's times 2^-8 (fp16 has e4m3's mantissa bits and 8 more exponent bias; fp8 subnormals
          land on fp16 subnormals). Needs no fp8 instruction: sm_80, gfx90a, Intel PVC / BMG, the
          interpreter. Converting it on to bf16 / fp32 is exact too.
    FN    the codes as float8e4nv (OCP e4m3fn): the device converts (sm_89+, gfx95x, gfx12) and,
          left as fp8, multiplies them (fp8 MMA, sm_89+ / gfx950).
    FNUZ  the codes as float8e4b8 (e4m3fnuz, MI300's fp8): the same bits read with exponent bias 8
          are the value / 2. 0x80 (-0 in e4m3fn) is NaN in e4m3fnuz and becomes +0.

The operand's value is the code's value divided by SCALE[MODE] (a power of two): kernels multiply
their fp32 accumulators by it (once per operand).
"""
from __future__ import annotations

import triton
import triton.language as tl

from ... import platform

INT, FN, FNUZ = 0, 1, 2
MODES = {"int": INT, "fn": FN, "fnuz": FNUZ}
SCALE = {INT: 256.0, FN: 1.0, FNUZ: 2.0}


def mode_for(capability: str | None) -> str:
    """How a device of this capability decodes e4m3fn bytes: "fnuz" on MI300 (gfx94x converts e4m3fnuz
    only), "fn" where it converts fp8 in hardware (platform.fp8_hardware), "int" elsewhere (exact either way)."""
    if (capability or "").startswith("gfx94"):
        return "fnuz"
    return "fn" if platform.fp8_hardware(capability) else "int"


def mma_mode_for(capability: str | None) -> str | None:
    """The operand mode of an fp8 x fp8 tl.dot on this device's matrix units, None without fp8 MMA
    (platform.fp8_mma): e4m3fn on NVIDIA sm_89+ and gfx950 (MI350), e4m3fnuz on gfx942 (MI300)."""
    if not platform.fp8_mma(capability):
        return None
    return "fnuz" if capability.startswith("gfx94") else "fn"


@triton.jit
def fp8_operand(byte, MODE: tl.constexpr):
    """uint8 e4m3fn codes -> the operand of mode MODE (value = code value / SCALE[MODE])."""
    if MODE == 0:
        u = byte.to(tl.uint16)
        x = (((u & 0x80) << 8) | ((u & 0x7F) << 7)).to(tl.float16, bitcast=True)
    elif MODE == 1:
        x = byte.to(tl.float8e4nv, bitcast=True)
    else:
        x = tl.where(byte == 0x80, 0, byte).to(tl.uint8).to(tl.float8e4b8, bitcast=True)
    return x


@triton.jit
def dot(a, b, acc, F32: tl.constexpr):
    """acc + a @ b. F32: both operands as fp32, IEEE products and sums (fp32 inputs, no TF32; and
    the interpreter, whose 16-bit tl.dot is not reliable; its fp8 x fp8 tl.dot is exact)."""
    if F32:   # (one return: the statement after a constexpr if's return is compiled too)
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc)
    return acc
