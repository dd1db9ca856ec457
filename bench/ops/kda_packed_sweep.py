"""Sweep the packed KDA decode kernel's tile (BV) and warps at H=32, K=V=128 on CUDA; device
time from CUDA-graph replay; fraction of the state floor (state read + written once)."""
from __future__ import annotations

import torch
import triton

from kernelgate.tools.benchmark import copy_bandwidth, graph_us
from kernelgate.ops.kda.kda_decode import packed_case
import kernelgate.ops.kda.kda_decode_triton as kd


def main():
    dev = torch.device("cuda")
    bw = copy_bandwidth(dev)
    H, K, V = 32, 128, 128
    print(f"copy bandwidth {bw:.0f} GB/s")
    print("| N | BV | warps | µs (graph) | of state floor |\n|---:|---:|---:|---:|---:|")
    for N in (1, 32, 256):
        args, kw = packed_case(N, list(range(N)), H, K, V, pool=N).make("cpu", torch.bfloat16, torch.Generator().manual_seed(0))
        qkv, f, b, A_log, dt_bias, state, slots, _, _ = [a.to(dev) if isinstance(a, torch.Tensor) else a for a in args]
        q, k, v = qkv.split([H * K, H * K, H * V], dim=1)
        q, k, v = q.view(N, H, K), k.view(N, H, K), v.view(N, H, V)
        o = torch.empty(N, H, V, device=dev, dtype=qkv.dtype)
        floor_us = 2 * N * H * K * V * 4 / bw / 1e3
        for BV in (8, 16, 32, 64):
            for warps in (1, 2, 4, 8):
                def fn():
                    kd._kda_step_kernel[(N, H, triton.cdiv(V, BV))](
                        q, k, v, f.view(N, H, K), b, A_log, dt_bias, state, slots, o,
                        q.stride(0), k.stride(0), v.stride(0), f.stride(0), b.stride(0), state.stride(0), o.stride(0),
                        K ** -0.5, 0.0, H=H, K=K, V=V, BK=K, BV=BV, PACKED=True, USE_LB=False, HAS_BIAS=True,
                        L2=True, num_warps=warps)
                us = graph_us(fn, dev)
                print(f"| {N} | {BV} | {warps} | {us:.2f} | {floor_us / us:.3f} |", flush=True)


if __name__ == "__main__":
    main()
