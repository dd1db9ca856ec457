"""Issue 35's served scenario without the server: is the TTFT gap in the engine or around it?

One Engine built as `kernelgate serve` builds it (same flags as bench/e2e/serve_long_prompts.py:
max_num_seqs 72, max_model_len 32,832, prefix cache on, warmed up for every shape) on the
4-layer checkpoint. Three phases, each on fresh prompts (no prefix hits):
  alone   8 prompts of 32,768 tokens, nothing else running (the offline baseline);
  beside  the same count while 64 short streams (128-token prompts) decode;
  alone   again (noise check).
Per phase: time from the adds to the last long prompt's first token, the sum of the steps'
device time (CUDA events, device_spans.py), and the host interval / device time of every step
with the allocator's counters (cudaMalloc / cudaFree calls, retries) so a slow step is named.

    PYTHONPATH=.:bench/e2e python bench/probes/served_mix.py [--model DIR] [--profile] [--kernels]

--kernels: both phases again under the profiler, and the kernels' time beside minus alone, by
kernel name (what a mixed step adds to the prefill it carries).
"""
from __future__ import annotations

import argparse
import cProfile
import gc
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
from device_spans import DeviceSpans  # noqa: E402

COUNTERS = ("num_device_alloc", "num_device_free", "num_alloc_retries", "num_sync_all_streams")


def counters() -> dict:
    s = torch.cuda.memory_stats()
    return {k: s.get(k, 0) for k in COUNTERS}


GC = {"t": None, "s": 0.0, "n": 0}
KERNELS: dict = {}   # phase -> {kernel name: (device ms, launches)} (--kernels)


def _gc(phase_, info):                 # time spent in the garbage collector (gc.callbacks)
    if phase_ == "start":
        GC["t"] = time.perf_counter()
    elif GC["t"] is not None:
        GC["s"] += time.perf_counter() - GC["t"]
        GC["n"] += info["generation"] == 2
        GC["t"] = None


