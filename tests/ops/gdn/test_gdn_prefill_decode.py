"""GDN prefill / decode / packed decode vs transformers' Qwen3-Next torch functions and fla-core's
naive gated delta rule: varlen batches of odd lengths, grouped value heads (HV / HK = 1, 2, 4),
odd head sizes, skipped slots, prefill continued over calls, decode after prefill, fp32 and bf16."""
import pytest
import torch
import torch.nn.functional as F

from kernelgate import KernelgateError, ops, platform, registry
from kernelgate.ops.gdn.gdn_prefill import gdn_inputs
from kernelgate.tools.testing import rel_err

from gdn_refs import fla_sequence, hf_sequence
from helpers.kda_refs import call, need, runnable, tol

DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]
# The recurrent Triton prefill on fewer cases here (fp32, varlen): its step is the decode kernel's (bf16
# and grouped heads tested there and in the parity suite) and under the interpreter it runs its tokens
# one by one (the slowest tests of the family).
BATCHES = {"L1-G1": ([1], [0], 2, 2), "L63-G2": ([63], [1], 1, 2), "L65_20_7-skip-G4": ([65, 20, 7], [2, -1, 0], 1, 4),
           "L17_1_64-G2": ([17, 1, 64], [3, 0, 1], 2, 4), "L9_5_3-skip-G4": ([9, 5, 3], [2, -1, 0], 1, 4)}
# (the chunked Triton kernel in bf16 on the one batch that has them all: varlen, a skipped slot, grouped
# heads, a sequence past a chunk boundary; its bf16 path is in the parity suite too)
PREFILL = [pytest.param(i.id, d.values[0], b, id=f"{b}-{d.id}-{i.id}") for b in BATCHES for d in DTYPES
           for i in runnable("gdn_prefill")
           if ((i.id == "triton_recurrent") == (b == "L9_5_3-skip-G4") or (i.id == "triton_recurrent" and d.id == "fp32"
                                                                          and b == "L1-G1"))
           and not (i.id == "triton" and d.id == "bf16" and b != "L65_20_7-skip-G4")]
K, V = 60, 48


def _check_batch(o, state, before, args, slots, dtype, impl, ref=hf_sequence):
    q, k, v, g, beta, _, cu, _ = args
    for n, slot in enumerate(slots):
        s, e = int(cu[n]), int(cu[n + 1])
        if slot < 0:
            assert (o[s:e] == 0).all(), f"skipped sequence {n} has output"
            continue
        ro, rS = ref(q[s:e], k[s:e], v[s:e], g[s:e], beta[s:e], before[slot])
        assert rel_err(o[s:e], ro) < tol(dtype, "gdn_prefill", impl), f"sequence {n}"
        assert rel_err(state[slot], rS) < tol(dtype, "gdn_prefill", impl), f"state of sequence {n}"
    for s in set(range(state.shape[0])) - {x for x in slots if x >= 0}:
        assert torch.equal(state[s], before[s]), f"untouched slot {s} changed"


@pytest.mark.parametrize("impl,dtype,batch", PREFILL)
def test_prefill_vs_hf_chunk(impl, dtype, batch):
    lens, slots, HK, HV = BATCHES[batch]
    args = gdn_inputs(lens, slots, HK, HV, K, V, "cpu", dtype, torch.Generator().manual_seed(0))
    state = args[5]
    before = state.clone()
    o = call("gdn_prefill", impl, *args)
    assert o.dtype == dtype and o.shape == args[2].shape
    _check_batch(o, state, before, args, slots, dtype, impl)


@pytest.mark.parametrize("impl", runnable("gdn_prefill"))
def test_prefill_vs_fla_naive(impl):
    slots = [1, 0]
    args = gdn_inputs([33, 19], slots, 1, 2, 32, 40, "cpu", torch.float32, torch.Generator().manual_seed(5))
    before = args[5].clone()
    o = call("gdn_prefill", impl, *args)
    _check_batch(o, args[5], before, args, slots, torch.float32, impl, ref=fla_sequence)


