"""Launch sweep of the one-token `linear` GEMV (kernelgate/ops/linear/linear_gemv_triton.py) at the
decode projections of Qwen3.5-MoE and Kimi Linear, beside PyTorch's (cuBLAS) GEMV of the same weight.

    PYTHONPATH=. python bench/ops/linear_sweep.py [--only 'ROWS,WIDTH,warps,X_ROWS;...'] [--shapes a,b]

Each call reads another copy of the weight (copies cycled past the L2 cache), 20 calls captured in one
CUDA graph, µs per call. The GEMV is timed with programmatic dependent launch off ("alone": each call
waits for the previous one to drain, as cuBLAS's do) and on ("PDL": as in a decode step's chain of
kernels, ops/common/pdl.py). Each launch is checked against float64 first. The floor is the weight's
bytes at the measured copy bandwidth. '*' marks the launch dispatch makes.
"""
from __future__ import annotations

import argparse
import itertools
import os

import torch

from kernelgate import platform
from kernelgate.ops.linear import linear as lin
from kernelgate.ops.linear import linear_gemv_triton as lgt
from kernelgate.tools import benchmark


def timed(fn, ws, x, dev):
    """µs per call of fn(x, w), each call on the next weight copy."""
    it = itertools.cycle(ws)
    return benchmark.graph_us(lambda: fn(x, next(it)), dev)


def pdl(on: bool):
    os.environ["KERNELGATE_PDL"] = "1" if on else "0"
    platform.refresh()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="", help="just these launches: 'ROWS,WIDTH,warps,X_ROWS;...'")
    ap.add_argument("--shapes", default="", help="comma-separated names of linear.SHAPES (default: all)")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA device")
        return 1
    dev = torch.device("cuda")
    bw = benchmark.copy_bandwidth(dev)
    print(f"copy bandwidth {bw:.0f} GB/s; dispatched launches {lgt.LAUNCH.get(platform.current().name, lgt._LAUNCH)}\n")
    print("| shape (N x K) | launch | alone µs | PDL µs | of floor (PDL) | rel err | cuBLAS µs (of floor) |")
    print("|---|---|---:|---:|---:|---:|---|")
    grid = [tuple(int(v) for v in c.split(",")) for c in a.only.split(";")] if a.only else \
        list(itertools.product((1, 2, 4, 8), (512, 1024), (4, 8), (0, 1)))
    names = a.shapes.split(",") if a.shapes else list(lin.SHAPES)
    for name in names:
        N, K = lin.SHAPES[name]
        gen = torch.Generator(device=dev).manual_seed(0)
        copies = max(2, -(-(256 << 20) // (N * K * 2)))             # >= 256 MB of weights: past the L2
        ws = [torch.randn(N, K, generator=gen, device=dev, dtype=torch.bfloat16) * K ** -0.5 for _ in range(copies)]
        x = torch.randn(1, K, generator=gen, device=dev, dtype=torch.bfloat16)
        ref = x.double() @ ws[0].double().T
        floor_us = N * K * 2 / (bw * 1e9) * 1e6
        cub = timed(torch.nn.functional.linear, ws, x, dev)
        cub_txt = f"{cub:.1f} ({floor_us / cub:.2f})"
        default = lgt.launch_config(platform.current(), N)
        for r, wd, wp, xr in grid:
            cfg = dict(ROWS=r, WIDTH=wd, num_warps=wp, X_ROWS=bool(xr))
            pdl(True)
            err = ((lgt.linear_gemv(x, ws[0], **cfg).double() - ref).abs().max() / ref.abs().max()).item()
            if err > 2e-2:
                print(f"| {name} ({N} x {K}) | {cfg} | wrong: {err:.1e} | | | | |")
                continue
            on = timed(lambda x_, w_: lgt.linear_gemv(x_, w_, **cfg), ws, x, dev)
            pdl(False)
            off = timed(lambda x_, w_: lgt.linear_gemv(x_, w_, **cfg), ws, x, dev)
            star = " *" if all(default.get(k) == v for k, v in cfg.items()) else ""
            print(f"| {name} ({N} x {K}) | rows {r}, width {wd}, warps {wp}, X_ROWS {bool(xr)}{star} | {off:.1f} | "
                  f"{on:.1f} | {floor_us / on:.2f} | {err:.1e} | {cub_txt} |", flush=True)
            cub_txt = ""
    pdl(True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
