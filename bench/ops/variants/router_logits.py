"""Variant probe (issue 38's B1, not dispatched): fp32 router logits from 16-bit activations in one
launch.

The MoE blocks compute `F.linear(x.float(), router)` (router fp32 [E, D]): at decode that is a cast
kernel and an fp32 cuBLAS GEMV, ~2.5 + 3 µs a layer on the H200 for 1-2 MB of weights (Session 24's
profile). Here one kernel reads x in its own dtype and the fp32 rows, FMAs in fp32 (the same products
and an fp32 sum, in another order), every token of the step in the same program so the router is
read once:

    logits[t, e] = sum_d float(x[t, d]) * w[e, d]            grid (E / BLOCK_E,), T <= 8 tokens

Checked against the fp32 definition (fp32 round-off), timed in a CUDA graph against the two-launch
form, at Qwen3.5-MoE's (257 x 2,048: the stacked shared gate's row included) and Kimi's (256 x 2,304)
routers.

    PYTHONPATH=. python bench/ops/variants/router_logits.py [--tiny]
"""
from __future__ import annotations

import argparse
import itertools

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernelgate import platform
from kernelgate.tools import benchmark
from kernelgate.tools.testing import rel_err


@triton.jit
def _router_kernel(x_ptr, w_ptr, y_ptr, T, E, D, sxt, sxd, swe, swd, syt, sye,
                   T_PAD: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr):
    e = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    e_ok = e < E
    t = tl.arange(0, T_PAD)
    t_ok = t < T
    acc = tl.zeros([T_PAD, BLOCK_E, BLOCK_D], dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        d_ok = d < D
        w = tl.load(w_ptr + e[:, None].to(tl.int64) * swe + d[None, :] * swd, mask=e_ok[:, None] & d_ok[None, :],
                    other=0.0)                                                   # [BLOCK_E, BLOCK_D] fp32
        x = tl.load(x_ptr + t[:, None] * sxt + d[None, :] * sxd, mask=t_ok[:, None] & d_ok[None, :],
                    other=0.0).to(tl.float32)                                    # [T_PAD, BLOCK_D]
        acc += x[:, None, :] * w[None, :, :]
    y = tl.sum(acc, 2)                                                           # [T_PAD, BLOCK_E]
    tl.store(y_ptr + t[:, None] * syt + e[None, :] * sye, y, mask=t_ok[:, None] & e_ok[None, :])


def router_logits(x, w, BLOCK_E=8, BLOCK_D=256, num_warps=4):
    T, D = x.shape
    E = w.shape[0]
    y = torch.empty((T, E), dtype=torch.float32, device=x.device)
    _router_kernel[(triton.cdiv(E, BLOCK_E),)](x, w, y, T, E, D, *x.stride(), *w.stride(), *y.stride(),
                                               T_PAD=max(1, triton.next_power_of_2(T)), BLOCK_E=BLOCK_E,
                                               BLOCK_D=BLOCK_D, num_warps=num_warps)
    return y


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true", help="small shapes, correctness only (e.g. the interpreter)")
    a = ap.parse_args()
    dev = platform.default_device()
    timing = dev.type == "cuda" and not platform.interpreting()
    shapes = {"tiny": (37, 100)} if a.tiny else {"Qwen3.5-MoE": (257, 2048), "Kimi": (256, 2304)}
    print("| router | T | launch | µs | rel err (fp32 definition) |\n|---|---:|---|---:|---:|")
    for name, (E, D) in shapes.items():
        g = torch.Generator(device=dev).manual_seed(0)
        w = torch.randn(E, D, generator=g, device=dev) * D ** -0.5
        for T in (1, 3) if a.tiny else (1, 4, 8):
            x = torch.randn(T, D, generator=g, device=dev).to(torch.bfloat16)
            ref = x.double() @ w.double().t()
            two = lambda: F.linear(x.float(), w)  # noqa: E731
            rows = [("x.float() + F.linear (the models' form)", two)]
            grid = [(8, 64, 4), (16, 32, 2)] if a.tiny else itertools.product((1, 2, 4, 8, 16), (128, 256, 512), (2, 4, 8))
            for be, bd, nw in grid:
                if T * be * bd > 16384:
                    continue
                rows.append((f"one kernel BLOCK_E {be} BLOCK_D {bd} {nw}w",
                             lambda be=be, bd=bd, nw=nw: router_logits(x, w, be, bd, nw)))
            for label, fn in rows:
                try:
                    err = rel_err(fn().double(), ref)
                except Exception as e:  # noqa: BLE001 - a launch this Triton refuses: listed, not fatal
                    print(f"| {name} | {T} | {label} | refused: {type(e).__name__} | |")
                    continue
                us = benchmark.graph_us(fn, dev) if timing else None
                print(f"| {name} | {T} | {label} | {'-' if us is None else f'{us:.1f}'} | {err:.1e} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
