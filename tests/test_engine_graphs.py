"""Decode graphs (engine/graphs.py): what a captured decode step relies on, checked on the CPU.

A real capture needs CUDA / ROCm; here a stand-in graph re-runs the captured step on replay, so
the whole engine path runs -- static buffers refreshed per step, batch padded to a power of two
with rows aimed at the reserved scratch slot, attention context rounded up to a bucket -- and its
tokens and logits must equal plain eager decoding. Also: capture failure falls back to eager decode
with a warning, and the platforms without graphs say why."""
import contextlib

import pytest
import torch

import kernelgate
from kernelgate.engine import Request, SamplingParams, Scheduler, StepBatch, graphs
from kernelgate.models import build, tiny
from kernelgate.registry import FallbackWarning


@pytest.fixture(scope="module")
def model():
    return build(tiny(vocab_size=128), seed=11)


class _ReplayGraph:
    """Stands in for torch.cuda.CUDAGraph: replay() re-runs the captured step into its outputs."""
    owner = None

    def replay(self):
        self.owner.logits.copy_(self.owner.run())


@contextlib.contextmanager
def _capture(graph, pool=None):
    yield


@pytest.fixture
def fake_graphs(monkeypatch):
    monkeypatch.setattr(graphs, "graph_api", lambda device: ((_ReplayGraph, _capture, lambda: None), None))
    init = graphs._Captured.__init__

    def hooked(self, *a, **k):
        init(self, *a, **k)
        self.graph.owner = self
    monkeypatch.setattr(graphs._Captured, "__init__", hooked)
    monkeypatch.setattr(kernelgate.engine.model_runner, "graph_api", graphs.graph_api)


def _prompts(n=5, seed=3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 128, (int(L),), generator=g).tolist() for L in torch.randint(1, 20, (n,), generator=g)]


def _decode_logits(model, prompts, steps, graphs_on):
    sched = Scheduler(model, max_slots=len(prompts), max_len=160, graphs=graphs_on)
    reqs = [sched.add(Request(p, SamplingParams(max_new_tokens=steps + 1))) for p in prompts]
    sched.step()                                  # prefill
    seen = []
    orig = sched.model.step
    sched.model.step = lambda *a: seen.append(orig(*a).clone()) or seen[-1]
    try:
        while not sched.idle:
            sched.step()
    finally:
        del sched.model.step
    return sched, [r.output for r in reqs]


def test_graph_decode_equals_eager(model, fake_graphs):
    prompts = _prompts()
    eager_sched, eager = _decode_logits(model, prompts, 6, graphs_on=False)
    sched, got = _decode_logits(model, prompts, 6, graphs_on=True)
    assert eager_sched.graphs is None and sched.graphs is not None
    assert got == eager
    # 5 sequences -> one bucket of 8 rows; contexts < 128 -> one context bucket
    assert set(sched.graphs.graphs) == {(8, 128)}
    assert sched.pool.num_slots == len(prompts) + 1 and sched.graphs.scratch not in sched.pool._free   # reserved


def test_padded_bucketed_step_matches_exact_step(model):
    """The invariants graphs rely on: padding rows in a scratch slot and a longer masked context
    change nothing for the real rows (logits equal to fp32 rounding)."""
    pool = model.new_pool(4, 64)
    slots = [pool.alloc() for _ in range(3)]
    scratch = pool.reserve()
    prompts = _prompts(3, seed=9)
    pre = StepBatch.build([len(p) for p in prompts], slots, [0] * 3, "cpu")
    model.step(torch.tensor([t for p in prompts for t in p]), pre, pool)
    state = [*pool.mla_cache.values(), *pool.kda_state.values(), *pool.conv_state.values()]
    snap = [t.clone() for t in state]
    starts = [len(p) for p in prompts]
    exact = model.step(torch.tensor([5, 6, 7]), StepBatch.build([1] * 3, slots, starts, "cpu"), pool)
    for t, saved in zip(state, snap):
        t.copy_(saved)
    padded = StepBatch.build([1] * 4, slots + [scratch], starts + [0], "cpu")
    padded.context_len = 64                       # the bucket: attention reads more, masked
    got = model.step(torch.tensor([5, 6, 7, 0]), padded, pool)
    torch.testing.assert_close(got[:3], exact, rtol=1e-5, atol=1e-5)


def test_capture_failure_falls_back_to_eager(model, fake_graphs, monkeypatch):
    def broken(*a, **k):
        raise RuntimeError("operation not permitted when stream is capturing")
    monkeypatch.setattr(graphs._Captured, "__init__", broken)
    prompts = _prompts(2)
    with pytest.warns(FallbackWarning, match="decode graphs off.*not permitted"):
        _, got = _decode_logits(model, prompts, 3, graphs_on=True)
    _, eager = _decode_logits(model, prompts, 3, graphs_on=False)
    assert got == eager


def test_graph_api_reasons(monkeypatch):
    api, why = graphs.graph_api(torch.device("cpu"))
    assert api is None and "cpu" in why
    monkeypatch.setenv("KERNELGATE_GRAPHS", "0")
    assert graphs.graph_api(torch.device("cuda")) == (None, "KERNELGATE_GRAPHS=0")


def test_sync_check_runs_in_error_mode_and_restores(monkeypatch):
    modes = []
    monkeypatch.setattr(torch.cpu, "set_sync_debug_mode", modes.append, raising=False)

    def syncing():
        assert modes[-1] == "error"
        raise RuntimeError("called a synchronizing CUDA operation")
    with pytest.raises(RuntimeError, match="synchronizing"):
        graphs._without_host_syncs(torch.device("cpu"), syncing)
    assert modes == ["error", "default"]
