"""Fed: RESULTS.md, 'Session 14 (2026-12-02) ... Where the time went'.

Where mla_decode's time goes on a GPU (issue 15): the bandwidth the cache's access pattern
allows, without the attention math, and a hardware-counter profile of the real kernel.

    PYTHONPATH=. python bench/probes/mla_decode_probe.py [--ncu]
    ncu --clock-control none --section SpeedOfLight --section MemoryWorkloadAnalysis \
        --section WarpStateStats -k regex:_partial --launch-count 1 python bench/probes/mla_decode_probe.py --ncu

Prints GB/s for (at B64 32k / B1 128k / B1 32k, H=32, R=512, Dr=64, bf16, blocks of 64 in a shuffled
table): torch's sum over the cache (a plain streaming read), a TMA kernel that walks the
table exactly as `_partial_tma_kernel` does and only sums the tiles, and mla_decode itself.
--ncu: launch mla_decode's kernels (each launch choice of interest) a few times, nothing timed.
"""
from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

from kernelgate.tools.benchmark import graph_us, time_ms
from kernelgate.ops.mla import mla_decode_triton as T
from kernelgate.ops.mla.mla_decode import bench_inputs

H, R, DR, BS = 32, 512, 64, 64
SCALE = (R + DR) ** -0.5
CHOICES = {"tma64-w4": dict(keys="tma", block_n=64, num_warps=4, num_stages=2, programs=132),
           "tma16-w4": dict(keys="tma", block_n=16, num_warps=4, num_stages=4, programs=264)}


@triton.jit
def _read_tma(desc_c, desc_r, bt_ptr, out_ptr, s_bt, per, tiles, block_size,
              BLOCK_N: tl.constexpr, RC: tl.constexpr, DRP: tl.constexpr):
    n = tl.program_id(0)
    sp = tl.program_id(1)
    acc = tl.zeros([BLOCK_N, RC], dtype=tl.float32)
    accr = tl.zeros([BLOCK_N, DRP], dtype=tl.float32)
    for i in range(sp * per, tl.minimum(sp * per + per, tiles)):
        t0 = i * BLOCK_N
        b = tl.load(bt_ptr + n.to(tl.int64) * s_bt + t0 // block_size)
        off = t0 % block_size
        acc += tl.reshape(desc_c.load([b, off, 0]), (BLOCK_N, RC)).to(tl.float32)
        acc += tl.reshape(desc_c.load([b, off, RC]), (BLOCK_N, RC)).to(tl.float32)
        accr += tl.reshape(desc_r.load([b, off, 0]), (BLOCK_N, DRP)).to(tl.float32)
    tl.store(out_ptr + n * tl.num_programs(1) + sp, tl.sum(acc) + tl.sum(accr))


def read_tma(cache, table, ctx, bn, programs, stages):
    N = table.shape[0]
    splits = max(1, programs // N)
    tiles = ctx // bn
    per = -(-tiles // splits)
    desc_c, desc_r = T._descriptors(cache, R, DR, bn, 256, DR)
    out = torch.empty(N * splits, device=cache.device, dtype=torch.float32)
    return lambda: _read_tma[(N, splits)](desc_c, desc_r, table, out, table.stride(0), per, tiles, BS,
                                          BLOCK_N=bn, RC=256, DRP=DR, num_warps=4, num_stages=stages)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ncu", action="store_true", help="launch the kernels for a hardware-counter profile, nothing timed")
    ncu = ap.parse_args().ncu
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    dev = torch.device("cuda")
    for B, ctx in ((64, 32768), (1, 131072), (1, 32768)):
        q, cache, table, seq = bench_inputs(B, ctx, dev, torch.bfloat16, H, R, DR, BS)
        nbytes = B * ctx * (R + DR) * 2
        rows = []
        for name, c in CHOICES.items():
            cfg = {**T.config(), **c}
            fn = lambda: T.launch(q, cache, table, seq, SCALE, R, cfg=cfg)  # noqa: E731
            fn()
            if ncu:
                for _ in range(2):
                    fn()
                continue
            rows.append((f"mla_decode {name}", graph_us(fn, dev)))
        if ncu:
            torch.cuda.synchronize()
            continue
        rows.append(("torch sum (streaming read)", time_ms(lambda: cache.sum(dtype=torch.float32), dev) * 1e3))
        for bn, programs, stages in ((64, 132, 2), (64, 264, 2), (16, 264, 4), (64, 132, 3)):
            try:
                rows.append((f"TMA read only, tiles {bn}, {programs} programs, {stages} stages",
                             graph_us(read_tma(cache, table, ctx, bn, programs, stages), dev)))
            except Exception as e:  # noqa: BLE001 - e.g. out of shared memory
                print(f"TMA read {bn}/{programs}/{stages}: {type(e).__name__}: {str(e)[:100]}")
        print(f"\nB{B} ctx {ctx} ({nbytes / 1e9:.2f} GB of latents)\n| what | µs | GB/s |\n|---|---:|---:|")
        for what, us in rows:
            print(f"| {what} | {us:.1f} | {nbytes / us / 1e3:.0f} |")
        del q, cache, table, seq
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
