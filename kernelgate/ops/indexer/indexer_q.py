"""DeepSeek V3.2 / V4 lightning-indexer query prep: RoPE, Hadamard rotation, FP8 quantization.

    fused_q_indexer_rope_hadamard_quant(q[B,H,128], weight[B,H], weight_scale, freqs_cis,
        positions[B], variant="v4", fp8_format="e4m3fn", hadamard=None)
        -> (q_fp8 [B,H,128] fp8, weights_out fp32 [B,H,1])

`freqs_cis` is DeepSeek's own table: complex64 [max_pos, 32], freqs_cis[p, i] = exp(1j*p*theta_i)
(`precompute_freqs_cis` of the inference code; YaRN scaling, if any, is baked in).

variant "v4" (DeepSeek V4, head = [nope 64 | rope 64]): RoPE on dims 64..127 with
  *interleaved* pairs (64+2i, 65+2i) rotated by freqs_cis[p, i]; then the 128-point
  Walsh-Hadamard transform in natural (Sylvester) order times 1/sqrt(128).
variant "v32" (DeepSeek V3.2, head = [rope 64 | nope 64]): RoPE on dims 0..63 with
  *non-interleaved* pairs (i, 32+i) -- DeepSeek's inference code says "rope in indexer is
  not interleaved" (fixed there in Nov 2025) and HF transformers' deepseek_v32 agrees; no
  Hadamard by default. `hadamard=True` adds it (DeepSeek's reference applies
  `rotate_activation` after RoPE in V3.2 too; engines that run it as a separate kernel
  call this op without it).

A position outside [0, max_pos) (freqs_cis rows) gives that token zero codes and zero
weights_out (it adds nothing to the logits); checked mode (KERNELGATE_CHECKS=1) raises.

Then per (token, head): scale = max(amax, 1e-4) / FP8_MAX, q_fp8 = clamp(x / scale, +-FP8_MAX)
in the chosen e4m3 format (FP8_MAX 448 for e4m3fn, 240 for ROCm's e4m3fnuz), and
weights_out = weight * weight_scale * scale, so that indexer logits computed on the fp8
codes need no separate q scale: relu(s*a) = s*relu(a) for s > 0.
"""
from __future__ import annotations

import math

import torch

from ... import checks
from ...registry import GPU_TRITON, Case, declare
from ..common import fp8 as _fp8
from ..common import index_checks
from .hadamard import sylvester_hadamard

OP = "fused_q_indexer_rope_hadamard_quant"
HEAD_DIM = 128
ROPE_DIM = 64
VARIANTS = ("v4", "v32")


