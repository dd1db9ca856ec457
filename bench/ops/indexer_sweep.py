"""Sweep the indexer q kernels on CUDA: fused_q_indexer_rope_hadamard_quant by the token-major
kernel (triton_tok: tokens per program, warps, register cap), the portable row-major kernel
(triton), and the sweep-only split-tree form (bench/ops/variants/indexer_q_tree.py), on the op's
bench cases. (What else was tried and dropped: bench/RESULTS.md, "indexer forms moved out of the
package".)

Each variant is first checked against the native reference (the parity compare: fp8 codes
within one code on <= 1/64 of them, weights_out rtol 1e-5),
then timed by CUDA-graph replay. `floor` = byte-floor time (the case's byte count at measured
copy bandwidth) / kernel time. Run: PYTHONPATH=. python bench/ops/indexer_sweep.py
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from kernelgate import platform, registry
from kernelgate.ops.common import fp8 as _fp8
import kernelgate.ops.indexer.indexer_q_tok_triton as tok
import kernelgate.ops.indexer.indexer_q_triton as rows
from sweep_table import row, start, time_us

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "variants"))
import indexer_q_tree as tree  # noqa: E402

DEADLINE_S = 90.0  # later rows print 'skipped (time)'
T0 = time.time()


def _tok(t, w, **kw):
    return (f"tok{t} w{w}" + "".join(f" {k}={v}" for k, v in kw.items()), tok, dict(tok=t, num_warps=w, **kw))


Q_VARIANTS = {   # variant -> [(name, kernel module, launch overrides)], dispatch's choice first
    # 2026-11-29 H200 (session 4): lanes w4 35.1-35.4 us, at 80 registers (maxnreg) 32.5 = 0.75 -> launch table;
    # 72 spills (37.0); tok2 w8 39.5. Split tree p4 tok1 w2 freq2 51.0 (L2-bound on half-sector stores).
    "v4": [("triton_tok (launch table)", tok, {}), _tok(1, 4, maxnreg=88), _tok(1, 4, maxnreg=None),
           _tok(2, 8), ("triton rows (portable, autotuned)", rows, {}),
           ("tree p4 tok1 w2 freq2 (bench/ops/variants)", tree,
            dict(pieces=4, tok=1, num_warps=2, freq=2, hw_encode=True, fast_div=True))],
    # v3.2 (no Hadamard): tok1 w4 29.3-29.5 us; maxnreg 64 44.4
    "v32": [("triton_tok (launch table)", tok, {}), _tok(1, 4, maxnreg=72), _tok(1, 2),
            ("triton rows (portable, autotuned)", rows, {})],
}


def sweep_q(dev, bw):
    op = registry.get("fused_q_indexer_rope_hadamard_quant")
    for case in op.bench_cases():
        args, kw = case.make(dev, torch.bfloat16, torch.Generator().manual_seed(0))
        floor_us = case.bytes(args, kw) / bw / 1e3
        ref = op.reference(*args, **kw)
        native_us = time_us(lambda: op.reference(*args, **kw), dev)
        variant = kw["variant"]
        print(f"| q {case.id} | native | {native_us:.1f} | {floor_us / native_us:.3f} | 1x | floor {floor_us:.1f} us |")
        for name, mod, cfg in Q_VARIANTS[variant]:
            def run(mod=mod, cfg=cfg):
                return mod.launch(*args, **kw, **cfg)

            def check(run=run):
                out = run()
                _fp8.assert_fp8_close(out[0], ref[0])
                rel = float(((out[1] - ref[1]).abs() / ref[1].abs().clamp(min=1e-30)).max())
                assert rel <= 1e-5, f"weights_out rel err {rel:.2e}"
                near = int((_fp8.code_distance(out[0].cpu(), ref[0].cpu()) == 1).sum())
                return f"ok ({near} codes off by 1)"
            row(f"q {variant}", name, check, run, dev, floor_us, native_us, deadline=T0 + DEADLINE_S)


def compiled_regs(kernel):
    """(num_warps, maxnreg, registers, spills) of every binary the JIT holds for `kernel`: a register cap
    must give a binary of its own (Triton keys its cache on the launch options)."""
    rows = []
    for cache in getattr(kernel, "device_caches", {}).values():
        kc = cache[0] if isinstance(cache, tuple) else cache
        for k in kc.values():
            if hasattr(k, "_init_handles"):
                k._init_handles()
            md = k.metadata
            rows.append((md.num_warps, getattr(md, "maxnreg", None), getattr(k, "n_regs", None),
                         getattr(k, "n_spills", None)))
    return rows


def main():
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    plat = platform.current()
    got = start(f"q launch tables: tok v4 {tok.launch_config(plat, 'v4')}, v3.2 {tok.launch_config(plat, 'v32')}; "
                f"rows {rows.launch_config(plat)}")
    if got:
        sweep_q(*got)
        print("tok-form binaries (num_warps, maxnreg, registers, spills):",
              sorted(compiled_regs(tok._indexer_q_tok_kernel), key=str))
        print(f"total {time.time() - T0:.0f} s")


if __name__ == "__main__":
    main()
