"""The serving path without a model: how many streamed tokens per second the HTTP server and
`kernelgate bench serve` carry, and which process runs out of CPU first.

A stand-in engine (tests/helpers/fake_engine.py, in an engine process as under `kernelgate serve`)
gives every running request one token per step and sleeps --step-ms per step, like a GPU step
with nothing to compute. The real app (kernelgate.server) runs on uvicorn in a child process;
`kernelgate bench serve` loads it at --concurrency. Printed: output tok/s against the stand-in's
ceiling (concurrency / step), and the CPU share each process used during the run.

    PYTHONPATH=. python bench/e2e/serve_http_path.py --concurrency 64 --step-ms 3.7
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # the repo root
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests", "helpers"))


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except OSError:
        return []


def server_main(port: int, slots: int, step_ms: float) -> None:
    import uvicorn

    import fake_engine
    from kernelgate.serving.async_engine import AsyncEngine
    from kernelgate.serving.core_process import EngineProcess
    from kernelgate.server.app import create_app
    from kernelgate.server.jobs import ModelInfo
    from kernelgate.server.metrics import Metrics
    from kernelgate.text.byte_tokenizer import ByteTokenizer
    tok = ByteTokenizer()
    core = EngineProcess(fake_engine.build, None, {"vocab": tok.vocab_size, "slots": slots,
                                                   "step_s": step_ms / 1e3}).spawn()
    core.ready()
    metrics = Metrics("fake")
    app = create_app(AsyncEngine(core, observer=metrics).start(), ModelInfo("fake", tok, 4096, tok.vocab_size, []),
                     metrics)
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--step-ms", type=float, default=3.7)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--client-processes", type=int)
    ap.add_argument("--serve", type=int, help=argparse.SUPPRESS)   # internal: run the server on this port
    a = ap.parse_args()
    if a.serve:
        return server_main(a.serve, a.concurrency, a.step_ms)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    srv = subprocess.Popen([sys.executable, __file__, "--serve", str(port), "--concurrency", str(a.concurrency),
                            "--step-ms", str(a.step_ms)])
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(240):
            try:
                urllib.request.urlopen(f"{base}/health", timeout=2)
                break
            except OSError:
                time.sleep(0.25)
        engine_pid = children(srv.pid)
        cmd = [sys.executable, "-m", "kernelgate", "bench", "serve", "--base-url", base, "--json", "--seed", "0",
               "--num-prompts", str(a.num_prompts), "--max-concurrency", str(a.concurrency), "--input-len", "128",
               "--output-len", str(a.output_len)]
        if a.client_processes:
            cmd += ["--client-processes", str(a.client_processes)]
        s0 = {p: cpu_s(p) for p in [srv.pid, *engine_pid]}
        t0 = time.perf_counter()
        cli = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, cwd=ROOT)
        c_cpu = 0.0
        while cli.poll() is None:
            try:
                c_cpu = sum(cpu_s(p) for p in [cli.pid, *children(cli.pid)])
            except OSError:
                pass
            time.sleep(0.05)
        wall = time.perf_counter() - t0
        res = json.loads(cli.stdout.read().strip().splitlines()[-1])
        used = {p: cpu_s(p) - s0[p] for p in s0}
    finally:
        srv.terminate()
        srv.wait(30)
    ceiling = a.concurrency / (a.step_ms / 1e3)
    print("| c | step ms | output tok/s | ceiling | ratio | TTFT p50 ms | ITL p50 ms | server CPU | engine CPU | "
          "client CPU |\n|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    eng = sum(v for p, v in used.items() if p != srv.pid)
    print(f"| {a.concurrency} | {a.step_ms} | {res['output_throughput']:,.0f} | {ceiling:,.0f} | "
          f"{res['output_throughput'] / ceiling:.2f} | {res['median_ttft_ms']:.1f} | {res['median_itl_ms']:.2f} | "
          f"{used[srv.pid] / wall:.0%} | {eng / wall:.0%} | {c_cpu / wall:.0%} (failed {res['failed']}) |")


if __name__ == "__main__":
    main()
