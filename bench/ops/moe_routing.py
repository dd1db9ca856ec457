"""biased_grouped_topk at the issue's shapes (bf16 logits, fp32 bias, k=8, renormalize):
DeepSeek V3 (E=256, 8 groups, topk_group 4), Kimi Linear (E=256, n_group 1), Kimi K2
(E=384, n_group 1), T = 1, 64, 4096. Checks every implementation against the native
reference first, then prints per-call time of native eager, torch.compile(native), the Triton
kernel with its heuristic launch config, sgl_kernel if importable, and a sweep of Triton
launch configs (BLOCK_T x num_warps) so the heuristic can be checked.

    PYTHONPATH=. python bench/ops/moe_routing.py [--T 1 64 4096] [--no-sweep] [--json out.json]

Two timings: `us` is kernelgate.tools.benchmark.time_ms (events around each call, launch included);
`graph_us` replays the call inside a CUDA graph (device time without Python/launch cost).
Targets (issue 3, H200): Triton <= 8 us for T <= 64 and <= 25 us at T = 4096.
"""
from __future__ import annotations

import argparse
import json
import sys

SHAPES = (("dsv3", 256, 8, 4), ("kimi", 256, 1, 1), ("k2", 384, 1, 1))
SWEEP = ((1, 1), (1, 2), (1, 4), (2, 1), (2, 2), (4, 2), (4, 4), (8, 4))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--T", type=int, nargs="+", default=[1, 64, 4096])
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    import torch
    import triton.testing

    from kernelgate import alloc, platform, registry
    from kernelgate.tools.benchmark import graph_us, time_ms
    from kernelgate.ops.moe.moe_routing import biased_grouped_topk_native

    device = platform.default_device()
    if device.type != "cuda" or platform.interpreting():
        print("moe_routing bench: needs a CUDA/ROCm GPU with compiled Triton (TRITON_INTERPRET unset)")
        return 0
    import kernelgate.ops.moe.moe_routing_triton as tri

    op = registry.get("biased_grouped_topk")
    plat = platform.current()
    print(f"{plat.device_name}, torch {torch.__version__}, triton {triton.__version__}")
    compiled = torch.compile(biased_grouped_topk_native, dynamic=False)
    rows, ok = [], True
    for name, E, G, tg in SHAPES:
        for T in args.T:
            gen = torch.Generator(device="cpu").manual_seed(T + E)
            logits = torch.randn(T, E, generator=gen).to(device=device, dtype=torch.bfloat16)
            bias = (0.1 * torch.randn(E, generator=gen)).to(device)
            call = (logits, bias, 8, G, tg, True, 2.5)
            ref_w, ref_ids = biased_grouped_topk_native(*call)
            cands = [("native", biased_grouped_topk_native), ("native-compiled", compiled)]
            for impl in op.ranked():
                if impl.name != "native" and not impl.rejects(plat, call, {}):
                    cands.append((impl.name, impl.callable()))
            if not args.no_sweep:
                for bt, nw in SWEEP:
                    w = torch.empty(T, 8, dtype=torch.float32, device=device)
                    ids = torch.empty(T, 8, dtype=torch.int32, device=device)
                    cands.append((f"triton-bt{bt}-w{nw}", lambda w=w, ids=ids, bt=bt, nw=nw: (
                        tri.launch(*call, "sigmoid", 0, w, ids, bt, nw), (w, ids))[1]))
            for label, fn in cands:
                with alloc.poisoned():
                    w, ids = fn(*call) if not label.startswith("triton-bt") else fn()
                same = torch.equal(ids, ref_ids) and torch.allclose(w, ref_w, rtol=1e-5, atol=1e-6)
                ok &= same
                us = time_ms((lambda: fn(*call)) if not label.startswith("triton-bt") else fn, device) * 1e3
                gus = graph_us((lambda: fn(*call)) if not label.startswith("triton-bt") else fn, torch.device("cuda"))
                rows.append(dict(shape=name, T=T, E=E, n_group=G, impl=label, correct=same, us=round(us, 2),
                                 graph_us=round(gus, 2) if gus is not None else None))
                print(f"{name:<5} T={T:<5} E={E:<4} G={G:<2} {label:<18} {'ok ' if same else 'BAD'} "
                      f"{us:9.2f} us   graph {gus if gus is None else round(gus, 2)} us", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=plat.device_name, torch=torch.__version__, rows=rows), f, indent=1)
    print("\n| shape | T | impl | µs (do_bench) | µs (CUDA graph) |\n|---|---:|---|---:|---:|")
    for r in rows:
        if not r["impl"].startswith("triton-bt"):
            print(f"| {r['shape']} E{r['E']} G{r['n_group']} | {r['T']} | {r['impl']} | {r['us']} | {r['graph_us']} |")
    print("all implementations match the native reference" if ok else "MISMATCH against the native reference")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
