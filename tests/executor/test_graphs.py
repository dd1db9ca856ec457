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
from helpers.engine_checks import assert_drained
from kernelgate.engine import Engine, SamplingParams
from kernelgate.executor import graphs
from kernelgate.models.batch import StepBatch
from kernelgate.serving.warmup import warm_up
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
    monkeypatch.setattr(kernelgate.executor.model_runner, "graph_api", graphs.graph_api)


def _prompts(n=5, seed=3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 128, (int(L),), generator=g).tolist() for L in torch.randint(1, 20, (n,), generator=g)]


def _decode_logits(model, prompts, steps, graphs_on):
    eng = Engine(model, max_num_seqs=len(prompts), max_model_len=160, graphs=graphs_on)
    for i, p in enumerate(prompts):
        eng.add_request(str(i), p, SamplingParams(max_new_tokens=steps + 1))
    got = {str(i): [] for i in range(len(prompts))}
    while eng.has_unfinished():
        for o in eng.step():
            got[o.request_id] += o.new_token_ids
    return eng.runner, [got[str(i)] for i in range(len(prompts))]


def test_graph_decode_equals_eager(model, fake_graphs):
    prompts = _prompts()
    eager_runner, eager = _decode_logits(model, prompts, 6, graphs_on=False)
    runner, got = _decode_logits(model, prompts, 6, graphs_on=True)
    assert eager_runner.graphs is None and runner.graphs is not None
    assert got == eager
    # 5 sequences -> one bucket of 8 rows; contexts < 128 -> one context bucket of 2 blocks of 64
    assert set(runner.graphs.graphs) == {(8, 128)}
    # the padding rows' scratch slot and block lie outside what the block manager hands out
    assert runner.scratch == (len(prompts), runner.capacity.num_blocks)
    assert runner.cache.num_slots == len(prompts) + 1 and runner.cache.num_blocks == runner.capacity.num_blocks + 1


@pytest.mark.parametrize("family", ["kimi", "qwen"])
def test_padded_bucketed_step_matches_exact_step(model, family):
    """The invariants graphs rely on: padding rows in a scratch slot / block and a wider block
    table change nothing for the real rows (logits equal to fp32 rounding). Both families: KDA +
    MLA latents, and Gated DeltaNet + paged K / V attention."""
    if family == "qwen":
        from kernelgate.models import qwen3_next
        from kernelgate.models.qwen3_next_config import tiny as qwen_tiny
        model = qwen3_next.build(qwen_tiny(vocab_size=128), seed=11)
    bs = 8
    cache = model.new_cache(4, 12, bs)
    slots, scratch = [0, 1, 2], (3, 11)
    prompts = _prompts(3, seed=9)
    tables = [[5, 2, 7], [0, 9, 1], [3, 4, 6]]           # shuffled blocks, 24 positions each
    pre = StepBatch.build([len(p) for p in prompts], slots, [0] * 3, "cpu", tables, bs)
    model.step(torch.tensor([t for p in prompts for t in p]), pre, cache)
    state = cache.slot_tensors + cache.block_tensors        # recurrent / conv states, latents or K / V
    snap = [t.clone() for t in state]
    starts = [len(p) for p in prompts]
    exact = model.step(torch.tensor([5, 6, 7]), StepBatch.build([1] * 3, slots, starts, "cpu", tables, bs), cache)
    for t, saved in zip(state, snap):
        t.copy_(saved)
    wide = [t + [10] for t in tables] + [[scratch[1]] * 4]   # one more (unused) block per row + padding row
    padded = StepBatch.build([1] * 4, slots + [scratch[0]], starts + [0], "cpu", wide, bs)
    got = model.step(torch.tensor([5, 6, 7, 0]), padded, cache)
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


def test_graph_decode_through_chunking_and_preemption(model, fake_graphs):
    """Captured decode beside chunked prefill and preemption (block tables change under the
    static buffers between replays): tokens equal the eager engine's."""
    prompts = _prompts(6, seed=4)

    def run(graphs_on):
        eng = Engine(model, max_num_seqs=6, max_model_len=40, block_size=4, num_cache_blocks=12,
                     max_num_batched_tokens=10, graphs=graphs_on)
        for i, p in enumerate(prompts):
            eng.add_request(str(i), p, SamplingParams(max_new_tokens=8))
        got, preempted = {str(i): [] for i in range(len(prompts))}, 0
        while eng.has_unfinished():
            for o in eng.step():
                got[o.request_id] += o.new_token_ids
            preempted += eng.last_step.preempted if eng.last_step else 0
        return [got[str(i)] for i in range(len(prompts))], preempted, eng.runner.graphs
    eager, _, _ = run(False)
    got, preempted, g = run(True)
    assert got == eager and preempted > 0 and g is not None and g.graphs