@pytest.mark.parametrize("impl", [i for i in runnable("gdn_prefill") if i.id != "triton_recurrent"])
@pytest.mark.parametrize("strength", [8.0, 40.0], ids=["mid", "strong"])
def test_prefill_strong_decay_vs_hf_recurrent(impl, strength):
    """Per-step decays down to ~ -100 (x40): every exp(cumsum) inside a chunk underflows; the
    chunked forms must only ever form differences of it."""
    q, k, v, g, beta, state, cu, sl = gdn_inputs([70], [0], 2, 4, 32, 32, "cpu", torch.float32,
                                                 torch.Generator().manual_seed(3))
    g = g * strength
    S0 = state[0].clone()
    o = call("gdn_prefill", impl, q, k, v, g, beta, state, cu, sl)
    ro, rS = hf_sequence(q, k, v, g, beta, S0, form="recurrent")
    assert torch.isfinite(o).all()
    bound = tol(torch.float32, "gdn_prefill", impl)
    assert rel_err(o, ro) < bound and rel_err(state[0], rS) < bound


@pytest.mark.parametrize("impl,dtype", [pytest.param(i.id, d.values[0], id=f"{d.id}-{i.id}") for d in DTYPES
                                        for i in runnable("gdn_prefill") if i.id != "triton_recurrent" or d.id == "fp32"])
def test_prefill_in_two_calls_equals_one(impl, dtype):
    """Chunked prefill: each sequence's first part in one call, the rest in a second (the state
    carries over in its slot) == the whole sequences in one call."""
    need("gdn_prefill", impl)
    # (the recurrent kernel steps token by token under the interpreter: a shorter batch, same splits)
    lens, split, slots = ([40, 19, 1], [17, 1, 1], [2, 0, 1]) if impl != "triton_recurrent" else ([20, 9, 1], [7, 1, 1], [2, 0, 1])
    args = gdn_inputs(lens, slots, 1, 2, K, V, "cpu", dtype, torch.Generator().manual_seed(7))
    q, k, v, g, beta, state, cu, sl = args
    whole = state.clone()
    o_whole = call("gdn_prefill", impl, q, k, v, g, beta, whole, cu, sl)
    o = torch.full_like(o_whole, float("nan"))
    for part in (0, 1):
        rows = [torch.arange(int(cu[n]), int(cu[n]) + split[n]) if part == 0
                else torch.arange(int(cu[n]) + split[n], int(cu[n + 1])) for n in range(3)]
        idx = torch.cat(rows)
        cu_p = torch.tensor([0] + torch.tensor([len(r) for r in rows]).cumsum(0).tolist(), dtype=torch.int32)
        o[idx] = call("gdn_prefill", impl, q[idx], k[idx], v[idx], g[idx], beta[idx], state, cu_p, sl)
    bound = tol(dtype, "gdn_prefill", impl)
    assert rel_err(o, o_whole) < bound and rel_err(state, whole) < bound


def _prefix_then_steps(dtype, seed, steps=3):
    """(args of the whole batch, native whole-prefill output / state, state after the prefixes, rows per step)."""
    lens, slots = [63, 1, 65], [1, 3, 0]
    args = gdn_inputs([n + steps for n in lens], slots, 2, 4, 32, 40, "cpu", dtype, torch.Generator().manual_seed(seed))
    q, k, v, g, beta, state, cu, sl = args
    whole = state.clone()
    o_whole = call("gdn_prefill", "native", q, k, v, g, beta, whole, cu, sl)
    pre = torch.cat([torch.arange(int(cu[n]), int(cu[n]) + lens[n]) for n in range(3)])
    cu_pre = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    call("gdn_prefill", "native", q[pre], k[pre], v[pre], g[pre], beta[pre], state, cu_pre, sl)
    rows = [torch.tensor([int(cu[n]) + lens[n] + s for n in range(3)]) for s in range(steps)]
    return args, o_whole, whole, rows


