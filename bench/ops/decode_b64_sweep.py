"""Launch sweep of the small ops of a batch-64 decode step of Qwen3.5-MoE (issue 38's B64 target):
the projections at 64 tokens (cuBLAS against a decode-batch Triton GEMM, variants/linear_gemm_decode.py), the router
logits (the one-launch kernel's token block, row block, K width and warps; the bf16x3 matrix-unit form
with small tiles) and the Gated DeltaNet decode step (V tile, warps).

Each launch is checked against a reference first (float64 for the projections and the router; the
dispatched launch for the GDN step, from the same state), then timed in a CUDA graph of 20 calls
(projections: weights cycled past the L2, as in a step). '*' marks what dispatch launches today.

    PYTHONPATH=. python bench/ops/decode_b64_sweep.py [--parts linear,router,gdn] [--tokens 64]
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys

import torch

from kernelgate import platform
from kernelgate.ops.linear import linear as lin
from kernelgate.ops.moe import router_logits_triton as rlt
from kernelgate.tools import benchmark
from kernelgate.ops.kda.kda_decode_triton import launch_step

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "variants"))
import linear_gemm_decode as lgm  # noqa: E402


def rel(y, ref):
    return ((y.double() - ref).norm() / ref.norm()).item()


def part_linear(T, dev, bw):
    print(f"\n### projections at {T} tokens (N x K; floor: the weight's bytes at {bw:.0f} GB/s)\n")
    print("| shape | launch | µs | of floor | rel err | cuBLAS µs (of floor) |")
    print("|---|---|---:|---:|---:|---|")
    shapes = {n: s for n, s in lin.SHAPES.items() if n.startswith("qwen")}
    grid = [(bn, bk, w, st) for bn, bk, w, st in itertools.product((16, 32, 64), (128, 256), (4, 8), (3, 4, 5))
            if not (bn == 64 and w == 8 and bk == 128)]
    for name, (N, K) in shapes.items():
        gen = torch.Generator(device=dev).manual_seed(0)
        copies = max(2, -(-(256 << 20) // (N * K * 2)))
        ws = [torch.randn(N, K, generator=gen, device=dev, dtype=torch.bfloat16) * K ** -0.5 for _ in range(copies)]
        x = torch.randn(T, K, generator=gen, device=dev, dtype=torch.bfloat16)
        ref = x.double() @ ws[0].double().T
        floor = N * K * 2 / (bw * 1e9) * 1e6
        it = itertools.cycle(ws)
        cub = benchmark.graph_us(lambda: torch.nn.functional.linear(x, next(it)), dev)
        cub_txt = f"{cub:.1f} ({floor / cub:.2f})"
        best = None
        for bn, bk, w, st in grid:
            cfg = dict(BN=bn, BK=bk, num_warps=w, num_stages=st)
            try:
                err = rel(lgm.linear_gemm(x, ws[0], **cfg), ref)
            except Exception as e:  # noqa: BLE001 - out of resources: next launch
                print(f"| {name} | {cfg} | ({type(e).__name__}) | | | |")
                continue
            if err > 1e-2:
                print(f"| {name} | {cfg} | wrong {err:.1e} | | | |")
                continue
            it = itertools.cycle(ws)
            us = benchmark.graph_us(lambda: lgm.linear_gemm(x, next(it), **cfg), dev)
            best = min(best or (1e9, None), (us, cfg), key=lambda b: b[0])
            star = " *" if all(lgm._LAUNCH.get(k) == v for k, v in cfg.items()) else ""
            print(f"| {name} ({N} x {K}) | BN {bn}, BK {bk}, warps {w}, stages {st}{star} | {us:.1f} | "
                  f"{floor / us:.2f} | {err:.1e} | {cub_txt} |", flush=True)
            cub_txt = ""
        print(f"best {name}: {best[0]:.1f} µs at {best[1]} (cuBLAS {cub:.1f}, floor {floor:.1f})", flush=True)


def part_router(T, dev):
    E, D = 257, 2048
    print(f"\n### router logits at {T} tokens ({E} x {D} fp32 weight)\n")
    print("| form | launch | µs | rel err |")
    print("|---|---|---:|---:|")
    gen = torch.Generator(device=dev).manual_seed(0)
    w = torch.randn(E, D, generator=gen, device=dev) * D ** -0.5
    x = torch.randn(T, D, generator=gen, device=dev, dtype=torch.bfloat16)
    ref = x.double() @ w.double().T
    cast = benchmark.graph_us(lambda: x.float() @ w.T, dev)
    print(f"| cast + fp32 GEMM | | {cast:.1f} | |")
    for tb, be, bd, nw in itertools.product((8, 16, 32, 64), (1, 2, 4), (256, 512), (4, 8)):
        if tb * be * bd > 64 * 32 * nw:          # accumulator over 64 fp32 registers a thread
            continue
        cfg = dict(T_BLOCK=tb, BLOCK_E=be, BLOCK_D=bd, num_warps=nw)
        err = rel(rlt.router_logits_triton(x, w, **cfg), ref)
        us = benchmark.graph_us(lambda: rlt.router_logits_triton(x, w, **cfg), dev)
        star = " *" if (tb, be, bd, nw) == (rlt.T_BLOCK, rlt.LAUNCH["BLOCK_E"], rlt.LAUNCH["BLOCK_D"],
                                           rlt.LAUNCH["num_warps"]) else ""
        print(f"| one launch | T_BLOCK {tb}, BLOCK_E {be}, BLOCK_D {bd}, warps {nw}{star} | {us:.1f} | {err:.1e} |",
              flush=True)
    for bm, bn, bk, nw, st in itertools.product((16, 32, 64), (16, 32), (64, 128), (4,), (2, 3)):
        if bm < min(T, 64) and T > 16:
            continue
        cfg = dict(BM=bm, BN=bn, BK=bk, num_warps=nw, num_stages=st)
        err = rel(rlt.router_logits_bf16x3(x, w, **cfg), ref)
        us = benchmark.graph_us(lambda: rlt.router_logits_bf16x3(x, w, **cfg), dev)
        print(f"| bf16x3 | BM {bm}, BN {bn}, BK {bk}, warps {nw}, stages {st} | {us:.1f} | {err:.1e} |", flush=True)


def part_gdn(T, dev, bw):
    H, HK, K, V = 32, 16, 128, 128
    print(f"\n### Gated DeltaNet packed decode step at {T} sequences (H {H}, HK {HK}, K {K}, V {V}; fp32 state "
          f"read and written, floor at {bw:.0f} GB/s)\n")
    print("| launch | µs | of floor | max diff vs dispatched |")
    print("|---|---:|---:|---:|")
    gen = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(T, HK, K, generator=gen, device=dev, dtype=torch.bfloat16)
    k = torch.randn(T, HK, K, generator=gen, device=dev, dtype=torch.bfloat16)
    v = torch.randn(T, H, V, generator=gen, device=dev, dtype=torch.bfloat16)
    a = torch.randn(T, H, generator=gen, device=dev, dtype=torch.bfloat16)
    b = torch.randn(T, H, generator=gen, device=dev, dtype=torch.bfloat16)
    A_log = torch.randn(H, generator=gen, device=dev) * 0.5
    dt_bias = torch.randn(H, generator=gen, device=dev) * 0.5
    state0 = torch.randn(T + 3, H, K, V, generator=gen, device=dev) * 0.1
    slots = torch.randperm(T + 3, generator=gen, device=dev)[:T].to(torch.int32)
    floor = 2 * T * H * K * V * 4 / (bw * 1e9) * 1e6
    st = state0.clone()
    ref = launch_step(q, k, v, a, b, A_log, dt_bias, st, slots, K ** -0.5, None, True, True)
    ref_state = st.clone()
    for bv, nw in itertools.product((16, 32, 64, 128), (2, 4, 8)):
        st = state0.clone()
        o = launch_step(q, k, v, a, b, A_log, dt_bias, st, slots, K ** -0.5, None, True, True, bv=bv, num_warps=nw)
        diff = max((o.float() - ref.float()).abs().max().item(), (st - ref_state).abs().max().item())
        us = benchmark.graph_us(lambda: launch_step(q, k, v, a, b, A_log, dt_bias, st, slots, K ** -0.5, None, True,
                                                    True, bv=bv, num_warps=nw), dev)
        star = " *" if (bv, nw) == ((16 if T * H < 256 else 64), 4) else ""
        print(f"| BV {bv}, warps {nw}{star} | {us:.1f} | {floor / us:.2f} | {diff:.1e} |", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", default="linear,router,gdn")
    ap.add_argument("--tokens", type=int, default=64)
    a = ap.parse_args()
    dev = platform.default_device()
    if dev.type != "cuda":
        print("decode_b64_sweep: needs a CUDA device")
        return 0
    bw = benchmark.copy_bandwidth(dev)
    print(f"{platform.current().device_name}, copy bandwidth {bw:.0f} GB/s, {a.tokens} tokens")
    parts = a.parts.split(",")
    if "linear" in parts:
        part_linear(a.tokens, dev, bw)
    if "router" in parts:
        part_router(a.tokens, dev)
    if "gdn" in parts:
        part_gdn(a.tokens, dev, bw)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
