"""Launch-table sweep of the decode GEMV experts (kernelgate/ops/moe/fused_experts_gemv_triton.py).

    PYTHONPATH=. python bench/ops/fused_experts_gemv_sweep.py [--shared] [--qwen]

Kimi shapes (D 2304, I 1024, 256 experts, top-8, bf16) at T = 1, 4, 16 (--shared: the model's
call, the shared expert stacked as expert 256 with a unit-weight ninth slot, at T = 1, 4, 8):
each launch choice is checked against the native reference, then timed in a CUDA graph; the
floor is each distinct expert's weights read once at the measured copy bandwidth. --qwen: the
Qwen3.5-MoE 35B-A3B shapes instead (D 2048, I 512, 256 experts, top-8). --only's fifth field is the
gate/up GEMV's X_ROWS, --down the down GEMV's own launches (each crossed with --only's). The FP8 GEMV
has its own sweep: bench/ops/fp8_gemv_sweep.py.
"""
from __future__ import annotations

import argparse
import itertools

import torch

from kernelgate import platform
from kernelgate.ops.moe import fused_experts as fe
from kernelgate.ops.moe import fused_experts_gemv_triton as gv
from kernelgate.tools import benchmark
from kernelgate.tools.testing import rel_err


def with_shared(args):
    """The routed experts plus a shared one, stacked as expert E, in a unit-weight last slot
    (FP8: its scales stacked alike)."""
    x, w_gate_up, w_down, topk_w, topk_ids, *scales = args
    E = w_down.shape[0]
    ids = torch.cat([topk_ids, torch.full_like(topk_ids[:, :1], E)], 1)
    wts = torch.cat([topk_w, torch.ones_like(topk_w[:, :1])], 1)
    return (x, torch.cat([w_gate_up, w_gate_up[:1]]), torch.cat([w_down, w_down[:1]]), wts, ids,
            *[torch.cat([s, s[:1]]) for s in scales])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shared", action="store_true")
    ap.add_argument("--qwen", action="store_true", help="Qwen3.5-MoE shapes (D 2048, I 512)")
    ap.add_argument("--tokens", default="", help="comma-separated T (default 1,4,16; --shared 1,4,8)")
    ap.add_argument("--only", default="", help="just these launches: 'BLOCK_I,BLOCK_O,BLOCK_K,warps[,X_ROWS];...'")
    ap.add_argument("--down", default="", help="bf16: the down GEMV's own launches 'DOWN_O,DOWN_K,warps,DOWN_X_ROWS;...'")
    ap.add_argument("--dispatched", action="store_true", help="just the launch dispatch makes at each T")
    a = ap.parse_args()
    D, I = (2048, 512) if a.qwen else (2304, 1024)
    if not torch.cuda.is_available():
        print("needs a CUDA device")
        return 1
    dev = torch.device("cuda")
    bw = benchmark.copy_bandwidth(dev)
    print(f"copy bandwidth {bw:.0f} GB/s\n\n| T | BLOCK_I | BLOCK_O | BLOCK_K | warps | X_ROWS (bf16: + down launch) | µs | of floor |\n"
          "|---:|---:|---:|---:|---:|---|---:|---:|")
    mod, ref_fn, run = gv, fe.fused_experts_native, gv.fused_experts_gemv
    dispatched = mod.launch_config
    try:
        tokens = [int(t) for t in a.tokens.split(",")] if a.tokens else ((1, 4, 8) if a.shared else (1, 4, 16))
        for T in tokens:
            gen = torch.Generator(device=dev).manual_seed(0)
            args, kw = fe.make_inputs(T, D, I, 256, 8, torch.bfloat16, dev, gen)
            if a.shared:
                args = with_shared(args)
            floor_us = fe._bytes(args, kw) / (bw * 1e9) * 1e6
            ref = ref_fn(*args, **kw)
            default = dispatched(platform.current(), T)    # (* marks the choice dispatch makes at this T)
            if a.dispatched:
                out = run(*args, **kw)
                us = benchmark.graph_us(lambda: run(*args, **kw), dev)
                print(f"| {T} | {default} | | | | | {us:.1f} (err {rel_err(out, ref):.1e}) | {floor_us / us:.2f} |", flush=True)
                continue
            grid = [tuple(int(v) for v in c.split(",")) for c in a.only.split(";")] if a.only else \
                itertools.product((4, 8, 16, 32), (8, 16, 32), (128, 256, 512), (2, 4, 8))
            downs = [tuple(int(v) for v in c.split(",")) for c in a.down.split(";")] if a.down else [()]
            for (bi, bo, bk, w, *flags), down in itertools.product(list(grid), downs):
                if bi * bk > 16384 or bo * bk > 16384:
                    continue
                trial = dict(BLOCK_I=bi, BLOCK_O=bo, BLOCK_K=bk, num_warps=w, X_ROWS=bool(flags and flags[0]))
                trial.update(zip(("DOWN_O", "DOWN_K", "DOWN_WARPS", "DOWN_X_ROWS"), down))
                flags = flags + list(down)
                mod.launch_config = lambda plat, tokens=2, trial=trial: trial  # noqa: E731
                out = run(*args, **kw)
                err = rel_err(out, ref)
                if err > 2e-2:
                    print(f"| {T} | {bi} | {bo} | {bk} | {w} | {flags} | wrong: {err:.1e} | |")
                    continue
                us = benchmark.graph_us(lambda: run(*args, **kw), dev)
                star = " *" if all(default.get(k, False) == v for k, v in trial.items()) else ""
                print(f"| {T} | {bi} | {bo} | {bk} | {w}{star} | {flags} | {us:.1f} | {floor_us / us:.2f} |", flush=True)
    finally:
        mod.launch_config = dispatched
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
