"""FP8 e4m3 formats shared by the DeepSeek indexer ops, and an fp8-aware parity compare.

Two 8-bit e4m3 encodings are in use:
  e4m3fn   (OCP, NVIDIA/Intel): bias 7, max 448, no infinities, 0x7F/0xFF = NaN
  e4m3fnuz (AMD MI300 "fnuz"):  bias 8, max 240, 0x80 = NaN (so no negative zero)
The format is an op argument (`fp8_format=`), never a platform branch.
"""
from __future__ import annotations

import torch

from ... import checks

FORMATS = {
    "e4m3fn": (torch.float8_e4m3fn, 448.0),
    "e4m3fnuz": (torch.float8_e4m3fnuz, 240.0),
}
DTYPE_FORMAT = {dt: name for name, (dt, _) in FORMATS.items()}
AMAX_FLOOR = 1e-4  # scale = max(amax, 1e-4) / FP8_MAX: an all-zero row still gets a finite scale


def check_format(op: str, fp8_format: str) -> tuple[torch.dtype, float]:
    checks.require(fp8_format in FORMATS, op, f"fp8_format {fp8_format!r} not in {tuple(FORMATS)}")
    return FORMATS[fp8_format]


def quantize_rows(x: torch.Tensor, fp8_format: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row (last dim) symmetric quantization, the reference for every kernel here.

    x fp32 [..., D] -> (codes fp8 [..., D], scale fp32 [..., 1]) with
    scale = max(amax, 1e-4) / FP8_MAX and codes = clamp(x / scale, +-FP8_MAX) rounded to
    nearest even (torch's cast)."""
    dtype, fmax = FORMATS[fp8_format]
    amax = x.abs().amax(-1, keepdim=True).clamp(min=AMAX_FLOOR)
    # Divide by a tensor, not a Python float: CUDA divides by a scalar through its
    # reciprocal, one ulp off the IEEE quotient, and the scale bytes would then differ from
    # the kernels', which divide correctly rounded.
    scale = amax / torch.full_like(amax, fmax)
    return (x / scale).clamp(-fmax, fmax).to(dtype), scale


def code_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|ordinal(a) - ordinal(b)| for fp8 tensors of one format: 0 = same value, 1 = adjacent
    representable values (one ulp apart). e4m3 codes are sign-magnitude and the 7-bit
    magnitude is monotonic in the value, so the ordinal is +-magnitude."""
    def ordinal(t):
        u = t.view(torch.uint8).to(torch.int32)
        mag = u & 0x7F
        return torch.where(u >= 0x80, -mag, mag)
    return (ordinal(a) - ordinal(b)).abs()


# A kernel may round a value differently from torch when its fp32 input differs in the last
# bits (FMA contraction, another summation order in the Hadamard transform). Such a value
# lands on the neighbouring fp8 code. Allowed: at most ULP_FRACTION of the elements one code
# apart, none further. Measured on CPU (interpreter): 0 to a few in 10^4.
ULP_FRACTION = 1 / 64


def assert_fp8_close(out: torch.Tensor, ref: torch.Tensor, what: str = "q_fp8") -> None:
    assert out.dtype == ref.dtype, f"{what}: dtype {out.dtype} != {ref.dtype}"
    assert out.shape == ref.shape, f"{what}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    o, r = out.cpu(), ref.cpu()
    assert not torch.isnan(o.float()).any(), f"{what}: NaN codes (unwritten output?)"
    dist = code_distance(o, r)
    far = int((dist > 1).sum())
    near = int((dist == 1).sum())
    assert far == 0, f"{what}: {far} of {r.numel()} elements differ by more than one fp8 code"
    assert near <= ULP_FRACTION * r.numel(), \
        f"{what}: {near} of {r.numel()} elements one fp8 code apart (allowed {ULP_FRACTION:.4f})"
