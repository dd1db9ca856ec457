"""`kernelgate serve` in its own process, `kernelgate bench serve` in another (issue 19's c64 and
c1 figures as a user would measure them), vs offline `kernelgate.generate()` on the same
checkpoint in this process afterwards.

    PYTHONPATH=. python bench/e2e/serve_separate.py --model /tmp/kernelgate-ckpt/kimi-4l
    ... --repeat 3                      # three c64 / c1 runs per server, medians
    ... --platform xpu                  # dispatch as on an Intel GPU (simulated: Triton everywhere)
    ... --engine process thread   # one server run each: the engine in its own process (default) / on a thread
    ... --delay-factors 0,0.5           # one server run each, with --scheduler-delay-factor F
    ... --variants none,max-num-batched-tokens=2048   # one server run each, with those flags
    ... --trace                         # the server at log level debug: each c64 run's timeline
                                        # (arrivals, steps, idle), and the offline run profiled

Targets: c64 output tok/s >= 0.85 x offline b64; c1 ITL p50 <= 1.3 x the offline batch-1 decode step.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))   # the repo root


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bench(base: str, conc: int, num: int, a) -> dict:
    out = subprocess.run([sys.executable, "-m", "kernelgate", "bench", "serve", "--base-url", base, "--json",
                          "--num-prompts", str(num), "--max-concurrency", str(conc), "--input-len", str(a.input_len),
                          "--output-len", str(a.output_len), "--seed", "0"],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="checkpoint folder (default: the built-in tiny model, for a dry run)")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--engine", nargs="*", choices=["process", "thread"], default=["process"],
                    help="one server run per value: the engine in its own process, or on a server thread")
    ap.add_argument("--delay-factors", default="0",
                    help="comma list; one server run per value, with --scheduler-delay-factor F")
    ap.add_argument("--variants", default="none",
                    help="comma list; one server run per value: 'none' or `kernelgate serve` flags without their "
                         "dashes, '+'-joined (max-num-batched-tokens=2048+scheduler-delay-factor=0.5)")
    ap.add_argument("--no-offline", action="store_true")
    ap.add_argument("--repeat", type=int, default=1, help="c64 and c1 runs per server (medians reported)")
    ap.add_argument("--trace", action="store_true", help="timeline of each c64 run from the server's debug log; "
                    "offline: one more x64 run under cProfile")
    ap.add_argument("--platform", help="simulate a platform's dispatch (server and offline), e.g. xpu: Triton everywhere")
    a = ap.parse_args()
    if a.platform:
        os.environ["KERNELGATE_PLATFORM"] = a.platform   # the server inherits it; offline reads it at first dispatch
    rows = [((mode, f"{extra} {v}".strip()), serve(a, mode, f"{extra} {v}".strip())) for mode in a.engine
            for extra in (f"--scheduler-delay-factor {f}" if float(f) else "" for f in a.delay_factors.split(","))
            for v in ("" if v == "none" else " ".join("--" + f for f in v.split("+")) for v in a.variants.split(","))]
    if not a.no_offline:
        off, step1 = offline(a)
    for (si, extra), res in rows:
        c = a.concurrency
        print(f"\nkernelgate serve{' --platform ' + a.platform if a.platform else ''}{' ' + extra if extra else ''}, "
              f"engine in {'its own process' if si == 'process' else 'a server thread'}")
        print("| metric | value | target |\n|---|---:|---|")
        if not a.no_offline:
            print(f"| offline generate() b{c} output tok/s | {off:,.0f} | |\n"
                  f"| served c{c} output tok/s | {res['cN_tok_s']:,.0f} ({res['cN_tok_s'] / off:.2f} x offline) | >= 0.85 x |\n"
                  f"| offline decode step b1 ms | {step1 * 1e3:.2f} | |\n"
                  f"| c1 ITL p50 ms | {res['c1_itl_p50_ms']:.2f} ({res['c1_itl_p50_ms'] / (step1 * 1e3):.2f} x) | <= 1.3 x |")
        print(f"| c{c} output tok/s | {res['cN_tok_s']:,.0f} | |\n"
              f"| c{c} TTFT p50 / ITL p50 ms | {res['cN_ttft_p50_ms']:.1f} / {res['cN_itl_p50_ms']:.2f} | |\n"
              f"| c1 TTFT p50 ms | {res['c1_ttft_p50_ms']:.1f} | <= 30 |\n"
              + (f"| c1 ITL p50 ms | {res['c1_itl_p50_ms']:.2f} | |\n" if a.no_offline else "") +
              f"| failed requests | {res['failed']} | 0 |\n"
              f"| server process start to healthy | {res['server_ready_s']:.1f} s | |")


def serve(a, mode="process", extra="") -> dict:
    """Start `kernelgate serve` in its own process, run the client against it, stop it."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    t0 = time.perf_counter()
    argv = ["kernelgate", "serve", *(["--model", a.model] if a.model else []), "--port", str(port),
            "--max-num-seqs", str(a.concurrency)]
    if mode == "thread":
        argv.append("--no-engine-process")
    argv += extra.split()
    if a.trace:
        argv += ["--log-level", "debug"]
    # the server's log to a file: a pipe nobody reads would block the server once it fills
    log_path = f"/tmp/kernelgate-serve-{mode}-{port}.log"
    logf = open(log_path, "w")
    srv = subprocess.Popen([sys.executable, "-m", *argv], stdout=logf, stderr=subprocess.STDOUT, text=True)
    res = {}
    try:
        while True:
            try:
                urllib.request.urlopen(f"{base}/health", timeout=2)
                break
            except OSError:
                if srv.poll() is not None:
                    raise SystemExit("server exited:\n" + open(log_path).read()[-3000:])
                if time.perf_counter() - t0 > 300:
                    raise SystemExit("server not healthy within 300 s")
                time.sleep(0.5)
        res["server_ready_s"] = time.perf_counter() - t0
        print(f"server healthy after {res['server_ready_s']:.1f} s", flush=True)
        bench(base, 8, 16, a)                                   # warm-up of the HTTP path and batch sizes
        runs, ones = [], []
        for _ in range(a.repeat):              # the same server: c64 varies run to run by +-0.1 x
            before = steps(base)
            runs.append(bench(base, a.concurrency, 2 * a.concurrency, a))
            after = steps(base)
            print(f"engine steps during a c{a.concurrency} run (from /metrics): "
                  f"{runs[-1]['output_throughput']:,.0f} tok/s\n| kind | steps | tokens | seconds | mean ms |\n"
                  "|---|---:|---:|---:|---:|")
            for kind in sorted(after):
                n, tok, sec = (after[kind][i] - before.get(kind, (0, 0, 0))[i] for i in range(3))
                if n:
                    print(f"| {kind} | {n:.0f} | {tok:.0f} | {sec:.3f} | {sec / n * 1e3:.2f} |")
            ones.append(bench(base, 1, 16, a))

        def med(rs, key):
            return statistics.median(r[key] for r in rs)
        if a.repeat > 1:
            print(f"c{a.concurrency} output tok/s per run: " + ", ".join(f"{r['output_throughput']:,.0f}" for r in runs)
                  + "; c1 ITL p50 ms per run: " + ", ".join(f"{r['median_itl_ms']:.2f}" for r in ones) + " (medians below)")
        res.update(cN_tok_s=med(runs, "output_throughput"), cN_ttft_p50_ms=med(runs, "median_ttft_ms"),
                   cN_itl_p50_ms=med(runs, "median_itl_ms"), c1_ttft_p50_ms=med(ones, "median_ttft_ms"),
                   c1_itl_p50_ms=med(ones, "median_itl_ms"), failed=sum(r["failed"] for r in runs + ones))
    finally:
        srv.terminate()
        try:
            srv.wait(30)
        except subprocess.TimeoutExpired:
            srv.kill()
        logf.close()
        # what the server said of its start-up and of slow steps (kernels met during the run)
        said = [ln.rstrip() for ln in open(log_path) if "kernelgate serve:" in ln or " took " in ln]
        print(f"server log ({log_path}):\n  " + "\n  ".join(said[-20:]), flush=True)
        if a.trace:
            timeline(log_path, a.concurrency)
    return res


