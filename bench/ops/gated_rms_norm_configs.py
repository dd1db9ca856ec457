"""Launch-config sweep for the Triton gated RMSNorm at the issue's H200 shapes.

    PYTHONPATH=. python bench/ops/gated_rms_norm_configs.py            # needs a CUDA/ROCm/XPU device

For bf16 1M x 128 and 65536 x 4096 (x, gate, weight -> y): checks the heuristic config
against the native reference, then times it, a sweep of (rows per program, num_warps), and
fla-core's rms_norm_gated, and prints GB/s and the fraction of measured copy bandwidth. If a
swept config beats the heuristic by more than noise, change `config()` in
kernelgate/ops/norm/gated_rms_norm_triton.py accordingly.
"""
from __future__ import annotations

import argparse
import sys

import torch

SHAPES = ((1 << 20, 128), (65536, 4096))


def main() -> int:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    if not torch.accelerator.is_available():
        print("no accelerator here: this sweep times GPU kernels; nothing to do")
        return 0
    import triton


    from kernelgate.tools import benchmark
    from kernelgate.ops.norm.gated_rms_norm import gated_rms_norm_native
    import kernelgate.ops.norm.gated_rms_norm_triton as k
    from kernelgate.tools.testing import rel_err

    device = torch.accelerator.current_accelerator()
    bw = benchmark.copy_bandwidth(device)
    print(f"{torch.cuda.get_device_name() if device.type == 'cuda' else device}, torch {torch.__version__}, "
          f"triton {triton.__version__}, copy bandwidth {bw:.0f} GB/s\n")
    print("| shape | config | µs | GB/s | of copy bw |\n|---|---|---:|---:|---:|")
    heuristic = k.config
    for rows, D in SHAPES:
        x = torch.randn(rows, D, device=device, dtype=torch.bfloat16)
        g = torch.randn(rows, D, device=device, dtype=torch.bfloat16)
        w = torch.randn(D, device=device, dtype=torch.bfloat16)
        nbytes = 3 * x.numel() * x.element_size() + w.numel() * w.element_size()
        err = rel_err(k.gated_rms_norm_triton(x, w, g, 1e-6), gated_rms_norm_native(x, w, g, 1e-6))
        assert err < 1e-2, f"{rows}x{D}: relative error {err:.2e} vs native"

        def row(name, fn):
            ms = benchmark.time_ms(fn, device)
            gbs = nbytes / (ms * 1e-3) / 1e9
            print(f"| {rows}x{D} | {name} | {ms * 1e3:.1f} | {gbs:.0f} | {gbs / bw:.3f} |")

        cfg = heuristic(rows, D)
        row(f"heuristic {cfg}", lambda: k.gated_rms_norm_triton(x, w, g, 1e-6))
        block_n = cfg.get("BLOCK_N", triton.next_power_of_2(D))
        for block_s in sorted({1, 2, 4, 8, 16, 32, 64, 128} & set(range(1, 16384 // block_n + 1))):
            for warps in (2, 4, 8, 16):
                trial = dict(kernel="block", BLOCK_S=block_s, BLOCK_N=block_n, num_warps=warps)
                k.config = lambda n, G, trial=trial: trial  # noqa: E731
                try:
                    row(f"S{block_s} w{warps}", lambda: k.gated_rms_norm_triton(x, w, g, 1e-6))
                finally:
                    k.config = heuristic
        try:
            from fla.modules.norm.fused_norm_gate import rms_norm_gated
            row("fla rms_norm_gated", lambda: rms_norm_gated(x, g, w, None, activation="sigmoid", eps=1e-6))
        except ImportError as e:
            print(f"| {rows}x{D} | fla unavailable: {e} | | | |")
        row("native eager", lambda: gated_rms_norm_native(x, w, g, 1e-6))
    return 0


if __name__ == "__main__":
    sys.exit(main())