@pytest.mark.parametrize("impl", runnable("gdn_decode"))
@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_then_decode_equals_whole_prefill(impl, dtype):
    need("gdn_decode", impl)
    (q, k, v, g, beta, state, _, sl), o_whole, whole, steps = _prefix_then_steps(dtype, seed=1)
    for rows in steps:
        o = call("gdn_decode", impl, q[rows], k[rows], v[rows], g[rows], beta[rows], state, sl)
        assert rel_err(o, o_whole[rows]) < tol(dtype)
    assert rel_err(state, whole) < 1e-5


@pytest.mark.parametrize("impl", runnable("gdn_packed_decode"))
@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_then_packed_decode_equals_whole_prefill(impl, dtype):
    """The packed step from raw gate input a and beta logits b; the whole prefill gets g and beta
    from them as Qwen3NextGatedDeltaNet computes them."""
    need("gdn_packed_decode", impl)
    (q, k, v, g, beta, state, cu, sl), _, _, steps = _prefix_then_steps(dtype, seed=2)
    gen = torch.Generator().manual_seed(9)
    HV = v.shape[1]
    a, b = (2 * torch.randn(q.shape[0], HV, generator=gen)).to(dtype), torch.randn(q.shape[0], HV, generator=gen).to(dtype)
    A_log, dt_bias = torch.randn(HV, generator=gen) - 1.0, torch.randn(HV, generator=gen)
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias)
    beta = b.float().sigmoid()          # fp32, as the packed step computes it (a bf16 beta would differ by its rounding)
    whole, start = state.clone(), state.clone()
    o_whole = call("gdn_prefill", "native", q, k, v, g, beta, whole, cu, sl)
    # the prefixes again with these gates
    lens = [int(cu[n + 1] - cu[n]) - len(steps) for n in range(3)]
    pre = torch.cat([torch.arange(int(cu[n]), int(cu[n]) + lens[n]) for n in range(3)])
    cu_pre = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    state = start
    call("gdn_prefill", "native", q[pre], k[pre], v[pre], g[pre], beta[pre], state, cu_pre, sl)
    for rows in steps:
        qkv = torch.cat([q[rows].flatten(1), k[rows].flatten(1), v[rows].flatten(1)], 1)
        o = call("gdn_packed_decode", impl, qkv, a[rows], b[rows], A_log, dt_bias, state, sl, 2, HV, 32)
        assert o.shape == (3, HV, 40) and rel_err(o, o_whole[rows]) < tol(dtype)
    assert rel_err(state, whole) < 1e-5


@pytest.mark.parametrize("impl", runnable("gdn_decode"))
@pytest.mark.parametrize("HK,HV", [(4, 4), (2, 4), (1, 4)], ids=["G1", "G2", "G4"])
def test_decode_vs_hf_recurrent_and_skip(impl, HK, HV):
    g_ = torch.Generator().manual_seed(2)
    N = 4
    q, k, v = torch.randn(N, HK, K, generator=g_), torch.randn(N, HK, K, generator=g_), torch.randn(N, HV, 40, generator=g_)
    g = F.logsigmoid(torch.randn(N, HV, generator=g_))
    beta = torch.rand(N, HV, generator=g_)
    state = torch.randn(6, HV, K, 40, generator=g_)
    before = state.clone()
    slots = torch.tensor([5, -1, 0, 2], dtype=torch.int32)
    o = call("gdn_decode", impl, q, k, v, g, beta, state, slots)
    assert (o[1] == 0).all()
    for n in (0, 2, 3):
        s = int(slots[n])
        ro, rS = hf_sequence(q[n][None], k[n][None], v[n][None], g[n][None], beta[n][None], before[s], form="recurrent")
        assert rel_err(o[n], ro[0]) < 1e-5 and rel_err(state[s], rS) < 1e-5
    for s in (1, 3, 4):
        assert torch.equal(state[s], before[s])


