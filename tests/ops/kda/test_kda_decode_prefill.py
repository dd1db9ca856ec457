"""KDA prefill / decode / packed decode vs fla-core's naive KDA and HF's kimi_linear torch
fallbacks: odd lengths, varlen batches, slot skipping, state continuity, fp32 and bf16."""
import pytest
import torch
import torch.nn.functional as F

from kernelgate import KernelgateError, platform, registry
from kernelgate.ops.kda.kda_prefill import make_inputs
from kernelgate.tools.testing import rel_err

from helpers.impls import on_platform
from helpers.kda_refs import call, fla_gate, fla_naive, hf, need, runnable, tol

DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]


def _naive(q, k, v, g, beta, S0):
    """fla naive_recurrent_kda on one sequence with HF's l2norm; -> (o [L,H,V] fp32, S)."""
    l2 = hf()["l2norm"]
    o, S = fla_naive().naive_recurrent_kda(l2(q.float())[None], l2(k.float())[None], v.float()[None],
                                           g[None], beta.float()[None], initial_state=S0[None].clone(),
                                           output_final_state=True)
    return o[0], S[0]


@pytest.mark.parametrize("impl", runnable("kda_prefill"))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lens,slots", [([1], [0]), ([63], [1]), ([65, 130, 7], [2, -1, 0]),
                                        ([130, 1, 64, 17], [3, 0, 5, 1])],
                         ids=["L1", "L63", "L65_130_7-skip", "L130_1_64_17"])
def test_prefill_vs_fla_naive(impl, dtype, lens, slots):
    q, k, v, g, beta, state, cu, sl = make_inputs(lens, slots, 2, 60, 48, "cpu", dtype, torch.Generator().manual_seed(0))
    before = state.clone()
    o = call("kda_prefill", impl, q, k, v, g, beta, state, cu, sl)
    assert o.dtype == dtype and o.shape == v.shape
    for n, slot in enumerate(slots):
        s, e = int(cu[n]), int(cu[n + 1])
        if slot < 0:
            assert (o[s:e] == 0).all()
            continue
        ro, rS = _naive(q[s:e], k[s:e], v[s:e], g[s:e], beta[s:e], before[slot])
        assert rel_err(o[s:e], ro) < tol(dtype, "kda_prefill", impl), f"sequence {n}"
        assert rel_err(state[slot], rS) < tol(dtype, "kda_prefill", impl), f"state of sequence {n}"
    for s in set(range(state.shape[0])) - {x for x in slots if x >= 0}:
        assert torch.equal(state[s], before[s]), f"untouched slot {s} changed"


