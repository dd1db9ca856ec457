"""Dispatch overhead: a registry call vs a direct call of the implementation it picked.

    PYTHONPATH=. python bench/ops/dispatch_overhead.py [--loops 2000] [--repeats 30]

Rows (µs per call, median of `repeats` timed loops of `loops` calls each):
- gated_rms_norm on a tiny input through `kernelgate.ops` vs the chosen implementation called
  directly (on a GPU that is the Triton kernel; on a CPU without TRITON_INTERPRET, native);
- a throwaway op whose implementation returns its input, so the difference is pure dispatch;
- for reference, torch.library.custom_op around the same native function (what the issue
  compares against: torch's own custom-op dispatch, 7-11 µs).
Correctness is checked first: the registry call must return what the direct call returns.
"""
from __future__ import annotations

import argparse
import sys

import torch

from kernelgate.tools.benchmark import host_us


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--loops", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args(argv)

    from kernelgate import ops, platform, registry
    from kernelgate.ops.norm.gated_rms_norm import gated_rms_norm_native

    device = platform.default_device()
    if device.type != "cpu":
        torch.accelerator.synchronize()
    op = registry.get("gated_rms_norm")
    x = torch.randn(4, 64, device=device)
    w = torch.randn(64, device=device)
    g = torch.randn(4, 64, device=device)
    call = (x, w, g)
    kw = dict(eps=1e-6)

    impl = op.select(call, kw)
    direct = impl.callable()
    torch.testing.assert_close(ops.gated_rms_norm(*call, **kw), direct(*call, **kw), rtol=0, atol=0)
    torch.testing.assert_close(direct(*call, **kw), gated_rms_norm_native(*call, **kw),
                               rtol=1e-5, atol=1e-5)

    # A throwaway op whose implementation does nothing: the difference is the dispatch alone.
    def ident(x, y, scale=1.0):
        return x
    probe = registry.declare("_dispatch_probe", ident)
    try:
        assert probe(x, w, scale=2.0) is x
        rows = [
            ("gated_rms_norm via registry", host_us(lambda: ops.gated_rms_norm(*call, **kw), args.loops, args.repeats)),
            (f"gated_rms_norm direct ({impl.name})", host_us(lambda: direct(*call, **kw), args.loops, args.repeats)),
            ("no-op op via registry", host_us(lambda: probe(x, w, scale=2.0), args.loops, args.repeats)),
            ("no-op function direct", host_us(lambda: ident(x, w, scale=2.0), args.loops, args.repeats)),
        ]
    finally:
        registry.OPS.pop("_dispatch_probe", None)
        registry._plan.pop("_dispatch_probe", None)

    try:
        @torch.library.custom_op("kernelgate_bench::gated_rms_norm", mutates_args=())
        def custom(x: torch.Tensor, w: torch.Tensor, g: torch.Tensor, eps: float) -> torch.Tensor:
            return gated_rms_norm_native(x, w, g, eps)
        torch.testing.assert_close(custom(x, w, g, 1e-6), gated_rms_norm_native(x, w, g, 1e-6))
        rows += [
            ("gated_rms_norm native via torch.library.custom_op", host_us(lambda: custom(x, w, g, 1e-6), args.loops, args.repeats)),
            ("gated_rms_norm native direct", host_us(lambda: gated_rms_norm_native(x, w, g, 1e-6), args.loops, args.repeats)),
        ]
    except Exception as e:  # noqa: BLE001 - older torch without custom_op: report and go on
        print(f"torch.library.custom_op unavailable: {type(e).__name__}: {e}", file=sys.stderr)

    t = dict(rows)
    print(f"device {device}, platform {platform.current().name}, torch {torch.__version__}, "
          f"chosen gated_rms_norm implementation: {impl.name}\n")
    print(f"| {'what':<52} | µs/call |")
    print(f"|{'-' * 54}|--------:|")
    for name, us in rows:
        print(f"| {name:<52} | {us:7.2f} |")
    print()
    print(f"registry overhead, gated_rms_norm: {t['gated_rms_norm via registry'] - t[f'gated_rms_norm direct ({impl.name})']:.2f} µs")
    print(f"registry overhead, no-op op:       {t['no-op op via registry'] - t['no-op function direct']:.2f} µs"
          "   <- dispatch alone (the rows above also carry the kernel's own run-to-run variance)")
    if "gated_rms_norm native via torch.library.custom_op" in t:
        print(f"torch.library.custom_op overhead:  "
              f"{t['gated_rms_norm native via torch.library.custom_op'] - t['gated_rms_norm native direct']:.2f} µs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
