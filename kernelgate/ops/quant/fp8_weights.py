"""FP8 e4m3fn weights: quantization, exact dequantization, and the checks FP8 ops share.

Block layout (DeepSeek-V3 / Qwen FP8 checkpoints, `quantization_config: {quant_method: fp8,
weight_block_size: [bn, bk]}`; `block_size=(bn, bk)` below):

    weight            float8_e4m3fn [..., N, K]
    weight_scale_inv  float32       [..., ceil(N / bn), ceil(K / bk)]
    dequantized       w[..., n, k] = float(weight[..., n, k]) * scale[..., n // bn, k // bk]

Edge blocks are partial: N and K need not be multiples of the block. Per-channel layout
(compressed-tensors `strategy: channel`; `block_size=None`): scale float32 [..., N, 1],
w[n, k] = float(weight[n, k]) * scale[n, 0] -- the block layout with block (1, K), which is
how the kernels see it. Leading dims `...` are stacked experts ([E, N, K]), each with its own scales.

Quantization, per block (what a loader does to a bf16 tensor; the tests' reference):

    scale  = max(amax(|w| over the block), AMAX_FLOOR) / 448
    weight = clamp(w / scale, -448, 448) rounded to nearest even, as e4m3fn

computed in fp32 from w's values (bf16 / fp16 / fp32); an all-zero block gets a finite scale and
zero codes. quantize_fp8_groups does the same per (token, group of K columns): the activations of
fp8_linear's w8a8 form.
"""
from __future__ import annotations

import math

import torch

from ... import checks
from ...platform import KernelgateError

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
AMAX_FLOOR = 1e-12      # amax below this quantizes as if it were this (all-zero blocks: scale > 0)
DEFAULT_BLOCK = (128, 128)


def block_dims(block_size, K: int) -> tuple[int, int]:
    """(bn, bk) of a block_size; per-channel (None) is (1, K)."""
    return (1, max(K, 1)) if block_size is None else (int(block_size[0]), int(block_size[1]))


def scale_shape(shape, block_size) -> tuple:
    """Scale shape of a weight of `shape` [..., N, K] under block_size (None: per channel, [..., N, 1])."""
    *lead, N, K = shape
    bn, bk = block_dims(block_size, K)
    return (*lead, math.ceil(N / bn), math.ceil(K / bk))


def _expand(scale: torch.Tensor, bn: int, bk: int, N: int, K: int) -> torch.Tensor:
    """[..., nb, kb] -> [..., N, K]: each block's scale over its (partial) block."""
    return scale.repeat_interleave(bn, dim=-2)[..., :N, :].repeat_interleave(bk, dim=-1)[..., :K]


def _quantize(w: torch.Tensor, bn: int, bk: int, fmax: float = FP8_MAX):
    *lead, N, K = w.shape
    nb, kb = math.ceil(N / bn), math.ceil(K / bk)
    a = w.float().abs()
    a = torch.nn.functional.pad(a, (0, kb * bk - K, 0, nb * bn - N))     # zeros: amax unchanged
    amax = a.reshape(*lead, nb, bn, kb, bk).amax(dim=(-3, -1)).clamp(min=AMAX_FLOOR)
    # a tensor divisor, not a Python float: CUDA divides by a scalar through its reciprocal (1 ulp off)
    scale = amax / torch.full_like(amax, fmax)
    codes = (w.float() / _expand(scale, bn, bk, N, K)).clamp(-fmax, fmax).to(FP8)
    return codes, scale


def quantize_fp8_block(w: torch.Tensor, block=DEFAULT_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """w float [..., N, K] -> (e4m3fn [..., N, K], scale_inv fp32 [..., ceil(N/bn), ceil(K/bk)]).

    Peak memory: two fp32 copies of w (quantize a checkpoint tensor by tensor, or expert by expert)."""
    bn, bk = block_dims(block, w.shape[-1])
    if bn < 1 or bk < 1:
        raise KernelgateError(f"quantize_fp8_block: block {block} must be two ints > 0")
    return _quantize(w, bn, bk)


def quantize_fp8_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w float [..., N, K] -> (e4m3fn [..., N, K], scale fp32 [..., N, 1]): one scale per output row."""
    return _quantize(w, 1, max(w.shape[-1], 1))


def dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor, block_size=DEFAULT_BLOCK) -> torch.Tensor:
    """fp32 [..., N, K]: float(weight) * the scale of each element's block (block_size None: per channel)."""
    *_, N, K = weight.shape
    bn, bk = block_dims(block_size, K)
    return weight.float() * _expand(scale.float(), bn, bk, N, K)


def quantize_fp8_groups(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations x [T, K] -> (e4m3fn [T, K], scale fp32 [T, ceil(K / group)]), one scale per token
    and group of `group` consecutive columns (the last group partial); same rule as the weights."""
    return _quantize(x, 1, group)


# -- checks shared by the FP8 ops ----------------------------------------------------------
def check_block_size(op: str, block_size) -> None:
    if block_size is None:
        return
    ok = (isinstance(block_size, (tuple, list)) and len(block_size) == 2
          and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block_size))
    checks.require(ok, op, f"block_size must be None (per-channel scales) or two ints > 0, got {block_size!r}")


def check_weight(op: str, name: str, weight, scale_name: str, scale, block_size, shape, device) -> None:
    """`weight` e4m3fn of `shape`; `scale` fp32 of its scale shape under `block_size`."""
    checks.tensor(op, name, weight, ndim=len(shape), dtype=FP8, device=device)
    checks.tensor(op, name, weight, shape=shape)
    check_block_size(op, block_size)
    checks.tensor(op, scale_name, scale, ndim=len(shape), dtype=torch.float32, device=device)
    want = scale_shape(tuple(weight.shape), block_size)
    layout = "per-channel (block_size None)" if block_size is None else f"block_size {tuple(block_size)}"
    checks.require(tuple(scale.shape) == want, op,
                   f"{scale_name} shape {tuple(scale.shape)} != {want} ({layout} over {name} {tuple(weight.shape)})")


def check_scale_values(op: str, name: str, scale: torch.Tensor) -> None:
    """Every scale finite (reads the device: checked mode, or once at load)."""
    bad = ~torch.isfinite(scale.detach())
    if bool(bad.any()):
        i = tuple(int(v) for v in bad.nonzero()[0])
        raise KernelgateError(f"{op}: {name}{list(i)} = {float(scale[i])} is not finite "
                              f"({int(bad.sum())} of {scale.numel()} scales)")

