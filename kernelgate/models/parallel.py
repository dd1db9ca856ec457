"""Tensor / expert parallel pieces of the model: who holds which slice, and the collectives.

A `Parallel` says which rank of how many this process is. Layers build their parameters at
their shard's size and mark each sharded parameter with (dim, segments): the full tensor's
`dim` is `segments` equal parts (q|k|v: 3, gate|up: 2) -- or parts of the given full sizes
(a tuple: Gated DeltaNet's q | k | v, whose v has more heads) -- and rank r holds part r / size
of every segment, in order. The loader reads exactly those slices; everything unmarked is
replicated. Column-parallel outputs need no collective; a row-parallel output is a partial
sum, reduced once per block (`all_reduce`). Vocab-parallel embedding masks the ids outside
the rank's rows and sums over ranks; vocab-parallel logits are gathered along the vocab.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .. import ops
from ..errors import KernelgateError


@dataclass
class Parallel:
    rank: int = 0
    size: int = 1
    expert_parallel: bool = False
    group: object = None          # torch.distributed process group of the model's collectives

    def split(self, n: int, what: str) -> int:
        if n % self.size:
            raise KernelgateError(f"tensor_parallel_size {self.size} does not divide {what} ({n})")
        return n // self.size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            torch.distributed.all_reduce(x, group=self.group)
        return x

    def gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """[..., n] on each rank -> [..., size * n] on every rank (rank order)."""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        torch.distributed.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=-1)

    def part(self, full: int, segments=1) -> list:
        """[(full start, local start, length)] of this rank's piece of each segment of `full`."""
        out, g0, l0 = [], 0, 0
        for seg in segment_sizes(full, segments):
            n = seg // self.size
            out.append((g0 + self.rank * n, l0, n))
            g0, l0 = g0 + seg, l0 + n
        return out


SINGLE = Parallel()


