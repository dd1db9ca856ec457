"""The fla GDN wrappers' own logic on CPU (fla's kernels need a GPU): chunk_gated_delta_rule and
fused_recurrent_gated_delta_rule replaced by stand-ins built from fla's naive_recurrent_gated_delta_rule
run per sequence, with the grouped heads expanded and the L2 norm the kernels apply. Checked:
the arguments the wrappers pass (GVA shapes, int64 bounds, host bounds, fla's chunk list, one
state per run sequence), slot gather / scatter, compaction of skipped and empty sequences,
against the native references."""
import pytest
import torch

pytest.importorskip("fla")
from fla.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule  # noqa: E402
from fla.ops.utils.index import prepare_chunk_indices  # noqa: E402

from kernelgate.ops.gdn import gdn_fla  # noqa: E402
from kernelgate.ops.gdn.gdn_decode import gdn_decode_native  # noqa: E402
from kernelgate.ops.common.varlen import host_hints  # noqa: E402
from kernelgate.ops.gdn.gdn_prefill import gdn_inputs, gdn_prefill_native  # noqa: E402

HK, HV, K, V = 1, 2, 16, 8


def _naive_varlen(q, k, v, g, beta, scale, h0, bounds, l2):
    assert q.shape[2] == HK and k.shape[2] == HK and v.shape[2] == HV and g.shape[2] == HV and beta.shape[2] == HV
    assert h0.shape == (len(bounds) - 1, HV, K, V) and h0.dtype == torch.float32
    if l2:   # fla: x / sqrt(sum x^2 + 1e-6)
        q, k = (x / torch.sqrt(x.float().pow(2).sum(-1, keepdim=True) + 1e-6) for x in (q, k))
    q, k = (x.repeat_interleave(HV // HK, dim=2) for x in (q, k))
    o, ht = [], []
    for n, (s, e) in enumerate(zip(bounds, bounds[1:])):
        on, hn = naive_recurrent_gated_delta_rule(q[:, s:e], k[:, s:e], v[:, s:e], beta[:, s:e], g[:, s:e], scale=scale,
                                                  initial_state=h0[n:n + 1], output_final_state=True)
        o.append(on)
        ht.append(hn)
    return torch.cat(o, 1), torch.cat(ht, 0)


@pytest.fixture
def fla_calls(monkeypatch):
    calls = []

    def chunk(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=False,
              cu_seqlens=None, cu_seqlens_cpu=None, chunk_indices=None, **extra):
        assert not extra and output_final_state and q.shape[0] == 1 and cu_seqlens.dtype == torch.long
        bounds = cu_seqlens_cpu.tolist()
        assert bounds == cu_seqlens.tolist() and bounds[0] == 0 and bounds[-1] == q.shape[1]
        assert all(e > s for s, e in zip(bounds, bounds[1:])), "fla gets no empty sequences"
        assert torch.equal(chunk_indices, prepare_chunk_indices(cu_seqlens, 64)), "not fla's chunk list"
        calls.append(("chunk", bounds))
        return _naive_varlen(q, k, v, g, beta, scale, initial_state, bounds, use_qk_l2norm_in_kernel)

    def recurrent(q, k, v, g=None, beta=None, scale=None, initial_state=None, output_final_state=False,
                  use_qk_l2norm_in_kernel=False, cu_seqlens=None, **extra):
        assert not extra and output_final_state and q.shape[1] == initial_state.shape[0]
        bounds = cu_seqlens.tolist()
        assert bounds == list(range(q.shape[1] + 1))
        calls.append(("recurrent", bounds))
        return _naive_varlen(q, k, v, g, beta, scale, initial_state, bounds, use_qk_l2norm_in_kernel)

    monkeypatch.setattr(gdn_fla, "chunk_gated_delta_rule", chunk)
    monkeypatch.setattr(gdn_fla, "fused_recurrent_gated_delta_rule", recurrent)
    return calls


CASES = {  # id: (lengths, slots, kwargs)
    "mixed-skip-empty-T1": ([7, 0, 70, 5, 1], [2, 0, -1, 4, 1], {}),
    "one-seq-65": ([65], [1], {}),
    "no-l2-scale": ([40, 24], [1, 0], dict(qk_l2norm=False, scale=0.3)),
    "all-skipped": ([3, 64], [-1, -1], {}),
}


@pytest.mark.parametrize("hints", [False, True], ids=["tolist", "hints"])
@pytest.mark.parametrize("name", list(CASES))
def test_chunk_prefill_matches_native(name, hints, fla_calls):
    lens, slots, kw = CASES[name]
    q, k, v, g, beta, state, cu, sl = gdn_inputs(lens, slots, HK, HV, K, V, "cpu", torch.float32,
                                                 torch.Generator().manual_seed(3), pool=6)
    if not kw.get("qk_l2norm", True):
        q, k = (x / x.norm(dim=-1, keepdim=True) for x in (q, k))
    if hints:
        kw = {**kw, **host_hints(cu, sl)}
    s_fla, s_ref = state.clone(), state.clone()
    o = gdn_fla.chunk_prefill(q, k, v, g, beta, s_fla, cu, sl, **kw)
    o_ref = gdn_prefill_native(q, k, v, g, beta, s_ref, cu, sl, **kw)
    runs = [n for n, (s, L) in enumerate(zip(slots, lens)) if s >= 0 and L > 0]
    assert fla_calls == ([("chunk", [0] + torch.tensor([lens[n] for n in runs]).cumsum(0).tolist())] if runs else [])
    torch.testing.assert_close(o, o_ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(s_fla, s_ref, rtol=1e-4, atol=1e-5)
    written = {slots[n] for n in runs}
    for s in range(state.shape[0]):
        assert torch.equal(s_fla[s], state[s]) == (s not in written), f"slot {s}"


def test_fused_recurrent_decode_matches_native(fla_calls):
    g_ = torch.Generator().manual_seed(1)
    N, slots = 4, torch.tensor([3, -1, 0, 9], dtype=torch.int32)     # 9: outside the pool of 5, skipped
    q, k, v = torch.randn(N, HK, K, generator=g_), torch.randn(N, HK, K, generator=g_), torch.randn(N, HV, V, generator=g_)
    g, beta = torch.nn.functional.logsigmoid(torch.randn(N, HV, generator=g_)), torch.rand(N, HV, generator=g_)
    state = torch.randn(5, HV, K, V, generator=g_)
    s_fla, s_ref = state.clone(), state.clone()
    o = gdn_fla.fused_recurrent_decode(q, k, v, g, beta, s_fla, slots)
    o_ref = gdn_decode_native(q, k, v, g, beta, s_ref, slots)
    assert fla_calls == [("recurrent", [0, 1, 2])]
    torch.testing.assert_close(o, o_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(s_fla, s_ref, rtol=1e-5, atol=1e-6)
    assert (o[1] == 0).all() and (o[3] == 0).all()


def test_chunk_indices_once_per_metadata_object():
    cu = torch.tensor([0, 5, 70, 71], dtype=torch.long)
    a, b = gdn_fla.chunk_indices(cu, cu), gdn_fla.chunk_indices(cu, cu)
    assert a is b and a.tolist() == [[0, 0], [1, 0], [1, 1], [2, 0]]
