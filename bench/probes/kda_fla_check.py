"""Fed: RESULTS.md, 'Session 10 (2026-12-01) ... Eager (prefill / mixed) steps of a warmed engine'
(fla's chunk list built on the device, checked at the model's shapes).

kda_prefill through fla (the model's prefill path, fla building its chunk list on the device:
use_graph) against the native reference at the model's head shapes (H 32, K = V 128, bf16):
varlen batches with zero-length and skipped sequences, host hints, a server-like mixed batch.

    PYTHONPATH=. python bench/probes/kda_fla_check.py
"""
from __future__ import annotations

import argparse

import torch

from kernelgate import registry
from kernelgate.ops.kda.kda_prefill import host_hints, make_inputs
from kernelgate.tools.testing import rel_err

OP = registry.get("kda_prefill")


def main() -> int:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA device")
        return 1
    dev = torch.device("cuda")
    fla, native = OP.impl("fla").callable(), OP.impl("native").callable()
    bad = 0
    print("| lens | slots | rel err o | rel err state | ok |\n|---|---|---:|---:|---|")
    for lens, slots in (([17, 0, 70, 5], [2, 0, -1, 1]), ([130, 1, 64, 17], [3, 0, 5, 1]), ([384], [0]),
                        ([1, 1, 128, 1, 127, 1], [5, 1, 0, 2, 3, 4]), ([2048, 33], [1, 0])):
        gen = torch.Generator().manual_seed(len(lens))
        args = make_inputs(lens, slots, 32, 128, 128, "cpu", torch.bfloat16, gen, pool=8)
        args = tuple(a.to(dev) for a in args)
        hints = host_hints(*[a.cpu() for a in args[6:8]])
        s_ref, s_fla = args[5].clone(), args[5].clone()
        want = native(*args[:5], s_ref, *args[6:], **hints)
        got = fla(*args[:5], s_fla, *args[6:], **hints)
        eo, es = rel_err(got, want), rel_err(s_fla, s_ref)
        ok = eo < 2e-2 and es < 2e-2
        bad += not ok
        print(f"| {lens} | {slots} | {eo:.2e} | {es:.2e} | {'yes' if ok else 'NO'} |")
    return int(bad > 0)


if __name__ == "__main__":
    raise SystemExit(main())
