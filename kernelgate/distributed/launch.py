"""Start the worker ranks and watch them.

`Workers.spawn(n)`: this process becomes rank 0 (the driver); ranks 1..n-1 are fresh
interpreters (`python -m <the caller's rank module>`, kernelgate.executor.parallel) that rendezvous on a TCPStore at a free
port of 127.0.0.1. `Workers.from_env()`: a torchrun-style launch (RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR, MASTER_PORT); ranks > 0 serve the driver and exit with it.

A monitor thread watches the spawned processes: a rank that exits is recorded with its
cause (its own report, or its exit code / signal). The driver's next collective then fails
(Gloo: the peer's sockets close) and `failure()` turns that into one error naming the rank;
where a collective would hang instead (a device backend waits for its peer), the monitor
ends the job itself after a grace period, with the same message.

The driver's own failure while the ranks run a command together (`lockstep()`: a step, a
forward, the profile step of a runner) leaves the other ranks inside a collective that rank 0
will never join: the group cannot be resynchronised, so it is torn down (workers killed,
process group aborted) and the error names rank 0 and the cause. Under torchrun, where the
driver cannot kill its peers, their collective timeout (KERNELGATE_DIST_TIMEOUT) ends them.
"""
from __future__ import annotations

import atexit
import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from ..errors import KernelgateError
from .group import Groups, check_world_size, collective_timeout, nccl_env

START_TIMEOUT_S = 120.0      # all ranks must join by then (a rank that dies says so at once)
GRACE_S = 10.0               # a dead rank not surfaced by the driver by then ends the job


def describe(e: BaseException) -> str:
    """One line of what went wrong: a KernelgateError's message, else type, message and where."""
    if isinstance(e, KernelgateError):
        return str(e)
    tb = traceback.extract_tb(e.__traceback__)
    where = f" at {tb[-1].filename}:{tb[-1].lineno}" if tb else ""
    return f"{type(e).__name__}: {e}{where}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cause(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


def one_line(text: str) -> str:
    return re.sub(r"\s*\n\s*", " | ", str(text).strip())


def _from_collective(e: BaseException) -> bool:
    """Whether `e` was raised inside torch.distributed (a peer gone, a timeout), not by our code."""
    if isinstance(e, getattr(dist, "DistError", ())):
        return True
    tb = e.__traceback__
    last = None
    while tb is not None:
        last = tb.tb_frame.f_code.co_filename
        tb = tb.tb_next
    return last is not None and f"torch{os.sep}distributed{os.sep}" in last