@pytest.mark.parametrize("impl", runnable("gdn_packed_decode"))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("HK,HV", [(2, 2), (2, 4), (1, 4)], ids=["G1", "G2", "G4"])
def test_packed_decode_vs_fla(impl, dtype, HK, HV):
    from gdn_refs import fla_gate
    g_ = torch.Generator().manual_seed(4)
    N, slots = 4, [4, -1, 0, 2]
    qkv = torch.randn(N, 2 * HK * K + HV * V, generator=g_).to(dtype)
    a, b = (3 * torch.randn(N, HV, generator=g_)).to(dtype), torch.randn(N, HV, generator=g_).to(dtype)
    a[0, 0] = 25.0                                       # softplus' linear region
    A_log, dt_bias = torch.randn(HV, generator=g_) - 1.0, torch.randn(HV, generator=g_)
    state = 0.3 * torch.randn(6, HV, K, V, generator=g_)
    before = state.clone()
    o = call("gdn_packed_decode", impl, qkv, a, b, A_log, dt_bias, state, torch.tensor(slots, dtype=torch.int32),
             HK, HV, K)
    assert o.dtype == dtype and o.shape == (N, HV, V) and (o[1] == 0).all()
    g = fla_gate().naive_gdn_gate(a, A_log, dt_bias)
    q, k, v = qkv.float().split([HK * K, HK * K, HV * V], dim=1)
    for n, s in enumerate(slots):
        if s < 0:
            continue
        ro, rS = fla_sequence(q[n].view(1, HK, K), k[n].view(1, HK, K), v[n].view(1, HV, V), g[n][None],
                              torch.sigmoid(b[n].float())[None], before[s])
        assert rel_err(o[n], ro[0]) < tol(dtype) and rel_err(state[s], rS) < tol(dtype)
    for s in (1, 3, 5):
        assert torch.equal(state[s], before[s]), f"untouched slot {s} changed"


@pytest.mark.parametrize("impl", [i for i in runnable("gdn_prefill") if i.id != "native"])
def test_prefill_reads_views_through_strides(impl):
    """q, k, v as column slices of the packed conv output and g, beta as slices of wider rows, as a
    model passes them: the same numbers as dense copies."""
    need("gdn_prefill", impl)
    lens, slots, HK, HV, Kd, Vd = [9, 20], [0, 1], 1, 2, 16, 24
    q, k, v, g, beta, state, cu, sl = gdn_inputs(lens, slots, HK, HV, Kd, Vd, "cpu", torch.bfloat16,
                                                 torch.Generator().manual_seed(6))
    T = q.shape[0]
    qkv = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], 1)
    qv, kv, vv = (x.view(T, -1, d) for x, d in zip(qkv.split([HK * Kd, HK * Kd, HV * Vd], 1), (Kd, Kd, Vd)))
    gb = torch.stack([g, beta.float()], 2)                              # [T, HV, 2]: strided g, beta
    s_dense, s_view = state.clone(), state.clone()
    o_dense = call("gdn_prefill", impl, q, k, v, g, beta, s_dense, cu, sl)
    o_view = call("gdn_prefill", impl, qv, kv, vv, gb[..., 0], gb[..., 1].to(beta.dtype), s_view, cu, sl)
    assert not qv.is_contiguous() and not gb[..., 0].is_contiguous()
    assert torch.equal(o_dense, o_view) and torch.equal(s_dense, s_view)


# -- dispatch, bad inputs, index values ------------------------------------------------------
def test_xpu_dispatch_gets_triton():
    ok = platform.current().triton is None                  # interpreter or a GPU
    with platform.simulate("xpu"):
        for op, chosen in (("gdn_prefill", "triton"), ("gdn_decode", "triton"), ("gdn_packed_decode", "triton")):
            rows = {i.name: r for i, r in registry.get(op).explain()}
            if ok:   # (fla, where it runs -- a GPU machine with it installed -- ranks above)
                assert [n for n, r in rows.items() if r is None] in ([chosen], ["fla"]), (op, rows)
    with platform.simulate("cpu"):
        assert {i.name: r for i, r in registry.get("gdn_packed_decode").explain()}["chain"] is None
        assert {i.name: r for i, r in registry.get("gdn_prefill").explain()}["native"] is None


def _prefill_args():
    return list(gdn_inputs([5, 3], [0, 1], 2, 4, 16, 8, "cpu", torch.float32, torch.Generator()))


