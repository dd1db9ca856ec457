"""Where a Kimi Linear step spends its time: synchronizing calls (with their source lines) and
the top device kernels of one decode step (batch 1 and 64) and one 8k-token prefill, for
kernelgate's kernel path and HF transformers on the same weights (bench/e2e/kimi_e2e.py's model).

    PYTHONPATH=. python bench/e2e/kimi_profile.py [--layers 4] [--batches 1,64] [--prefill 8192]
    PYTHONPATH=. python bench/e2e/kimi_profile.py --qwen --mixed 64x128+0   # the Gated DeltaNet family
                                                      # (qwen_e2e.py's Qwen3.5-MoE widths, random weights, no HF)
    PYTHONPATH=. python bench/e2e/kimi_profile.py --quantization fp8 --batches 1 --prefill 0   # FP8 weights
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
import warnings

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kimi_e2e as e2e  # noqa: E402
from device_spans import DeviceSpans  # noqa: E402


def sync_sites(fn):
    """Unique (file:line) sites of synchronizing CUDA calls made by fn()."""
    sites = {}
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as ws:
            warnings.simplefilter("always")
            orig = warnings.showwarning

            def hook(message, category, filename, lineno, file=None, line=None):
                stack = [f"{f.filename.split('/work/main/')[-1]}:{f.lineno}"
                         for f in traceback.extract_stack()[:-1]
                         if "kernelgate" in f.filename or "bench/" in f.filename]
                key = " < ".join(reversed(stack[-3:])) or f"{filename}:{lineno}"
                sites[key] = sites.get(key, 0) + 1
            warnings.showwarning = hook
            fn()
            torch.cuda.synchronize()
            for w in ws:
                hook(w.message, w.category, w.filename, w.lineno)
            warnings.showwarning = orig
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return sites


def kernels(fn, title, top=18, warm=True):
    if warm:
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) * 1e6
    ev = prof.key_averages()
    dev = sum(e.self_device_time_total for e in ev)
    print(f"\n### {title}: wall {wall:.0f} us (profiled), device busy {dev:.0f} us")
    print("| kernel / op | calls | device us | cpu us |\n|---|---:|---:|---:|")
    for e in sorted(ev, key=lambda e: -e.self_device_time_total)[:top]:
        print(f"| {e.key[:90]} | {e.count} | {e.self_device_time_total:.0f} | {e.cpu_time_total:.0f} |")
    print(f"host: the {min(top, 12)} ops of most own CPU time\n| op | calls | own cpu us |\n|---|---:|---:|")
    for e in sorted(ev, key=lambda e: -e.self_cpu_time_total)[:min(top, 12)]:
        print(f"| {e.key[:90]} | {e.count} | {e.self_cpu_time_total:.0f} |")
    syncs = [e for e in ev if "Synchronize" in e.key or "Memcpy" in e.key]
    print("sync/copy api calls: " + ", ".join(f"{e.key} x{e.count} ({e.cpu_time_total:.0f} us)" for e in syncs))


def host_profile(fn, title, top=22):
    """fn() under cProfile: the functions of most own host time, and kernelgate's of most total."""
    import cProfile
    import pstats
    pr = cProfile.Profile()
    t0 = time.perf_counter()
    pr.enable()
    fn()
    pr.disable()
    torch.cuda.synchronize()
    st = pstats.Stats(pr)
    print(f"\n### host: {title}: {(time.perf_counter() - t0) * 1e3:.1f} ms (under cProfile)")
    rows = sorted(st.stats.items(), key=lambda kv: -kv[1][2])[:top]
    print("| function | calls | own ms | total ms |\n|---|---:|---:|---:|")
    for (f, line, name), (_, calls, own, total, _) in rows:
        print(f"| {f.split('/')[-1]}:{line}({name}) | {calls} | {own * 1e3:.2f} | {total * 1e3:.2f} |")
    ours = sorted(((k, v) for k, v in st.stats.items() if "kernelgate" in k[0]), key=lambda kv: -kv[1][3])[:top]
    print("| kernelgate function | calls | own ms | total ms |\n|---|---:|---:|---:|")
    for (f, line, name), (_, calls, own, total, _) in ours:
        print(f"| {f.split('kernelgate/')[-1]}:{line}({name}) | {calls} | {own * 1e3:.2f} | {total * 1e3:.2f} |")


