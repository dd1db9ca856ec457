"""What an eager (prefill / mixed) step costs a warmed server, and why: the engine gets the
server's warm-up, then takes waves of new prompts -- some waves repeat one token count, the
others bring a new count each time (as a server's steps do) -- and each step's wall time is
split into the host's launch time and the wait for the device. A micro-benchmark beside it
times one bf16 GEMM's host cost for a repeated and for a new M (cuBLAS chooses a kernel per
shape).

    PYTHONPATH=. python bench/e2e/eager_steps.py [--layers 4] [--waves 6] [--profile]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch


def gemm_host_cost(device, reps: int = 50) -> list:
    """Host microseconds of one F.linear [M, 2304] x [2304, 12288]^T, M repeated vs M new each call."""
    w = torch.randn(12288, 2304, device=device, dtype=torch.bfloat16)
    x = torch.randn(8192, 2304, device=device, dtype=torch.bfloat16)
    rows = []
    for label, ms in (("same M (384)", [384] * reps), ("new M each call (385..)", list(range(385, 385 + reps)))):
        torch.nn.functional.linear(x[:ms[0]], w)
        torch.cuda.synchronize()
        host = []
        for m in ms:
            t0 = time.perf_counter()
            torch.nn.functional.linear(x[:m], w)
            host.append((time.perf_counter() - t0) * 1e6)
            torch.cuda.synchronize()
        rows.append((label, statistics.median(host), max(host)))
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--waves", type=int, default=6)
    ap.add_argument("--new", type=int, default=3, help="new prompts per wave")
    ap.add_argument("--length", type=int, default=128)
    ap.add_argument("--running", type=int, default=0, help="requests decoding while each wave arrives")
    ap.add_argument("--profile", action="store_true", help="profile the last wave (host ops table)")
    ap.add_argument("--tiny", action="store_true")
    a = ap.parse_args()
    from kernelgate.engine import Engine, SamplingParams
    from kernelgate.serving.warmup import warm_up
    from kernelgate.models import build, real_width, tiny
    dev = torch.device("cpu" if a.tiny else "cuda")
    if a.tiny:   # no CUDA: the helpers below only need these to be no-ops
        torch.cuda.synchronize = lambda: None
        torch.cuda.set_sync_debug_mode = lambda mode: None
    cfg = tiny() if a.tiny else real_width(a.layers)
    model = build(cfg, dev, torch.bfloat16)
    eng = Engine(model, max_num_seqs=128, max_model_len=2048, max_num_batched_tokens=8192, block_size=64,
                 num_cache_blocks=128 * 32)
    t0 = time.perf_counter()
    warm_up(eng, log=lambda s: print("warm-up:", s), every_shape=not a.tiny)
    print(f"warm-up {time.perf_counter() - t0:.1f} s")
    g = torch.Generator().manual_seed(0)
    vocab = cfg.vocab_size

    def prompt(n):
        return torch.randint(0, vocab, (n,), generator=g).tolist()
    for i in range(a.running):
        eng.add_request(f"r{i}", prompt(a.length), SamplingParams(max_new_tokens=2048 - a.length - 8))
    for _ in range(4 if a.running else 0):
        eng.step()

    def wave(tag, lengths):
        for i, n in enumerate(lengths):
            eng.add_request(f"{tag}-{i}", prompt(n), SamplingParams(max_new_tokens=2))
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        eng.step()                              # launches this wave's step (reads the one before)
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        st = eng.last_step
        for _ in range(3):
            eng.step()
        return st, (t1 - t0) * 1e3, (t2 - t0) * 1e3

    print("\n| wave | step | tokens | host launch ms | launch + device ms |\n|---|---|---:|---:|---:|")
    for w in range(a.waves):
        same = w % 2 == 0
        lengths = [a.length] * a.new if same else [a.length + 1 + w + i for i in range(a.new)]
        st, launch, total = wave(f"w{w}", lengths)
        print(f"| {w} ({'repeated count' if same else 'new count'}) | {st.kind} | {st.tokens} | {launch:.2f} | {total:.2f} |")
    if a.profile:
        import cProfile
        import os
        import pstats
        import sys
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from kimi_profile import sync_sites
        sites = sync_sites(lambda: wave("sync", [a.length] * a.new))
        print("\nsyncs in a repeated-count wave: " + "; ".join(f"{k} x{v}" for k, v in sites.items()))
        prof = cProfile.Profile()
        prof.runcall(wave, "cprof", [a.length] * a.new)
        print("\nPython functions of a repeated-count wave, by cumulative time (cProfile):")
        pstats.Stats(prof).sort_stats("cumulative").print_stats(r"kernelgate|fla|triton", 30)
        prof = cProfile.Profile()
        prof.runcall(wave, "cprof2", [a.length] * a.new)
        print("\nthe same, by own time:")
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    if a.profile and not a.tiny:
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            wave("prof", [a.length + 97 + i for i in range(a.new)])
        ev = prof.key_averages()
        print("\nhost: ops of most own CPU time (a wave of a new count)\n| op | calls | own cpu us |\n|---|---:|---:|")
        for e in sorted(ev, key=lambda e: -e.self_cpu_time_total)[:15]:
            print(f"| {e.key[:80]} | {e.count} | {e.self_cpu_time_total:.0f} |")
    if not a.tiny:
        print("\n| one GEMM's host cost | median us | max us |\n|---|---:|---:|")
        for label, med, mx in gemm_host_cost(dev):
            print(f"| {label} | {med:.1f} | {mx:.1f} |")


if __name__ == "__main__":
    main()
