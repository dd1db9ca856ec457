"""moe_align (token permutation of the Triton fused_experts) at Kimi Linear shapes: E = 256
(384 with --E), top-8, P = T*k pairs in 8, 512, 65536 (decode T=1, decode batch 64, 8k
prefill), BLOCK_M from fused_experts.block_m_for. Each call is first checked against a stable
argsort of the ids (exact equality: the permutation is deterministic), then timed:
`graph_us` replays 20 calls captured in one CUDA graph (device time, no launch cost; its
presence also shows there is no host sync), `us` is kernelgate.tools.benchmark.time_ms (launches included).
Rows per chunk size (`chunk`, pairs per program; * marks the default) show where the
one-chunk (2 launches) and multi-chunk (3 launches) paths win.

    PYTHONPATH=. python bench/ops/moe_align.py [--P 8 512 65536] [--E 256] [--no-sweep]

Targets (issue A2, H200): P=512 a few us, P=65536 well under 100 us (was 48 us / 5.3 ms).
"""
from __future__ import annotations

import argparse
import sys


def reference(ids, E: int, block_m: int, num_blocks: int):
    """Stable sort of the valid pairs by expert into runs padded to block_m (torch, on device)."""
    import torch
    flat = ids.flatten().long()
    P = flat.numel()
    valid = (flat >= 0) & (flat < E)
    key = torch.where(valid, flat, torch.full_like(flat, E))
    order = torch.sort(key, stable=True).indices[:int(valid.sum())]
    counts = torch.bincount(flat[valid], minlength=E)
    padded = (counts + block_m - 1) // block_m * block_m
    starts = torch.cumsum(padded, 0) - padded
    e_sorted = key[order]
    within = torch.arange(order.numel(), device=ids.device) - (torch.cumsum(counts, 0) - counts)[e_sorted]
    pairs = torch.full((num_blocks * block_m,), P, dtype=torch.int32, device=ids.device)
    pairs[starts[e_sorted] + within] = order.to(torch.int32)
    blocks = torch.full((num_blocks,), -1, dtype=torch.int32, device=ids.device)
    n_live = int((padded // block_m).sum())
    blocks[:n_live] = torch.repeat_interleave(torch.arange(E, device=ids.device), padded // block_m).int()
    return pairs, blocks


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--P", type=int, nargs="+", default=[8, 512, 65536])
    ap.add_argument("--E", type=int, default=256)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--module", default="kernelgate.ops.moe.moe_align_triton",
                    help="the moe_align to time (e.g. a variant under bench/ops/variants, with PYTHONPATH)")
    args = ap.parse_args()

    import torch
    import triton
    import triton.testing

    from kernelgate import platform
    from kernelgate.tools.benchmark import graph_us, time_ms

    device = platform.default_device()
    if device.type != "cuda" or platform.interpreting():
        print("moe_align bench: needs a CUDA/ROCm GPU with compiled Triton (TRITON_INTERPRET unset)")
        return 0
    from kernelgate.ops.moe.fused_experts_triton import block_m_for
    import importlib
    mod = importlib.import_module(args.module)
    default_chunk, moe_align = mod.default_chunk, mod.moe_align

    print(f"{platform.current().device_name}, torch {torch.__version__}, triton {triton.__version__}, {args.module}")
    print(f"{'P':>7} {'E':>4} {'bm':>3} {'chunk':>6} {'launches':>8} {'graph_us':>9} {'us':>9}  check")
    ok = True
    for P in args.P:
        E, T = args.E, max(1, P // args.k)
        gen = torch.Generator(device="cpu").manual_seed(P)
        # top-k of random scores: distinct experts per token, like the router's output
        ids = torch.rand(T, E, generator=gen).topk(args.k, dim=1).indices.int().flatten()[:P].to(device)
        bm = block_m_for(triton.next_power_of_2(P), E)   # as fused_experts chooses it
        chunks = [default_chunk(P)]
        if not args.no_sweep:
            chunks += [c for c in (16, 32, 64, 128, 256, 512, 1024) if c != chunks[0] and c <= 4 * P]
        for chunk in chunks:
            pairs, blocks = moe_align(ids, E, bm, chunk=chunk)
            want_pairs, want_blocks = reference(ids, E, bm, blocks.numel())
            good = torch.equal(pairs, want_pairs) and torch.equal(blocks, want_blocks)
            ok &= good
            g = graph_us(lambda: moe_align(ids, E, bm, chunk=chunk), device)
            us = 1e3 * time_ms(lambda: moe_align(ids, E, bm, chunk=chunk), device)
            star = "*" if chunk == chunks[0] else " "
            launches = 2 if triton.cdiv(P, chunk) == 1 else 3
            gs = f"{g:9.2f}" if g is not None else f"{'n/a':>9}"
            print(f"{P:>7} {E:>4} {bm:>3} {chunk:>5}{star} {launches:>8} {gs} {us:9.2f}  "
                  f"{'ok' if good else 'MISMATCH'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
