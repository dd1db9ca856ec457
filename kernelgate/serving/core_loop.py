"""The loop that owns an `Engine`: commands in, events out, one batch of each per step
(the messages: messages.py).

It runs where the engine lives: on a thread of this process (`ThreadCore`, tests and
embedding) or in an engine process of its own (`core_process.EngineProcess`, under
`kernelgate serve`), so the async front end (`async_engine.AsyncEngine`) is the same for both.
"""
from __future__ import annotations

import logging
import threading
import time

from ..errors import KernelgateError
from .messages import Abort, AddRequest, Admitted, Dead, Exit, Failed, Outputs

log = logging.getLogger("kernelgate.engine")

SLOW_STEP_S = 0.5   # a step this long is logged: every running stream stalled behind it


def run_loop(engine, take, emit) -> None:
    """take(block) -> list of commands (block: wait for one); emit(list of events).
    At log level DEBUG every step is logged with its start (perf_counter, comparable across
    processes), the requests added before it and what it ran: a timeline of the loop."""
    live: set = set()                      # admitted, not finished
    trace = log.isEnabledFor(logging.DEBUG)
    try:
        while True:
            events = []
            for cmd in take(not engine.has_unfinished()):
                if isinstance(cmd, Exit):
                    return
                if isinstance(cmd, Abort):
                    live.discard(cmd.request_id)
                    engine.abort(cmd.request_id)
                    continue
                assert isinstance(cmd, AddRequest), cmd
                rid = cmd.request_id
                try:
                    engine.add_request(rid, cmd.prompt_ids, cmd.params)
                    live.add(rid)
                    events.append(Admitted(rid, None))
                except Exception as e:  # noqa: BLE001 - a bad request is the client's error, not the loop's
                    events.append(Admitted(rid, str(e) if isinstance(e, KernelgateError)
                                           else f"{type(e).__name__}: {e}"))
            adds = len(events)
            if events:                      # admissions before the step, which may be long
                emit(events)
                events = []
            outs, step = [], None
            if engine.has_unfinished():
                try:
                    t0 = time.perf_counter()
                    outs = engine.step()
                    step = _step(engine, time.perf_counter() - t0)
                    if trace:
                        st = getattr(engine, "last_step", None)
                        log.debug("kernelgate step: t=%.6f adds=%d kind=%s tokens=%d seqs=%d dt=%.6f", t0,
                                  adds, st.kind if st else "none",
                                  st.tokens if st else 0, st.seqs if st else 0, time.perf_counter() - t0)
                except Exception as e:  # noqa: BLE001 - fail what was running, keep serving
                    msg = f"engine step failed: {type(e).__name__}: {e}"
                    log.exception("kernelgate: %s", msg)
                    for rid in live:
                        engine.abort(rid)
                    events.append(Failed(sorted(live), msg))
                    live.clear()
            for out in outs:
                if out.finished:
                    live.discard(out.request_id)
            # after aborts too: the gauges must say when they freed everything
            events.append(Outputs(outs, engine.num_running, engine.num_waiting, engine.cache_usage, step))
            emit(events)
    except BaseException as e:  # noqa: BLE001 - the loop must never die silently
        msg = f"engine loop died: {type(e).__name__}: {e}"
        log.exception("kernelgate: %s", msg)
        emit([Dead(msg)])


def _step(engine, secs: float):
    """(kind, tokens, seconds) of the step just run (None if it ran nothing); a slow one is logged."""
    st = getattr(engine, "last_step", None)
    if secs >= SLOW_STEP_S:
        what = (f"a {st.kind} step of {st.tokens} tokens ({st.seqs} sequence{'s' * (st.seqs != 1)})"
                if st is not None else "a step")
        log.warning("kernelgate: %s took %.2f s (kernels compiled or autotuned for a new shape? "
                    "`kernelgate warmup` / serve's warm-up meet them ahead of requests)", what, secs)
    return None if st is None else (st.kind, st.tokens, secs)


class ThreadCore:
    """The loop on a background thread of this process; events are handled on that thread."""

    def __init__(self, engine):
        self.engine = engine
        self._cv = threading.Condition()
        self._cmds: list = []
        self._thread: threading.Thread | None = None

    def start(self, on_events) -> None:
        self._thread = threading.Thread(target=run_loop, args=(self.engine, self._take, on_events),
                                        name="kernelgate-engine", daemon=True)
        self._thread.start()

    def send(self, cmd: tuple) -> None:
        self.send_many([cmd])

    def send_many(self, cmds: list) -> None:
        """Commands the loop takes together (one request's choices join one step, never split)."""
        with self._cv:
            self._cmds.extend(cmds)
            self._cv.notify()

    def _take(self, block: bool) -> list:
        with self._cv:
            while block and not self._cmds:
                self._cv.wait()
            cmds, self._cmds = self._cmds, []
        return cmds

    def join(self, timeout: float) -> None:
        if self._thread is not None:
            self._thread.join(timeout)
