"""gated_rms_norm_linear at decode sizes: every launch choice of the one-launch Triton form against the
two-op form it replaces (`chain`: the registry's gated_rms_norm, then cuBLAS), at Qwen3.5-MoE's GDN
out_proj (32 x 128 -> 2,048, silu) and Kimi's KDA o_proj (32 x 128 -> 2,304, sigmoid). Each launch is
checked against the native reference first; times are device µs per call from a CUDA graph.

    PYTHONPATH=. python bench/ops/gated_rms_norm_linear_sweep.py [--tokens 1,2,4] [--tiny]
"""
from __future__ import annotations

import argparse
import itertools

import torch

from kernelgate import platform, registry
from kernelgate.ops.norm.gated_rms_norm_linear_triton import gated_rms_norm_linear_triton, launch_config
from kernelgate.tools import benchmark
from kernelgate.tools.testing import rel_err


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1,2,4")
    ap.add_argument("--tiny", action="store_true", help="small shapes, correctness only (e.g. the interpreter)")
    a = ap.parse_args()
    dev = platform.default_device()
    op = registry.get("gated_rms_norm_linear")
    chain = op.impls["chain"].callable()
    shapes = {"tiny": (3, 40, 37, "silu")} if a.tiny else {"Qwen3.5 GDN": (32, 128, 2048, "silu"),
                                                           "Kimi KDA": (32, 128, 2304, "sigmoid")}
    bw = benchmark.copy_bandwidth(dev)
    print(f"{platform.current().device_name}, copy bandwidth {bw:.0f} GB/s; default launch {launch_config(platform.current())}")
    print("| shape | T | launch | µs | of floor | rel err |\n|---|---:|---|---:|---:|---:|")
    grid = [(64, 4, 4)] if a.tiny else list(itertools.product((4, 8, 16, 32), (1, 2, 4), (2, 4, 8)))
    ok = True
    for name, (H, V, N, act) in shapes.items():
        for T in map(int, a.tokens.split(",")):
            g = torch.Generator(device=dev).manual_seed(T)
            r = lambda *s: torch.randn(*s, generator=g, device=dev).to(torch.bfloat16)  # noqa: E731
            x, gate, nw, w = r(T, H, V), r(T, H * V + 64)[:, :H * V].reshape(T, H, V), 1 + 0.1 * r(V), r(N, H * V) * (H * V) ** -0.5
            args = (x, nw, gate, w)
            ref = op.reference(*args, activation=act).float()
            floor_us = (w.numel() * 2 + 2 * x.numel() * 2) / bw / 1e3
            rows = [("chain (gated_rms_norm + cuBLAS)", lambda: chain(*args, activation=act))]
            for bn, hb, nw_ in grid:
                if T * bn * hb * V > 32768:
                    continue
                cfg = dict(BLOCK_N=bn, HB=hb, num_warps=nw_)
                rows.append((f"BLOCK_N {bn} HB {hb} {nw_}w",
                             lambda cfg=cfg: gated_rms_norm_linear_triton(*args, activation=act, cfg=cfg)))
            for label, fn in rows:
                err = rel_err(fn().float(), ref)
                ok &= err < 2e-2
                us = benchmark.graph_us(fn, dev)
                print(f"| {name} | {T} | {label} | {'-' if us is None else f'{us:.1f}'} | "
                      f"{'-' if us is None else f'{floor_us / us:.2f}'} | {err:.1e} |", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
