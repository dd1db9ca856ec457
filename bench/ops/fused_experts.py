"""fused_experts at Kimi Linear shapes (D=2304, I=1024, E=256, k=8, bf16, uniform routing):
correctness of every implementation against the native reference first, then a table of
time, fraction of the weight-bandwidth floor (bytes of the distinct experts hit, read once,
over measured copy bandwidth) and speedup over native.

    PYTHONPATH=. python bench/ops/fused_experts.py [--T 1 64 512] [--json out.json]

Targets (issue 6, H200): >= 0.6 of the floor at T=64, >= 5x native at every T.
"""
from __future__ import annotations

import argparse
import json
import sys


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--T", type=int, nargs="+", default=[1, 64, 512])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    import torch

    from kernelgate import platform, registry
    from kernelgate.tools import benchmark
    from kernelgate.ops.moe.fused_experts import _bytes, make_inputs
    from kernelgate.tools.testing import rel_err

    device = platform.default_device()
    if device.type == "cpu":
        print("fused_experts bench: needs a GPU (Kimi shapes are too large for the CPU interpreter)")
        return 0
    op = registry.get("fused_experts")
    plat = platform.current()
    bw = benchmark.copy_bandwidth(device)
    print(f"{plat.device_name}, torch {torch.__version__}, copy bandwidth {bw:.0f} GB/s")
    rows, ok = [], True
    for T in args.T:
        gen = torch.Generator(device=device).manual_seed(0)
        call_args, kw = make_inputs(T, 2304, 1024, 256, 8, torch.bfloat16, device, gen)
        nbytes = _bytes(call_args, kw)
        hit = int(torch.unique(call_args[4]).numel())
        ref = op.reference(*call_args, **kw)
        native_ms = None
        for impl in op.ranked():
            why = impl.rejects(plat, call_args, kw, forced=True)
            if why:
                print(f"T={T} {impl.name}: skipped ({why})")
                continue
            fn = impl.callable()
            err = rel_err(fn(*call_args, **kw).float(), ref.float())
            if err > 2e-2:
                ok = False
                print(f"T={T} {impl.name}: WRONG, relative error {err:.3e}")
                continue
            ms = benchmark.time_ms(lambda: fn(*call_args, **kw), device)
            native_ms = ms if impl.name == "native" else native_ms
            rows.append(dict(T=T, impl=impl.name, experts_hit=hit, us=round(ms * 1e3, 1), rel_err=err,
                             floor_frac=round(nbytes / (ms * 1e-3) / 1e9 / bw, 3)))
        for r in rows:
            if r["T"] == T and native_ms:
                r["vs_native"] = round(native_ms * 1e3 / r["us"], 1)
    print("\n| T | experts hit | impl | µs | of weight-bw floor | vs native | rel err |")
    print("|---:|---:|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['T']} | {r['experts_hit']} | {r['impl']} | {r['us']} | {r['floor_frac']} | "
              f"{r.get('vs_native', '')} | {r['rel_err']:.1e} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=plat.device_name, torch=torch.__version__, copy_gb_s=bw, rows=rows), f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
