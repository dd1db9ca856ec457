"""A worker rank (1..N-1): follows the driver's commands until told to exit.

Commands (rank 0's broadcasts on the command group): load a shard, build a model runner, run
a step with the driver's metadata, run a plain forward, report memory, exit. A load, and a
runner build outside its profile step, end with a status gather (an error names its rank;
the group stays usable). A failure while the ranks run model collectives together (a step,
a forward, the runner's profile step) cannot be answered in lockstep: the worker leaves its
last words in the rendezvous store, prints them and exits; the driver's pending collective
fails and it raises with that report (launch.py).

A spawned worker never outlives its driver (it polls its parent) and ignores SIGINT: Ctrl-C
reaches the whole foreground process group, and the driver alone decides what stops.

Fault injection for tests: KERNELGATE_DIST_FAULT="RANK:COMMAND[:N]" makes rank RANK raise on
its N-th (default first) COMMAND (step, forward, load, runner), or with COMMAND `start`, exit
before joining the rendezvous.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time

import torch

from ... import envs
from ...distributed.launch import describe
from ...errors import KernelgateError
from ..plan import StepPlan


class _Fault:
    """KERNELGATE_DIST_FAULT for this rank: (command, n) or nothing."""

    def __init__(self, rank: int):
        self.op, self.left = None, 0
        raw = envs.get("KERNELGATE_DIST_FAULT")
        if not raw:
            return
        parts = raw.split(":")
        try:
            r, op, n = int(parts[0]), parts[1], int(parts[2]) if len(parts) > 2 else 1
        except (IndexError, ValueError):
            raise KernelgateError(f"KERNELGATE_DIST_FAULT={raw!r}: expected RANK:COMMAND[:N]") from None
        if r == rank:
            self.op, self.left = op, n

    def check(self, op: str) -> None:
        if op != self.op:
            return
        self.left -= 1
        if self.left == 0:
            raise KernelgateError(f"injected fault (KERNELGATE_DIST_FAULT) in command {op!r}")


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


def device_stats(groups) -> dict:
    """This rank's device memory: peak and current bytes allocated by torch (None on the CPU),
    and the decode graphs of its last runner: shapes captured, or why it decodes eagerly."""
    device = groups.device
    graphs, off = groups.graph_state
    g = {"graphs": graphs, "graphs_off": off}
    mod = getattr(torch, device.type, None)
    if device.type == "cpu" or not hasattr(mod, "max_memory_allocated"):
        return {"device": str(device), "peak_bytes": None, "allocated_bytes": None, **g}
    return {"device": str(device), "peak_bytes": mod.max_memory_allocated(),
            "allocated_bytes": mod.memory_allocated(), **g}


# commands during which the ranks run model collectives together: a failure cannot be gathered
IN_STEP = ("step", "forward")


class Worker:
    def __init__(self, groups):
        self.g = groups
        self.model = None
        self.runner = None
        self.fault = _Fault(groups.rank)

    def handle(self, op: str, arg):
        from ...models.loader import load_model
        self.fault.check(op)
        if op == "load":
            self.model = self.runner = None
            self.g.graph_state = (0, "no runner yet")
            _release(self.g.device)
            self.model = load_model(arg["path"], device=self.g.device, dtype=arg["dtype"],
                                    par=self.g.parallel(arg["expert_parallel"]), quantization=arg.get("quantization"))
            return None
        if op == "runner":
            from .rank_runner import RankRunner
            self.runner = None
            _release(self.g.device)          # the last engine's cache, before this one measures memory
            self.runner = RankRunner(self.g, self.model, arg)
            return None
        if op == "step":
            self.runner.run(StepPlan.from_words(arg))
            return None
        if op == "forward":
            self.model(arg)
            return None
        if op == "stats":
            return device_stats(self.g)
        if op == "unload":
            self.model = self.runner = None
            return None
        raise KernelgateError(f"distributed worker: unknown command {op!r}")

    def serve(self, errors=None) -> None:
        with torch.inference_mode():
            while True:
                op, arg = self.g.next_command()
                if op == "exit":
                    return
                value = err = None
                try:
                    value = self.handle(op, arg)
                except Exception as e:  # noqa: BLE001 - reported to the driver, with the rank
                    err = describe(e)
                    if op in IN_STEP or getattr(e, "kernelgate_midstep", False):
                        self._die(err, errors)
                if op == "stats":
                    self.g.gather(value)
                elif op in ("load", "runner"):
                    errs = self.g.gather(err)
                    if op == "runner" and not any(errs):
                        self.runner.reconcile()

    def _die(self, err: str, errors) -> None:
        """Out of step with the other ranks: leave the report, exit (the driver names this rank)."""
        if errors is not None:
            errors.put((self.g.rank, err))
        line = err.replace("\n", " | ")
        print(f"kernelgate: rank {self.g.rank}: {line}", file=sys.stderr, flush=True)
        os._exit(1)


def main(argv=None) -> None:
    """Entry point of a spawned worker process: python -m kernelgate.distributed RANK SIZE HOST PORT."""
    import datetime

    import torch.distributed as dist
    rank, size, host, port = (argv or sys.argv[1:])[:4]
    rank, size, port = int(rank), int(size), int(port)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()
    store = dist.TCPStore(host, port, size, is_master=False, timeout=datetime.timedelta(seconds=60))
    errors = _StoreErrors(store)
    try:
        from ...distributed.group import Groups
        if _Fault(rank).op == "start":
            raise KernelgateError("injected fault (KERNELGATE_DIST_FAULT) before the rendezvous")
        store.set(f"kernelgate/ready/{rank}", "1")
        groups = Groups(rank, size, store, rank)
    except Exception as e:  # noqa: BLE001 - a rank that cannot start says why
        errors.put((rank, describe(e)))
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
