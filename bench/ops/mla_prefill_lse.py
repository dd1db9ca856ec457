"""Which of torch's lse-returning attention kernels `mla_prefill` (sdpa) should use for its
context pieces: each kernel on the pieces of an 8,192-token chunk (Kimi MLA: H 32, q/k width
192, v width 128, bf16), checked against fp32 math on a slice of the queries, then the whole
op at 32k / 128k of context with each kernel forced.

    PYTHONPATH=. python3 bench/ops/mla_prefill_lse.py
"""
from __future__ import annotations

import argparse

import torch

from kernelgate import forcing, registry
from kernelgate.ops.mla import mla_prefill_sdpa as S
from kernelgate.ops.mla.mla_prefill import make_inputs

H, DQK, DV, N, P = 32, 192, 128, 8192, 16384
R, DR, DN, BS = 512, 64, 128, 64
SCALE = DQK ** -0.5


def time_ms(fn, reps=10):
    fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / reps


def pieces(dev):
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(1, H, N, DQK, device=dev, dtype=torch.bfloat16, generator=g)
    print("| piece | kernel | ms | TFLOP/s | max err o | max err lse |\n|---|---|---:|---:|---:|---:|")
    for label, nk, causal in (("prefix 8192 x 16384", P, False), ("chunk 8192 x 8192 causal", N, True),
                              ("chunk 16384 x 8192 causal (split)", N, True)):
        qq = torch.cat([q, q], 2) if label.startswith("chunk 16384") else q
        k = torch.randn(1, H, nk, DQK, device=dev, dtype=torch.bfloat16, generator=g)
        v = torch.randn(1, H, nk, DV, device=dev, dtype=torch.bfloat16, generator=g)
        sl = slice(nk - 200, nk + 56) if qq.shape[2] > nk else slice(0, 256)
        ro, rl = S._math_lse(qq[:, :, sl], k, v, SCALE, False) if not causal else (None, None)
        if causal:   # top-left causal: query t sees keys 0..t
            full_o, full_l = S._math_lse(qq[:, :, :nk], k, v, SCALE, True)
            rest_o, rest_l = S._math_lse(qq[:, :, nk:], k, v, SCALE, False)
            ro, rl = torch.cat([full_o, rest_o], 2)[:, :, sl], torch.cat([full_l, rest_l], 2)[:, :, sl]
        nq = qq.shape[2]
        pairs = nq * nk - (nk * (nk - 1) // 2 if causal else 0)
        flops = 2 * H * pairs * (DQK + DV)
        for name in S.LSE_KERNELS:
            if name == "cpu_flash":
                continue
            S.FORCE_LSE = name
            try:
                o, lse = S.attend_lse(qq, k, v, SCALE, causal)
                eo = (o[:, :, sl] - ro).abs().max().item()
                el = (lse[:, :, sl] - rl).abs().max().item()
                ms = time_ms(lambda: S.attend_lse(qq, k, v, SCALE, causal))
                print(f"| {label} | {name} | {ms:.2f} | {flops / ms / 1e9:.0f} | {eo:.2e} | {el:.2e} |")
            except Exception as e:  # noqa: BLE001 - a kernel that refuses: say so
                print(f"| {label} | {name} | refused: {type(e).__name__}: {str(e).splitlines()[0][:100]} | | | |")
            finally:
                S.FORCE_LSE = None


def whole_op(dev):
    op = registry.get("mla_prefill")
    g = torch.Generator().manual_seed(0)
    print("\n| chunk | context after | kernel | ms | attention TFLOP/s (expanded form) |\n|---:|---:|---|---:|---:|")
    for L in (32768, 131072):
        args = make_inputs([N], [L], H, R, DR, DN, DV, BS, torch.bfloat16, g, dev)
        flops = 2 * H * N * (L - N / 2) * (DN + DR + DV)
        ref = None
        for name in ("efficient", "flash", "cudnn"):
            S.FORCE_LSE = name
            try:
                with forcing({"mla_prefill": "sdpa"}):
                    out = op(*args, SCALE, DV)
                    ref = out if ref is None else ref
                    err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
                    ms = time_ms(lambda: op(*args, SCALE, DV), reps=5)
                print(f"| {N} | {L} | {name} | {ms:.2f} | {flops / ms / 1e9:.0f} (vs efficient: {err:.1e}) |")
            except Exception as e:  # noqa: BLE001
                print(f"| {N} | {L} | {name} | refused: {type(e).__name__}: {str(e).splitlines()[0][:100]} | |")
            finally:
                S.FORCE_LSE = None


def main() -> int:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA device: this times GPU kernels")
        return 1
    dev = torch.device("cuda")
    pieces(dev)
    whole_op(dev)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
