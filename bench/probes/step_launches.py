"""Every launch of one decode step as a GPU would get it, listed on this machine: the model's step run under a
stand-in GPU (kernelgate.tools.compile_stand_in.targeting: dispatch as on that GPU, each Triton kernel
compiled for it and launched nowhere; torch ops run on CPU tensors), every Triton launch and every torch op
that would be a device kernel recorded in order, per decoder layer (of a second step: what the layers keep
between steps is made in the first).

Why: at batch 1 a step is a chain of small dependent launches (bench/RESULTS.md, Sessions 27 and 33). A
Triton kernel written for programmatic dependent launch (PDL) starts while its predecessor drains; a torch
op (cuBLAS, a copy, an elementwise kernel) does not, and the PDL kernel after it cannot start early either.
This lists both, so a device profile can be read against it and the launches a fusion would remove counted.

    PYTHONPATH=. python bench/probes/step_launches.py                             # Kimi FP8, sm_90
    PYTHONPATH=. python bench/probes/step_launches.py --family qwen --weights bf16
    PYTHONPATH=. python bench/probes/step_launches.py --forms "kda_up_gemv"

Widths are the real models' (Kimi-Linear-48B-A3B, Qwen3.5-MoE-35B-A3B) but for 16 experts, a 4,096-token
vocabulary and 4 layers (3 linear-attention : 1 attention), so that the model fits this machine; the launches
of a layer do not depend on those. --forms installs bench/ops/variants probes first (as fp8_decode.py's).
"""
from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# aten ops that move no data on a device (views, metadata, allocation): not launches
NOT_KERNELS = {"view", "_unsafe_view", "split", "split_with_sizes", "slice", "t", "transpose", "as_strided",
               "detach", "empty", "empty_strided", "empty_like", "select", "expand", "unsqueeze", "squeeze",
               "reshape", "alias", "permute", "unbind", "narrow", "lift_fresh", "_to_copy_noop", "unflatten",
               "is_same_size", "resize_", "set_", "_reshape_alias", "chunk", "numpy_T", "sym_size", "sym_stride",
               "sym_numel", "sym_storage_offset", "stride", "size", "dim", "is_contiguous", "_local_scalar_dense"}


class Launches(TorchDispatchMode):
    """Records torch ops that would be device kernels; Triton launches are added by the JIT hook."""

    def __init__(self, log):
        super().__init__()
        self.log = log

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._opname if hasattr(func, "_opname") else str(func)
        out = func(*args, **(kwargs or {}))
        if name not in NOT_KERNELS and not _in_host_check() and not _alias(name, out, args):
            self.log.append(("torch", name, False))
        return out


def _alias(name: str, out, args) -> bool:
    """Whether an out-of-place op returned a view of an input (a `.to` to the dtype it has): no kernel."""
    if name.endswith("_") or not isinstance(out, torch.Tensor):
        return False
    ptr = out.untyped_storage().data_ptr()
    return any(isinstance(a, torch.Tensor) and a.untyped_storage().data_ptr() == ptr for a in args)


def _in_host_check() -> bool:
    """Whether the op runs inside a value check that only host tensors get (an op checks a CPU tensor's
    values where that is free; on a GPU the same call skips them: no device sync)."""
    f = sys._getframe(2)
    while f is not None:
        code = f.f_code
        if code.co_name.startswith("check") or code.co_filename.endswith(("checks.py", "index_checks.py")):
            return True
        f = f.f_back
    return False


def _hook_triton(log):
    from triton.runtime.jit import JITFunction
    run = JITFunction.run

    def logged(self, *args, **kw):
        log.append(("triton", self.fn.__name__, bool(kw.get("launch_pdl", False))))
        return run(self, *args, **kw)
    JITFunction.run = logged
    return lambda: setattr(JITFunction, "run", run)


