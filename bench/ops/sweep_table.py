"""Shared by the kernel-variant sweeps (bench/ops/indexer_sweep.py, bench/ops/logits_sweep.py): one
markdown row per variant -- checked against the reference first, then timed on the device."""
from __future__ import annotations

import time

import torch

from kernelgate.tools.benchmark import copy_bandwidth, graph_us, time_ms

HEADER = "| case | variant | µs (graph) | of floor | vs native | check |\n|---|---|---:|---:|---:|---|"


def time_us(fn, dev) -> float:
    """CUDA-graph device time of fn, or do_bench time where it cannot be captured."""
    us = graph_us(fn, dev)
    return us if us is not None else time_ms(fn, dev) * 1e3


def start(what: str):
    """(device, copy bandwidth GB/s) after printing the card line and the table header; None off CUDA."""
    if not torch.cuda.is_available():
        print("needs a CUDA device")
        return None
    dev = torch.device("cuda")
    bw = copy_bandwidth(dev)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, copy bandwidth {bw:.0f} GB/s; {what}")
    print(HEADER)
    return dev, bw


def row(case, name, check, fn, dev, floor_us, native_us=None, deadline=float("inf"), time_inexact=False):
    """check() -> a note (None = "ok") or raises. An AssertionError is a wrong result: the row says
    NOT EXACT and, with time_inexact, is still timed (to show what exactness costs)."""
    if time.time() > deadline:
        print(f"| {case} | {name} | skipped (time) | | | |")
        return
    try:
        note = check() or "ok"
    except AssertionError as e:
        if not time_inexact:
            print(f"| {case} | {name} | FAIL: {str(e)[:90]} | | | |", flush=True)
            return
        note = f"NOT EXACT: {str(e)[:80]}"
    except Exception as e:  # noqa: BLE001 - report the variant, go on with the others
        print(f"| {case} | {name} | FAIL: {type(e).__name__}: {str(e)[:90]} | | | |", flush=True)
        return
    try:
        us = time_us(fn, dev)
    except Exception as e:  # noqa: BLE001
        print(f"| {case} | {name} | FAIL timing: {type(e).__name__}: {str(e)[:80]} | | | |", flush=True)
        return
    vs = f"{native_us / us:.1f}x" if native_us else ""
    print(f"| {case} | {name} | {us:.1f} | {floor_us / us:.3f} | {vs} | {note} |", flush=True)
