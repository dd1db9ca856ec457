"""Sweep-only variant (bench/ops/variants, not dispatched): the FP8 experts GEMV's gate/up kernel
with the next K step's codes loaded before the current step's FMAs.

Why: Session 19 measured the package's GEMV (kernelgate/ops/moe/fused_experts_fp8_gemv_triton.py)
at 37.0 µs for Kimi's experts at one token, 0.41 of the copy floor, while the bf16 GEMV streams the
same number of weight *elements* in the same time with twice the bytes: the bound looks like one K
step's load latency per program and step, not bytes or ALU (integer decode and matrix-unit forms
were both slower). Triton does not pipeline loads that feed no tl.dot, so this form issues step
k + 1's loads (codes and activations) by hand before step k's arithmetic: two steps in flight per
program. Same arithmetic as the package's row_step (fp8_f32 decode, scales per sub-tile); the
program owns BLOCK_I gate rows and their BLOCK_I up rows.

    PYTHONPATH=. python bench/ops/variants/fp8_gemv_prefetch.py      # GPU: check, then time both
    TRITON_INTERPRET=1 python -m pytest -q bench/ops/variants/test_fp8_gemv_prefetch.py
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernelgate.ops.quant.fp8_gemv_triton import fp8_f32, hw_decode, row_sums, tile


@triton.jit
def _step(acc, w, s_row0, s_rows, xv, k0, K, bk, ssk, r_ok, ONE_KBLOCK: tl.constexpr, UNIFORM: tl.constexpr,
          NB: tl.constexpr, BK: tl.constexpr):
    """row_step's arithmetic on codes already loaded (w [rows, NB, BK] fp32)."""
    if ONE_KBLOCK:
        acc += w * xv[None, :, :]
    else:
        k_sub = k0 + tl.arange(0, NB) * BK
        if UNIFORM:
            s = tl.load(s_row0 + (k_sub // bk) * ssk, mask=k_sub < K, other=0.0)
            acc += w * (xv * s[:, None])[None, :, :]
        else:
            s = tl.load(s_rows[:, None] + (k_sub // bk)[None, :] * ssk, mask=r_ok[:, None] & (k_sub < K)[None, :],
                        other=0.0)
            acc += w * (xv[None, :, :] * s[:, :, None])
    return acc


@triton.jit
def gate_up_prefetch_kernel(x_ptr, w_ptr, s_ptr, ids_ptr, h_ptr, D, I, E, TOPK, sxt, sxd, swe, swr, swd,
                            sse, ssr, ssk, sit, sij, bn, bk,
                            HW: tl.constexpr, ONE_KBLOCK: tl.constexpr, UNIFORM: tl.constexpr,
                            BLOCK_I: tl.constexpr, NB: tl.constexpr, BK: tl.constexpr):
    p = tl.program_id(0)
    t, j = p // TOPK, p % TOPK
    i0 = tl.program_id(1) * BLOCK_I
    i = i0 + tl.arange(0, BLOCK_I)
    i_ok = i < I
    e = tl.load(ids_ptr + t.to(tl.int64) * sit + j * sij).to(tl.int64)
    valid = (e >= 0) & (e < E)
    s_e = s_ptr + tl.where(valid, e, 0) * sse
    sg_rows = s_e + (i // bn).to(tl.int64) * ssr
    su_rows = s_e + ((i + I) // bn).to(tl.int64) * ssr
    sg_row0 = s_e + (i0 // bn).to(tl.int64) * ssr
    su_row0 = s_e + ((i0 + I) // bn).to(tl.int64) * ssr
    acc_g = tl.zeros([BLOCK_I, NB, BK], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_I, NB, BK], dtype=tl.float32)
    sub = tl.arange(0, NB)[:, None] * BK + tl.arange(0, BK)[None, :]
    if valid:
        w_g = w_ptr + e * swe + i.to(tl.int64) * swr
        w_u = w_g + I * swr
        x_row = x_ptr + t.to(tl.int64) * sxt
        m = i_ok[:, None, None] & (sub < D)[None, :, :]
        cg = tl.load(w_g[:, None, None] + sub[None, :, :] * swd, mask=m, other=0)      # step 0, in flight
        cu = tl.load(w_u[:, None, None] + sub[None, :, :] * swd, mask=m, other=0)
        xv = tl.load(x_row + sub * sxd, mask=sub < D, other=0.0).to(tl.float32)
        for k0 in range(0, D, NB * BK):
            kn = k0 + NB * BK + sub                                                      # the next step
            mn = i_ok[:, None, None] & (kn < D)[None, :, :]
            cg_n = tl.load(w_g[:, None, None] + kn[None, :, :] * swd, mask=mn, other=0)
            cu_n = tl.load(w_u[:, None, None] + kn[None, :, :] * swd, mask=mn, other=0)
            xv_n = tl.load(x_row + kn * sxd, mask=kn < D, other=0.0).to(tl.float32)
            acc_g = _step(acc_g, fp8_f32(cg, HW), sg_row0, sg_rows, xv, k0, D, bk, ssk, i_ok, ONE_KBLOCK, UNIFORM,
                          NB, BK)
            acc_u = _step(acc_u, fp8_f32(cu, HW), su_row0, su_rows, xv, k0, D, bk, ssk, i_ok, ONE_KBLOCK, UNIFORM,
                          NB, BK)
            cg, cu, xv = cg_n, cu_n, xv_n
    g = row_sums(acc_g, sg_rows, i_ok, 1.0, ONE_KBLOCK)
    u = row_sums(acc_u, su_rows, i_ok, 1.0, ONE_KBLOCK)
    tl.store(h_ptr + p.to(tl.int64) * I + i, g * tl.sigmoid(g) * u, mask=i_ok)


def gate_up_prefetch(x, w_gate_up, topk_ids, w_gate_up_scale, block=(128, 128), BLOCK_I=4, WIDTH=256, num_warps=4,
                     hw=None):
    """h [T * k, I] fp32 = swiglu of the gate / up rows of each (token, slot)'s expert: the package
    GEMV's first kernel (_gate_up_kernel), prefetching."""
    from kernelgate import platform
    from kernelgate.ops.quant.fp8_weights import block_dims
    T, D = x.shape
    I = w_gate_up.shape[1] // 2
    k = topk_ids.shape[1]
    bn, bk = block_dims(block, D)
    hw = hw_decode(platform.current().capability) if hw is None else hw
    h = torch.empty((T * k, I), dtype=torch.float32, device=x.device)
    w = w_gate_up.view(torch.uint8)
    gate_up_prefetch_kernel[(T * k, triton.cdiv(I, BLOCK_I))](
        x, w, w_gate_up_scale, topk_ids, h, D, I, w.shape[0], k, *x.stride(), *w.stride(), *w_gate_up_scale.stride(),
        *topk_ids.stride(), bn, bk, HW=hw, ONE_KBLOCK=triton.cdiv(D, bk) == 1,
        UNIFORM=bn % BLOCK_I == 0 and I % BLOCK_I == 0, BLOCK_I=BLOCK_I, **tile(bk, D, WIDTH), num_warps=num_warps)
    return h


def package_gate_up(x, w_gate_up, topk_ids, w_gate_up_scale, block=(128, 128), BLOCK_I=4, WIDTH=256, num_warps=4):
    """The package kernel alone, same launch (for the comparison)."""
    from kernelgate import platform
    from kernelgate.ops.moe import fused_experts_fp8_gemv_triton as G
    from kernelgate.ops.quant.fp8_weights import block_dims
    T, D = x.shape
    I = w_gate_up.shape[1] // 2
    k = topk_ids.shape[1]
    bn, bk = block_dims(block, D)
    h = torch.empty((T * k, I), dtype=torch.float32, device=x.device)
    w = w_gate_up.view(torch.uint8)
    G._gate_up_kernel[(T * k, triton.cdiv(I, BLOCK_I))](
        x, w, w_gate_up_scale, topk_ids, h, D, I, w.shape[0], k, *x.stride(), *w.stride(), *w_gate_up_scale.stride(),
        *topk_ids.stride(), bn, bk, 0.0, 1.0, HAS_LIMIT=False, HW=hw_decode(platform.current().capability),
        ONE_KBLOCK=triton.cdiv(D, bk) == 1, UNIFORM=bn % BLOCK_I == 0 and I % BLOCK_I == 0, BLOCK_I=BLOCK_I,
        **tile(bk, D, WIDTH), num_warps=num_warps)
    return h


def main() -> int:
    from kernelgate.ops.moe import fused_experts_fp8 as fe8
    from kernelgate.tools import benchmark
    from kernelgate.tools.testing import rel_err
    if not torch.cuda.is_available():
        print("needs a CUDA device")
        return 1
    dev = torch.device("cuda")
    bw = benchmark.copy_bandwidth(dev)
    gen = torch.Generator(device=dev).manual_seed(0)
    (x, wgu, _, _, ids, sgu, _), _ = fe8.make_inputs(1, 2304, 1024, 256, 9, torch.bfloat16, dev, gen)
    floor = ids.numel() * wgu[0].numel() / (bw * 1e9) * 1e6          # each hit expert's gate/up codes once
    print(f"Kimi gate/up at one token, 9 experts, copy bandwidth {bw:.0f} GB/s, floor {floor:.1f} µs\n")
    print("| kernel | BLOCK_I | WIDTH | warps | µs | of floor |\n|---|---:|---:|---:|---:|---:|")
    for bi, width, warps in ((4, 256, 4), (4, 512, 4), (8, 256, 4), (8, 512, 8), (16, 256, 8)):
        ref = package_gate_up(x, wgu, ids, sgu, BLOCK_I=bi, WIDTH=width, num_warps=warps)
        for name, fn in (("package", package_gate_up), ("prefetch", gate_up_prefetch)):
            h = fn(x, wgu, ids, sgu, BLOCK_I=bi, WIDTH=width, num_warps=warps)
            if rel_err(h, ref) > 1e-5:
                print(f"| {name} | {bi} | {width} | {warps} | wrong: {rel_err(h, ref):.1e} | |")
                continue
            us = benchmark.graph_us(lambda: fn(x, wgu, ids, sgu, BLOCK_I=bi, WIDTH=width, num_warps=warps), dev)
            print(f"| {name} | {bi} | {width} | {warps} | {us:.1f} | {floor / us:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
