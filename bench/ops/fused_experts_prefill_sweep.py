"""Launch sweep of the prefill grouped-GEMM experts (kernelgate/ops/moe/fused_experts_triton.py) at
a prefill step's shape: T tokens (default 8,192, the token budget) routed top-8 over 256 experts
plus the shared expert stacked as a ninth slot (the model's call), bf16, uniform routing.

For each BLOCK_M (rows of one expert per program: 128 is what block_m_for gives a prefill step),
GROUP_M (row blocks that take all their column tiles together, for L2 reuse of their rows) and
each (BLOCK_N, BLOCK_K, warps, stages), the gate/up and the down kernel run on their own: output
checked against one fixed launch, then timed (median, CUDA events). TFLOP/s counts 2 * pairs * N * K
per GEMM (gate/up: both halves), not the rows padded to BLOCK_M. Also timed: the dispatched call
(autotuned, BLOCK_M from block_m_for) and its parts around the GEMMs (moe_align, the fp32 sum over
slots). Issue 35 part 3: in a Kimi 4-layer prefill step the two GEMMs took 1.67 + 1.21 ms of ~32
(417 / 288 TFLOP/s against the H200's measured 790).

    PYTHONPATH=. python bench/ops/fused_experts_prefill_sweep.py --quick    # 5 launches per BLOCK_M (~1 min)
    PYTHONPATH=. python bench/ops/fused_experts_prefill_sweep.py [--tokens 8192] [--qwen]   # 54 (~5 min: compiles)
    TRITON_INTERPRET=1 PYTHONPATH=. python bench/ops/fused_experts_prefill_sweep.py --tiny   # smoke run
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fused_experts_gemv_sweep import with_shared  # noqa: E402

from kernelgate import platform  # noqa: E402
from kernelgate.ops.moe import fused_experts as fe  # noqa: E402
from kernelgate.ops.moe import fused_experts_triton as ft  # noqa: E402
from kernelgate.ops.moe.moe_align_triton import moe_align  # noqa: E402
from kernelgate.tools import benchmark  # noqa: E402
from kernelgate.tools.testing import rel_err  # noqa: E402

SMEM = 227 * 1024          # H100 / H200 shared memory per block (opt-in)


def launches(quick: bool, decode: bool = False):
    if decode:    # a decode batch: ~1-3 rows per expert, the weights' bytes are the cost
        return [(bn, bk, w, st) for bn, bk, w, st in itertools.product((16, 32, 64, 128), (128, 256), (4, 8), (3, 4, 5))
                if not (w == 8 and bn < 64)] + [(64, 64, 4, 4), (128, 64, 4, 4)]
    if quick:
        return [(64, 64, 4, 3), (128, 64, 8, 3), (128, 64, 8, 4), (256, 64, 8, 3), (128, 128, 8, 3)]
    return list(itertools.product((64, 128, 256), (32, 64, 128), (4, 8), (3, 4, 5)))


def fits(bm, bn, bk, stages, halves):
    """Operand tiles of all stages in shared memory (bf16): A [bm, bk] + `halves` B tiles [bk, bn]."""
    return stages * 2 * (bm * bk + halves * bk * bn) <= SMEM


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--qwen", action="store_true", help="Qwen3.5-MoE shapes (D 2048, I 512)")
    ap.add_argument("--block-m", default="64,128", help="BLOCK_M values, comma-separated")
    ap.add_argument("--quick", action="store_true", help="a few launches per BLOCK_M instead of 54")
    ap.add_argument("--group-m", default="0,1,8", help="GROUP_M values (row blocks that take all their column "
                                                       "tiles together: L2 reuse of their rows; 0: every row "
                                                       "block, one column tile after another), comma-separated")
    ap.add_argument("--tiny", action="store_true", help="small shapes, any device (the interpreter on a CPU)")
    ap.add_argument("--decode", action="store_true", help="decode launches (narrow column tiles, deep K steps) "
                                                          "and the weights' read rate; e.g. --tokens 64 --block-m 16 "
                                                          "--group-m 0")
    a = ap.parse_args()
    dev = platform.default_device()
    if dev.type == "cpu" and not (a.tiny and platform.interpreting()):
        print("fused_experts_prefill_sweep: needs a GPU (or --tiny with TRITON_INTERPRET=1)")
        return 0
    T, D, I, E, k = (64, 64, 32, 8, 2) if a.tiny else (a.tokens, *((2048, 512) if a.qwen else (2304, 1024)), 256, 8)
    dtype = torch.float32 if a.tiny else torch.bfloat16      # (the interpreter's bf16 dot is unusable)
    gen = torch.Generator(device=dev).manual_seed(0)
    args, _ = fe.make_inputs(T, D, I, E, k, dtype, dev, gen)
    x, wgu, wd, tw, ids = with_shared(args)
    ids, tw = ids.contiguous(), tw.contiguous()
    E1, k1, P = wd.shape[0], ids.shape[1], ids.numel()
    bucket = triton.next_power_of_2(P)
    ieee = dtype == torch.float32
    gu_flop, d_flop = 2 * P * 2 * I * D, 2 * P * D * I
    hit = ids.unique().numel()                    # distinct experts: each one's weights read once
    gu_bytes, d_bytes = hit * 2 * I * D * wgu.element_size(), hit * D * I * wd.element_size()

    def gate_up(sp, be, h, bm, bn, bk, w, st, g=0):
        ft._gate_up_kernel[(be.numel() * triton.cdiv(I, bn),)](
            x, wgu, h, sp, be, P, I, D, bucket, be.numel(), x.stride(0), x.stride(1), *wgu.stride(), 0.0, k1,
            HAS_LIMIT=False, IEEE=ieee, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=g, num_warps=w, num_stages=st)

    def down(sp, be, h, y, bm, bn, bk, w, st, g=0):
        ft._down_kernel[(be.numel() * triton.cdiv(D, bn),)](
            h, wd, y, tw, sp, be, P, D, I, bucket, be.numel(), *wd.stride(), IEEE=ieee, BLOCK_M=bm, BLOCK_N=bn,
            BLOCK_K=bk, GROUP_M=g, num_warps=w, num_stages=st)

    # the fixed launch every other one is checked against
    sp, be = moe_align(ids, E1, 64 if not a.tiny else 16)
    ref_h = torch.empty(P, I, dtype=dtype, device=dev)
    ref_y = torch.empty(P, D, dtype=torch.float32, device=dev)
    gate_up(sp, be, ref_h, 64 if not a.tiny else 16, 64, 64, 4, 2)
    down(sp, be, ref_h, ref_y, 64 if not a.tiny else 16, 64, 64, 4, 2)
    out = ft.fused_experts_triton(x, wgu, wd, tw, ids)
    full = fe.fused_experts_native(x, wgu, wd, tw, ids)
    print(f"{platform.current().device_name or dev.type}: T {T}, D {D}, I {I}, {E1} experts (shared stacked), "
          f"{k1} slots, {P} pairs; dispatched call vs native: rel {rel_err(out, full):.2e}")
    t_call = benchmark.time_ms(lambda: ft.fused_experts_triton(x, wgu, wd, tw, ids), dev)
    r = ft.route(ids, E1)
    t_align = benchmark.time_ms(lambda: moe_align(ids, E1, r.block_m), dev)
    o = torch.empty(T, D, dtype=dtype, device=dev)
    t_sum = benchmark.time_ms(lambda: ft.sum_slots(ref_y, ids, o, E1), dev)
    print(f"dispatched call {t_call * 1e3:,.0f} µs ({(gu_flop + d_flop) / t_call / 1e9:,.0f} TFLOP/s over the call; "
          f"BLOCK_M {r.block_m}); moe_align {t_align * 1e3:,.0f} µs, sum over slots {t_sum * 1e3:,.0f} µs\n")
    if a.decode:
        print(f"decode: {hit} experts hit, weights read {(gu_bytes + d_bytes) / 1e6:,.0f} MB; columns: µs, TB/s of "
              "those bytes")
    print("| BLOCK_M | padded rows | GROUP_M | BLOCK_N | BLOCK_K | warps | stages | gate/up µs | "
          f"{'TB/s' if a.decode else 'TFLOP/s'} | down µs | {'TB/s' if a.decode else 'TFLOP/s'} |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    groups = [int(v) for v in a.group_m.split(",")] if not a.tiny else [0, 2]
    best = {}
    for bm in [int(v) for v in a.block_m.split(",")] if not a.tiny else [16, 32]:
        sp, be = moe_align(ids, E1, bm)
        pad = be.numel() * bm / P - 1
        h = torch.empty_like(ref_h)
        y = torch.empty_like(ref_y)
        for g, (bn, bk, w, st) in itertools.product(
                groups, launches(a.quick, a.decode) if not a.tiny else [(32, 32, 4, 2), (64, 32, 4, 2)]):
            cells = []
            for name, halves, fn, flop, got, ref in (
                    ("gate/up", 2, lambda: gate_up(sp, be, h, bm, bn, bk, w, st, g),
                     gu_bytes * 1e3 if a.decode else gu_flop, h, ref_h),
                    ("down", 1, lambda: down(sp, be, ref_h, y, bm, bn, bk, w, st, g),
                     d_bytes * 1e3 if a.decode else d_flop, y, ref_y)):
                if not fits(bm, bn, bk, st, halves):
                    cells += ["(smem)", ""]
                    continue
                try:
                    got.zero_()
                    fn()
                except Exception as e:  # noqa: BLE001 - out of resources for this launch: the next
                    cells += [f"({type(e).__name__})", ""]
                    continue
                err = rel_err(got, ref)
                if err > (1e-2 if got.dtype == torch.bfloat16 else 1e-4):
                    cells += [f"(wrong: {err:.1e})", ""]
                    continue
                ms = benchmark.time_ms(fn, dev, rep_ms=100.0)
                tf = flop / ms / 1e9        # TFLOP/s, or (decode) TB/s: bytes * 1e3 / ms / 1e9
                if tf > best.get(name, (0,))[0]:
                    best[name] = (tf, ms, (bm, g, bn, bk, w, st))
                cells += [f"{ms * 1e3:,.1f}", f"{tf:,.2f}" if a.decode else f"{tf:,.0f}"]
            print(f"| {bm} | {pad:.1%} | {g} | {bn} | {bk} | {w} | {st} | " + " | ".join(cells) + " |", flush=True)
    for name, (tf, ms, cfg) in best.items():
        print(f"best {name}: {ms * 1e3:,.0f} µs, {tf:,.2f} {'TB/s' if a.decode else 'TFLOP/s'} at BLOCK_M, GROUP_M, BLOCK_N, BLOCK_K, warps, "
              f"stages = {cfg}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
