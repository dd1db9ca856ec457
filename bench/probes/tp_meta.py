"""Fed: RESULTS.md, 'Session 5 (2026-11-30) ... Tensor parallel, 4 layers, bf16' -- the follow-up to its
"the driver broadcasts metadata each step" (this probe's own figures were not recorded there).

Host cost of the driver's per-step metadata broadcast (tensor parallel), two CPU processes.

    PYTHONPATH=. python bench/probes/tp_meta.py [--batch 64] [--blocks 2] [--n 2000]

A decode step's metadata (tokens, lengths, slots, starts, block tables) sent by rank 0 and
received by rank 1 over the Gloo command group, as a pickled object (broadcast_object_list:
what the driver did before) and as int32 words in one tensor broadcast (StepPlan.to_words ->
Groups.command / next_command -> StepPlan.from_words, what it does now). Microseconds per step,
rank 0's view of the full round (a barrier every 100 steps keeps the sender from running ahead).
"""
from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
from datetime import timedelta


def worker(rank: int, port: int, args) -> None:
    import torch.distributed as dist

    from kernelgate.distributed.group import Groups
    from kernelgate.executor.plan import StepPlan
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=timedelta(seconds=60))
    g = Groups(rank, 2, store, 0)
    B, nb = args.batch, args.blocks
    plan = StepPlan(lengths=[1] * B, slots=list(range(B)), starts=[64 * nb - 8] * B,
                    tables=[list(range(i * nb, (i + 1) * nb)) for i in range(B)], tokens=list(range(B)))
    meta = {"fresh": ([], []), "tokens": plan.tokens, "lengths": plan.lengths, "slots": plan.slots,
            "starts": plan.starts, "tables": plan.tables}
    for kind in ("object", "words") * 2:
        dist.barrier(group=g.cpu)
        t0 = time.perf_counter()
        for i in range(args.n):
            if rank == 0:
                g.broadcast(("step", meta)) if kind == "object" else g.command("step", plan.to_words())
            else:
                g.broadcast() if kind == "object" else StepPlan.from_words(g.next_command()[1])
            if i % 100 == 99:
                dist.barrier(group=g.cpu)
        dist.barrier(group=g.cpu)
        if rank == 0:
            us = 1e6 * (time.perf_counter() - t0) / args.n
            print(f"{kind:>6}: {us:7.1f} us per step (B={B}, {nb} blocks per sequence)", flush=True)
    g.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--blocks", type=int, default=2)
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--rank", type=int, default=-1)
    ap.add_argument("--port", type=int, default=0)
    args = ap.parse_args()
    if args.rank >= 0:
        worker(args.rank, args.port, args)
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = [sys.executable, __file__, "--batch", str(args.batch), "--blocks", str(args.blocks), "--n", str(args.n),
            "--port", str(port)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}   # Gloo ranks on the CPU, also on a GPU host
    peer = subprocess.Popen([*base, "--rank", "1"], env=env)
    subprocess.run([*base, "--rank", "0"], env=env, check=True)
    peer.wait()


if __name__ == "__main__":
    main()