def tail(model, spec, top, warm=False):
    """The step that ends a long prompt: its last TAIL tokens after CTX cached ones, beside RUNNING
    decoding streams (what a served long prompt's last chunk looks like), against the chunk steps
    before it; budget 8,192, prefix cache off (no snapshot splits)."""
    from kernelgate.engine import SamplingParams
    ctx, n_tail, running = (int(x) for x in spec.split("+"))
    budget = 8192
    per = budget - running
    L = (ctx // per) * per + n_tail
    from kernelgate.engine import Engine
    sched = Engine(model, max_num_seqs=running + 1, max_model_len=max(L, 528) + 8, max_num_batched_tokens=budget,
                   block_size=64, num_cache_blocks=(running + 1) * -(-(max(L, 528) + 8) // 64),
                   enable_prefix_caching=False)
    if warm:   # as a server starts: every step size and a multi-chunk prompt met before the timed steps
        from kernelgate.serving.warmup import warm_up
        warm_up(sched, log=lambda m: None, every_shape=True)
    g = torch.Generator().manual_seed(3)
    for i in range(running):
        sched.add_request(f"r{i}", torch.randint(0, 1000, (128,), generator=g).tolist(),
                          SamplingParams(max_new_tokens=400))
    for _ in range(6):
        sched.step()
    sched.add_request("long", torch.randint(0, 1000, (L,), generator=g).tolist(), SamplingParams(max_new_tokens=4))
    times = []
    for i in range(ctx // per):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        if i == 2:   # a chunk in the middle of the prompt, profiled (its time includes the profiler's)
            kernels(sched.step, f"chunk step {per} tokens after {i * per} + {running} decodes", top, warm=False)
        elif i == 3:  # and the next one's synchronizing calls (each stops the host running ahead)
            print("syncs in a chunk step: " + "; ".join(f"{k} x{v}" for k, v in sync_sites(sched.step).items()))
        elif i == 1:  # where the host's time goes (Python functions, cProfile: its overhead included)
            host_profile(sched.step, f"chunk step {per} tokens after {i * per} + {running} decodes")
        else:
            sched.step()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    print(f"\n## chunk steps of {per} tokens beside {running} decodes (ms, each reads the step before): "
          + ", ".join(f"{t:.1f}" for t in times))
    # and as the engine runs them (async: host work overlapping the device), their device time
    if not torch.cuda.is_available():
        return
    sched.add_request("long2", torch.randint(0, 1000, (L,), generator=g).tolist(), SamplingParams(max_new_tokens=4))
    spans = DeviceSpans(sched)
    t0 = time.perf_counter()
    for _ in range(ctx // per + 8):          # (the first long prompt's last decodes, then all of long2's chunks)
        sched.step()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) * 1e3
    tab = spans.table()
    print(f"## the same prompt again, async: {wall:.1f} ms for {len(tab)} steps; device ms per step: "
          + ", ".join(f"{k[0]}{n}:{ms:.1f}" for k, n, ms in tab))
    kernels(lambda: (sched.step(), sched.step()), f"tail step {n_tail} tokens after {L - n_tail} + {running} decodes, "
            "and the step after it", top, warm=False)


def mixed(model, spec, top):
    """One step of NEW fresh prompts joining RUNNING decoding requests (what a server's step
    looks like when a wave of requests arrives), timed and profiled (the second such wave)."""
    from kernelgate.engine import SamplingParams
    new, rest = spec.split("x")
    length, running = (int(x) for x in rest.split("+"))
    new = int(new)
    # (the budget a wave's step needs: the engine warms its eager steps up to the budget)
    sched = e2e._engine(model, running + 3 * new, length + 200, budget=new * length + running)
    g = torch.Generator().manual_seed(2)

    def add(n, tag):
        for i in range(n):
            sched.add_request(f"{tag}{i}", torch.randint(0, 1000, (length,), generator=g).tolist(),
                              SamplingParams(max_new_tokens=150))
    add(running, "r")
    for _ in range(6 if running else 0):
        sched.step()
    for wave in range(2):
        add(new, f"w{wave}-")
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        sched.step()                       # queues the mixed step (reads the decode step before it)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        kind = sched.last_step.kind
        sched.step()                       # queues a decode step, reads the mixed one
        torch.cuda.synchronize()
        print(f"\n## {kind} step ({new} x {length} new + {running} decoding): {(t1 - t0) * 1e3:.2f} ms; "
              f"the step after it {(time.perf_counter() - t1) * 1e3:.2f} ms (unprofiled, wave {wave})")
        for _ in range(3):
            sched.step()
    add(new, "w2-")
    kernels(lambda: (sched.step(), sched.step()), f"mixed step {new}x{length}+{running} and a decode step",
            top, warm=False)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--prefill", type=int, default=8192, help="prompt tokens of the profiled prefill (0: none)")
    ap.add_argument("--hf", action="store_true", help="also profile HF transformers")
    ap.add_argument("--qwen", action="store_true", help="Qwen3.5-MoE at real width (random weights) instead of Kimi")
    ap.add_argument("--tiny", action="store_true", help="smoke run of this script on the CPU")
    ap.add_argument("--quantization", choices=("bf16", "fp8"), default=None,
                    help="Kimi at real width from seeded random weights (no HF model) in bf16 or 128x128 block FP8 "
                         "(quantized as built), e.g. to see which FP8 kernels a decode step spends its time in")
    ap.add_argument("--top", type=int, default=18, help="kernels listed per profile")
    ap.add_argument("--tail", default="", metavar="CTX+TAIL+RUNNING",
                    help="also profile the step that ends a long prompt (its last TAIL tokens after about CTX) "
                         "beside RUNNING decodes, e.g. 32768+67+64")
    ap.add_argument("--warm", action="store_true", help="--tail: warm the engine up first, as `kernelgate serve` does")
    ap.add_argument("--mixed", default="", metavar="NEWxLEN+RUNNING",
                    help="also profile a mixed step: NEW prompts of LEN tokens joining RUNNING decodes (e.g. 32x128+32; "
                         "comma-separated for several)")
    a = ap.parse_args()
    from kernelgate.engine import SamplingParams
    from kernelgate.models.batch import StepBatch
    dev, dtype = torch.device("cpu" if a.tiny else "cuda"), torch.bfloat16
    if a.tiny:   # no CUDA: the helpers below only need these to be no-ops
        torch.cuda.synchronize = lambda: None
        torch.cuda.set_sync_debug_mode = lambda mode: None
    if a.qwen:
        import qwen_e2e
        from kernelgate.models import Qwen3NextConfig
        from kernelgate.models.qwen3_next import build
        hf, a.hf = None, False
        d = {**qwen_e2e.hf_config(a.layers, a.tiny).to_dict(), **({"vocab_size": 1024} if a.tiny else {})}
        ours = build(Qwen3NextConfig.from_dict(d), dev, dtype, seed=0)
    elif a.quantization:
        from fp8_decode import config_for
        from kernelgate.models import build
        hf, a.hf = None, False
        ours = build(config_for(a.layers, a.tiny), dev, dtype, seed=0,
                     quantization=None if a.quantization == "bf16" else a.quantization)
    else:
        hf = e2e.hf_model(a.layers, dev, dtype, a.tiny)
        ours = e2e.kernelgate_model(hf, dev, dtype)
    for b in [int(x) for x in a.batches.split(",") if x]:
        sched = e2e._engine(ours, b, 200)
        g = torch.Generator().manual_seed(1)
        for i in range(b):   # distinct prompts: one shared prompt would route every token to the same experts
            sched.add_request(str(i), torch.randint(0, 1000, (64,), generator=g).tolist(),
                              SamplingParams(max_new_tokens=100))
        sched.step()
        for _ in range(3):
            sched.step()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(10):
            sched.step()
        torch.cuda.synchronize()
        print(f"\n## decode b{b}: {(time.perf_counter() - t0) / 10 * 1e3:.2f} ms/step (scheduler, unprofiled)")
        sites = sync_sites(sched.step)
        print("syncs in one step: " + "; ".join(f"{k} x{v}" for k, v in sites.items()))
        kernels(sched.step, f"decode b{b} step", a.top)
    for spec in filter(None, a.mixed.split(",")):
        mixed(ours, spec, a.top)
    for spec in filter(None, a.tail.split(",")):
        tail(ours, spec, a.top, a.warm)
    if not a.prefill:
        return
    nb = -(-a.prefill // 64)
    cache = ours.new_cache(1, nb, 64)
    ids = torch.randint(0, 1000, (a.prefill,), device=dev)

    def prefill():
        cache.clear([0], list(range(nb)))
        ours.step(ids, StepBatch.build([a.prefill], [0], [0], dev, [list(range(nb))], 64), cache)
    prefill()
    print("\nsyncs in one prefill: " + "; ".join(f"{k} x{v}" for k, v in sync_sites(prefill).items()))
    kernels(prefill, f"prefill {a.prefill}", a.top)
    if a.hf:
        hids = ids[None]
        with torch.no_grad():
            kernels(lambda: hf(input_ids=hids, logits_to_keep=1), f"HF prefill {a.prefill}")


if __name__ == "__main__":
    main()