BAD = [  # (id, op, how to break the arguments, message)
    ("gva", "gdn_prefill", lambda a: a.__setitem__(2, torch.randn(8, 3, 8)),
     r"gdn_prefill: v has 3 heads, not a multiple of the 2 q/k heads \(each q/k head serves HV // HK value heads\)"),
    ("k_shape", "gdn_prefill", lambda a: a.__setitem__(1, a[1][:, :1]), r"gdn_prefill: k shape \(8, 1, 16\) != \(8, 2, 16\)"),
    ("g_per_channel", "gdn_prefill", lambda a: a.__setitem__(3, torch.zeros(8, 4, 16)),
     r"gdn_prefill: g shape \(8, 4, 16\) != \(8, 4\)"),
    ("state_dtype", "gdn_prefill", lambda a: a.__setitem__(5, a[5].bfloat16()),
     r"gdn_prefill: state dtype bfloat16 not in \(float32\)"),
    ("state_heads", "gdn_prefill", lambda a: a.__setitem__(5, a[5][:, :2]),
     r"gdn_prefill: state shape \(3, 2, 16, 8\) != \(\*, 4, 16, 8\)"),
    ("q_int", "gdn_prefill", lambda a: a.__setitem__(0, a[0].long()), r"gdn_prefill: q dtype int64 not in"),
    ("slots_float", "gdn_prefill", lambda a: a.__setitem__(7, a[7].float()),
     r"gdn_prefill: slots dtype float32 not in \(int32, int64\)"),
]


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_prefill_rejects_bad_input(case):
    _, op, breaks, msg = case
    args = _prefill_args()
    breaks(args)
    with pytest.raises(KernelgateError, match=f"^{msg}"):
        registry.get(op)(*args)


def test_decode_and_packed_reject_bad_input():
    q, k, v, g, _, state, _, _ = _prefill_args()
    sl = torch.zeros(8, dtype=torch.int32)
    with pytest.raises(KernelgateError, match=r"^gdn_decode: beta shape \(8, 3\) != \(8, 4\)$"):
        ops.gdn_decode(q, k, v, g, torch.rand(8, 3), state, sl)
    with pytest.raises(KernelgateError, match=r"^gdn_decode: v has 6 heads, not a multiple of the 4 q/k heads"):
        ops.gdn_decode(torch.randn(8, 4, 16), torch.randn(8, 4, 16), torch.randn(8, 6, 8), torch.zeros(8, 6),
                       torch.rand(8, 6), torch.zeros(3, 6, 16, 8), sl)
    qkv = torch.randn(2, 2 * 2 * 16 + 4 * 8 + 1)
    one = torch.zeros(2, dtype=torch.int32)
    with pytest.raises(KernelgateError, match=r"^gdn_packed_decode: qkv width 97 != 2\*2\*16 \+ 4\*V for some V > 0$"):
        ops.gdn_packed_decode(qkv, torch.randn(2, 4), torch.randn(2, 4), torch.zeros(4), torch.zeros(4), state, one, 2, 4, 16)
    with pytest.raises(KernelgateError, match=r"^gdn_packed_decode: num_v_heads 3 is not a multiple of num_k_heads 2$"):
        ops.gdn_packed_decode(qkv, torch.randn(2, 3), torch.randn(2, 3), torch.zeros(3), torch.zeros(3), state, one, 2, 3, 16)
    with pytest.raises(KernelgateError, match=r"^gdn_packed_decode: num_k_heads must be a positive int, got 2.0$"):
        ops.gdn_packed_decode(qkv, torch.randn(2, 4), torch.randn(2, 4), torch.zeros(4), torch.zeros(4), state, one, 2.0, 4, 16)
    qkv = torch.randn(2, 2 * 2 * 16 + 4 * 8)
    with pytest.raises(KernelgateError, match=r"^gdn_packed_decode: dt_bias shape \(64,\) != \(4,\)$"):
        ops.gdn_packed_decode(qkv, torch.randn(2, 4), torch.randn(2, 4), torch.zeros(4), torch.zeros(64), state, one, 2, 4, 16)
