"""FP8 weights in a model: the projections that keep e4m3 codes and fp32 scales on the device, the
module that runs them, and the switch of a model to them before its parameters are allocated.

    Fp8Linear            weight e4m3 [N, K] + weight_scale_inv fp32 [ceil(N/bn), ceil(K/bk)]  block (bn, bk)
                         (DeepSeek-V3 / Qwen FP8) or weight_scale fp32 [N, 1]  per output channel
                         (compressed-tensors): y = ops.fp8_linear(x, weight, scale, block)
    experts (layers.py)  gate_up_proj / down_proj e4m3 [E, N, K] + <name>_scale_inv | <name>_scale
                         -> ops.fused_experts_fp8

`Fp8(block, chosen)` says how a model stores FP8 weights; `convert(model, fp8)` applies it to a
model built on the meta device, before build() allocates anything. What becomes FP8:
  - candidates: nn.Linear projections (parallel.column / row and the layers' own), except lm_head and
    those built with quantize=False (e.g. MLA's kv_b, whose weight is read as a tensor), and the
    tensors a module lists in `fp8_params` (the routed experts). Norms, router, embeddings, lm_head
    and the fp32 decay parameters never are.
  - `chosen(name)`: a published checkpoint's e4m3 weights (loader), or every candidate (quantize on load).
  - all or none: the parts of a fused matrix (parallel.fuse), of a stacked tensor (parallel.stack)
    and an experts' pair run as one kernel call, so they are FP8 together or not at all.
  - whole scale blocks: a weight is filled part by part as a checkpoint stores it (q / k / v, gate /
    up, each rank's shard), each part quantized (or its published scales sliced) on its own, so
    each part must start on a block boundary (every real model: 128-row parts). A weight that cannot
    stays in the model dtype (published FP8 codes are then dequantized as they load).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from .. import ops
from ..errors import KernelgateError
from ..ops.quant.fp8_weights import block_dims, quantize_fp8_block, quantize_fp8_channel, scale_shape
from .parallel import SINGLE, fuse, segment_sizes, stack

FP8 = torch.float8_e4m3fn
DEFAULT_BLOCK = (128, 128)
QUANTIZATIONS = ("fp8",)          # load_model(quantization=...) / --quantization: 128 x 128 block FP8
_CHUNK = 32 << 20                 # fp32 bytes of one slab quantized at a time


@dataclass(frozen=True)
class Fp8:
    block: tuple | None = DEFAULT_BLOCK   # (bn, bk); None: one scale per output channel
    chosen: Callable | None = None        # weight parameter name -> FP8? (None: every candidate)
    sliced: bool = False                  # scales sliced from a published grid (else quantized per part)

    def scale_name(self, pname: str) -> str:
        return pname + ("_scale_inv" if self.block is not None else "_scale")


def scheme(quantization, where: str = "build") -> Fp8 | None:
    """None | "fp8" | an Fp8 -> the Fp8 to convert a model with (None: keep the model dtype)."""
    if quantization is None or isinstance(quantization, Fp8):
        return quantization
    if quantization not in QUANTIZATIONS:
        raise KernelgateError(f"{where}: quantization {quantization!r} is not one of: "
                              f"{', '.join(QUANTIZATIONS)} (or None: the checkpoint's own)")
    return Fp8()


class Fp8Linear(nn.Module):
    """A bias-free linear layer over FP8 codes and their scales (no dequantized copy is kept)."""

    def __init__(self, in_features: int, out_features: int, block, device="meta"):
        super().__init__()
        self.in_features, self.out_features, self.block_size = in_features, out_features, block
        sname = Fp8(block).scale_name("weight")
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8, device=device),
                                   requires_grad=False)
        self.register_parameter(sname, nn.Parameter(torch.empty(scale_shape((out_features, in_features), block),
                                                                device=device), requires_grad=False))
        self._fp8 = {"weight": sname}
        self._dtypes = {"weight": FP8, sname: torch.float32}

    @property
    def scale(self) -> torch.Tensor:
        return getattr(self, self._fp8["weight"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = ops.fp8_linear(x.reshape(-1, self.in_features), self.weight, self.scale, self.block_size)
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, block_size={self.block_size}"


# -- call sites ----------------------------------------------------------------------------
def linear(x: torch.Tensor, module: nn.Module, name: str) -> torch.Tensor:
    """x [T, K] @ the fused matrix `name` of `module` (parallel.fuse) transposed; FP8 codes go
    through ops.fp8_linear with the fused scales."""
    w = getattr(module, name)
    if w.dtype != FP8:
        return ops.linear(x, w)
    first = getattr(module, module._fused[name][0])
    return ops.fp8_linear(x, w, getattr(module, name + "_scale"), first.block_size)


def scale(owner: nn.Module, name: str) -> torch.Tensor:
    """The scales of FP8 tensor `name` of `owner`: a parameter's, or a stacked tensor's."""
    sname = owner.__dict__.get("_fp8", {}).get(name)
    return getattr(owner, sname if sname is not None else name + "_scale")


def is_fp8(t: torch.Tensor) -> bool:
    return t.dtype == FP8


# -- switching a (meta) model to FP8 -------------------------------------------------------
def _join(*parts) -> str:
    return ".".join(p for p in parts if p)


def _candidates(mn: str, m: nn.Module) -> dict:
    """{parameter name: parts along N it is filled from} of module `m` that may be FP8."""
    if isinstance(m, nn.Linear):
        if m.bias is not None or m.__dict__.get("_no_fp8") or mn.rsplit(".", 1)[-1] == "lm_head":
            return {}
        mark = m.__dict__.get("_tp_shards", {}).get("weight")
        return {"weight": mark[1] if mark and mark[0] == 0 else 1}
    return dict(getattr(m, "fp8_params", {}))


def _whole_blocks(m: nn.Module, pname: str, parts: int, fp8: Fp8, par) -> bool:
    """Every part this process fills of `pname` starts on a scale block (see the module docstring)."""
    if fp8.block is None:
        return True
    shape = m._parameters[pname].shape
    nd = len(shape)
    bn, bk = fp8.block
    if parts != 1 and any(n % bn for n in segment_sizes(shape[nd - 2], parts)):
        return False
    mark = m.__dict__.get("_tp_shards", {}).get(pname)
    if mark is None or par.size == 1 or mark[0] < nd - 2:     # replicated, or whole experts per rank
        return True
    d, seg = mark
    b = bn if d == nd - 2 else bk
    ns = segment_sizes(shape[d], seg)                       # this rank's rows (columns) of each segment
    if all(n % b == 0 for n in ns):
        return True
    if len(ns) > 1:
        return False
    n = ns[0]
    if not fp8.sliced:
        return True                                         # quantized per rank: its shard is its grid
    # a published grid: each rank's rows must lie inside one block (whose scale row it then holds)
    return all((r * n) // b == (r * n + n - 1) // b for r in range(par.size))


def _groups(model: nn.Module, fp8: Fp8) -> list:
    """[(weight parameter names that are FP8 together, whether their scales can be concatenated)]."""
    out = []
    for mn, m in model.named_modules():
        for children in m.__dict__.get("_fused", {}).values():
            if not all(isinstance(c, str) for c in children):
                continue
            rows = [getattr(m, c).weight.shape[0] for c in children]
            fits = fp8.block is None or all(r % fp8.block[0] == 0 for r in rows[:-1])
            out.append(([_join(mn, c, "weight") for c in children], fits))
        for parts in m.__dict__.get("_stacked", {}).values():
            out.append(([_join(mn, path, pn) for path, pn in parts], True))
        if getattr(m, "fp8_params", None):
            out.append(([_join(mn, pn) for pn in m.fp8_params], True))
    return out


def convert(model: nn.Module, fp8: Fp8) -> set:
    """Switch the chosen projections of a meta-device model to FP8 (module docstring) -> the names
    of the weight parameters now FP8."""
    par = getattr(model, "par", SINGLE)
    cands = {}
    for mn, m in model.named_modules():
        for pn, parts in _candidates(mn, m).items():
            cands[_join(mn, pn)] = (mn, m, pn, parts)
    want = {n: (fp8.chosen is None or bool(fp8.chosen(n))) and _whole_blocks(m, pn, parts, fp8, par)
            for n, (mn, m, pn, parts) in cands.items()}
    groups = _groups(model, fp8)
    changed = True
    while changed:                        # a group with one member that cannot be FP8 keeps all in the model dtype
        changed = False
        for names, fits in groups:
            if any(want.get(n) for n in names) and not (fits and all(want.get(n) for n in names)):
                for n in names:
                    changed |= bool(want.get(n))
                    want[n] = False
    modules = dict(model.named_modules())
    for n, (mn, m, pn, _) in cands.items():
        if not want[n]:
            continue
        if isinstance(m, nn.Linear):
            parent, _, attr = mn.rpartition(".")
            new = Fp8Linear(m.in_features, m.out_features, fp8.block)
            if "_tp_shards" in m.__dict__:
                new._tp_shards = dict(m._tp_shards)
            setattr(modules[parent], attr, new)
        else:
            _params_to_fp8(m, pn, fp8)
    # fused matrices and stacked tensors of FP8 parts: their scales fused / stacked alike
    for mn, m in model.named_modules():
        for name, children in list(m.__dict__.get("_fused", {}).items()):
            if all(isinstance(c, str) and isinstance(getattr(m, c), Fp8Linear) for c in children):
                fuse(m, name + "_scale", [(c, getattr(m, c)._fp8["weight"]) for c in children])
        for name, parts in list(m.__dict__.get("_stacked", {}).items()):
            owners = [(m.get_submodule(path), pn) for path, pn in parts]
            if all(pn in o.__dict__.get("_fp8", {}) for o, pn in owners):
                stack(m, name + "_scale", [(path, o._fp8[pn]) for (path, _), (o, pn) in zip(parts, owners)])
    return {n for n, ok in want.items() if ok}


def _params_to_fp8(m: nn.Module, pname: str, fp8: Fp8) -> None:
    shape = m._parameters[pname].shape
    sname = fp8.scale_name(pname)
    m._parameters[pname] = nn.Parameter(torch.empty(shape, dtype=FP8, device="meta"), requires_grad=False)
    m.register_parameter(sname, nn.Parameter(torch.empty(scale_shape(tuple(shape), fp8.block), device="meta"),
                                             requires_grad=False))
    m.__dict__.setdefault("_fp8", {})[pname] = sname
    m.__dict__.setdefault("_dtypes", {}).update({pname: FP8, sname: torch.float32})
    m.fp8_block = fp8.block


def fp8_params(model: nn.Module) -> dict:
    """{weight parameter name: (its scale parameter, block)} of a model's FP8 tensors."""
    out = {}
    for mn, m in model.named_modules():
        for pn, sn in m.__dict__.get("_fp8", {}).items():
            block = m.block_size if isinstance(m, Fp8Linear) else m.fp8_block
            out[_join(mn, pn)] = (getattr(m, sn), block)
    return out


