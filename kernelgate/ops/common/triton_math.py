"""Portable Triton math the kernels share (no libdevice: the same code lowers for NVIDIA, AMD
and Intel)."""
import triton
import triton.language as tl


@triton.jit
def log1p(e):
    """log(1 + e), accurate for tiny e: log(u) * e / (u - 1) with u = 1 + e (e where u rounds to 1)."""
    u = 1.0 + e
    d = u - 1.0
    return tl.where(d == 0.0, e, tl.log(u) * (e / tl.where(d == 0.0, 1.0, d)))


@triton.jit
def softplus(x):
    """torch's softplus (beta 1, threshold 20): x above 20, else log1p(exp(x))."""
    return tl.where(x > 20.0, x, log1p(tl.exp(tl.minimum(x, 20.0))))
