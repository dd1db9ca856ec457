"""Sweep the fp8_paged_mqa_logits Triton kernels' launch options on CUDA (keys x q^T, triton_kq:
tile, warps, stages, grid size, key loads, register cap; and the portable q x K^T form, triton)
on the op's bench cases. (Forms and modes tried and dropped -- bf16 operand, fp8 MMA with or without
promotion, prefetch / plain-TMA key loads, reshape head sum: bench/RESULTS.md.)

Each variant is first checked against the native reference on the same inputs (the parity
compare: rtol 2e-4 on the finite logits, -inf at identical positions); a variant that fails
is still timed, marked NOT EXACT: the fp8-MMA rows show what exactness costs. After the
timing rows, a few variants (PARITY_TOO) are checked on the op's small parity cases too (a
one-token context is where Hopper's fp8 MMA missed by 4e-3). Times are CUDA-graph replays;
`of floor` = byte-floor time (the case's byte count at measured copy bandwidth) / kernel time;
`vs native` = native time / kernel time.
Run: PYTHONPATH=. python bench/ops/logits_sweep.py
"""
from __future__ import annotations

import argparse
import time

import torch

from kernelgate import registry
from kernelgate.tools.testing import assert_close
from sweep_table import row, start, time_us

DEADLINE_S = 90.0  # rows past their share print 'skipped (time)' (a second run finds Triton's cache warm)
TIMING_S = 78.0    # the bench cases' share; case i may run until T0 + TIMING_S * sum(SHARES[:i+1])
SHARES = (0.4, 0.35, 0.25)  # the first two compile every variant (next_n 1, 2); the third reuses
T0 = time.time()
OP = "fp8_paged_mqa_logits"

VARIANTS = [   # name -> kl.launch overrides (everything pinned: nothing autotunes); <= 8 rows
    # key loads (kl docstring): sm_90 TTGIR from Triton 3.6 shows tma = cp.async.bulk.tensor + mbarrier ring
    # of S - 1 tiles. Session 3 (H200): tma s3 51.7 / 85.1 / 8.7 us against plain s3 63.3 / 104.2 / 9.6 and
    # ahead s3 58.2 / 84.9 / 9.7 -> CONFIG. Here: grid shape (programs -> tiles per program), warps, stages.
    ("CONFIG", {}),                          # triton_kq by its launch table (launch_config_kq)
    # Session 3 (H200): programs 528 / 2112 / 4224: 51.9 / 53.4 / 57.6 us at next_n 1 (CONFIG 52.4), w8 80.3,
    # s2 56.3 (but 8.0 at B1 ctx128k), s5 54.1. Session 4: tma2 s3 51.6 / 79.3 / 8.5 -> CONFIG; fp8 MMA + tma2
    # 42.0 (inexact). ncu (CONFIG): 114 registers -> 4 programs / SM, 3.65 warps per scheduler, 46 % issue,
    # DRAM 62 %. Now: a register cap for 5 / 6 programs per SM, the grid sized to whole waves.
    # H200: maxnreg 96 47.5 / 96.1 / 8.1 us (programs 1320: 48.0 / 113.1 / 8.1), 104: 49.6 / 137.2, 80: 62.9 and
    # a ptxas failure at next_n 2 -> CONFIG maxnreg "auto" = 96 at next_n 1 only (kl.MAXNREG).
    # Session 4 after: CONFIG 47.3 / 78.1 / 8.0, no cap 50.5 / 78.7 / 8.5, s4 48.6 / 84.6 / 8.6, maxnreg 88
    # 52.4 / ptxas failure / 8.6. Grid at 5 programs per SM (660 per wave): programs 640 (one wave) 45.6 / 79.9 /
    # 8.1 against CONFIG 46.4 / 77.2 / 8.1 in the same run, 1920 47.0 / 77.3, 2560 48.2 / 77.8: CONFIG kept.
    # B1 ctx128k (2,048 tiles): CONFIG's min_tiles 4 gives 512 programs, under one wave of 660; fewer tiles per
    # program (min_tiles changes nothing at B32, 16 tiles per program there). H200: min_tiles 3 / 2 / 1 9.5 / 9.7 /
    # 9.8 us against CONFIG 8.1 (B32: 45.9-46.6 all): the per-program q load and split bookkeeping cost more.
    ("min_tiles 2", dict(min_tiles=2)),
    ("min_tiles 1", dict(min_tiles=1)),
    ("min_tiles 3", dict(min_tiles=3)),
    ("portable q x K^T (triton)", dict(form="qk")),
]
PARITY_TOO = {"CONFIG", "min_tiles 1"}


def _check(run, args, ref, rtol):
    out = run(*args)
    assert torch.equal(torch.isneginf(out), torch.isneginf(ref)), "-inf positions differ"
    assert_close(out, ref, rtol)


def sweep(dev, bw):
    import kernelgate.ops.indexer.fp8_paged_mqa_logits_triton as kl
    op = registry.get(OP)
    variants = VARIANTS
    cases = op.bench_cases()
    for i, case in enumerate(cases):
        deadline = T0 + TIMING_S * sum(SHARES[:i + 1])
        dtype = case.dtypes[0]
        args, kw = case.make(dev, dtype, torch.Generator().manual_seed(0))
        floor_us = case.bytes(args, kw) / bw / 1e3
        ref = op.reference(*args, **kw)
        native_us = time_us(lambda: op.reference(*args, **kw), dev)
        print(f"| {case.id} | native | {native_us:.1f} | {floor_us / native_us:.3f} | 1x | floor {floor_us:.1f} us |",
              flush=True)
        for name, cfg in variants:
            def run(*a, cfg=cfg):
                return kl.launch(*a, **cfg)
            row(case.id, name, lambda run=run: _check(run, args, ref, op.rtol[dtype]),
                lambda run=run: run(*args), dev, floor_us, native_us, deadline=deadline, time_inexact=True)
    # the op's small parity cases (odd contexts, a one-token context, next_n 2 and 3)
    parity = [(c, c.make(dev, torch.float8_e4m3fn, torch.Generator().manual_seed(1234))[0]) for c in op.cases()]
    parity = [(c, a, op.reference(*a)) for c, a in parity]
    for name, cfg in variants:
        if name not in PARITY_TOO:
            continue
        if time.time() - T0 > DEADLINE_S:
            print(f"| parity cases | {name} | skipped (time) | | | |")
            continue
        bad = []
        for c, a, ref in parity:
            try:
                _check(lambda *x, cfg=cfg: kl.launch(*x, **cfg), a, ref, op.rtol[torch.float8_e4m3fn])
            except AssertionError as e:
                bad.append(f"{c.id}: {str(e)[:60]}")
        note = "ok" if not bad else "NOT EXACT: " + "; ".join(bad)[:200]
        print(f"| {len(parity)} parity cases | {name} | | | | {note} |", flush=True)


def main():
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    import kernelgate.ops.indexer.fp8_paged_mqa_logits_triton as kl
    from kernelgate import platform
    got = start(f"logits launch table (triton_kq) {kl.launch_config_kq(platform.current())}")
    if got:
        sweep(*got)
        print(f"total {time.time() - T0:.0f} s")


if __name__ == "__main__":
    main()
