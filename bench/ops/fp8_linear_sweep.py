"""fp8_linear's decode forms (kernelgate/ops/quant/fp8_linear_triton.py: the dispatched one, and the
split-K tl.dot launch that takes 2..8 tokens) at Kimi Linear's decode shapes, beside the bf16 linear
(cuBLAS) of the same weight. The one-token GEMV's own launch sweep: bench/ops/fp8_gemv_sweep.py.

    PYTHONPATH=. python bench/ops/fp8_linear_sweep.py [--tokens 1,8]

Shapes: the fused KDA in_proj (q|k|v|f_a|g_a|b: 12,576 x 2,304), the KDA o_proj (2,304 x 4,096), the
MLA q_proj (6,144 x 2,304), 128 x 128 block scales. Each launch is checked against the native reference
(and the GEMV in fp32 for exactness), then timed in a CUDA graph; the floor is the weight's bytes
(codes + scales) at the measured copy bandwidth. '*' marks the launch dispatch makes.
"""
from __future__ import annotations

import argparse

import torch

from kernelgate.ops.quant import fp8_linear as fl
from kernelgate.ops.quant import fp8_linear_triton as flt
from kernelgate.tools import benchmark
from kernelgate.tools.testing import rel_err

SHAPES = {"KDA in_proj": (12576, 2304), "KDA o_proj": (2304, 4096), "MLA q_proj": (6144, 2304)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1,8")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA device")
        return 1
    dev = torch.device("cuda")
    bw = benchmark.copy_bandwidth(dev)
    print(f"copy bandwidth {bw:.0f} GB/s\n")
    print("| shape | T | launch | µs | of floor | fp32 max rel err | bf16 cuBLAS µs (of its floor) |")
    print("|---|---:|---|---:|---:|---:|---|")
    for name, (N, K) in SHAPES.items():
        for T in (int(t) for t in a.tokens.split(",")):
            gen = torch.Generator(device=dev).manual_seed(0)
            (x, w, s), kw = fl.make_inputs(T, N, K, (128, 128), torch.bfloat16, dev, gen)
            ref = fl.fp8_linear_native(x, w, s, **kw)
            ref32 = fl.fp8_linear_native(x.float(), w, s, **kw)
            floor_us = (w.numel() + s.numel() * 4) / (bw * 1e9) * 1e6
            wb = fl.dequantize_fp8(w, s, (128, 128)).to(torch.bfloat16)
            cub = benchmark.graph_us(lambda: torch.nn.functional.linear(x, wb), dev)
            cub_txt = f"{cub:.1f} ({2 * floor_us / cub:.2f})"
            trials = [("dispatched", {}), ("split-K tl.dot (dispatched at 2..8 tokens)", dict(form="decode"))]
            for label, cfg in trials:
                out = flt.fp8_linear_triton(x, w, s, **cfg)
                err = rel_err(out, ref)
                err32 = rel_err(flt.fp8_linear_triton(x.float(), w, s, **cfg), ref32)
                if err > 2e-2:
                    print(f"| {name} | {T} | {label} | wrong: {err:.1e} | | | |")
                    continue
                us = benchmark.graph_us(lambda: flt.fp8_linear_triton(x, w, s, **cfg), dev)
                print(f"| {name} | {T} | {label} | {us:.1f} | {floor_us / us:.2f} | {err32:.1e} | {cub_txt} |",
                      flush=True)
                cub_txt = ""
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
