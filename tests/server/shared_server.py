"""One real server process for every pytest-xdist worker that runs the server tests.

The suite runs with `-n 2` and plain load distribution (xdist's loadgroup does not work
with pytest 9), so the tests of one module may land on both workers. The first worker to
need the server starts it and owns it; others join through a state file guarded by an
flock in the run's shared temp folder. The owner stops it (SIGTERM, checking rc 0) only when
every user has left.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

MAX_SEQS, MAX_LEN = 8, 1024          # the built-in model's server in these tests (conftest.py)
ROOT = Path(__file__).resolve().parents[2]


def run_folder(tmp_path_factory) -> Path:
    """A folder every xdist worker of this run sees (for the shared servers' state files)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _locked(path: Path):
    with open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _read(state: Path):
    return json.loads(state.read_text()) if state.exists() else None


def _start(args: list, cwd: Path, log: Path, timeout: float = 240):
    port = _free_port()
    # one intra-op thread: the server shares the CI machine's 2 cores with the test workers
    env = {**os.environ, "KERNELGATE_PLATFORM": "", "KERNELGATE_FORCE": "", "OMP_NUM_THREADS": "1"}
    with open(log, "w") as f:
        # its own process group, like a server started from a terminal (the engine process joins it)
        proc = subprocess.Popen([sys.executable, "-m", "kernelgate", "serve", "--port", str(port), *args],
                                cwd=cwd, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with rc {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"server not healthy after {timeout} s:\n{log.read_text()[-3000:]}")
        time.sleep(0.25)


@contextlib.contextmanager
def shared_server(folder: Path, args: list, cwd: Path, ctrl_c: bool = False):
    """Yields the base URL; on exit the owner asserts a clean SIGTERM shutdown (rc 0, no traceback).
    ctrl_c: stop it as Ctrl-C in a terminal does (SIGINT to its process group, the engine process
    included) while a long stream runs, which must end with finish_reason "abort" and [DONE]
    after the server's --shutdown-timeout; no process of the group may outlive it."""
    lock, state, log = folder / "server.lock", folder / "server.json", folder / "server.log"
    me = os.environ.get("PYTEST_XDIST_WORKER", "master")
    proc = None
    while True:
        with _locked(lock):
            st = _read(state)
            if st is None:
                proc, base = _start(args, cwd, log)
                state.write_text(json.dumps({"base": base, "owner": me, "users": 1, "stopping": False}))
                break
            if not st["stopping"]:
                st["users"] += 1
                state.write_text(json.dumps(st))
                base = st["base"]
                break
        time.sleep(0.5)                     # the owner is stopping it: start a fresh one after
    try:
        yield base
    finally:
        with _locked(lock):
            st = _read(state)
            st["users"] -= 1
            state.write_text(json.dumps(st))
        if proc is not None:
            _stop(proc, lock, state, log, base if ctrl_c else None)


def _stream_until_done(base: str, events: list, started: threading.Event) -> None:
    body = {"prompt": [1, 2, 3], "max_tokens": MAX_LEN - 3, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line:
                events.append(line)
                started.set()


def _group_left(pgid: int) -> list:
    """Live (not zombie) processes still in the process group."""
    out = subprocess.run(["ps", "-o", "pid=,stat=", "-g", str(pgid)], capture_output=True, text=True).stdout
    return [ln for ln in out.splitlines() if ln.split() and not ln.split()[1].startswith("Z")]


def _stop(proc, lock: Path, state: Path, log: Path, ctrl_c_base: str | None) -> None:
    deadline = time.monotonic() + 600
    while True:
        with _locked(lock):
            st = _read(state)
            if st["users"] == 0:
                st["stopping"] = True
                state.write_text(json.dumps(st))
                break
        assert time.monotonic() < deadline, "other workers still use the server after 600 s"
        time.sleep(0.5)
    events, started = [], threading.Event()
    if ctrl_c_base:
        reader = threading.Thread(target=_stream_until_done, args=(ctrl_c_base, events, started), daemon=True)
        reader.start()
        assert started.wait(120), "the last stream never started"
        os.killpg(proc.pid, signal.SIGINT)
    else:
        proc.send_signal(signal.SIGTERM)
    try:
        rc = proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError(f"server did not stop within 30 s of its stop signal:\n{log.read_text()[-3000:]}") from None
    finally:
        with _locked(lock):
            state.unlink()
    text = log.read_text()
    assert rc == 0, text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    if ctrl_c_base:
        reader.join(30)
        assert events[-1] == "data: [DONE]", events[-3:]
        assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] == "abort", events[-3:]
        for _ in range(50):
            if not _group_left(proc.pid):
                break
            time.sleep(0.1)
        assert not _group_left(proc.pid), _group_left(proc.pid)
