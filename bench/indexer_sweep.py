"""Sweep the DeepSeek indexer kernels' variants on CUDA: fused_q_indexer_rope_hadamard_quant
(Hadamard form, fp8 encode, division, RoPE form, rows per program) and fp8_paged_mqa_logits
(tile, warps, pipeline stages, program count), on the ops' own bench cases.

Each variant is first checked against the native reference (q: the parity compare, fp8 codes
within one code on <= 1/64 of them, weights_out rtol 1e-5; logits: same -inf mask, the parity suite's rel_err <= 2e-4),
then timed by CUDA-graph replay. `floor` = byte-floor time (the case's byte count at measured
copy bandwidth) / kernel time. Run: PYTHONPATH=. python bench/indexer_sweep.py
"""
from __future__ import annotations

import time

import torch

from kernelgate import registry
from kernelgate.benchmark import copy_bandwidth, graph_us, time_ms
from kernelgate.ops import _fp8
from kernelgate.testing import rel_err
from kernelgate.ops.triton import indexer_logits as kl
from kernelgate.ops.triton import indexer_q as kq

DEADLINE_S = 80.0  # later rows print 'skipped (time)'
T0 = time.time()

Q_VARIANTS = {   # name -> kq.launch overrides (rows per program, warps pinned so nothing autotunes)
    "v4": [("CONFIG (autotuned R/warps)", {}),
           *[(f"R{r} w{w}", dict(block_r=r, num_warps=w)) for r, w in ((32, 4), (64, 4), (64, 8), (128, 8))],
           ("R64 w4 hmode=fp32 (3xTF32)", dict(block_r=64, num_warps=4, hmode="fp32")),
           ("R64 w4 hmode=butterfly", dict(block_r=64, num_warps=4, hmode="butterfly")),
           ("R64 w4 hw_encode=False", dict(block_r=64, num_warps=4, hw_encode=False)),
           ("R64 w4 fast_div=False", dict(block_r=64, num_warps=4, fast_div=False)),
           ("R64 w4 rope_split=False", dict(block_r=64, num_warps=4, rope_split=False))],
    "v32": [("CONFIG (autotuned R/warps)", {}),
            *[(f"R{r} w{w}", dict(block_r=r, num_warps=w)) for r, w in ((32, 4), (64, 4), (128, 8))],
            ("R64 w4 hw_encode=False", dict(block_r=64, num_warps=4, hw_encode=False)),
            ("R64 w4 rope_split=False", dict(block_r=64, num_warps=4, rope_split=False))],
}


def _logit_variants(case_id):
    tiles = [(64, 4, 3), (64, 4, 2), (64, 4, 4), (64, 8, 3), (128, 4, 3), (128, 8, 3), (128, 8, 4)]
    if case_id.endswith("N2"):
        tiles = [(64, 4, 3), (64, 8, 3), (128, 8, 3), (128, 8, 4)]
    out = [("CONFIG", {})]
    out += [(f"T{t} w{w} s{s}", dict(block_t=t, num_warps=w, num_stages=s)) for t, w, s in tiles]
    progs = (132, 264, 528, 1056) if case_id.startswith("B1-") else (528, 2112, 4224)
    out += [(f"programs={p}", dict(programs=p)) for p in progs]
    return out


def _time(fn, dev):
    us = graph_us(fn, dev)
    return us if us is not None else time_ms(fn, dev) * 1e3


def _row(case, name, check, fn, dev, floor_us, native_us=None):
    if time.time() - T0 > DEADLINE_S:
        print(f"| {case} | {name} | skipped (time) | | | |")
        return
    try:
        note = check()
        us = _time(fn, dev)
    except Exception as e:  # noqa: BLE001 - report the variant, go on with the others
        print(f"| {case} | {name} | FAIL: {type(e).__name__}: {str(e)[:90]} | | | |", flush=True)
        return
    vs = f"{native_us / us:.1f}x" if native_us else ""
    print(f"| {case} | {name} | {us:.1f} | {floor_us / us:.3f} | {vs} | {note} |", flush=True)


def sweep_q(dev, bw):
    op = registry.get("fused_q_indexer_rope_hadamard_quant")
    for case in op.bench_cases():
        args, kw = case.make(dev, torch.bfloat16, torch.Generator().manual_seed(0))
        floor_us = case.bytes(args, kw) / bw / 1e3
        ref = op.reference(*args, **kw)
        native_us = _time(lambda: op.reference(*args, **kw), dev)
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
            _row(f"q {variant}", name, check, run, dev, floor_us, native_us)


def sweep_logits(dev, bw):
    op = registry.get("fp8_paged_mqa_logits")
    for case in op.bench_cases():
        args, kw = case.make(dev, torch.float8_e4m3fn, torch.Generator().manual_seed(0))
        floor_us = case.bytes(args, kw) / bw / 1e3
        ref = op.reference(*args, **kw)
        fin = torch.isfinite(ref)
        print(f"| {case.id} | (floor {floor_us:.1f} us) | | | | |")
        for name, cfg in _logit_variants(case.id):
            def run(cfg=cfg):
                return kl.launch(*args, **kw, **cfg)

            def check(run=run):
                out = run()
                assert torch.equal(torch.isfinite(out), fin), "-inf mask differs"
                err = rel_err(out[fin].cpu(), ref[fin].cpu())     # the parity suite's measure
                assert err <= 2e-4, f"rel err {err:.2e}"
                return f"ok (rel {err:.0e})"
            _row(case.id, name, check, run, dev, floor_us)
        del ref, fin
        torch.cuda.empty_cache()


def main():
    if not torch.cuda.is_available():
        print("needs a CUDA device")
        return
    dev = torch.device("cuda")
    bw = copy_bandwidth(dev)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, copy bandwidth {bw:.0f} GB/s; "
          f"q CONFIG {kq.CONFIG}; logits CONFIG {kl.CONFIG} SMALL_BATCH {kl.SMALL_BATCH}")
    print("| case | variant | µs (graph) | of floor | vs native | check |\n|---|---|---:|---:|---:|---|")
    sweep_q(dev, bw)
    sweep_logits(dev, bw)
    print(f"total {time.time() - T0:.0f} s")


if __name__ == "__main__":
    main()
