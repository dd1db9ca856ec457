"""The fla kda_prefill wrapper's own logic (slot gather/scatter, compaction of skipped and
empty sequences, host hints) on CPU: fla's chunk_kda needs a GPU, so it is replaced by a
stand-in built from fla's `naive_recurrent_kda` run per sequence (what chunk_kda computes
for varlen input). The wrapper is checked against the native kda_prefill reference.

Also: the host hints (`cu_seqlens_cpu`, `slots_cpu`) are validated on a dispatch miss, the
wrapper never reads the device metadata on the host when it has them, and the engine's
StepBatch / KDA layer pass them.
"""
import pytest
import torch

pytest.importorskip("fla")
from fla.ops.kda.naive import naive_recurrent_kda  # noqa: E402

from kernelgate import KernelgateError, ops, registry  # noqa: E402
from kernelgate.models.batch import StepBatch  # noqa: E402
from kernelgate.ops.kda.kda_fla import chunk_prefill  # noqa: E402
from kernelgate.ops.kda.kda_prefill import host_hints, kda_prefill_native, make_inputs  # noqa: E402

H, K, V = 2, 16, 8
HOST_READS = (torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.__int__, torch.Tensor.__bool__,
              torch.Tensor.__index__, torch.Tensor.cpu, torch.Tensor.numpy)


class NoHostRead(torch.Tensor):
    """Device metadata that must not be read on the host (on a GPU that read is a sync)."""
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in HOST_READS:
            raise AssertionError(f"host read of device metadata: {func.__name__}")
        return super().__torch_function__(func, types, args, kwargs or {})


def _plain(t):
    return t.as_subclass(torch.Tensor)


def fake_chunk_kda(calls):
    """CPU stand-in for fla.ops.kda.chunk_kda (varlen form, as the wrapper calls it)."""
    def chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                  use_qk_l2norm_in_kernel=False, cu_seqlens=None, cu_seqlens_cpu=None, use_graph=False,
                  max_num_seqs=None, **extra):
        assert not extra, extra
        # the chunk list built on the device (no blocking upload per call); fla's graph mode wants
        # cu_seqlens of exactly max_num_seqs + 1 entries and initial states of max_num_seqs rows
        assert use_graph is True
        assert max_num_seqs in (None, cu_seqlens.shape[0] - 1)
        assert q.shape[0] == 1 and cu_seqlens is not None and cu_seqlens.dtype == torch.long
        assert cu_seqlens_cpu is not None and cu_seqlens_cpu.device.type == "cpu"
        bounds = cu_seqlens_cpu.tolist()
        assert bounds == _plain(cu_seqlens).tolist(), "cu_seqlens_cpu must match cu_seqlens"
        N = len(bounds) - 1
        assert bounds[0] == 0 and bounds[-1] == q.shape[1]
        assert all(e > s for s, e in zip(bounds, bounds[1:])), "fla gets no empty sequences"
        assert initial_state.shape == (N, H, K, V) and initial_state.dtype == torch.float32
        calls.append(bounds)
        if use_qk_l2norm_in_kernel:   # fla: x / sqrt(sum x^2 + 1e-6), then the recurrence
            q, k = (x / torch.sqrt(x.float().pow(2).sum(-1, keepdim=True) + 1e-6) for x in (q, k))
        o, ht = [], []
        for n, (s, e) in enumerate(zip(bounds, bounds[1:])):
            on, hn = naive_recurrent_kda(q[:, s:e], k[:, s:e], v[:, s:e], g[:, s:e], beta[:, s:e], scale=scale,
                                         initial_state=initial_state[n:n + 1], output_final_state=True)
            o.append(on)
            ht.append(hn)
        return torch.cat(o, 1), (torch.cat(ht, 0) if output_final_state else None)
    return chunk_kda


@pytest.fixture
def fla_calls(monkeypatch):
    from kernelgate.ops.kda import kda_fla
    calls = []
    monkeypatch.setattr(kda_fla, "chunk_kda", fake_chunk_kda(calls))   # (the name the wrapper calls)
    return calls


CASES = {  # id: (lengths, slots, kwargs)
    "mixed-skip-empty-T1": ([7, 0, 70, 5, 1], [2, 0, -1, 4, 1], {}),
    "one-seq-65": ([65], [1], {}),
    "no-l2-scale": ([40, 24], [1, 0], dict(qk_l2norm=False, scale=0.3)),
    "all-skipped": ([3, 64], [-1, -1], {}),
    "all-empty": ([0, 0], [0, 1], {}),
    "empty-first-skip-last": ([0, 9, 33], [3, 0, -1], {}),
}


