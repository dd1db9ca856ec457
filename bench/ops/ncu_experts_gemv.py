"""Launch the one-token experts GEMVs (bf16 and FP8, Kimi's shapes with the stacked shared expert) a
few times each, for a hardware-counter profile of why the FP8 one is at ~0.39 of its byte floor where
the bf16 one reaches ~0.68 (bench/RESULTS.md Session 25; issue 37 wants 0.7):

    ncu --clock-control none --section SpeedOfLight --section WarpStateStats --section MemoryWorkloadAnalysis \
        --section LaunchStats --section Occupancy -k regex:'_gate_up|_down|_sum' \
        python bench/ops/ncu_experts_gemv.py [bf16] [fp8]

(ncu's clock control off: the clocks stay as the timings saw them.) Each form is checked against
the native reference once before the profiled launches; `--tiny` runs that check on small shapes
(e.g. under TRITON_INTERPRET=1 on a CPU).
"""
from __future__ import annotations

import argparse

import torch

from kernelgate import platform, registry
from kernelgate.tools.testing import rel_err

FORMS = {"bf16": ("fused_experts", "triton_gemv"), "fp8": ("fused_experts_fp8", "triton_gemv")}


def inputs(op: str, tiny: bool, device):
    from kernelgate.ops.moe import fused_experts as fe, fused_experts_fp8 as fe8
    gen = torch.Generator(device=device).manual_seed(0)
    D, I, E = (96, 64, 8) if tiny else (2304, 1024, 256)
    make = fe8.make_inputs if op == "fused_experts_fp8" else fe.make_inputs
    args, kw = make(1, D, I, E, 8 if not tiny else 2, torch.bfloat16, device, gen)
    x, gu, dn, tw, ids, *scales = args          # the shared expert stacked as expert E, a unit-weight slot
    args = (x, torch.cat([gu, gu[:1]]), torch.cat([dn, dn[:1]]), torch.cat([tw, torch.ones_like(tw[:, :1])], 1),
            torch.cat([ids, torch.full_like(ids[:, :1], E)], 1), *[torch.cat([s, s[:1]]) for s in scales])
    return args, kw


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("forms", nargs="*", help=f"{', '.join(FORMS)} (default: both)")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--launches", type=int, default=3)
    a = ap.parse_args()
    dev = platform.default_device()
    if dev.type != "cuda" and not a.tiny:
        raise SystemExit("ncu_experts_gemv: needs a CUDA device (or --tiny)")
    for form in a.forms or FORMS:
        op_name, impl = FORMS[form]
        op = registry.get(op_name)
        args, kw = inputs(op_name, a.tiny, dev)
        fn = op.impls[impl].callable()
        err = rel_err(fn(*args, **kw).float(), op.reference(*args, **kw).float())
        if err > 2e-2:
            raise SystemExit(f"{form}: WRONG, relative error {err:.2e}")
        for _ in range(a.launches):
            fn(*args, **kw)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        print(f"{form} ({op_name}/{impl}) checked (rel err {err:.1e}), {a.launches} launches", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