def timeline(log_path: str, conc: int) -> None:
    """Each run of 2 x conc requests in the server's debug log: when its requests reached the
    server, the engine steps (every non-decode step listed, decode steps summed) and the time
    the engine loop stood idle between steps."""
    import re
    adds, steps_ = [], []
    for ln in open(log_path):
        if m := re.search(r"kernelgate add: t=([\d.]+)", ln):
            adds.append(float(m.group(1)))
        elif m := re.search(r"kernelgate step: t=([\d.]+) adds=(\d+) kind=(\w+) tokens=(\d+) seqs=(\d+) dt=([\d.]+)", ln):
            steps_.append((float(m.group(1)), int(m.group(2)), m.group(3), int(m.group(4)), int(m.group(5)),
                           float(m.group(6))))
    runs, cur = [], []
    for t in sorted(adds):                         # runs: arrivals separated by > 0.3 s of none
        if cur and t - cur[-1] > 1.0:       # (a bench client takes > 1 s to start)
            runs.append(cur)
            cur = []
        cur.append(t)
    runs.append(cur)
    for k, r in enumerate(runs):
        if len(r) != 2 * conc:
            continue
        t0, t1 = r[0], runs[k + 1][0] if k + 1 < len(runs) else float("inf")
        ss = [s for s in steps_ if t0 - 0.01 <= s[0] < t1]
        while ss and ss[-1][2] == "none":
            ss.pop()
        waves = [r[:conc], r[conc:]]
        print(f"c{conc} run timeline (ms from its first arrival; {len(ss)} steps):")
        for i, w in enumerate(waves):
            print(f"  wave {i + 1}: arrivals {(w[0] - t0) * 1e3:.1f} .. {(w[-1] - t0) * 1e3:.1f} "
                  f"(half by {(w[len(w) // 2] - t0) * 1e3:.1f})")
        idle = sum(max(0.0, b[0] - (a[0] + a[5])) for a, b in zip(ss, ss[1:]))
        dec = [s for s in ss if s[2] == "decode"]
        print(f"  busy {sum(s[5] for s in ss) * 1e3:.1f} ms, idle {idle * 1e3:.1f} ms, run "
              f"{(ss[-1][0] + ss[-1][5] - t0) * 1e3:.1f} ms; decode steps {len(dec)} "
              f"({sum(s[5] for s in dec) * 1e3:.1f} ms, seqs {min(s[4] for s in dec)}-{max(s[4] for s in dec)})")
        print("  | t ms | kind | tokens | seqs | adds before | ms | idle before ms |")
        prev_end = None
        for s in ss:
            gap = 0.0 if prev_end is None else s[0] - prev_end
            if s[2] != "decode" or gap > 2e-3 or s[1]:
                print(f"  | {(s[0] - t0) * 1e3:.1f} | {s[2]} | {s[3]} | {s[4]} | {s[1]} | {s[5] * 1e3:.2f} | "
                      f"{gap * 1e3:.2f} |")
            prev_end = s[0] + s[5]


