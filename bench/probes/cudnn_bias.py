"""Probe (GPU): can cuDNN's attention take a prefix piece of unplanned key length, padded to a
planned length with the padded keys masked by an additive bias (-inf), and what does it cost
against FlashAttention-2 on the unpadded piece (what mla_prefill does today) and against the
planned piece without a bias? Kimi's MLA widths (32 heads, qk 192, v 128), bf16, 8,192 queries.

    PYTHONPATH=. python bench/probes/cudnn_bias.py
"""
from __future__ import annotations

import statistics

import torch

from kernelgate.ops.mla import mla_prefill_sdpa as m


def timed(fn, n=20):
    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(n):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3)
    return statistics.median(ts)


def cudnn_bias(q, k, v, scale, bias):
    out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, bias, True, 0.0, False, False,
                                                                  scale=scale)[:2]
    return out.float(), lse.reshape(q.shape[:3]).float()


def main():
    torch.manual_seed(0)
    H, Dqk, Dv, nq, scale = 32, 192, 128, 8192, 192 ** -0.5
    dev, dt = "cuda", torch.bfloat16
    print("| keys (real) | padded to | form | µs | max rel err o | max abs err lse |\n|---:|---:|---|---:|---:|---:|")
    for real in (8064, 6000, 2100):
        pad_to = 8192
        q = torch.randn(1, H, nq, Dqk, device=dev, dtype=dt)
        k = torch.randn(1, H, real, Dqk, device=dev, dtype=dt)
        v = torch.randn(1, H, real, Dv, device=dev, dtype=dt)
        ro, rl = m._math_lse(q, k, v, scale, False)
        kp = torch.nn.functional.pad(k, (0, 0, 0, pad_to - real))
        vp = torch.nn.functional.pad(v, (0, 0, 0, pad_to - real))
        row = torch.zeros(pad_to, device=dev, dtype=dt)
        row[real:] = float("-inf")
        forms = {
            "flash, unpadded (today)": (lambda: m._lse_flash(q, k, v, scale, False)),
            "cudnn, bias [1,1,1,nk] expanded": (lambda: cudnn_bias(q, kp, vp, scale, row.view(1, 1, 1, -1).expand(1, H, nq, -1))),
            "cudnn, bias [1,1,nq,nk]": (lambda: cudnn_bias(q, kp, vp, scale, row.view(1, 1, 1, -1).expand(1, 1, nq, -1).contiguous())),
            "cudnn, no bias, full planned piece (cost only)": (lambda: m._lse_cudnn(q, kp, vp, scale, False)),
        }
        for name, fn in forms.items():
            try:
                o, lse = fn()
                us = timed(fn)
            except Exception as e:  # noqa: BLE001 - a refusal is the answer
                print(f"| {real} | {pad_to} | {name} | refused: {type(e).__name__}: {str(e).splitlines()[0][:100]} | | |")
                continue
            err = ((o - ro).abs().max() / ro.abs().max()).item()
            lerr = (lse - rl).abs().max().item()
            print(f"| {real} | {pad_to} | {name} | {us:.0f} | {err:.2e} | {lerr:.2e} |", flush=True)


if __name__ == "__main__":
    main()