def test_prepare_captures_every_shape_up_front(model, fake_graphs):
    """The server's warm-up: every (batch bucket, context bucket) up to max_num_seqs and
    max_model_len is captured before the first request, so no step waits for a capture; the
    decode afterwards captures nothing new and still equals eager decoding."""
    prompts = _prompts()
    eng = Engine(model, max_num_seqs=5, max_model_len=300)
    captures = []
    init = graphs._Captured.__init__

    def counted(self, *a, **k):
        init(self, *a, **k)
        captures.append((self.nb, self.width * self.bs))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(graphs._Captured, "__init__", counted)
        warm_up(eng, log=lambda m: None, every_shape=True)
        # batch buckets 1..8 (5 sequences pad to 8) x contexts 128, 256 and the cap (300 -> 5 blocks of 64)
        want = {(nb, ctx) for nb in (1, 2, 4, 8) for ctx in (128, 256, 320)}
        assert set(eng.runner.graphs.graphs) == want and len(captures) == len(want)
        before = len(captures)
        out = kernelgate.generate(model, prompts, max_new_tokens=7, stop_token_ids=[], engine=eng)
        assert len(captures) == before
    _, eager = _decode_logits(model, prompts, 6, graphs_on=False)
    assert [o.token_ids for o in out] == eager


def test_server_warm_up_meets_every_step_size_and_leaves_the_engine_clean(model):
    """warm_up(every_shape=True) with a 64-token budget: one prefill step of each power of two
    up to it, several prompts per step where max_model_len is shorter, an odd count, a mixed
    step, and one 256-token prompt
    (chunked: its chunks meet a cached prefix), alone and beside a decode; afterwards every slot and block is free and the
    engine decodes exactly as a fresh one."""
    eng = Engine(model, max_num_seqs=4, max_model_len=256 + 1, max_num_batched_tokens=64, graphs=False)
    steps, said = [], []
    real = eng.step

    def step():
        outs = real()
        if eng.last_step is not None:
            steps.append((eng.last_step.kind, eng.last_step.tokens))
        return outs
    eng.step = step
    warm_up(eng, log=said.append, every_shape=True)
    assert any("a 256-token prompt" in m for m in said), said
    prefill = [t for kind, t in steps if kind == "prefill"]
    # the 64-token step, then the long prompt in chunks of the budget
    assert prefill.count(64) >= 1 + 256 // 64
    assert 33 in prefill                                   # an odd token count (Triton's other specialisation)
    assert any(kind == "mixed" for kind, _ in steps), steps   # a prompt joining decodes
    # the long prompt again beside a decoding request, as served: chunks of the budget with the
    # decode on top (the default), or of 63 + the decode (decode_tokens_in_budget)
    mixed = 64 + (not eng.config.decode_tokens_in_budget)
    assert sum(kind == "mixed" and t == mixed for kind, t in steps) >= 256 // 64 - 1, steps
    assert_drained(eng)
    prompts = _prompts()
    out = kernelgate.generate(model, prompts, max_new_tokens=5, stop_token_ids=[], engine=eng)
    fresh = Engine(model, max_num_seqs=4, max_model_len=257, max_num_batched_tokens=64, graphs=False)
    want = kernelgate.generate(model, prompts, max_new_tokens=5, stop_token_ids=[], engine=fresh)
    assert [o.token_ids for o in out] == [o.token_ids for o in want]


def test_graph_decode_with_prefix_cache_hits(model, fake_graphs):
    """Requests that resume from prefix-cache snapshots (restored slots, shared blocks, a copied
    partial block) then decode through captured graphs: tokens equal the cache-off eager engine's."""
    doc = _prompts(1, seed=8)[0] * 3
    prompts = [doc + p[:3] for p in _prompts(5, seed=9)]

    def run(graphs_on, cache_on):
        eng = Engine(model, max_num_seqs=2, max_model_len=96, block_size=4, max_num_batched_tokens=16,
                     graphs=graphs_on, enable_prefix_caching=cache_on)
        got, cached = [], []
        for i, p in enumerate(prompts):              # one after another: later ones hit
            eng.add_request(str(i), p, SamplingParams(max_new_tokens=6))
            toks = []
            while eng.has_unfinished():
                for o in eng.step():
                    toks += o.new_token_ids
                    cached.append(o.num_cached_tokens)
            got.append(toks)
        return got, max(cached), eng.runner.graphs
    eager, _, _ = run(False, False)
    got, cached, g = run(True, True)
    assert got == eager and cached >= len(doc) - 4 and g is not None and g.graphs


