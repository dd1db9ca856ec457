"""Benchmark harness: time every implementation of an op that can run on this device.

Device-side timing (Triton's `do_bench`, CUDA/XPU events; wall clock on CPU), medians,
GB/s from each case's declared byte count, and the fraction of measured copy bandwidth.
`torch.compile` of the native reference is timed beside the implementations.
"""
from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch

from .. import platform, registry


def _sync(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize()


def time_ms(fn, device: torch.device, warmup: int = 5, rep_ms: float = 200.0) -> float:
    """Median milliseconds per call."""
    if device.type == "cuda" and not platform.interpreting():
        import triton.testing
        return float(triton.testing.do_bench(fn, warmup=25, rep=int(rep_ms), return_mode="median"))
    for _ in range(warmup):
        fn()
    _sync(device)
    samples, spent = [], 0.0
    while spent < rep_ms / 1e3 or len(samples) < 5:
        t0 = time.perf_counter()
        fn()
        _sync(device)
        dt = time.perf_counter() - t0
        samples.append(dt)
        spent += dt
        if len(samples) >= 1000:
            break
    return statistics.median(samples) * 1e3


def host_us(fn, loops: int = 1000, repeats: int = 7) -> float:
    """Median host µs per call over `repeats` runs of `loops` calls, no device sync: GPU launches
    are asynchronous, and the host-side cost of issuing a call is what dispatch adds."""
    for _ in range(max(10, loops // 10)):
        fn()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(loops):
            fn()
        samples.append((time.perf_counter() - t0) / loops * 1e6)
    return statistics.median(samples)


def graph_us(fn, device: torch.device, calls: int = 20) -> float | None:
    """Device time per call (µs) from replaying `calls` calls captured in one CUDA graph:
    no Python or launch overhead. None where graphs are unavailable or capture fails
    (e.g. a host sync inside `fn`)."""
    if device.type != "cuda" or platform.interpreting():
        return None
    try:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(calls):
                fn()
        ms = time_ms(g.replay, device)
        return ms * 1e3 / calls
    except Exception:  # noqa: BLE001 - not capturable: report eager time only
        torch.cuda.synchronize()
        return None


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30) -> float:
    """Measured device copy bandwidth in GB/s, counting bytes read plus written."""
    if device.type == "cpu":
        nbytes = 1 << 27
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).normal_()
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), device)
    return 2 * nbytes / (ms * 1e-3) / 1e9


def run(op_name: str, device: torch.device | None = None, cases: list[str] | None = None,
        compile_native: bool = True, impls: list[str] | None = None) -> dict:
    op = registry.get(op_name)
    device = device or platform.default_device()
    plat = platform.current()
    bw = copy_bandwidth(device)
    rows = []
    for case in op.bench_cases():
        if cases and case.id not in cases:
            continue
        for dtype in case.dtypes:
            g = torch.Generator().manual_seed(0)
            args, kwargs = case.make(device, dtype, g)
            nbytes = case.bytes(args, kwargs) if case.bytes else None
            candidates = [(i.name, i.provider, i.callable()) for i in op.ranked()
                          if not i.unavailable(plat) and (not impls or i.name in impls)
                          and not (i.supports and i.supports(*args, **kwargs))
                          and (i.dtypes is None or op.dtype_of(args, kwargs) in i.dtypes)]
            if compile_native and device.type != "cpu" and (not impls or "native-compiled" in impls):
                candidates.append(("native-compiled", "torch.compile", torch.compile(op.reference)))
            for name, provider, fn in candidates:
                try:
                    ms = time_ms(lambda: fn(*args, **kwargs), device)
                except Exception as e:  # noqa: BLE001 - report, keep benchmarking the others
                    rows.append(dict(op=op.name, case=case.id, dtype=str(dtype)[6:], impl=name,
                                     provider=provider, error=f"{type(e).__name__}: {e}"[:200]))
                    continue
                row = dict(op=op.name, case=case.id, dtype=str(dtype)[6:], impl=name, provider=provider,
                           ms=round(ms, 5), us=round(ms * 1e3, 2))
                gus = graph_us(lambda: fn(*args, **kwargs), device) if name != "native-compiled" else None
                if gus is not None:
                    row["graph_us"] = round(gus, 2)
                    # small calls are host-bound eagerly; the graph time is the device time
                    ms = min(ms, gus / 1e3)
                    row["ms"] = round(ms, 5)
                if nbytes:
                    gbs = nbytes / (ms * 1e-3) / 1e9
                    row.update(gb_s=round(gbs, 1), frac_copy_bw=round(gbs / bw, 3))
                rows.append(row)
            native = next((r["ms"] for r in rows if r["case"] == case.id and r["impl"] == "native"
                           and r.get("dtype") == str(dtype)[6:] and "ms" in r), None)
            for r in rows:
                if r["case"] == case.id and "ms" in r and native:
                    r["speedup_vs_native"] = round(native / r["ms"], 2)
    return dict(op=op.name, platform=plat.as_dict(), device=str(device),
                torch=torch.__version__, copy_gb_s=round(bw, 1),
                date=time.strftime("%Y-%m-%d"), rows=rows)


def markdown(result: dict) -> str:
    p = result["platform"]
    lines = [f"### {result['op']} — {p.get('device_name') or p['real']}, torch {result['torch']}, "
             f"triton {p['triton']}, {result['date']} (copy bandwidth {result['copy_gb_s']} GB/s)", "",
             "| case | dtype | impl | µs (eager) | µs (CUDA graph) | GB/s | of copy bw | vs native |",
             "|---|---|---|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        if "error" in r:
            lines.append(f"| {r['case']} | {r['dtype']} | {r['impl']} | error: {r['error']} | | | | |")
            continue
        lines.append(f"| {r['case']} | {r['dtype']} | {r['impl']} | {r['us']} | {r.get('graph_us', '')} | {r.get('gb_s', '')} | "
                     f"{r.get('frac_copy_bw', '')} | {r.get('speedup_vs_native', '')} |")
    return "\n".join(lines) + "\n"


def write(result: dict, out_dir: str | Path) -> tuple[Path, Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"{result['op']}-{result['platform']['real']}"
    j, m = out / f"{stem}.json", out / f"{stem}.md"
    j.write_text(json.dumps(result, indent=1))
    m.write_text(markdown(result))
    return j, m