class Workers:
    def __init__(self, groups: Groups | None, procs: list, store, size: int):
        self.groups, self.procs, self.store = groups, procs, store
        self.size = size
        self.failed: tuple | None = None       # (rank, what happened to it)
        self.surfaced = False
        self.closed = False
        self.owner = None                      # the ParallelModel whose shard the ranks hold
        if procs:
            threading.Thread(target=self._monitor, daemon=True).start()
        atexit.register(self.close)

    # ---- start
    @classmethod
    def spawn(cls, size: int, module: str) -> "Workers":
        """module: what each rank runs (`python -m module RANK SIZE HOST PORT`)."""
        check_world_size(size)
        collective_timeout()                     # a bad KERNELGATE_DIST_TIMEOUT: an error before any process starts
        nccl_env()
        host, port = "127.0.0.1", _free_port()
        store = dist.TCPStore(host, port, size, is_master=True, wait_for_workers=False,
                              timeout=timedelta(seconds=START_TIMEOUT_S))
        # a fresh interpreter per rank (not multiprocessing's spawn: that re-runs the caller's __main__)
        root = str(Path(__file__).resolve().parents[2])
        env = {**os.environ,
               "PYTHONPATH": os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])])}
        procs = [subprocess.Popen([sys.executable, "-m", module, str(r), str(size), host,
                                   str(port)], env=env) for r in range(1, size)]
        t0 = time.monotonic()
        for r, p in enumerate(procs, start=1):     # wait for each rank, or its death
            while not store.check([f"kernelgate/ready/{r}"]):
                if p.poll() is not None:
                    msg = one_line(_report(store, r) or _cause(p.returncode))
                    _kill(procs)
                    raise KernelgateError(f"tensor parallel: rank {r} of {size} failed to start: {msg}")
                if time.monotonic() - t0 > START_TIMEOUT_S:
                    _kill(procs)
                    raise KernelgateError(f"tensor parallel: rank {r} of {size} did not start within {START_TIMEOUT_S:.0f} s")
                time.sleep(0.02)
        # watched from here on: a rank dying in the rendezvous ends the job. The monitor reads the
        # workers' reports through its own store connection (the driver's may be blocked in a wait)
        monitor_store = dist.TCPStore(host, port, size, is_master=False, timeout=timedelta(seconds=10))
        w = cls(None, procs, monitor_store, size)
        try:
            w.groups = Groups(0, size, store, 0)
        except Exception as e:  # noqa: BLE001
            w.closed = True
            _kill(procs)
            raise KernelgateError(f"tensor parallel: process group did not form: {type(e).__name__}: {e}") from None
        return w

    @classmethod
    def from_env(cls, serve) -> "Workers":
        """torchrun: every rank runs the caller's script; ranks > 0 run serve(groups) (they follow
        rank 0's commands), then exit."""
        rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local = int(os.environ.get("LOCAL_RANK", rank))
        groups = Groups(rank, size, None, local)
        if rank != 0:
            serve(groups)
            sys.exit(0)
        return cls(groups, [], None, size)

    # ---- faults
    def _monitor(self) -> None:
        while not self.closed:
            for r, p in enumerate(self.procs, start=1):
                if p.poll() is not None and not self.closed:
                    time.sleep(0.05)         # its last words may still be on the way
                    report = _report(self.store, r)
                    if self.failed is None:
                        self.failed = (r, f"died ({_cause(p.returncode)}" + (f": {one_line(report)})" if report else ")"))
                    deadline = time.monotonic() + GRACE_S
                    while time.monotonic() < deadline and not self.surfaced:
                        time.sleep(0.05)
                    if not self.surfaced:
                        print(f"kernelgate: {self.message()}; ending the job", file=sys.stderr, flush=True)
                        _kill(self.procs)
                        os._exit(1)
                    return
            time.sleep(0.1)

    def message(self) -> str:
        r, what = self.failed
        return f"tensor parallel: rank {r} of {self.size} {what}"

    def failure(self, e: BaseException) -> KernelgateError:
        """The error to raise for a collective that failed with `e`: names the dead rank if any.
        The group is torn down either way (a failed collective leaves the ranks out of step)."""
        timed_out = re.search(r"timed? ?out", str(e), re.IGNORECASE) is not None
        # a peer's death closes its sockets a moment before its exit status shows: wait for the monitor
        deadline = time.monotonic() + (0.0 if timed_out else 2.0)
        while self.failed is None and time.monotonic() < deadline and self.procs:
            time.sleep(0.05)
        if self.failed is None:
            if timed_out and self.groups is not None:
                what = f"timed out after {self.groups.timeout_s:g} s (KERNELGATE_DIST_TIMEOUT): a peer is stuck"
            else:
                what = f"failed: {one_line(describe(e))}"
            self.failed = (0, f"(the driver): a collective {what}; the other ranks were stopped")
        self.abandon()
        return KernelgateError(self.message())

    @contextlib.contextmanager
    def lockstep(self, what: str):
        """The driver's part of a command every rank runs with model collectives: any failure
        here ends the group (the other ranks may be waiting inside a collective)."""
        try:
            yield
        except KernelgateError as e:
            if self.closed and self.failed is not None:
                raise                                # already surfaced (a nested lockstep)
            self._driver_failed(e, what)
            raise KernelgateError(self.message()) from None
        except Exception as e:  # noqa: BLE001
            if _from_collective(e):
                raise self.failure(e) from None
            self._driver_failed(e, what)
            raise KernelgateError(self.message()) from None
        except BaseException:                        # KeyboardInterrupt, SystemExit: stop the ranks, re-raise
            self.abandon()
            raise

    def _driver_failed(self, e: BaseException, what: str) -> None:
        if self.failed is None:
            cause = one_line(describe(e))
            self.failed = (0, f"(the driver) failed during {what}: {cause}; the other ranks were stopped")
        self.abandon()

    def abandon(self) -> None:
        """After a fault: stop every rank; this group cannot be used again."""
        self.surfaced = True
        self.closed = True
        _kill(self.procs)
        _forget(self, abort=True)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            if self.groups is not None:
                self.groups.command("exit")
        except Exception:  # noqa: BLE001 - a rank already gone
            pass
        for p in self.procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        _kill(self.procs)
        _forget(self)


def _report(store, rank: int) -> str | None:
    key = f"kernelgate/error/{rank}"
    try:
        return store.get(key).decode() if store is not None and store.check([key]) else None
    except Exception:  # noqa: BLE001
        return None


def _kill(procs) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
    for p in procs:
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass


_live: dict = {}


def _forget(w: Workers, abort: bool = False) -> None:
    if _live.get("workers") is w:
        del _live["workers"]
    try:
        if w.groups is not None:
            w.groups.abort() if abort else w.groups.close()
    except Exception:  # noqa: BLE001
        pass


def workers(size: int, module: str, serve) -> Workers:
    """The process's worker group of `size` ranks (one per process: torch.distributed has one
    default group); reused across models and engines, replaced when the size changes. Spawned
    ranks run `python -m module`; under torchrun, ranks > 0 run serve(groups)."""
    w = _live.get("workers")
    if w is not None and w.size == size and not w.closed:
        return w
    if w is not None:
        w.close()
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_PORT" in os.environ:
        if int(os.environ["WORLD_SIZE"]) != size:
            raise KernelgateError(f"tensor_parallel_size {size} != WORLD_SIZE {os.environ['WORLD_SIZE']} of the launcher")
        w = Workers.from_env(serve)
    else:
        w = Workers.spawn(size, module)
    _live["workers"] = w
    return w