def test_mixed_step_decodes_meet_captured_shapes(model, fake_graphs, monkeypatch):
    """In a mixed step the decodes' absorbed attention runs on their rows padded to a captured
    graph's (batch, context) shape -- empty rows of length 0 -- so it meets kernels compiled at
    capture; the tokens equal the engine's without graphs."""
    from kernelgate import ops
    prompts = _prompts(6, seed=5)
    shapes, aligned = [], []
    real = ops.mla_decode

    def spy(q, cache, table, lens, *a, **k):
        shapes.append((tuple(table.shape), int((lens == 0).sum())))
        aligned.append((table.data_ptr() % 16, lens.data_ptr() % 16))   # (kernels specialize on it)
        return real(q, cache, table, lens, *a, **k)

    def run(graphs_on):
        # (vLLM's policy: its schedule of these prompts gives mixed steps whose decode counts are
        # no captured batch size, so they are padded; the default's gives only one decode a step)
        eng = Engine(model, max_num_seqs=6, max_model_len=64, block_size=8, max_num_batched_tokens=12,
                     graphs=graphs_on, enable_prefix_caching=False, decode_tokens_in_budget=True)
        if graphs_on:
            eng.runner.graphs.prepare(6)
        for i, p in enumerate(prompts):
            eng.add_request(str(i), p, SamplingParams(max_new_tokens=5))
        got = {str(i): [] for i in range(len(prompts))}
        kinds = []
        while eng.has_unfinished():
            for o in eng.step():
                got[o.request_id] += o.new_token_ids
            kinds.append(eng.last_step.kind if eng.last_step else None)
        return [got[str(i)] for i in range(len(prompts))], kinds, eng.runner.graphs
    eager, _, _ = run(False)
    monkeypatch.setattr(ops, "mla_decode", spy)
    got, kinds, g = run(True)
    assert got == eager and "mixed" in kinds
    captured = set(g.graphs)
    padded = [(s, empty) for s, empty in shapes if empty]
    assert padded, shapes                                         # some mixed step's decodes were padded
    for (nb, width), empty in shapes:
        assert (nb, width * 8) in captured, (nb, width, captured)   # every absorbed call: a captured shape
    assert set(aligned) == {(0, 0)}, aligned                       # table and lengths 16-byte aligned


def test_graph_decode_equals_eager_gated_deltanet(fake_graphs):
    """The Qwen3-Next family through captured decode: GDN states in slots, K/V in paged blocks,
    rotary positions from the captured batch's device-side starts."""
    from kernelgate.models import qwen3_next, qwen3_next_config
    qwen = qwen3_next.build(qwen3_next_config.tiny(vocab_size=128), seed=0)
    prompts = _prompts()
    _, eager = _decode_logits(qwen, prompts, 6, graphs_on=False)
    runner, got = _decode_logits(qwen, prompts, 6, graphs_on=True)
    assert runner.graphs is not None and runner.graphs.graphs
    assert got == eager


def test_warm_up_meets_full_chunks_beside_decodes_when_decodes_ride_on_top(model, monkeypatch):
    """With decode_tokens_in_budget off, a served step can be the whole budget's chunk plus a
    decode per other sequence: the warm-up runs one such step per padded size past the budget
    (here 64 + 3: 4 sequences, one for the chunk), where steps are padded (every GPU)."""
    from kernelgate.executor import model_runner
    real_init = model_runner.ModelRunner.__init__

    def padded(self, *a, **k):
        real_init(self, *a, **k)
        self.pad_steps = True
    monkeypatch.setattr(model_runner.ModelRunner, "__init__", padded)
    eng = Engine(model, max_num_seqs=4, max_model_len=256 + 1, max_num_batched_tokens=64, graphs=False,
                 decode_tokens_in_budget=False)
    steps = []
    real = eng.step

    def step():
        outs = real()
        if eng.last_step is not None:
            steps.append((eng.last_step.kind, eng.last_step.tokens, eng.last_step.seqs))
        return outs
    eng.step = step
    warm_up(eng, log=lambda m: None, every_shape=True)
    assert ("mixed", 67, 4) in steps, steps
    assert_drained(eng)