@pytest.mark.parametrize("impl", runnable("kda_prefill"))
@pytest.mark.parametrize("strength", [8.0, 40.0], ids=["mid", "strong"])
def test_prefill_vs_hf_chunk_strong_decay(impl, strength):
    """HF chunk_kimi_delta_attention (chunk 64, padded) with decays strong enough that a
    naive exp(-cumsum) factorisation would overflow fp32 inside one chunk (x40: per-step
    decay down to ~ -100, every block split to single tokens) or that only some block
    sizes stay factorable (x8: the native Gram splits chunks twice, down to 16-blocks)."""
    q, k, v, g, beta, state, cu, sl = make_inputs([130], [0], 2, 32, 32, "cpu", torch.float32,
                                                  torch.Generator().manual_seed(3))
    g = g * strength
    S0 = state[0].clone()
    o = call("kda_prefill", impl, q, k, v, g, beta, state, cu, sl)
    ro, rS = hf()["chunk"](q[None], k[None], v[None], g[None], beta[None], initial_state=S0[None],
                           output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert torch.isfinite(o).all()
    bound = tol(torch.float32, "kda_prefill", impl)
    assert rel_err(o, ro[0]) < bound and rel_err(state[0], rS[0]) < bound


@pytest.mark.parametrize("impl", runnable("kda_decode"))
@pytest.mark.parametrize("dtype", DTYPES)
def test_prefix_prefill_then_decode_equals_whole_prefill(impl, dtype):
    need("kda_decode", impl)
    lens, slots, steps = [63, 1, 65], [1, 3, 0], 3
    full = [n + steps for n in lens]
    args = make_inputs(full, slots, 2, 32, 32, "cpu", dtype, torch.Generator().manual_seed(1))
    q, k, v, g, beta, state, cu, sl = args
    whole = state.clone()
    o_whole = call("kda_prefill", "native", q, k, v, g, beta, whole, cu, sl)
    pre = torch.cat([torch.arange(int(cu[n]), int(cu[n]) + lens[n]) for n in range(3)])
    cu_pre = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    call("kda_prefill", "native", q[pre], k[pre], v[pre], g[pre], beta[pre], state, cu_pre, sl)
    for step in range(steps):
        rows = torch.tensor([int(cu[n]) + lens[n] + step for n in range(3)])
        o = call("kda_decode", impl, q[rows], k[rows], v[rows], g[rows], beta[rows], state, sl)
        assert rel_err(o, o_whole[rows]) < tol(dtype)
    assert rel_err(state, whole) < 1e-5


@pytest.mark.parametrize("impl", runnable("kda_decode"))
def test_decode_vs_hf_recurrent_and_skip(impl):
    g_ = torch.Generator().manual_seed(2)
    N, H, K, V = 4, 3, 60, 40
    q, k, v = torch.randn(N, H, K, generator=g_), torch.randn(N, H, K, generator=g_), torch.randn(N, H, V, generator=g_)
    g = F.logsigmoid(torch.randn(N, H, K, generator=g_))
    beta = torch.rand(N, H, generator=g_)
    state = torch.randn(6, H, K, V, generator=g_)
    before = state.clone()
    slots = torch.tensor([5, -1, 0, 2], dtype=torch.int32)
    o = call("kda_decode", impl, q, k, v, g, beta, state, slots)
    assert (o[1] == 0).all()
    for n in (0, 2, 3):
        s = int(slots[n])
        ro, rS = hf()["recurrent"](q[n][None, None], k[n][None, None], v[n][None, None], g[n][None, None],
                                   beta[n][None, None], before[s][None].clone(), True, use_qk_l2norm_in_kernel=True)
        assert rel_err(o[n], ro[0, 0]) < 1e-5 and rel_err(state[s], rS[0]) < 1e-5
    for s in (1, 3, 4):
        assert torch.equal(state[s], before[s])


def _packed_inputs(N, slots, H, K, V, dtype, seed):
    g_ = torch.Generator().manual_seed(seed)
    qkv = torch.randn(N, 2 * H * K + H * V, generator=g_).to(dtype)
    f, b = torch.randn(N, H * K, generator=g_).to(dtype), torch.randn(N, H, generator=g_).to(dtype)
    A_log, dt_bias = torch.randn(H, generator=g_) - 1.0, torch.randn(H * K, generator=g_)
    state = 0.3 * torch.randn(max(slots) + 2, H, K, V, generator=g_)
    return qkv, f, b, A_log, dt_bias, state, torch.tensor(slots, dtype=torch.int32)


@pytest.mark.parametrize("impl", runnable("kda_packed_decode"))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lb", [None, -5.0], ids=["softplus", "lb-5"])
def test_packed_decode_vs_fla(impl, dtype, lb):
    N, H, K, V, slots = 4, 3, 60, 32, [4, -1, 0, 2]
    qkv, f, b, A_log, dt_bias, state, sl = _packed_inputs(N, slots, H, K, V, dtype, seed=4)
    before = state.clone()
    o = call("kda_packed_decode", impl, qkv, f, b, A_log, dt_bias, state, sl, H, K, lower_bound=lb)
    assert o.dtype == dtype and o.shape == (N, H, V)
    gate = fla_gate()
    g = (gate.naive_kda_gate(f.view(N, H, K), A_log, dt_bias) if lb is None
         else gate.naive_kda_lowerbound_gate(f.view(N, H, K), A_log, dt_bias, lower_bound=lb))
    q, k, v = qkv.float().split([H * K, H * K, H * V], dim=1)
    assert (o[1] == 0).all()
    for n, s in enumerate(slots):
        if s < 0:
            continue
        ro, rS = _naive(q[n].view(1, H, K), k[n].view(1, H, K), v[n].view(1, H, V), g[n][None],
                        torch.sigmoid(b[n].float())[None], before[s])
        assert rel_err(o[n], ro[0]) < tol(dtype) and rel_err(state[s], rS) < tol(dtype)
    for s in (1, 3, 5):
        assert torch.equal(state[s], before[s]), f"untouched slot {s} changed"


def test_packed_decode_dispatch_by_platform():
    op = registry.get("kda_packed_decode")
    args = _packed_inputs(2, [0, 1], 2, 32, 32, torch.float32, seed=5)[:7] + (2, 32)
    with platform.simulate("cpu"):
        rows = dict((i.name, r) for i, r in op.explain(args, {}))
        assert rows["triton"].startswith("not declared for cpu")
        assert rows["chain"] is None                        # chosen
    with platform.simulate("xpu"):
        chosen = op.select(on_platform(args), {})
        if platform.current().triton is None:               # interpreter or a GPU
            assert chosen.name == "triton"
        else:
            assert "Triton unusable" in dict((i.name, r) for i, r in op.explain(args, {}))["triton"]


def test_kda_rejects_bad_input():
    from kernelgate import ops
    q, k, v, g, beta, state, cu, sl = make_inputs([5], [0], 2, 16, 16, "cpu", torch.float32, torch.Generator())
    with pytest.raises(KernelgateError, match=r"kda_prefill: state dtype bfloat16 not in \(float32\)"):
        ops.kda_prefill(q, k, v, g, beta, state.bfloat16(), cu, sl)
    with pytest.raises(KernelgateError, match=r"kda_decode: beta shape \(5, 3\) != \(5, 2\)"):
        ops.kda_decode(q, k, v, g, torch.rand(5, 3), state, torch.zeros(5, dtype=torch.int32))
    qkv = torch.randn(1, 2 * 2 * 16 + 2 * 16 + 1)
    with pytest.raises(KernelgateError, match="kda_packed_decode: qkv width 97 != 2\\*2\\*16"):
        ops.kda_packed_decode(qkv, torch.randn(1, 32), torch.randn(1, 2), torch.zeros(2), None, state,
                              torch.zeros(1, dtype=torch.int32), 2, 16)
