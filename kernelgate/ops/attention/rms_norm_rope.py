"""Per-head RMSNorm then partial rotate-half rotary, in one op (the q / k path of Qwen3-Next /
Qwen3.5 gated attention).

    rms_norm_rope(x, weight, cos, sin, eps) -> out
        x       [T, H, Dh]  float32 / bfloat16 / float16; any strides (the query half of a
                            [T, H, 2 * Dh] projection is a view); a last dim that is not
                            contiguous is copied by the Triton wrapper
        weight  [Dh]        float32, the whole multiplier (zero-centred norms pass 1 + w)
        cos     [T, R / 2]  float32, rotary of each token's position (2 <= R <= Dh)
        sin     [T, R / 2]  float32, same shape as cos
        eps     float > 0
        -> out  [T, H, Dh]  new, contiguous, in x's dtype

Math in fp32, rounded to x's dtype once at the end:
    y = x * rsqrt(mean(x^2 over Dh) + eps) * weight
    h = R / 2; y1 = y[:h], y2 = y[h:R]
    out[:h] = y1 * cos - y2 * sin;  out[h:R] = y2 * cos + y1 * sin;  out[R:] = y[R:]
This is transformers' RMSNorm followed by `apply_rotary_pos_emb` with cos / sin = cat([c, c]) /
cat([s, s]), except that transformers rounds to x's dtype in between.
"""
from __future__ import annotations

import torch

from ... import checks
from ...triton_utils import compiled_needs_gpu
from ...registry import GPU_TRITON, Case, declare

OP = "rms_norm_rope"


def rms_norm_rope_native(x, weight, cos, sin, eps):
    """RMSNorm over the head dim, then rotate-half rotary on its first 2 * cos.shape[1] dims."""
    h = cos.shape[1]
    xf = x.float()                                                              # [T, H, Dh]
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    c, s = cos.float()[:, None, :], sin.float()[:, None, :]                     # [T, 1, h]
    y1, y2 = y[..., :h], y[..., h:2 * h]
    out = torch.cat([y1 * c - y2 * s, y2 * c + y1 * s, y[..., 2 * h:]], dim=-1)
    return out.to(x.dtype)


def validate(x, weight, cos, sin, eps):
    checks.tensor(OP, "x", x, ndim=3, dtype=checks.FLOATS)
    T, H, Dh = x.shape
    checks.require(Dh >= 2, OP, f"x head dim (last) must be >= 2 (room for one rotary pair), got shape {tuple(x.shape)}")
    checks.tensor(OP, "weight", weight, shape=(Dh,), dtype=torch.float32, device=x.device)
    checks.tensor(OP, "cos", cos, ndim=2, dtype=torch.float32, device=x.device)
    checks.tensor(OP, "sin", sin, ndim=2, dtype=torch.float32, device=x.device)
    checks.same_shape(OP, "sin", sin, "cos", cos)
    checks.require(cos.shape[0] == T, OP, f"cos shape {tuple(cos.shape)}: rows != x tokens {T}")
    h = cos.shape[1]
    checks.require(1 <= h and 2 * h <= Dh, OP,
                   f"cos shape {tuple(cos.shape)}: rotary dim 2 * {h} = {2 * h} must be in [2, head dim {Dh}]")
    checks.require_number(OP, "eps", eps, lo=0, lo_open=True)


# -- parity cases ----------------------------------------------------------------------------
THETA = 10_000_000.0   # Qwen3-Next / Qwen3.5 rope_theta


def cos_sin(positions: torch.Tensor, R: int, theta: float = THETA) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [T] -> (cos, sin) fp32 [T, R / 2] (the model's rotary tables)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, R, 2, dtype=torch.float32) / R)
    freqs = positions.float()[:, None] * inv_freq[None, :]
    return freqs.cos(), freqs.sin()


def make_inputs(T, H, Dh, R, dtype, gen, device="cpu", fused=False):
    """(x, weight, cos, sin): x ~ N(0, 2^2); `fused`: x is the first half of each head of a
    [T, H, 2 * Dh] tensor (the query view of the gated q projection)."""
    xx = 2 * torch.randn(T, H, 2 * Dh if fused else Dh, generator=gen)
    w = 1 + 0.1 * torch.randn(Dh, generator=gen)
    c, s = cos_sin(torch.randint(0, 1 << 17, (T,), generator=gen), R)
    xx, w, c, s = (t.to(device) for t in (xx.to(dtype), w, c, s))
    return (xx[..., :Dh] if fused else xx), w, c, s


def _case(T, H, Dh, R, fused=False, dtypes=(torch.float32, torch.bfloat16)):
    def make(device, dtype, gen):
        return make_inputs(T, H, Dh, R, dtype, gen, device, fused) + (1e-6,), {}
    return Case(f"T{T}-H{H}-D{Dh}-R{R}" + ("-qview" if fused else ""), make, dtypes=dtypes)


def cases():
    return [
        _case(1, 16, 256, 64, fused=True),                                  # Qwen3.5 / Qwen3-Next q, decode
        _case(37, 16, 256, 64, fused=True, dtypes=checks.FLOATS),           # q, a few tokens
        _case(1, 2, 256, 64),                                               # k: 2 KV heads, contiguous
        _case(37, 2, 256, 64, dtypes=checks.FLOATS),
        _case(5, 4, 128, 128),                                              # full rotary
        _case(9, 3, 96, 32),                                                # odd head dim and rotary
        _case(0, 16, 256, 64, fused=True),                                  # no tokens
    ]


def _bytes(args, kwargs):
    x, w, c, s, _ = args
    return 2 * x.numel() * x.element_size() + 2 * c.numel() * 4 + w.numel() * 4


def bench_cases():
    """Qwen3.5 / Qwen3-Next shapes: q (16 heads, a view of the gated projection) and k (2 heads)
    at decode batches 1 and 64 and a 8192-token prefill chunk."""
    def make(T, H, fused):
        def f(device, dtype, gen):
            return make_inputs(T, H, 256, 64, dtype, gen, device, fused) + (1e-6,), {}
        return f
    return [Case(f"{'q' if fused else 'k'}-T{T}-H{H}-D256-R64", make(T, H, fused), dtypes=(torch.bfloat16,),
                 bytes=_bytes)
            for fused, H in ((True, 16), (False, 2)) for T in (1, 64, 8192)]


rms_norm_rope = declare(OP, rms_norm_rope_native, validate=validate, cases=cases, bench_cases=bench_cases)


# -- implementations -------------------------------------------------------------------------
TRITON_MAX_HEAD_DIM = 1024   # the kernel holds a row whole in registers


def _triton_supports(x, weight, cos, sin, eps):
    if x.shape[2] > TRITON_MAX_HEAD_DIM:
        return f"head dim {x.shape[2]} > {TRITON_MAX_HEAD_DIM} (a row is held whole in registers)"
    return compiled_needs_gpu(x)


rms_norm_rope.implementation(
    "triton", ".rms_norm_rope_triton:rms_norm_rope_triton", provider="triton",
    platforms=GPU_TRITON, dtypes=checks.FLOATS, requires=("triton",), supports=_triton_supports,
    priority=10, doc="one launch: a block of (token, head) rows per program, norm and rotary in registers")