def apply_rope(x: torch.Tensor, freqs_cis: torch.Tensor, positions: torch.Tensor, variant: str) -> torch.Tensor:
    """x fp32 [B, H, 128] -> RoPE'd copy (real arithmetic, written as the complex product
    (a + ib) * (cos + i sin) of each pair)."""
    p = positions.long()
    cs = torch.view_as_real(freqs_cis[torch.where((p >= 0) & (p < freqs_cis.shape[0]), p, 0)])  # [B, 32, 2]
    cos, sin = cs[..., 0].unsqueeze(1), cs[..., 1].unsqueeze(1)     # [B, 1, 32]
    x = x.clone()
    if variant == "v4":
        a, b = x[..., ROPE_DIM::2], x[..., ROPE_DIM + 1::2]         # interleaved pairs
    else:
        a, b = x[..., :ROPE_DIM // 2], x[..., ROPE_DIM // 2:ROPE_DIM]
    a_new = a * cos - b * sin
    b_new = a * sin + b * cos
    if variant == "v4":
        x[..., ROPE_DIM::2], x[..., ROPE_DIM + 1::2] = a_new, b_new
    else:
        x[..., :ROPE_DIM // 2], x[..., ROPE_DIM // 2:ROPE_DIM] = a_new, b_new
    return x


def indexer_q_native(q, weight, weight_scale, freqs_cis, positions, variant="v4", fp8_format="e4m3fn",
                     hadamard=None):
    """Indexer query RoPE (+ Hadamard) + per-(token, head) FP8 quantization; fp32 math."""
    ok = ((positions >= 0) & (positions < freqs_cis.shape[0]))[:, None, None]     # [B, 1, 1]
    x = apply_rope(q.float(), freqs_cis, positions, variant)
    if (variant == "v4") if hadamard is None else hadamard:
        x = (x @ sylvester_hadamard(HEAD_DIM, x.device)) * (1.0 / math.sqrt(HEAD_DIM))
    x = torch.where(ok, x, 0.0)                  # a position outside freqs_cis: zero codes and weight
    q_fp8, scale = _fp8.quantize_rows(x, fp8_format)
    weights_out = torch.where(ok, weight.float().unsqueeze(-1) * weight_scale * scale, 0.0)
    return q_fp8, weights_out


def validate(q, weight, weight_scale, freqs_cis, positions, variant="v4", fp8_format="e4m3fn", hadamard=None):
    checks.tensor(OP, "q", q, ndim=3, dtype=checks.FLOATS)
    B, H, D = q.shape
    checks.require(D == HEAD_DIM, OP, f"q head dim {D} != {HEAD_DIM} (q shape {tuple(q.shape)})")
    checks.tensor(OP, "weight", weight, shape=(B, H), dtype=checks.FLOATS, device=q.device)
    checks.require(isinstance(weight_scale, (int, float)), OP,
                   f"weight_scale must be a Python float, got {type(weight_scale).__name__}")
    checks.tensor(OP, "freqs_cis", freqs_cis, ndim=2, dtype=torch.complex64, device=q.device)
    checks.require(freqs_cis.shape[1] == ROPE_DIM // 2, OP,
                   f"freqs_cis shape {tuple(freqs_cis.shape)} != (max_pos, {ROPE_DIM // 2})")
    checks.tensor(OP, "positions", positions, shape=(B,), dtype=(torch.int32, torch.int64), device=q.device)
    checks.require(variant in VARIANTS, OP, f"variant {variant!r} not in {VARIANTS}")
    _fp8.check_format(OP, fp8_format)
    checks.require(hadamard in (None, True, False), OP, f"hadamard must be None or a bool, got {hadamard!r}")


def check_values(q, weight, weight_scale, freqs_cis, positions, variant="v4", fp8_format="e4m3fn", hadamard=None):
    index_checks.ids_below(OP, "positions", positions, freqs_cis.shape[0], "rows of freqs_cis", negative_ok=False)


def compare(out, ref, dtype, inputs):
    """q_fp8 by fp8 code (one-code differences allowed on a small fraction, see _fp8);
    weights_out by relative error."""
    from ..common.compare import assert_close
    _fp8.assert_fp8_close(out[0], ref[0])
    assert_close(out[1], ref[1], 1e-5, "weights_out")


# -- parity cases ---------------------------------------------------------------------
def precompute_freqs_cis(max_pos: int, theta: float = 10000.0, device=None) -> torch.Tensor:
    """[max_pos, 32] complex64, exp(1j * p * theta^(-2i/64)) (plain RoPE, no YaRN)."""
    inv = theta ** (-torch.arange(0, ROPE_DIM, 2, dtype=torch.float64) / ROPE_DIM)
    ang = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv[None, :]
    return torch.polar(torch.ones_like(ang), ang).to(torch.complex64).to(device)


def _case(B, H, variant="v4", fmt="e4m3fn", hadamard=None, max_pos=4096):
    def make(device, dtype, gen):
        q = (3 * torch.randn(B, H, HEAD_DIM, generator=gen)).to(device=device, dtype=dtype)
        weight = torch.randn(B, H, generator=gen).to(device=device, dtype=dtype)
        pos = torch.randint(0, max_pos, (B,), generator=gen, dtype=torch.int32).to(device)
        kw = dict(variant=variant, fp8_format=fmt)
        if hadamard is not None:
            kw["hadamard"] = hadamard
        return (q, weight, 0.125, precompute_freqs_cis(max_pos, device=device), pos), kw
    hid = "" if hadamard is None else ("-hadamard" if hadamard else "-nohadamard")
    return Case(f"B{B}-H{H}-{variant}-{fmt}{hid}", make)


def cases():
    return [
        _case(1, 4),
        _case(63, 8),
        _case(65, 2, fmt="e4m3fnuz"),
        _case(5, 64),
        _case(33, 4, variant="v32"),
        _case(17, 3, variant="v32", fmt="e4m3fnuz"),
        _case(9, 5, variant="v32", hadamard=True),
        _case(7, 6, variant="v4", hadamard=False),
    ]


def _bytes(args, kwargs):
    q, weight = args[0], args[1]
    # read q and weight, write 1-byte codes and fp32 weights_out (freqs rows are negligible)
    return q.numel() * (q.element_size() + 1) + weight.numel() * (weight.element_size() + 4)


def bench_cases():
    def make(tokens, heads, variant):
        def f(device, dtype, gen):
            q = torch.randn(tokens, heads, HEAD_DIM, device=device, dtype=dtype)
            w = torch.randn(tokens, heads, device=device, dtype=torch.float32)
            pos = torch.randint(0, 65536, (tokens,), device=device, dtype=torch.int64)
            return (q, w, 0.125, precompute_freqs_cis(65536, device=device), pos), dict(variant=variant)
        return f
    return [Case(f"T4096-H64-{v}", make(4096, 64, v), dtypes=(torch.bfloat16,), bytes=_bytes)
            for v in VARIANTS]


fused_q_indexer_rope_hadamard_quant = declare(
    OP, indexer_q_native, validate=validate, check_values=check_values, cases=cases, bench_cases=bench_cases, compare=compare)

# Two kernels: the token-major one with the Hadamard on two lanes (the faster on NVIDIA: its layout
# stores whole 32-byte sectors of codes, and H16 in a thread x H2 across two lanes needs no MMA) and
# the row-major portable one (bf16x3 MMA Hadamard), which every Triton backend runs. Launch choices
# per platform: each kernel file's launch_config().
fused_q_indexer_rope_hadamard_quant.implementation(
    "triton_tok", ".indexer_q_tok_triton:indexer_q_tok_triton", provider="triton", platforms=("cuda",),
    requires=("triton",), priority=20,
    doc="token-major: per-token RoPE freqs, H4 across quarters x (H16 in a thread, H2 across two lanes), "
        "no MMA; hardware e4m3fn cast on fp8 GPUs")
fused_q_indexer_rope_hadamard_quant.implementation(
    "triton", ".indexer_q_triton:indexer_q_triton", provider="triton", platforms=GPU_TRITON,
    requires=("triton",), priority=10,
    doc="row-major: RoPE, 4-point butterfly + 32-point Hadamard as three bf16 parts by tl.dot, integer fp8 encode")
