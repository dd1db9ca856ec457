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

fp16 dots for 16-bit activations (fp16_operand, fp16_rows): every mode's codes are exact fp16 values
(INT builds them, the fp8 modes convert two codes per instruction), and a bf16 activation tile
scaled by a power of two per row so that its largest value lies in [2^14, 2^15) is exact in fp16 too
(bf16's 8 significant bits fit fp16's 11; only parts below 2^-24 of the row's largest value can
round, far below the fp32 accumulation's own error). So a 16-bit x takes fp16 x fp16 dots with fp32
accumulation, the scale undone on the partial: the products are the exact ones, and the weight
costs one conversion per two codes -- where a bf16 or fp32 operand costs one to two per code, and
conversions (16 per clock per SM on sm_90) would bind a memory-bound decode GEMV before its bytes.
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
def fp16_operand(byte, MODE: tl.constexpr):
    """uint8 e4m3fn codes -> fp16 operand of mode MODE (exact; value = code value / SCALE[MODE])."""
    x = fp8_operand(byte, MODE)
    if MODE != 0:
        x = x.to(tl.float16)
    return x


@triton.jit
def fp16_rows(a, SCALED: tl.constexpr):
    """16-bit activations a [R, C] -> (fp16 tile, fp32 [R] factors): a[r] == tile[r] * factor[r] exactly
    (to below 2^-24 of the row's largest |a|). SCALED: scale each row by a power of two that puts its
    largest |a| in [2^14, 2^15) (bf16 input); else a is fp16 already and factors are 1."""
    if SCALED:
        af = a.to(tl.float32)
        eb = (tl.max(tl.abs(af), axis=1).to(tl.int32, bitcast=True) >> 23) & 0xFF    # biased exponent
        eb = tl.minimum(tl.maximum(eb, 15), 253)      # (both factors normal; a row of zeros is any)
        up = ((268 - eb) << 23).to(tl.float32, bitcast=True)                          # 2^(141 - eb)
        down = ((eb - 14) << 23).to(tl.float32, bitcast=True)                         # 2^(eb - 141)
        return (af * up[:, None]).to(tl.float16), down
    else:
        return a.to(tl.float16), tl.full([a.shape[0]], 1.0, tl.float32)


@triton.jit
def dot(a, b, acc, F32: tl.constexpr):
    """acc + a @ b. F32: both operands as fp32, IEEE products and sums (fp32 inputs, no TF32; and
    the interpreter, whose 16-bit tl.dot is not reliable; its fp8 x fp8 tl.dot is exact)."""
    if F32:   # (one return: the statement after a constexpr if's return is compiled too)
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc)
    return acc
