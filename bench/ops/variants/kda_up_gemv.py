"""Probe (issues 37 / 38's Kimi side, not dispatched): a KDA layer's f_b / g_b projections at one token as
two `linear` GEMVs (linear_gemv_triton: PDL) instead of one cuBLAS batched matmul.

Why: in the Session 31 profile of a one-token Kimi step the f_b / g_b batched matmul took 3.3 µs a KDA
layer (PDL off) for 2 MB of bf16 weights (f_b and g_b stay bf16 in an FP8 model). It is also the one
launch in the layer that is not a programmatic dependent: with PDL on, the in_proj GEMV before it cannot
let it launch early, and the conv update after it cannot launch before it ends. Two GEMVs of 1 MB
(4,096 x 128) join the chain; the arithmetic differs from cuBLAS's only in rounding (fp32 accumulation).

    sys.path.insert(0, "bench/ops/variants"); import kda_up_gemv; kda_up_gemv.install()
    bench/e2e/fp8_decode.py --forms "none;kda_up_gemv"
"""
from __future__ import annotations

from kernelgate import ops
from kernelgate.models.kda import KimiDeltaAttention

_ORIGINAL = KimiDeltaAttention._up


def _up(self, fg_a):
    """KimiDeltaAttention._up with one token as two GEMVs (more tokens: the batched matmul)."""
    if fg_a.shape[0] != 1:
        return _ORIGINAL(self, fg_a)
    H, K = self.H, self.K
    f = ops.linear(fg_a[:, :K], self.up_proj[:H * K])
    gate = ops.linear(fg_a[:, K:], self.up_proj[H * K:])
    return f, gate.view(1, H, K)


def install() -> str:
    KimiDeltaAttention._up = _up
    return "kda_up_gemv: a KDA layer's f_b / g_b at one token as two linear GEMVs (PDL), not one batched matmul"


def uninstall() -> None:
    KimiDeltaAttention._up = _ORIGINAL
