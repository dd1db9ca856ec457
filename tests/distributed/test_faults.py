"""Faults under tensor parallel (Gloo, 2 real processes): every one ends the job within seconds
with one line naming the rank and the cause -- never a hang -- and leaves no worker behind.

Each test spawns its own worker group (a fault ends it). Mid-step faults are placed inside the
driver's own step (a wrapper on one decoder layer of its shard, after the ranks' first
collectives), so the other rank is waiting inside a collective when they happen.
"""
from __future__ import annotations

import signal
import time

import pytest
import torch

import kernelgate
from kernelgate.distributed import launch
from kernelgate.executor.parallel import parallelize
from kernelgate.models import build, tiny

PROMPTS = [[5, 6, 7], [9, 10]]
# A fault must end the job well within this, far below the 300 s collective timeout a hang would
# wait for. Most of it is starting a rank (a fresh Python importing torch): 3-6 s alone, 24-34 s
# on CI's two cores beside the compile checks.
BOUND_S = 60.0


@pytest.fixture(scope="module")
def model():
    return build(tiny(), seed=0)


@pytest.fixture
def fresh(monkeypatch):
    """No worker group left from an earlier test; whatever this one starts is stopped after it."""
    w = launch._live.get("workers")
    if w is not None:
        w.close()
    yield monkeypatch
    w = launch._live.get("workers")
    if w is not None:
        w.close()


def on_decode_layer(pm, fn, step: int = 1):
    """Call fn() inside the driver's `step`-th decode step, in decoder layer 1 (after the embedding's
    and layer 0's all-reduces: the worker is inside the step's collectives)."""
    layer = pm.shard.model.layers[1]
    inner, seen = layer.forward, []

    def forward(h, residual, batch, cache):
        if batch.decode:
            seen.append(1)
            if len(seen) == step:
                fn()
        return inner(h, residual, batch, cache)
    layer.forward = forward


def ends_within(fn, pattern: str) -> float:
    t0 = time.monotonic()
    with pytest.raises(kernelgate.KernelgateError, match=pattern) as e:
        fn()
    took = time.monotonic() - t0
    assert "\n" not in str(e.value)
    assert took < BOUND_S, took
    return took


def generate(model):
    return kernelgate.generate(model, PROMPTS, max_new_tokens=3, tensor_parallel_size=2)


def assert_gone(w, pm):
    assert w.closed and launch._live.get("workers") is None
    assert all(p.poll() is not None for p in w.procs)
    with pytest.raises(kernelgate.KernelgateError, match="worker ranks are gone"):
        pm(torch.tensor([[1, 2]]))


def test_worker_killed_mid_step(model, fresh):
    pm = parallelize(model, 2)
    w = pm.workers
    on_decode_layer(pm, lambda: w.procs[0].send_signal(signal.SIGKILL))
    ends_within(lambda: generate(model), r"^tensor parallel: rank 1 of 2 died \(killed by signal SIGKILL\)$")
    assert_gone(w, pm)


def test_driver_raises_mid_step(model, fresh):
    """The driver fails between its broadcast and its collectives: the worker, waiting inside an
    all-reduce, is stopped and the group torn down (not left out of step for the next command)."""
    pm = parallelize(model, 2)
    w = pm.workers

    def boom():
        raise RuntimeError("driver-side fault")
    on_decode_layer(pm, boom)
    ends_within(lambda: generate(model), r"^tensor parallel: rank 0 of 2 \(the driver\) failed during a step: "
                r"RuntimeError: driver-side fault at .*test_faults.py:\d+; the other ranks were stopped$")
    assert_gone(w, pm)


def test_a_new_group_after_a_fault(model, fresh):
    """After the abort above (process group torn down in this process), a new group forms; its
    rank 1 raising inside a step (its second: the first decode) is reported with its own words."""
    fresh.setenv("KERNELGATE_DIST_FAULT", "1:step:2")
    pm = parallelize(model, 2)
    ends_within(lambda: generate(model), r"^tensor parallel: rank 1 of 2 died \(exited with code 1: injected fault "
                r"\(KERNELGATE_DIST_FAULT\) in command 'step'\)$")
    assert_gone(pm.workers, pm)


def test_worker_fails_to_start(model, fresh):
    fresh.setenv("KERNELGATE_DIST_FAULT", "1:start")
    ends_within(lambda: generate(model), r"^tensor parallel: rank 1 of 2 failed to start: injected fault "
                r"\(KERNELGATE_DIST_FAULT\) before the rendezvous$")
    assert launch._live.get("workers") is None


def test_stuck_worker_times_out(model, fresh):
    """A rank alive but stuck (SIGSTOP) is caught by the collective timeout, KERNELGATE_DIST_TIMEOUT."""
    fresh.setenv("KERNELGATE_DIST_TIMEOUT", "5")
    pm = parallelize(model, 2)
    w = pm.workers
    on_decode_layer(pm, lambda: w.procs[0].send_signal(signal.SIGSTOP))
    took = ends_within(lambda: generate(model), r"^tensor parallel: rank 0 of 2 \(the driver\): a collective "
                       r"timed out after 5 s \(KERNELGATE_DIST_TIMEOUT\)")
    assert took >= 5
    assert_gone(w, pm)


def test_bad_timeout_is_a_clear_error(model, fresh):
    fresh.setenv("KERNELGATE_DIST_TIMEOUT", "soon")
    with pytest.raises(kernelgate.KernelgateError, match=r"KERNELGATE_DIST_TIMEOUT='soon': must be seconds > 0"):
        generate(model)
