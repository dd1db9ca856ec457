"""Launch sweep of fp8_linear's decode forms (kernelgate/ops/quant/fp8_linear_triton.py: the GEMV of
fp8_gemv_triton.py at one token, the split-K tl.dot launch up to 8) at Kimi Linear's decode shapes,
beside the bf16 linear (cuBLAS) of the same weight.

    PYTHONPATH=. python bench/ops/fp8_linear_sweep.py [--tokens 1,8] [--only 'ROWS,WIDTH,warps;...']

Shapes: the fused KDA in_proj (q|k|v|f_a|g_a|b: 12,576 x 2,304), the KDA o_proj (2,304 x 4,096), the
MLA q_proj (6,144 x 2,304), 128 x 128 block scales. Each launch is checked against the native reference
(and the GEMV in fp32 for exactness), then timed in a CUDA graph; the floor is the weight's bytes
(codes + scales) at the measured copy bandwidth. '*' marks the launch dispatch makes.
"""
from __future__ import annotations

import argparse
import itertools

import torch

from kernelgate import platform
from kernelgate.ops.quant import fp8_linear as fl
from kernelgate.ops.quant import fp8_linear_triton as flt
from kernelgate.tools import benchmark
from kernelgate.tools.testing import rel_err

SHAPES = {"KDA in_proj": (12576, 2304), "KDA o_proj": (2304, 4096), "MLA q_proj": (6144, 2304)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1,8")
    ap.add_argument("--only", default="", help="just these GEMV launches: 'ROWS,WIDTH,warps[,X_ROWS];...'")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA device")
        return 1
    dev = torch.device("cuda")
    bw = benchmark.copy_bandwidth(dev)
    table = flt.launch_config(platform.current(), "gemv")
    print(f"copy bandwidth {bw:.0f} GB/s; dispatched GEMV launches {table}\n")
    print("| shape | T | launch | µs | of floor | fp32 max rel err | bf16 cuBLAS µs (of its floor) |")
    print("|---|---:|---|---:|---:|---:|---|")
    grid = [tuple(int(v) for v in c.split(",")) for c in a.only.split(";")] if a.only else \
        list(itertools.product((4, 8, 16), (256, 512), (2, 4, 8), (0, 1)))
    for name, (N, K) in SHAPES.items():
        for T in (int(t) for t in a.tokens.split(",")):
            gen = torch.Generator(device=dev).manual_seed(0)
            (x, w, s), kw = fl.make_inputs(T, N, K, (128, 128), torch.bfloat16, dev, gen)
            ref = fl.fp8_linear_native(x, w, s, **kw)
            ref32 = fl.fp8_linear_native(x.float(), w, s, **kw)
            floor_us = (w.numel() + s.numel() * 4) / (bw * 1e9) * 1e6
            default = table["long"] if K >= table["long"]["K"] else table["short"]
            wb = fl.dequantize_fp8(w, s, (128, 128)).to(torch.bfloat16)
            cub = benchmark.graph_us(lambda: torch.nn.functional.linear(x, wb), dev)
            cub_txt = f"{cub:.1f} ({2 * floor_us / cub:.2f})"
            trials = [("split-K tl.dot (dispatched at 2..8 tokens)", dict(form="decode"))] + [
                (f"GEMV rows {r}, width {wd}, warps {wp}, X_ROWS {bool(xr and xr[0])}",
                 dict(form="gemv", ROWS=r, WIDTH=wd, num_warps=wp, X_ROWS=bool(xr and xr[0])))
                for r, wd, wp, *xr in grid if r * wd <= 8192]
            for label, cfg in trials:
                out = flt.fp8_linear_triton(x, w, s, **cfg)
                err = rel_err(out, ref)
                err32 = rel_err(flt.fp8_linear_triton(x.float(), w, s, **cfg), ref32)
                if err > 2e-2:
                    print(f"| {name} | {T} | {label} | wrong: {err:.1e} | | | |")
                    continue
                us = benchmark.graph_us(lambda: flt.fp8_linear_triton(x, w, s, **cfg), dev)
                star = " *" if T == 1 and all(default.get(k, False) == v for k, v in cfg.items() if k != "form") else ""
                print(f"| {name} | {T} | {label}{star} | {us:.1f} | {floor_us / us:.2f} | {err32:.1e} | {cub_txt} |",
                      flush=True)
                cub_txt = ""
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
