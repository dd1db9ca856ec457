"""Sweep the indexer q kernel's variants on CUDA: fused_q_indexer_rope_hadamard_quant
(program form: row-major, token-major "tok" with 4 / 8 / 16 column pieces, or the split-tree
"tree" form (no MMA; pieces 8 / 4 / 2 of 16 / 32 / 64 columns, cos/sin source freq 0 / 1 / 2); Hadamard form,
fp8 encode, rows per program, warps), on the op's bench cases.
(A keys x q^T form of the fp8_paged_mqa_logits kernel was swept here on 2026-11-29: every
variant missed the parity bound on the H200 -- Hopper's fp8 MMA accumulation, 2.3e-4 and
4e-3 on a one-token context -- so it was reverted; time that op with `kernelgate bench`.)

Each variant is first checked against the native reference (the parity compare: fp8 codes
within one code on <= 1/64 of them, weights_out rtol 1e-5),
then timed by CUDA-graph replay. `floor` = byte-floor time (the case's byte count at measured
copy bandwidth) / kernel time. Run: PYTHONPATH=. python bench/indexer_sweep.py
"""
from __future__ import annotations

import time

import torch

from kernelgate import registry
from kernelgate.ops.common import fp8 as _fp8
import kernelgate.ops.indexer.indexer_q_triton as kq
from sweep_table import row, start, time_us

DEADLINE_S = 90.0  # later rows print 'skipped (time)'
T0 = time.time()

ROWS = dict(kq.ROWS)   # the row-major kernel's last measured best, as a baseline


def _tok(tok, pieces, w, **kw):
    return (f"tok{tok} p{pieces} w{w}" + "".join(f" {k}={v}" for k, v in kw.items()),
            dict(form="tok", tok=tok, pieces=pieces, num_warps=w, **kw))


def _tree(tok, pieces, w, freq, **kw):
    """split-tree form (indexer_q_tree.py): R = tok * 64 rows; R = 32 * w is one row per thread."""
    return (f"tree tok{tok} p{pieces} w{w} freq{freq}" + "".join(f" {k}={v}" for k, v in kw.items()),
            dict(form="tree", tok=tok, pieces=pieces, num_warps=w, freq=freq, **kw))


Q_VARIANTS = {   # name -> kq.launch overrides, best guesses first (warps pinned so nothing autotunes)
    # 2026-11-29 H200 (session 4): tree p8 tok1 w2 freq2 51.0 us, p4 50.1, p2 54.8. Session 4 (ncu: the tree is L2-bound on half-sector accesses, a row per thread) -> tok form, H32 = H2
    # across two lanes x H16 inside ("lanes"): w4 35.1-35.4 us, lanes2 39.3, tok2 w8 39.5; at 80 registers
    # (maxnreg) 32.5 = 0.75 -> CONFIG; 72 spills (37.0); grid-stride loops with cp.async pipelining 37-44.
    "v4": [("CONFIG", {}), _tok(1, 4, 4, hmode="lanes", maxnreg=88), _tok(1, 4, 4, hmode="lanes"),
           _tok(1, 4, 4, hmode="lanes2", maxnreg=80), _tok(1, 4, 2, hmode="lanes", heads=32, maxnreg=80),
           ("tree (session-3 CONFIG)", kq.TREE)],
    # v3.2 (no Hadamard): CONFIG = tok1 p4 w4, 29.3-29.5 us; maxnreg 64 44.4, grid-stride loops 34.3-41.4
    "v32": [("CONFIG", {}), _tok(1, 4, 4, maxnreg=72), _tok(1, 4, 2, heads=32),
            ("rows R64 w4 rope_split=False (old CONFIG)", dict(ROWS, rope_split=False))],
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
        for name, cfg in Q_VARIANTS[variant]:
            def run(cfg=cfg):
                return kq.launch(*args, **kw, **cfg)

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
    got = start(f"q CONFIG v4 {kq.CONFIG}, v3.2 {kq.CONFIG_V32}")
    if got:
        sweep_q(*got)
        import kernelgate.ops.indexer.indexer_q_tok_triton
        print("tok-form binaries (num_warps, maxnreg, registers, spills):",
              sorted(compiled_regs(indexer_q_tok._indexer_q_tok_kernel), key=str))
        print(f"total {time.time() - T0:.0f} s")


if __name__ == "__main__":
    main()
