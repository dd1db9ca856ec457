"""FP8 e4m3 encoding in integer arithmetic, shared by the indexer kernels.

Why not `x.to(tl.float8e4nv)`: Triton's interpreter (3.9) rounds wrongly whenever rounding
carries into the exponent (e.g. 31.6 -> 16 instead of 32), and NVIDIA GPUs have no native
e4m3fnuz conversion. Building the byte from the fp32 bits is exact (round to nearest even,
same as torch's cast), identical on every backend and in the interpreter, and costs a
dozen integer ops per element of a memory-bound kernel. Kernels store the bytes into a
uint8 view of the fp8 output.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def encode_e4m3(x, FNUZ: tl.constexpr):
    """fp32 `x` with |x| <= FP8_MAX (clamp first) -> e4m3 byte (uint8), round to nearest even.

    A value of fp32 exponent e becomes fp8 code (e + BIAS) << 3 | 3 mantissa bits, so we
    keep the 24-bit significand m, shift it right by `sh` (20 for normals, more for fp8
    subnormals) and round on the dropped bits; a rounding carry moves into the exponent by
    itself because the code is exponent-major."""
    BIAS: tl.constexpr = 8 if FNUZ else 7
    bits = x.to(tl.int32, bitcast=True)
    sign = (bits >> 31) & 1
    a = bits & 0x7FFFFFFF
    eb = a >> 23                                              # biased fp32 exponent
    m = (a & 0x7FFFFF) | tl.where(eb > 0, 0x800000, 0)        # significand with hidden bit
    e = eb - 127
    ex = tl.maximum(e + BIAS - 1, 0)                          # fp8 biased exponent - 1 (normals)
    sh = tl.minimum(20 + tl.maximum(1 - BIAS - e, 0), 31)     # > 24 shifts everything out
    q = m >> sh
    rem = m - (q << sh)
    half = tl.full(sh.shape, 1, tl.int32) << (sh - 1)
    up = (rem > half) | ((rem == half) & ((q & 1) == 1))
    mag = (ex << 3) + q + up.to(tl.int32)
    if FNUZ:
        sign = tl.where(mag == 0, 0, sign)                    # 0x80 is NaN in fnuz
    return ((sign << 7) | mag).to(tl.uint8)


@triton.jit
def as_fp8(byte, FNUZ: tl.constexpr):
    """Reinterpret uint8 bytes as fp8 (decoding and `tl.dot` on fp8 are exact in the
    interpreter; only the fp32 -> fp8 rounding is not, see above)."""
    if FNUZ:    # one return: Triton 3.6 rejects two returns of different types even under a constexpr if
        x = byte.to(tl.float8e4b8, bitcast=True)
    else:
        x = byte.to(tl.float8e4nv, bitcast=True)
    return x
