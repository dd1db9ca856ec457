"""Sweep the packed KDA decode kernel's tile (BV) and warps at H=32, K=V=128 on CUDA; device
time from CUDA-graph replay; fraction of the state floor (state read + written once). Each
choice is first checked against the op's own launch (same arithmetic: the outputs must agree).

    PYTHONPATH=. python bench/ops/kda_packed_sweep.py
"""
from __future__ import annotations

import argparse

import torch
import triton

from kernelgate.ops.kda.kda_decode import packed_case
import kernelgate.ops.kda.kda_decode_triton as kd
from kernelgate.tools.benchmark import copy_bandwidth, graph_us
from kernelgate.tools.testing import rel_err


def launch(qkv, f, b, A_log, dt_bias, state, slots, H, K, BV, warps):
    """kda_packed_decode with the tile and warps given (the arguments as kd._launch passes them)."""
    N = qkv.shape[0]
    V = (qkv.shape[1] - 2 * H * K) // H
    q, k, v = qkv.split([H * K, H * K, H * V], dim=1)
    q, k, v, g = q.view(N, H, K), k.view(N, H, K), v.view(N, H, V), f.view(N, H, K)
    o = torch.empty(N, H, V, device=qkv.device, dtype=qkv.dtype)
    kd._kda_step_kernel[(N, H, triton.cdiv(V, BV))](
        q, k, v, g, b, A_log, dt_bias, state, slots, o, *q.stride(), *k.stride(), *v.stride(), *g.stride(),
        *b.stride(), A_log.stride(0), dt_bias.stride(0), slots.stride(0), *state.stride(), o.stride(0),
        state.shape[0], K ** -0.5, 0.0, H=H, K=K, V=V, BK=max(16, triton.next_power_of_2(K)), BV=BV,
        PACKED=True, USE_LB=False, HAS_BIAS=True, L2=True, GROUP=1, SCALAR_G=False, PDL=False, num_warps=warps)
    return o


def main():
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA device")
        return
    dev = torch.device("cuda")
    bw = copy_bandwidth(dev)
    H, K, V = 32, 128, 128
    print(f"copy bandwidth {bw:.0f} GB/s")
    print("| N | BV | warps | µs (graph) | of state floor |\n|---:|---:|---:|---:|---:|")
    for N in (1, 32, 256):
        args, kw = packed_case(N, list(range(N)), H, K, V, pool=N).make("cpu", torch.bfloat16, torch.Generator().manual_seed(0))
        qkv, f, b, A_log, dt_bias, state, slots, _, _ = [a.to(dev) if isinstance(a, torch.Tensor) else a for a in args]
        floor_us = 2 * N * H * K * V * 4 / bw / 1e3
        want = kd.kda_packed_decode(qkv, f, b, A_log, dt_bias, state.clone(), slots, H, K)
        for BV in (8, 16, 32, 64):
            for warps in (1, 2, 4, 8):
                err = rel_err(launch(qkv, f, b, A_log, dt_bias, state.clone(), slots, H, K, BV, warps).float(),
                              want.float())
                if not err < 1e-3:
                    print(f"| {N} | {BV} | {warps} | wrong: {err:.1e} | |", flush=True)
                    continue
                us = graph_us(lambda: launch(qkv, f, b, A_log, dt_bias, state, slots, H, K, BV, warps), dev)
                print(f"| {N} | {BV} | {warps} | {us:.2f} | {floor_us / us:.3f} |", flush=True)


if __name__ == "__main__":
    main()
