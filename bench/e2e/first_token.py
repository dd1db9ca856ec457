"""Time to first token of `kernelgate run --model DIR` on a fresh machine and on the second run
(issue 16: second run <= 15 s including model load; first run reported).

    PYTHONPATH=. python bench/e2e/first_token.py --model /tmp/kernelgate-ckpt

Each run is a new process, timed from its start to its exit, generating one token for a short
prompt (so the wall time is the time to the first token, start-up included). The first run
gets an empty KERNELGATE_CACHE_DIR and no TRITON_CACHE_DIR (everything compiles); the second
reuses that cache. The lines kernelgate prints about compiling / loading kernels are shown.
--profile: a third run (warm cache) under cProfile; prints where its seconds go (cumulative,
every call above 0.2 s but the import machinery).
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time


def once(model: str, cache: str, extra: list, profile: str | None = None) -> tuple[float, list]:
    """-> (wall seconds, [(seconds since start, output line)])."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_CACHE_DIR", "TRITON_CACHE_AUTOTUNING")}
    env["KERNELGATE_CACHE_DIR"] = cache
    env["PYTHONUNBUFFERED"] = "1"      # (each line timed when printed, not when a buffer fills)
    prof = ["-m", "cProfile", "-o", profile] if profile else []
    cmd = [sys.executable, *prof, "-m", "kernelgate", "run", "--model", model, "--prompt-ids", "1,2,3,4,5,6,7,8",
           "--max-new-tokens", "1", "--batch", "1", *extra]
    t0 = time.perf_counter()
    lines = []
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    for ln in p.stdout:
        lines.append((time.perf_counter() - t0, ln.rstrip()))
    rc = p.wait()
    wall = time.perf_counter() - t0
    if rc != 0:
        raise SystemExit(f"first_token: {' '.join(cmd)} failed ({rc}):\n" + "\n".join(ln for _, ln in lines[-30:]))
    return wall, lines


def show(path: str, floor_s: float = 0.2, rows: int = 45):
    import pstats
    st = pstats.Stats(path)
    print(f"    profiled: {st.total_tt:.2f} s in Python's main thread")
    skip = ("<frozen importlib", "built-in method builtins.exec", "runpy")
    items = [(ct, f"{os.path.relpath(fn) if 'kernelgate' in fn else fn.split('site-packages/')[-1]}:{ln}({name})", nc)
             for (fn, ln, name), (cc, nc, tt, ct, callers) in st.stats.items()
             if ct >= floor_s and not any(k in f"{fn}{name}" for k in skip)]
    for ct, where, nc in sorted(items, reverse=True)[:rows]:
        print(f"    {ct:7.2f} s  {nc:6d} calls  {where[:130]}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--extra", default="", help="more `kernelgate run` flags, space-separated")
    ap.add_argument("--seed-cache", help="copy this Triton cache folder in before the first run")
    ap.add_argument("--profile", action="store_true", help="a third run under cProfile: where the seconds go")
    args = ap.parse_args(argv)
    extra = args.extra.split()
    with tempfile.TemporaryDirectory(prefix="kg-cache-") as cache:
        if args.seed_cache:          # a cache carried from elsewhere: the "first" run is not a cold one
            shutil.copytree(args.seed_cache, os.path.join(cache, "triton"))
        rows = []
        first = "first run (kernel cache seeded)" if args.seed_cache else "first run (empty kernel cache)"
        for name in (first, "second run (same machine)"):
            wall, lines = once(args.model, cache, extra)
            rows.append((name, wall))
            print(f"{name}: {wall:.1f} s to the first token (process start to exit); its output, timed:", flush=True)
            for t, ln in lines:
                if ln.strip() and not ln.lstrip().startswith(("[", "{")):
                    print(f"    {t:6.1f} s | {ln[:150]}", flush=True)
        if args.profile:
            out = os.path.join(cache, "startup.prof")
            wall, _ = once(args.model, cache, extra, profile=out)
            print(f"\nthird run under cProfile: {wall:.1f} s; cumulative seconds per call (> 0.2 s):")
            show(out)
    print("\n| run | seconds to first token, incl. start-up and model load |\n|---|---:|")
    for name, wall in rows:
        print(f"| {name} | {wall:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