def phase(eng, spans, name, longs, shorts, g, vocab, prof=None, long_len=32768, kineto=False):
    from kernelgate.engine.params import SamplingParams
    greedy = dict(temperature=0.0, stop_token_ids=())
    sid = []
    if shorts:
        for i in range(shorts):
            rid = f"{name}-s{i}"
            eng.add_request(rid, torch.randint(0, vocab, (128,), generator=g).tolist(),
                            SamplingParams(max_new_tokens=min(4096, eng.config.max_model_len - 128), **greedy))
            sid.append(rid)
        for _ in range(40):            # into their decodes
            eng.step()
    torch.cuda.synchronize()
    spans.steps.clear()
    first: dict = {}
    lid = [f"{name}-l{i}" for i in range(longs)]
    rows = []
    if prof:
        prof.enable()
    kp = None
    if kineto:
        from torch.profiler import ProfilerActivity, profile
        kp = profile(activities=[ProfilerActivity.CUDA])
        kp.__enter__()
    GC.update(s=0.0, n=0)
    t_add = time.perf_counter()
    for rid in lid:
        eng.add_request(rid, torch.randint(0, vocab, (long_len,), generator=g).tolist(),
                        SamplingParams(max_new_tokens=16, **greedy))
    t_added = time.perf_counter()
    while len(first) < longs:
        c0, g0, t0 = counters(), GC["s"], time.perf_counter()
        outs = eng.step()
        t1 = time.perf_counter()
        c1 = counters()
        c1["gc_ms"] = (GC["s"] - g0) * 1e3
        st = eng.last_step
        rows.append((st.kind if st else "none", st.tokens if st else 0, st.seqs if st else 0, (t1 - t0) * 1e3,
                     {**{k: c1[k] - c0[k] for k in COUNTERS}, "gc_ms": c1["gc_ms"]}))
        for o in outs:
            if o.request_id in lid and o.new_token_ids and o.request_id not in first:
                first[o.request_id] = t1 - t_add
    if prof:
        prof.disable()
    dev = spans.table()
    if kp is not None:
        torch.cuda.synchronize()
        kp.__exit__(None, None, None)
        ev = [e for e in kp.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        busy = sum(e.time_range.elapsed_us() for e in ev) / 1e3
        print(f"\n{name}: GPU kernels {busy:.1f} ms in {len(ev)} launches over the {len(rows)} steps "
              f"({busy / max(len(rows), 1):.1f} ms per step)")
        print(kp.key_averages().table(sort_by="self_device_time_total", row_limit=18, max_name_column_width=60))
        KERNELS[name] = {}
        for e in ev:                          # per kernel name: (device ms, launches)
            t, n = KERNELS[name].get(e.name, (0.0, 0))
            KERNELS[name][e.name] = (t + e.time_range.elapsed_us() / 1e3, n + 1)
    for rid in sid + lid:
        eng.abort(rid)
    while eng.has_unfinished():
        eng.step()
    torch.cuda.synchronize()
    span = max(first.values())
    dev_ms = sum(ms for _, _, ms in dev)
    print(f"\n### {name}: {longs} x {long_len}{f' beside {shorts} decoding streams' if shorts else ''}")
    print(f"adds took {(t_added - t_add) * 1e3:.1f} ms; last first token at {span:.3f} s; "
          f"p50 TTFT {sorted(first.values())[longs // 2]:.3f} s; steps {len(rows)}, host sum "
          f"{sum(r[3] for r in rows) / 1e3:.3f} s, device sum {dev_ms / 1e3:.3f} s "
          f"({len(dev)} model steps); garbage collector {GC['s'] * 1e3:.1f} ms ({GC['n']} full)", flush=True)
    print("| step | kind | tokens | seqs | host ms | device ms | cudaMalloc | cudaFree | retries | syncs | gc ms |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for i, (kind, tok, seqs, ms, c) in enumerate(rows):
        d = f"{dev[i][2]:.1f}" if i < len(dev) else ""
        print(f"| {i} | {kind} | {tok} | {seqs} | {ms:.1f} | {d} | {c['num_device_alloc']} | {c['num_device_free']} | "
              f"{c['num_alloc_retries']} | {c['num_sync_all_streams']} | {c['gc_ms']:.1f} |")
    return span, dev_ms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="/tmp/kernelgate-ckpt/kimi-4l")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--profile", action="store_true", help="cProfile the host over the 'beside' phase (a 4th run)")
    ap.add_argument("--kernels", action="store_true", help="the GPU's kernel time over the 'beside' phase (a 5th run)")
    ap.add_argument("--decodes-in-budget", action="store_true",
                    help="decode_tokens_in_budget=True (vLLM's policy): chunks take what the decodes leave")
    a = ap.parse_args()
    import kernelgate
    from kernelgate.serving.warmup import warm_up
    if not (Path(a.model) / "config.json").exists():
        from serve_prefix import write_checkpoint
        write_checkpoint(Path(a.model), a.layers)
    model = kernelgate.load_model(a.model)
    print(f"torch threads {torch.get_num_threads()}, cpus {len(__import__('os').sched_getaffinity(0))}", flush=True)
    eng = kernelgate.Engine(model, max_num_seqs=72, max_model_len=32768 + 64,
                            decode_tokens_in_budget=a.decodes_in_budget)
    warm_up(eng, log=lambda m: print(m, flush=True), every_shape=True)
    spans = DeviceSpans(eng)
    gc.callbacks.append(_gc)
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    alone, _ = phase(eng, spans, "alone", 8, 0, g, vocab)
    beside, _ = phase(eng, spans, "beside", 8, 64, g, vocab)
    again, _ = phase(eng, spans, "alone-again", 8, 0, g, vocab)
    print(f"\nbeside / alone: {beside / alone:.2f} (alone again: {again / alone:.2f})")
    if a.profile:
        prof = cProfile.Profile()
        phase(eng, spans, "beside-profiled", 8, 64, g, vocab, prof)
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
        pstats.Stats(prof).sort_stats("cumulative").print_stats("kernelgate|fla|torch/nn", 45)
    if a.kernels:   # the same prompts' kernels alone and beside: what the decodes add, kernel by kernel
        phase(eng, spans, "alone-kernels", 8, 0, g, vocab, kineto=True)
        phase(eng, spans, "beside-kernels", 8, 64, g, vocab, kineto=True)
        al, bs = KERNELS["alone-kernels"], KERNELS["beside-kernels"]
        rows = sorted(set(al) | set(bs), key=lambda k: -abs(bs.get(k, (0, 0))[0] - al.get(k, (0, 0))[0]))
        print(f"\nkernels beside - alone: {sum(t for t, _ in bs.values()) - sum(t for t, _ in al.values()):+.1f} ms")
        print("| kernel | alone ms (launches) | beside ms (launches) | delta ms |\n|---|---:|---:|---:|")
        for k in rows[:25]:
            (ta, na), (tb, nb) = al.get(k, (0.0, 0)), bs.get(k, (0.0, 0))
            print(f"| {k[:90]} | {ta:.1f} ({na}) | {tb:.1f} ({nb}) | {tb - ta:+.1f} |")
    eng.close()


if __name__ == "__main__":
    main()
