"""A worker rank (1..N-1): follows the driver's commands until told to exit.

Commands (broadcast by rank 0 on the metadata group): load a shard, build a model runner,
run a step with the driver's metadata, run a plain forward, exit. Load and runner builds end
with a status gather (an error names its rank); a failure inside a step cannot be answered
in lockstep, so the worker reports it on its error queue and exits: the driver's pending
collective fails and it raises with that report.
"""
from __future__ import annotations

import os
import sys
import threading
import time
import traceback

import torch

from ..platform import KernelgateError


def _describe(e: BaseException) -> str:
    if isinstance(e, KernelgateError):
        return str(e)
    tb = traceback.extract_tb(e.__traceback__)
    where = f" at {tb[-1].filename}:{tb[-1].lineno}" if tb else ""
    return f"{type(e).__name__}: {e}{where}"


def _watch_parent(ppid: int) -> None:
    """A worker never outlives its driver (killed driver: no orphan holding a device)."""
    while True:
        time.sleep(0.5)
        if os.getppid() != ppid:
            os._exit(1)


def _release(device) -> None:
    import gc
    gc.collect()
    mod = getattr(torch, device.type, None)
    if device.type != "cpu" and hasattr(mod, "empty_cache"):
        mod.empty_cache()


def device_stats(device) -> dict:
    """This rank's device memory: peak and current bytes allocated by torch (None on the CPU)."""
    mod = getattr(torch, device.type, None)
    if device.type == "cpu" or not hasattr(mod, "max_memory_allocated"):
        return {"device": str(device), "peak_bytes": None, "allocated_bytes": None}
    return {"device": str(device), "peak_bytes": mod.max_memory_allocated(), "allocated_bytes": mod.memory_allocated()}


class Worker:
    def __init__(self, groups):
        self.g = groups
        self.model = None
        self.runner = None

    def handle(self, op: str, arg):
        from ..models.loader import load_model
        if op == "load":
            self.model = self.runner = None
            _release(self.g.device)
            self.model = load_model(arg["path"], device=self.g.device, dtype=arg["dtype"],
                                    par=self.g.parallel(arg["expert_parallel"]))
            return None
        if op == "runner":
            from ..engine.model_runner import ModelRunner
            self.runner = None
            _release(self.g.device)          # the last engine's cache, before this one measures memory
            self.runner = ModelRunner(self.model, *arg)
            return None
        if op == "step":
            self.runner.run(arg)
            return None
        if op == "forward":
            self.model(arg)
            return None
        if op == "stats":
            return device_stats(self.g.device)
        if op == "unload":
            self.model = self.runner = None
            return None
        raise KernelgateError(f"distributed worker: unknown command {op!r}")

    def serve(self, errors=None) -> None:
        with torch.inference_mode():
            while True:
                op, arg = self.g.broadcast()
                if op == "exit":
                    return
                value = None
                try:
                    value = self.handle(op, arg)
                    err = None
                except Exception as e:  # noqa: BLE001 - reported to the driver, with the rank
                    err = _describe(e)
                if op == "stats":
                    self.g.gather(value)
                elif op in ("load", "runner"):
                    errs = self.g.gather(err)
                    if op == "runner" and not any(errs):
                        from .driver import reconcile
                        reconcile(self.runner, self.g)
                elif err is not None:
                    if errors is not None:
                        errors.put((self.g.rank, err))
                    print(f"kernelgate: rank {self.g.rank}: {err}", file=sys.stderr, flush=True)
                    os._exit(1)


def main(argv=None) -> None:
    """Entry point of a spawned worker process: python -m kernelgate.distributed RANK SIZE HOST PORT."""
    import datetime

    import torch.distributed as dist
    rank, size, host, port = (argv or sys.argv[1:])[:4]
    rank, size, port = int(rank), int(size), int(port)
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()
    store = dist.TCPStore(host, port, size, is_master=False, timeout=datetime.timedelta(seconds=60))
    errors = _StoreErrors(store)
    try:
        from .group import Groups
        store.set(f"kernelgate/ready/{rank}", "1")
        groups = Groups(rank, size, store, rank)
    except Exception as e:  # noqa: BLE001 - a rank that cannot start says why
        errors.put((rank, f"failed to start: {_describe(e)}"))
        os._exit(1)
    Worker(groups).serve(errors)
    os._exit(0)


class _StoreErrors:
    """A worker's last words, left in the rendezvous store for the driver's monitor."""

    def __init__(self, store):
        self.store = store

    def put(self, item) -> None:
        rank, msg = item
        try:
            self.store.set(f"kernelgate/error/{rank}", msg)
        except Exception:  # noqa: BLE001 - the driver is gone too
            pass