def segment_sizes(n: int, segments) -> list:
    """The sizes of the segments of a dim of length `n` (full, or one rank's: the same shares):
    `segments` equal parts, or parts in proportion to the tuple of full sizes `segments`."""
    if isinstance(segments, int):
        return [n // segments] * segments
    total = sum(segments)
    return [s * n // total for s in segments]


def check_config(c, size: int, expert_parallel: bool) -> None:
    """Every split the model makes at `size` ranks, checked before any process starts."""
    if size == 1:
        return
    p = Parallel(0, size, expert_parallel)
    if "linear_attention" in c.layer_types:
        p.split(c.linear_num_key_heads, "linear_num_key_heads (Gated DeltaNet key heads)")
        p.split(c.linear_num_value_heads, "linear_num_value_heads (Gated DeltaNet value heads)")
    if "full_attention" in c.layer_types:
        p.split(c.num_attention_heads, "num_attention_heads")
        p.split(c.num_key_value_heads, "num_key_value_heads (K/V heads are split, not replicated)")
    if "kda" in c.layer_types:
        p.split(c.linear_num_heads, "linear_num_heads (KDA heads)")
    if "mla" in c.layer_types:
        p.split(c.num_attention_heads, "num_attention_heads (MLA heads)")
    p.split(c.vocab_size, "vocab_size")
    if "dense" in c.mlp_types:
        p.split(c.intermediate_size, "intermediate_size")
    if "moe" in c.mlp_types:
        shared = getattr(c, "shared_expert_intermediate_size", None)
        if shared is None:
            shared = c.moe_intermediate_size * c.num_shared_experts
        if shared:
            p.split(shared, "the shared expert's intermediate size")
        if expert_parallel:
            p.split(c.num_experts, "num_experts (enable_expert_parallel)")
        else:
            p.split(c.moe_intermediate_size, "moe_intermediate_size (expert-internal tensor parallel; "
                    "or enable_expert_parallel)")


def mark(module: nn.Module, pname: str, dim: int, segments: int = 1) -> None:
    """Parameter `pname` of `module` is this rank's part of a tensor split along `dim`."""
    if "_tp_shards" not in module.__dict__:
        module._tp_shards = {}
    module._tp_shards[pname] = (dim, segments)


def fuse(module: nn.Module, name: str, children: list) -> None:
    """The weights of Linear submodules `children` (one input, outputs stacked along dim 0, this
    rank's parts) live in one matrix, buffer `name` of `module`: one matmul reads them all. Each
    child keeps its parameter (a view into the matrix), so the loader, the shard marks and
    checkpoints see the usual names. `build` allocates the matrix (kimi_linear.py). A child given
    as (name, parameter) fuses that parameter instead of `weight` (FP8 scales: models/quant.py)."""
    module.__dict__.setdefault("_fused", {})[name] = list(children)


def stack(module: nn.Module, name: str, parts: list) -> None:
    """Parameters `parts` ((submodule path, parameter name); each [n, *shape] -- n entries -- or
    [*shape] -- one) live in one [N, *shape] tensor, buffer `name` of `module`, in order: e.g. the
    routed experts [E, 2I, D] and the shared expert's [2I, D] as experts 0..E (one grouped GEMM
    runs both). Each keeps its parameter, a view into the tensor. `build` allocates it."""
    module.__dict__.setdefault("_stacked", {})[name] = list(parts)


def allocate_fused(module: nn.Module, dtype, device) -> set:
    """Allocate `module`'s fused matrices and stacked tensors and make the parameters views of
    them -> the (module id, parameter name) of the parameters now allocated."""
    done = set()
    for name, children in module.__dict__.get("_fused", {}).items():
        owners = [(getattr(module, c), "weight") if isinstance(c, str) else (getattr(module, c[0]), c[1])
                  for c in children]
        rows = [m._parameters[pn].shape[0] for m, pn in owners]
        buf = torch.empty(sum(rows), *owners[0][0]._parameters[owners[0][1]].shape[1:],
                          dtype=param_dtype(*owners[0], dtype), device=device)
        module.register_buffer(name, buf, persistent=False)
        for (m, pn), a, n in zip(owners, [sum(rows[:i]) for i in range(len(rows))], rows):
            m._parameters[pn] = nn.Parameter(buf[a:a + n], requires_grad=False)
            done.add((id(m), pn))
    for name, parts in module.__dict__.get("_stacked", {}).items():
        owners = [(module.get_submodule(path), pname) for path, pname in parts]
        shape = min((m._parameters[pn].shape for m, pn in owners), key=len)   # one entry's shape
        counts = [m._parameters[pn].shape[0] if m._parameters[pn].dim() > len(shape) else 1 for m, pn in owners]
        buf = torch.empty(sum(counts), *shape, dtype=param_dtype(*owners[0], dtype), device=device)
        module.register_buffer(name, buf, persistent=False)
        a = 0
        for (m, pn), n in zip(owners, counts):
            view = buf[a:a + n] if m._parameters[pn].dim() > len(shape) else buf[a]
            m._parameters[pn] = nn.Parameter(view, requires_grad=False)
            done.add((id(m), pn))
            a += n
    return done


def param_dtype(module: nn.Module, pname: str, default):
    """The dtype parameter `pname` is allocated in: its own where the module fixes it (FP8 codes and
    their fp32 scales: models/quant.py), else `default`."""
    return module.__dict__.get("_dtypes", {}).get(pname, default)


def materialize(model: nn.Module, dtype, device, fp32: tuple = ()) -> nn.Module:
    """Allocate every parameter of a model built on the meta device, once, in its final dtype on
    `device` (fused matrices and stacked tensors first; parameters whose names end with one of
    `fp32` in float32, FP8 codes and scales in theirs: param_dtype), uninitialised."""
    fused = set()
    for mod in model.modules():
        fused |= allocate_fused(mod, dtype, device)
    for mod_name, mod in model.named_modules():
        for pname, p in list(mod._parameters.items()):
            if p is None or (id(mod), pname) in fused:
                continue
            full = f"{mod_name}.{pname}" if mod_name else pname
            want = param_dtype(mod, pname, torch.float32 if full.endswith(fp32) else dtype)
            mod._parameters[pname] = nn.Parameter(torch.empty(p.shape, dtype=want, device=device),
                                                  requires_grad=False)
    return model


class Linear(nn.Linear):
    """A bias-free projection in the model dtype through the registry's `linear` (at one token a
    GEMV that joins the decode step's chain of kernels; PyTorch's GEMM otherwise)."""

    def __init__(self, in_f: int, out_f: int):
        super().__init__(in_f, out_f, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = ops.linear(x.reshape(-1, self.in_features), self.weight)
        return y.view(*x.shape[:-1], self.out_features)


def column(in_f: int, out_f: int, par: Parallel, what: str, segments=1, quantize: bool = True) -> nn.Linear:
    """Linear whose output features (`segments` fused parts: a count, or their full sizes) are
    split over the ranks.
    quantize=False: kept in the model dtype in an FP8 model (a weight read as a tensor, not called)."""
    lin = Linear(in_f, par.split(out_f, what))
    mark(lin, "weight", 0, segments)
    if not quantize:
        lin._no_fp8 = True
    return lin


def row(in_f: int, out_f: int, par: Parallel, what: str, quantize: bool = True) -> nn.Linear:
    """Linear whose input features are split: each rank's output is a partial sum."""
    lin = Linear(par.split(in_f, what), out_f)
    mark(lin, "weight", 1)
    if not quantize:
        lin._no_fp8 = True
    return lin


def shard_specs(model: nn.Module) -> dict:
    """{parameter name: (dim, segments)} of the sharded parameters."""
    out = {}
    for mn, m in model.named_modules():
        for pn, spec in m.__dict__.get("_tp_shards", {}).items():
            out[f"{mn}.{pn}" if mn else pn] = spec
    return out


class VocabEmbedding(nn.Module):
    """Embedding whose rows (the vocabulary) are split over the ranks."""

    def __init__(self, vocab: int, dim: int, par: Parallel):
        super().__init__()
        self.par = par
        self.lo = par.rank * par.split(vocab, "vocab_size")
        self.weight = nn.Parameter(torch.empty(vocab // par.size, dim), requires_grad=False)
        mark(self, "weight", 0)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.par.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.lo
        mine = (local >= 0) & (local < self.weight.shape[0])              # [T]
        e = F.embedding(torch.where(mine, local, 0), self.weight)         # [T, D]
        return self.par.all_reduce(e * mine.unsqueeze(-1).to(e.dtype))