def block_of(model: nn.Module):
    """The model's FP8 layout: (bn, bk), None (per channel), or False where it has no FP8 tensor."""
    blocks = {b for _, b in fp8_params(model).values()}
    return next(iter(blocks)) if blocks else False


# -- quantizing ----------------------------------------------------------------------------
def quantize(w: torch.Tensor, block):
    return quantize_fp8_channel(w) if block is None else quantize_fp8_block(w, block)


def slab(shape: tuple, block) -> int:
    """Rows (2-D: a multiple of the block's) or experts (3-D) quantized at a time."""
    per = 4 * math.prod(shape[1:])
    if len(shape) == 3:
        return max(1, _CHUNK // per)
    b = block_dims(block, shape[-1])[0]
    return max(b, _CHUNK // per // b * b)


def quantize_into(w: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, block) -> None:
    """codes, scales <- w quantized (2-D [N, K] or experts [E, N, K]), a slab at a time."""
    step = slab(tuple(w.shape), block)
    b = block_dims(block, w.shape[-1])[0] if w.dim() == 2 else 1
    for a in range(0, w.shape[0], step):
        q, s = quantize(w[a:a + step], block)
        codes[a:a + step].copy_(q)
        scales[a // b:a // b + s.shape[0]].copy_(s)


def fp8_tensors(model: nn.Module) -> tuple[dict, set]:
    """({FP8 weight name: (scale parameter, block)}, {names of the scale parameters})."""
    weights = fp8_params(model)
    ids = {id(s) for s, _ in weights.values()}
    return weights, {n for n, p in model.named_parameters() if id(p) in ids}


def checkpoint_config(model: nn.Module) -> dict | None:
    """config.json's quantization_config for a model's FP8 tensors as save_checkpoint writes them
    (block: DeepSeek-V3's `fp8` with weight_scale_inv; per channel: compressed-tensors' weight_scale)."""
    block = block_of(model)
    if block is False:
        return None
    if block is not None:
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(block)}
    fp8 = {"num_bits": 8, "type": "float", "symmetric": True}
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"],
                                          "weights": {**fp8, "strategy": "channel", "dynamic": False},
                                          "input_activations": {**fp8, "strategy": "token", "dynamic": True}}}}
