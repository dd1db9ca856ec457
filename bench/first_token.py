"""Time to first token of `kernelgate run --model DIR` on a fresh machine and on the second run
(issue 16: second run <= 15 s including model load; first run reported).

    PYTHONPATH=. python bench/first_token.py --model /tmp/kernelgate-ckpt

Each run is a new process, timed from its start to its exit, generating one token for a short
prompt (so the wall time is the time to the first token, start-up included). The first run
gets an empty KERNELGATE_CACHE_DIR and no TRITON_CACHE_DIR (everything compiles); the second
reuses that cache. The lines kernelgate prints about compiling / loading kernels are shown.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time


def once(model: str, cache: str, extra: list) -> tuple[float, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_CACHE_DIR", "TRITON_CACHE_AUTOTUNING")}
    env["KERNELGATE_CACHE_DIR"] = cache
    cmd = [sys.executable, "-m", "kernelgate", "run", "--model", model, "--prompt-ids", "1,2,3,4,5,6,7,8",
           "--max-new-tokens", "1", "--batch", "1", "--json", *extra]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise SystemExit(f"first_token: {' '.join(cmd)} failed ({p.returncode}):\n{p.stderr[-2000:]}")
    return wall, p.stderr


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--extra", default="", help="more `kernelgate run` flags, space-separated")
    args = ap.parse_args(argv)
    extra = args.extra.split()
    with tempfile.TemporaryDirectory(prefix="kg-cache-") as cache:
        rows = []
        for name in ("first run (empty kernel cache)", "second run (same machine)"):
            wall, err = once(args.model, cache, extra)
            said = [ln.strip() for ln in err.splitlines() if "kernel" in ln.lower() or "load" in ln.lower()][:6]
            rows.append((name, wall, said))
            print(f"{name}: {wall:.1f} s to the first token (process start to exit)", flush=True)
            for ln in said:
                print(f"    | {ln}", flush=True)
    print("\n| run | seconds to first token, incl. start-up and model load |\n|---|---:|")
    for name, wall, _ in rows:
        print(f"| {name} | {wall:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
