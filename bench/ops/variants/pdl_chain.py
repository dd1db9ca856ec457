"""Programmatic dependent launch (PDL) on a chain of decode-sized Triton kernels, CUDA graph.

A one-token decode step is ~13 dependent launches a layer of 2-15 µs each; this asks what
letting each kernel launch while its predecessor drains buys (sm_90+: `launch_pdl=True`, the
kernel calling `gdc_wait()` before it reads what the previous one wrote). The chain alternates a
GEMV (x [K] -> y [N], bf16 weight, ROWS rows a program) with a one-program RMSNorm (y -> x), as
a layer's projection / norm pairs do. Forms, each checked bitwise against the plain launches:
  plain      no PDL
  wait       launch_pdl, gdc_wait first thing, no early trigger
  trigger    + gdc_launch_dependents right after the wait
  prefetch   + the GEMV loads its first weight tile before the wait (weights never depend on
             the previous kernel; only x does)
  early      prefetch, with the trigger before the wait (the next kernel may launch while this one
             still waits for its own predecessor)
    python bench/ops/variants/pdl_chain.py [--pairs 40] [--N 2048,4096] [--K 2048]
"""
from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def _ready(PDL: tl.constexpr, TRIGGER: tl.constexpr, EARLY: tl.constexpr):
    if PDL:
        if EARLY:
            gdc_launch_dependents()
        gdc_wait()
        if TRIGGER and not EARLY:
            gdc_launch_dependents()


@triton.jit
def _gemv(x_ptr, w_ptr, y_ptr, K, ROWS: tl.constexpr, BK: tl.constexpr,
          PDL: tl.constexpr, TRIGGER: tl.constexpr, PREFETCH: tl.constexpr, EARLY: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BK)
    if PREFETCH:
        w = tl.load(w_ptr + rows[:, None] * K + cols[None, :])
    _ready(PDL, TRIGGER, EARLY)
    if not PREFETCH:
        w = tl.load(w_ptr + rows[:, None] * K + cols[None, :])
    acc = w.to(tl.float32) * tl.load(x_ptr + cols).to(tl.float32)[None, :]
    for k0 in range(BK, K, BK):
        w = tl.load(w_ptr + rows[:, None] * K + (k0 + cols)[None, :])
        xv = tl.load(x_ptr + k0 + cols)
        acc += w.to(tl.float32) * xv.to(tl.float32)[None, :]
    tl.store(y_ptr + rows, tl.sum(acc, 1).to(y_ptr.dtype.element_ty))


@triton.jit
def _norm(y_ptr, w_ptr, x_ptr, N: tl.constexpr, PDL: tl.constexpr, TRIGGER: tl.constexpr,
          EARLY: tl.constexpr):
    o = tl.arange(0, N)
    w = tl.load(w_ptr + o).to(tl.float32)          # a parameter: independent of the previous kernel
    _ready(PDL, TRIGGER, EARLY)
    y = tl.load(y_ptr + o).to(tl.float32)
    r = tl.rsqrt(tl.sum(y * y, 0) / N + 1e-6)
    tl.store(x_ptr + o, (y * r * w).to(x_ptr.dtype.element_ty))


FORMS = {"plain": (False, False, False, False), "wait": (True, False, False, False),
         "trigger": (True, True, False, False), "prefetch": (True, True, True, False),
         "early": (True, True, True, True)}


def chain(xs, ws, nw, pairs, form, rows, bk):
    pdl, trig, pre, early = FORMS[form]
    K = xs.shape[0]
    for i in range(pairs):
        W, y = ws[i]
        _gemv[(W.shape[0] // rows,)](xs, W, y, K, ROWS=rows, BK=bk, PDL=pdl, TRIGGER=trig, PREFETCH=pre,
                                     EARLY=early, num_warps=4, launch_pdl=pdl)
        _norm[(1,)](y[:K], nw, xs, N=K, PDL=pdl, TRIGGER=trig, EARLY=early, num_warps=8, launch_pdl=pdl)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=int, default=40)
    ap.add_argument("--N", default="2048,4096,12352")
    ap.add_argument("--K", type=int, default=2048)
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--bk", type=int, default=512)
    ap.add_argument("--reps", type=int, default=50)
    a = ap.parse_args()
    dev, K = "cuda", a.K
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__)
    print(f"| GEMV N x K | pairs | {' | '.join(FORMS)} (µs a kernel, graph) | bitwise |")
    print("|---|---:|" + "---:|" * len(FORMS) + "---|")
    for N in (int(n) for n in a.N.split(",")):
        g = torch.Generator(device=dev).manual_seed(0)
        ws = [(torch.randn(N, K, device=dev, generator=g, dtype=torch.bfloat16) * 0.02,
               torch.empty(N, device=dev, dtype=torch.bfloat16)) for _ in range(a.pairs)]
        nw = torch.rand(K, device=dev, generator=g).bfloat16()
        x0 = torch.randn(K, device=dev, generator=g).bfloat16()
        times, outs = {}, {}
        for form in FORMS:
            xs = x0.clone()
            chain(xs, ws, nw, a.pairs, form, a.rows, a.bk)     # compile, warm
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                chain(xs, ws, nw, a.pairs, form, a.rows, a.bk)
            xs.copy_(x0)
            graph.replay()
            torch.cuda.synchronize()
            outs[form] = xs.clone()
            for _ in range(5):
                graph.replay()
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            for _ in range(a.reps):
                graph.replay()
            e.record()
            torch.cuda.synchronize()
            times[form] = s.elapsed_time(e) * 1e3 / a.reps / (2 * a.pairs)
        same = all(torch.equal(outs[f], outs["plain"]) for f in FORMS)
        print(f"| {N} x {K} | {a.pairs} | " + " | ".join(f"{times[f]:.2f}" for f in FORMS) + f" | {same} |")


if __name__ == "__main__":
    main()