def build(family: str, weights: str):
    from kernelgate.models import build as build_kimi, real_width
    q = "fp8" if weights == "fp8" else None
    if family == "kimi":
        c = real_width(4, num_experts=16, vocab_size=4096)
        return build_kimi(c, device="cpu", dtype=torch.bfloat16, seed=0, quantization=q)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
    from qwen_e2e import hf_config

    from kernelgate.models import Qwen3NextConfig
    from kernelgate.models.qwen3_next import build as build_qwen
    c = Qwen3NextConfig.from_dict({**hf_config(4, False).to_dict(), "num_experts": 16, "vocab_size": 4096})
    return build_qwen(c, device="cpu", dtype=torch.bfloat16, seed=0, quantization=q)


def decode_step(model, context: int = 40):
    """(tokens, batch, cache) of one sequence's decode step at position `context`."""
    from kernelgate.models import StepBatch
    bs = 64
    nb = -(-(context + 1) // bs)
    cache = model.new_cache(2, nb + 1, bs)
    batch = StepBatch.build([1], [0], [context], "cpu", [list(range(nb))], bs)
    return torch.tensor([7]), batch, cache


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", default="kimi", choices=("kimi", "qwen"))
    ap.add_argument("--weights", default="fp8", choices=("fp8", "bf16"))
    ap.add_argument("--target", default="sm_90")
    ap.add_argument("--forms", default="", help="bench/ops/variants probes to install first, '+'-joined")
    ap.add_argument("--all", action="store_true", help="print every launch, not only the first layer of each kind")
    args = ap.parse_args(argv)
    from kernelgate.tools.compile_stand_in import targeting
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
    from fp8_decode import forms
    probes = forms(args.forms)[0][1] if args.forms else []
    for mod, kw in probes:
        print(mod.install(**kw))
    model = build(args.family, args.weights)
    layers = model.model.layers
    log, marks = [], []
    for i, layer in enumerate(layers):
        attn = getattr(layer, "self_attn", None) or getattr(layer, "linear_attn")
        kind = f"{type(attn).__name__} + {type(layer.mlp).__name__}"
        layer.register_forward_pre_hook(lambda m, a, i=i, kind=kind: marks.append((len(log), i, kind)))
    tokens, batch, cache = decode_step(model)
    unhook = _hook_triton(log)
    try:
        with targeting(args.target) as rec, torch.inference_mode():
            rec.begin({"specs": []})
            model.step(tokens, batch, cache)           # a first step: what the layers keep between steps
            log.clear()
            marks.clear()
            with Launches(log):
                model.step(tokens, batch, cache)
    finally:
        unhook()
        for mod, _ in probes:
            mod.uninstall()
    bounds = [m[0] for m in marks] + [len(log)]
    spans = [("embedding", 0, bounds[0])] + [(f"layer {i}: {kind}", bounds[j], bounds[j + 1])
                                            for j, (_, i, kind) in enumerate(marks)]
    # the norm and LM head after the last layer: split off the last layer's span at its last decoder op
    print(f"\n### One decode step, {args.family} {args.weights}, as dispatched on {args.target}"
          f"{' with ' + args.forms if args.forms else ''}\n")
    print("| span | launches | Triton (PDL) | torch ops | chain breaks |\n|---|---:|---:|---:|---:|")
    seen = set()
    total = collections.Counter()
    for name, a, b in spans:
        part = log[a:b]
        tri = sum(1 for k, _, _ in part if k == "triton")
        pdl = sum(1 for k, _, p in part if k == "triton" and p)
        breaks = sum(1 for x, y in zip(part, part[1:]) if x[0] == "torch" and y[0] == "triton" and y[2])
        total.update(launches=len(part), triton=tri, torch=len(part) - tri, breaks=breaks)
        print(f"| {name} | {len(part)} | {tri} ({pdl}) | {len(part) - tri} | {breaks} |")
    print(f"| **step** | {total['launches']} | {total['triton']} | {total['torch']} | {total['breaks']} |")
    for name, a, b in spans:
        kind = name.split(": ", 1)[-1]
        if kind in seen and not args.all:
            continue
        seen.add(kind)
        print(f"\n{name}:")
        for k, op, pdl in log[a:b]:
            print(f"  {'triton' if k == 'triton' else 'torch '} {op}{'  (PDL)' if pdl else ''}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
