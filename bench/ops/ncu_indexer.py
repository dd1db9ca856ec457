"""Launch each indexer kernel variant of interest a few times, for a hardware-counter profile:
    ncu --clock-control none --section SpeedOfLight ... -k regex:'indexer|logits' \
        python bench/ops/ncu_indexer.py
(ncu's clock control off: the clocks stay as the timings saw them.) Arguments: only these
variants (names from Q and LOGITS below).
Every variant is checked against the reference once (the parity compare) before it is profiled.
"""
from __future__ import annotations

import argparse

import torch

from kernelgate import registry
from kernelgate.ops.common import fp8 as _fp8
from kernelgate.tools.testing import assert_close
import kernelgate.ops.indexer.fp8_paged_mqa_logits_triton as kl
import kernelgate.ops.indexer.indexer_q_tok_triton as kq

Q = {   # name -> (variant, launch overrides of the token-major kernel, triton_tok)
    "q-v4-CONFIG": ("v4", {}),
    "q-v4-no-maxnreg": ("v4", dict(maxnreg=None)),
    "q-v4-tok2-w8": ("v4", dict(tok=2, num_warps=8)),
    "q-v32-CONFIG": ("v32", {}),
}
LOGITS = {"logits-CONFIG": {}, "logits-portable-qk": dict(form="qk")}


def main(names):
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    qop = registry.get("fused_q_indexer_rope_hadamard_quant")
    for case in qop.bench_cases():
        args, kw = case.make(dev, torch.bfloat16, gen)
        for name, (variant, cfg) in Q.items():
            if kw.get("variant", "v4") != variant or (names and name not in names):
                continue
            ref = qop.reference(*args, **kw)
            out = kq.launch(*args, **kw, **cfg)
            _fp8.assert_fp8_close(out[0], ref[0])
            assert_close(out[1], ref[1], 1e-5)
            for _ in range(2):
                kq.launch(*args, **kw, **cfg)
            torch.cuda.synchronize()
            print(name, case.id, "checked", flush=True)
    lop = registry.get("fp8_paged_mqa_logits")
    for case in lop.bench_cases()[:2]:
        args, kw = case.make(dev, case.dtypes[0], gen)
        for name, cfg in LOGITS.items():
            if names and name not in names:
                continue
            ref = lop.reference(*args, **kw)
            out = kl.launch(*args, **cfg)
            assert torch.equal(torch.isneginf(out), torch.isneginf(ref))
            assert_close(out, ref, lop.rtol[case.dtypes[0]])
            for _ in range(2):
                kl.launch(*args, **cfg)
            torch.cuda.synchronize()
            print(name, case.id, "checked", flush=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("names", nargs="*", help=f"variants: {', '.join([*Q, *LOGITS])} (default: all)")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    main(set(a.names))