def steps(base: str) -> dict:
    """{step kind: (steps, tokens, seconds)} so far, from the server's /metrics."""
    from prometheus_client.parser import text_string_to_metric_families
    text = urllib.request.urlopen(f"{base}/metrics", timeout=10).read().decode()
    out: dict = {}
    for fam in text_string_to_metric_families(text):
        for smp in fam.samples:
            kind = smp.labels.get("kind")
            i = {"kernelgate:engine_step_seconds_count": 0, "kernelgate:engine_step_tokens_total": 1,
                 "kernelgate:engine_step_seconds_sum": 2}.get(smp.name)
            if kind is not None and i is not None:
                out.setdefault(kind, [0.0, 0.0, 0.0])[i] = smp.value
    return out


def offline(a) -> tuple[float, float]:
    """(output tok/s of generate() at --concurrency, median decode step at batch 1 in s)."""
    import random

    import kernelgate
    from kernelgate.engine import Engine
    from kernelgate.serving.drive import Timing
    if a.model:
        model = kernelgate.load_model(a.model)
    else:
        from kernelgate.cli.model import builtin_model
        model = builtin_model()
    V = model.config.vocab_size
    rng = random.Random(0)
    prompts = [[rng.randrange(V) for _ in range(a.input_len)] for _ in range(a.concurrency)]
    engine = Engine(model, max_num_seqs=a.concurrency, max_model_len=a.input_len + a.output_len + 16)

    def run(ps):
        t = Timing()
        t0 = time.perf_counter()
        out = kernelgate.generate(model, ps, max_new_tokens=a.output_len, stop_token_ids=[], engine=engine, timing=t)
        wall = time.perf_counter() - t0
        steps = [dt for kind, _, dt in t.steps if kind == "decode"]
        other = [(kind, round(dt * 1e3, 1)) for kind, _, dt in t.steps if kind != "decode"]
        print(f"offline generate() x{len(ps)}: {wall:.3f} s, {len(steps)} decode steps (median "
              f"{statistics.median(steps) * 1e3:.2f} ms, max {max(steps) * 1e3:.1f} ms, sum {sum(steps):.3f} s), "
              f"other steps (kind, ms): {other}", flush=True)
        return sum(len(r.token_ids) for r in out) / wall, statistics.median(steps[1:] or steps)
    for n in (1, 8, a.concurrency):
        run(prompts[:n])
    tok_s, _ = run(prompts)
    _, step1 = run(prompts[:1])
    if a.trace:
        import cProfile
        import pstats
        prof = cProfile.Profile()
        prof.enable()
        run(prompts)
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(14)
    engine.close()
    return tok_s, step1


if __name__ == "__main__":
    main()
