"""Split-KV decode at short contexts under a table sized for a long one (what an engine with a
32k max_model_len runs at every decode step of a short chat): `paged_attention_decode` at
Qwen3.5-MoE's attention shapes (16 query heads on 2 KV heads, head dim 256) and `mla_decode` at
Kimi's (32 heads, latent 512 + rope 64), bf16 caches in blocks of 64, a table of 513 blocks per
sequence (32,832 positions: qwen_e2e.py's full-depth engine), batch 1 / 8 / 64, contexts 80 to 32k.

The split count comes from the table's width, not the lengths (one captured graph fits every
length), so at batch 1 a sequence is cut into hundreds of splits (paged) or 132 (MLA) however
short it is. GPU only. Each launch module's output is checked bitwise against the first's, then
timed in a CUDA graph (µs a call).

    PYTHONPATH=. python bench/ops/split_kv_short.py [--modules paged=M1,M2 mla=M3,M4]

--paged / --mla: comma-separated launch modules to compare (default: the package's), e.g. a copy
of an earlier version on PYTHONPATH.
"""
from __future__ import annotations

import argparse
import importlib

import torch

from kernelgate.tools.benchmark import graph_us

BS, WIDTH = 64, 513
CTXS, BATCHES = (80, 1024, 8192, 32768), (1, 8, 64)


def paged_inputs(N, ctx, dev, g):
    Hq, Hkv, D = 16, 2, 256
    nb = N * WIDTH
    k = torch.randn(nb, BS, Hkv, D, generator=g, device=dev, dtype=torch.bfloat16)
    v = torch.randn(nb, BS, Hkv, D, generator=g, device=dev, dtype=torch.bfloat16)
    table = torch.randperm(nb, generator=g, device=dev).to(torch.int32).view(N, WIDTH)
    q = torch.randn(N, Hq, D, generator=g, device=dev, dtype=torch.bfloat16)
    lens = torch.full((N,), ctx, dtype=torch.int32, device=dev)
    return lambda mod: mod.launch(q, k, v, table, lens, D ** -0.5)


def mla_inputs(N, ctx, dev, g):
    H, R, Dr = 32, 512, 64
    nb = N * WIDTH
    cache = torch.randn(nb, BS, R + Dr, generator=g, device=dev, dtype=torch.bfloat16)
    table = torch.randperm(nb, generator=g, device=dev).to(torch.int32).view(N, WIDTH)
    q = torch.randn(N, H, R + Dr, generator=g, device=dev, dtype=torch.bfloat16)
    lens = torch.full((N,), ctx, dtype=torch.int32, device=dev)
    return lambda mod: mod.launch(q, cache, table, lens, (128 + 64) ** -0.5, R)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--paged", default="kernelgate.ops.attention.paged_attention_decode_triton")
    ap.add_argument("--mla", default="kernelgate.ops.mla.mla_decode_triton")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA device")
        return 1
    dev = torch.device("cuda")
    for op, make, names in (("paged_attention_decode", paged_inputs, a.paged), ("mla_decode", mla_inputs, a.mla)):
        mods = [importlib.import_module(m) for m in names.split(",")]
        print(f"\n{op}: table {WIDTH} x {BS} positions, µs a call (CUDA graph); modules " +
              ", ".join(m.__name__ for m in mods))
        print("| batch | context | " + " | ".join(m.__name__.rsplit(".", 1)[-1] for m in mods) + " |")
        print("|---:|---:|" + "---:|" * len(mods))
        for N in BATCHES:
            for ctx in CTXS:
                g = torch.Generator(device=dev).manual_seed(N * 100003 + ctx)
                run = make(N, ctx, dev, g)
                outs = [run(m) for m in mods]
                first = outs[0]
                for m, o in zip(mods[1:], outs[1:]):
                    assert torch.equal(o, first), f"{op} B{N} ctx {ctx}: {m.__name__} differs from {mods[0].__name__}"
                us = [graph_us(lambda m=m: run(m), dev) for m in mods]
                print(f"| {N} | {ctx:,} | " + " | ".join(f"{u:.1f}" for u in us) + " |", flush=True)
                del run, outs, first
                torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
