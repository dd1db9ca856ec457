"""Launch sweep of the varlen short conv (kernelgate/ops/conv/short_conv_triton.py `_conv_varlen_kernel`)
at a Kimi prefill chunk: one sequence of T tokens (default 8,192) of the q|k|v channels (3 x 32 x 128
= 12,288), read as the KDA layer does, a column view of its fused input projection (row stride 12,576),
width 4, SiLU, bf16. Each (BT, BD, warps) is checked against the dispatched call's output and timed
(median, CUDA events); GB/s counts x read once and y written once. Issue 35 part 3: the dispatched
launch (BT 16, BD 128) took 0.44 ms a call at this shape, ~0.9 TB/s (bench/e2e/step_kinds.py --kernels);
tiles of 8,192 elements or more spilled (7-8 ms).

    PYTHONPATH=. python bench/ops/short_conv_sweep.py [--tokens 8192]
    TRITON_INTERPRET=1 PYTHONPATH=. python bench/ops/short_conv_sweep.py --tiny   # smoke run
"""
from __future__ import annotations

import argparse
import itertools

import torch
import triton

from kernelgate import ops, platform
from kernelgate.ops.conv import short_conv_triton as sc
from kernelgate.tools import benchmark
from kernelgate.tools.testing import rel_err


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--tiny", action="store_true", help="a small shape and two launches (CPU interpreter)")
    a = ap.parse_args()
    dev = platform.default_device()
    T, D, extra, W = (a.tokens, 12288, 288, 4) if not a.tiny else (40, 96, 8, 4)
    g = torch.Generator(device="cpu").manual_seed(0)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    y_in = torch.randn(T, D + extra, generator=g).to(dev, dtype)
    x = y_in[:, :D]                                            # the layer's view of its projection
    weight = (torch.randn(D, W, generator=g) * 0.5).to(dev, dtype)
    state = torch.zeros(4, D, W - 1, dtype=dtype, device=dev)
    cu = torch.tensor([0, T], dtype=torch.int32, device=dev)
    slots = torch.tensor([1], dtype=torch.int32, device=dev)
    want = ops.short_conv(x, weight, None, state.clone(), cu, slots, "silu", cu_seqlens_cpu=cu.cpu())
    floor_bytes = 2 * T * D * x.element_size()
    launches = [(16, 128, 4)] if a.tiny else []
    launches += [(bt, bd, w) for bt, bd, w in itertools.product((8, 16, 32, 64), (32, 64, 128, 256), (2, 4, 8))
                 if not a.tiny and 512 <= bt * bd <= 8192] or [(8, 32, 4)]   # (larger tiles spill: Session 23)
    print(f"{platform.current().device_name}: T {T}, D {D} (row stride {x.stride(0)}), W {W}, {dtype}; "
          f"floor {floor_bytes / 1e6:.0f} MB")
    print("| BT | BD | warps | µs | GB/s | rel err |\n|---:|---:|---:|---:|---:|---:|")
    s_disp = state.clone()                                     # (the call writes the context it leaves)
    t_disp = benchmark.time_ms(lambda: ops.short_conv(x, weight, None, s_disp, cu, slots, "silu",
                                                      cu_seqlens_cpu=cu.cpu()), dev) / 1e3
    print(f"| dispatched | | | {t_disp * 1e6:,.1f} | {floor_bytes / t_disp / 1e9:,.0f} | 0 |")
    for bt, bd, warps in launches:
        y = torch.empty(T, D, dtype=dtype, device=dev)
        s = state.clone()

        def run():
            sc._conv_varlen_kernel[(1, triton.cdiv(D, bd), triton.cdiv(T, bt))](
                x, weight, weight, s, cu, slots, y, *x.stride(), *weight.stride(), 0, cu.stride(0), slots.stride(0),
                y.stride(0), *s.stride(), D, s.shape[0], T, W=W, BT=bt, BD=bd, HAS_BIAS=False, SILU=True,
                num_warps=warps)
        run()
        err = rel_err(y, want)
        t = benchmark.time_ms(run, dev) / 1e3
        print(f"| {bt} | {bd} | {warps} | {t * 1e6:,.1f} | {floor_bytes / t / 1e9:,.0f} | {err:.1e} |")
        assert err < 1e-2, (bt, bd, warps, err)


if __name__ == "__main__":
    main()