@pytest.mark.parametrize("hints", [False, True], ids=["tolist", "hints"])
@pytest.mark.parametrize("name", list(CASES))
def test_chunk_prefill_matches_native(name, hints, fla_calls):
    lens, slots, kw = CASES[name]
    q, k, v, g, beta, state, cu, sl = make_inputs(lens, slots, H, K, V, "cpu", torch.float32,
                                                  torch.Generator().manual_seed(3), pool=6)
    if not kw.get("qk_l2norm", True):   # unit keys keep the unnormalised delta rule contractive
        q, k = (x / x.norm(dim=-1, keepdim=True) for x in (q, k))
    if hints:
        kw = {**kw, **host_hints(cu, sl)}
        cu_dev, sl_dev = cu.as_subclass(NoHostRead), sl.as_subclass(NoHostRead)
    else:
        cu_dev, sl_dev = cu, sl
    s_fla, s_ref = state.clone(), state.clone()
    o = chunk_prefill(q, k, v, g, beta, s_fla, cu_dev, sl_dev, **kw)
    o_ref = kda_prefill_native(q, k, v, g, beta, s_ref, cu, sl, **kw)
    o = _plain(o)

    runs = [n for n, (s, L) in enumerate(zip(slots, lens)) if s >= 0 and L > 0]
    assert fla_calls == ([[0] + torch.tensor([lens[n] for n in runs]).cumsum(0).tolist()] if runs else [])
    torch.testing.assert_close(o, o_ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(s_fla, s_ref, rtol=1e-4, atol=1e-5)
    written = {slots[n] for n in runs}
    for n, L in enumerate(lens):   # skipped / empty sequences: exact zeros
        if n not in runs:
            assert torch.equal(o[cu[n]:cu[n] + L], torch.zeros(L, H, V))
    for s in range(state.shape[0]):   # slots no sequence ran in: bit-identical
        if s not in written:
            assert torch.equal(s_fla[s], state[s]), f"slot {s} touched"
        else:
            assert not torch.equal(s_fla[s], state[s]), f"slot {s} not updated"


def test_native_hints_bit_identical():
    args = make_inputs([9, 0, 30], [1, 0, -1], H, K, V, "cpu", torch.float32, torch.Generator().manual_seed(5))
    s1, s2 = args[5].clone(), args[5].clone()
    o1 = kda_prefill_native(*args[:5], s1, *args[6:])
    o2 = kda_prefill_native(*args[:5], s2, *args[6:], **host_hints(*args[6:]))
    assert torch.equal(o1, o2) and torch.equal(s1, s2)


def test_hint_validation_and_dispatch_cache():
    q, k, v, g, beta, state, cu, sl = make_inputs([5, 3, 4], [0, 1, 2], H, K, V, "cpu", torch.float32,
                                                  torch.Generator().manual_seed(0))
    args = (q, k, v, g, beta, state, cu, sl)
    bad = {
        r"kda_prefill: cu_seqlens_cpu shape \(3,\) != \(4,\)": dict(cu_seqlens_cpu=cu[:3]),
        r"kda_prefill: slots_cpu dtype float32 not in \(int32, int64\)": dict(slots_cpu=sl.float()),
        r"kda_prefill: slots_cpu must be a CPU tensor \(host copy\), got meta": dict(slots_cpu=sl.to("meta")),
        r"kda_prefill: cu_seqlens_cpu must be a tensor, got list": dict(cu_seqlens_cpu=cu.tolist()),
    }
    for msg, kw in bad.items():
        with pytest.raises(KernelgateError, match=msg):
            ops.kda_prefill(*args, **kw)
    x = torch.randn(12, 8)
    with pytest.raises(KernelgateError, match=r"short_conv: cu_seqlens_cpu shape \(2,\) != \(4,\)"):
        ops.short_conv(x, torch.randn(8, 4), None, torch.zeros(3, 8, 3), cu, sl, cu_seqlens_cpu=cu[:2])

    op = registry.get("kda_prefill")
    op._cache.clear()
    outs = [ops.kda_prefill(*args[:5], state.clone(), cu, sl, **host_hints(cu, sl)) for _ in range(2)]
    assert len(op._cache) == 1, "host hints must not defeat the dispatch cache"
    assert torch.equal(outs[0], outs[1])


def test_step_batch_and_layer_pass_host_copies(monkeypatch):
    b = StepBatch.build([3, 1, 4], [2, 0, 1], [0, 5, 0], "cpu")
    assert b.cu_seqlens_cpu.device.type == "cpu" and b.cu_seqlens_cpu.tolist() == [0, 3, 4, 8]
    assert b.slots_cpu.device.type == "cpu" and b.slots_cpu.tolist() == [2, 0, 1]
    assert b.cu_seqlens.tolist() == [0, 3, 4, 8] and b.slots.tolist() == [2, 0, 1]

    from kernelgate.models import build, tiny
    seen = []
    real_prefill, real_conv = ops.kda_prefill, ops.short_conv

    def prefill(*a, **kw):
        seen.append(("kda_prefill", kw["cu_seqlens_cpu"].tolist(), kw["slots_cpu"].tolist()))
        return real_prefill(*a, **kw)

    def conv(*a, **kw):
        seen.append(("short_conv", kw["cu_seqlens_cpu"].tolist()))
        return real_conv(*a, **kw)
    monkeypatch.setattr(ops, "kda_prefill", prefill)
    monkeypatch.setattr(ops, "short_conv", conv)
    model = build(tiny(vocab_size=64), seed=1)
    logits = model(torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(0)))
    assert logits.shape == (2, 5, 64) and torch.isfinite(logits).all()
    kda_layers = sum(1 for m in model.modules() if type(m).__name__ == "KimiDeltaAttention")
    assert kda_layers > 0
    assert seen.count(("kda_prefill", [0, 5, 10], [0, 1])) == kda_layers
    assert seen.count(("short_conv", [0, 5, 10])) == kda_layers and len(seen) == 2 * kda_layers


def test_long_metadata_is_memoized_by_identity():
    """fla caches chunk indices by argument identity: repeated calls must pass the same int64
    object (also for inference tensors, which have no version counter -- the model runs in
    inference mode)."""
    from kernelgate.ops.kda.kda_fla import _long
    with torch.inference_mode():
        cu = torch.tensor([0, 3, 7], dtype=torch.int32)
        a, b = _long(cu), _long(cu)
        assert a is b and a.dtype == torch.long and a.tolist() == [0, 3, 7]
        other = torch.tensor([0, 3, 7], dtype=torch.int32)
        assert _long(other) is not a
        assert _long(a) is a
