"""The engine in a process of its own (vLLM V1's split of the engine core from the API server).

`kernelgate serve` answers HTTP, renders chat templates, detokenizes and writes stream
chunks in Python; on one interpreter that work and the engine's per-step host work share one
GIL, and the steps slow down under many streams. Here the engine loop (`core_loop.run_loop`)
runs in a child process: commands go to it over a pipe as they come, and it sends back one
message per step (admissions, outputs, gauges: messages.py).

    proc = EngineProcess(build, args)      # build(*args) -> (engine, info), run in the child
    info = proc.spawn().ready()            # returns once the engine is built and warm
    AsyncEngine(proc, ...).start()         # the front end drives it like a local engine

The child is started with "spawn" (no inherited CUDA or thread state). It ignores SIGINT (a
terminal's Ctrl-C reaches the whole process group; the server drains and tells the engine
when to exit, or ends it while it still loads) and exits on its own when the pipe closes,
i.e. when the server process is gone. A child that dies makes the front end fail every request and report the engine dead,
with its exit code.
"""
from __future__ import annotations

import atexit
import multiprocessing as mp
import signal
import threading

from ..errors import KernelgateError
from .messages import Dead, Exit, Ready, StartFailed, pack, unpack


class EngineProcess:
    def __init__(self, build, *args):
        self.build, self.args = build, args
        self.proc = None
        self.conn = None
        self._send_lock = threading.Lock()
        self._reader: threading.Thread | None = None

    def spawn(self) -> EngineProcess:
        """Start the child, which builds the engine (`ready` waits for it)."""
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        self.proc = ctx.Process(target=_child_main, args=(child, self.build, self.args),
                                name="kernelgate-engine", daemon=False)   # its own children: TP ranks
        # the child ignores SIGINT from its first instruction (a disposition it inherits), not only
        # once its imports are done: Ctrl-C reaches the whole process group
        main = threading.current_thread() is threading.main_thread()
        before = signal.signal(signal.SIGINT, signal.SIG_IGN) if main else None
        try:
            self.proc.start()
        finally:
            if main:
                signal.signal(signal.SIGINT, before)
        child.close()
        self.conn = parent
        atexit.register(self._at_exit)   # before multiprocessing's own exit hook joins the child
        return self

    def ready(self):
        """Wait until the child's engine is built and warm; returns the builder's `info`.
        A child that fails to build raises KernelgateError with its message."""
        try:
            msg = unpack(self.conn.recv())
        except (EOFError, OSError):
            self.proc.join(5)
            raise KernelgateError(f"serve: the engine process exited with rc {self.proc.exitcode} "
                                  "before it was ready (see the log above)") from None
        except BaseException:
            self.stop()
            raise
        if not isinstance(msg, Ready):
            self.stop()
            raise KernelgateError(msg.message)
        return msg.info

    # ---- the core interface of AsyncEngine ----
    def start(self, on_events) -> None:
        self._reader = threading.Thread(target=self._read, args=(on_events,), name="kernelgate-engine-reader",
                                        daemon=True)
        self._reader.start()

    def send(self, cmd: tuple) -> None:
        self.send_many([cmd])

    def send_many(self, cmds: list) -> None:
        """Commands in one message: the loop takes them together (one request's choices join one step)."""
        try:
            with self._send_lock:
                if self.conn is not None:
                    self.conn.send([pack(c) for c in cmds])
        except (OSError, ValueError):   # the child is gone: the reader reports it
            pass

    def join(self, timeout: float) -> None:
        if self.proc is not None:
            self.proc.join(timeout)
        self.stop()
        if self._reader is not None:
            self._reader.join(timeout)

    def stop(self) -> None:
        """Close the pipe (the child exits at its next look) and end a child that lingers."""
        with self._send_lock:
            conn, self.conn = self.conn, None
        if conn is not None:
            conn.close()
        p = self.proc
        if p is not None and p.is_alive():
            try:
                p.join(2)
            finally:                     # a second Ctrl-C while waiting still ends the child
                if p.is_alive():
                    p.terminate()
                    p.join(5)

    def _at_exit(self) -> None:
        try:
            self.stop()
        except KeyboardInterrupt:
            if self.proc is not None and self.proc.is_alive():
                self.proc.kill()

    def _read(self, on_events) -> None:
        conn = self.conn
        while True:
            try:
                events = conn.recv()
            except (EOFError, OSError):
                if self.proc is not None:
                    self.proc.join(5)
                on_events([Dead(f"engine process exited (rc {self.proc.exitcode if self.proc else '?'})")])
                return
            events = [unpack(ev) for ev in events]
            on_events(events)
            if events and isinstance(events[-1], Dead):
                return


def _child_main(conn, build, args) -> None:
    # Ctrl-C reaches the whole process group: the server decides (a drain, or ending this process)
    signal.signal(signal.SIGINT, signal.SIG_IGN)     # (already ignored when started by `spawn`)
    from .core_loop import run_loop
    try:
        engine, info = build(*args)
    except BaseException as e:  # noqa: BLE001 - the server prints why, in one line
        msg = str(e) if isinstance(e, KernelgateError) else f"engine failed to start: {type(e).__name__}: {e}"
        try:
            conn.send(pack(StartFailed(msg.splitlines()[0] if msg else type(e).__name__)))
        except OSError:   # the server is gone already
            pass
        raise SystemExit(1) from None
    try:
        conn.send(pack(Ready(info)))
    except OSError:       # the server stopped while this engine was being built
        raise SystemExit(1) from None

    def take(block: bool) -> list:
        cmds = []
        if block:
            conn.poll(None)
        try:
            while conn.poll(0):
                cmds.extend(unpack(c) for c in conn.recv())   # each message a list (send_many)
        except (EOFError, OSError):      # the server is gone: exit
            cmds.append(Exit())
        return cmds

    def emit(events: list) -> None:
        try:
            conn.send([pack(ev) for ev in events])
        except OSError:
            pass

    try:
        run_loop(engine, take, emit)
    finally:
        atexit._run_exitfuncs()   # a multiprocessing child skips them: TP ranks, caches
