"""Torch's intra-op threads in a process that drives an accelerator for `kernelgate serve`.

torch starts one intra-op thread per core, and its OpenMP threads spin for a while after each
parallel region. A serving engine's host ops are small (block tables, positions, a step's
token lists), so a pool per core buys nothing there, while under a server the pool fights the
API process, the tokenizer and the clients for the same cores: a parallel region waits for its
slowest thread, and a step's host work, queued ahead of the device, falls behind it. Measured
on the H200 machine (16 cores, Kimi 4 layers, 8 x 32k prompts beside 64 streams): served mixed
steps 58.5 ms with the default pool, 34.5 ms with one thread (offline: the same 1.06 s either
way). vLLM sets its workers to one thread for the same reason. OMP_NUM_THREADS, when set,
is the user's choice and is kept; on the CPU the threads do the model's work and are left alone.
"""
from __future__ import annotations

import os

import torch

ENV = "OMP_NUM_THREADS"


def serving_threads(device: torch.device, environ=os.environ) -> int | None:
    """Intra-op threads for a serving process whose model runs on `device`; None: leave torch's."""
    if environ.get(ENV, "").strip():
        return None
    return None if torch.device(device).type == "cpu" else 1


def apply(device: torch.device, log=None) -> int | None:
    """Set this process's intra-op threads (and its children's: tensor-parallel ranks start with
    OMP_NUM_THREADS); -> the count set, or None where left alone."""
    n = serving_threads(device)
    if n is None:
        return None
    os.environ[ENV] = str(n)
    torch.set_num_threads(n)
    if log is not None:
        log(f"{n} torch host thread per process on {torch.device(device).type} (a step's host ops are small; "
            f"a thread per core contends with the server's other processes); {ENV} sets another count")
    return n
