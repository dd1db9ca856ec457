"""The contract for bad inputs (issue 20), for every implementation that runs on CPU: native,
Triton under the interpreter with the platform simulated as cuda and xpu, the chain and
grouped_mm forms.

- checked mode (`registry.checked()`, KERNELGATE_CHECKS=1): a bad index value is one clear
  KernelgateError naming the op, the argument and the value, raised before anything is written;
- checks off: an out-of-range slot / expert id is the same call with that entry skipped (-1),
  a sequence with out-of-range bounds is skipped and rows no sequence covers are zeros, state
  slots the call does not own stay bit-identical;
- strided index tensors (views) give the same result as dense ones;
- edge shapes and wrong argument types answer with one line naming the argument.
"""
import itertools

import pytest
import torch

from kernelgate import KernelgateError, ops, registry
from kernelgate.ops.kda import kda_decode as kda_decode_mod
from kernelgate.ops.kda import kda_prefill as kda_prefill_mod
from kernelgate.ops.gdn import gdn_decode as gdn_decode_mod
from kernelgate.ops.gdn import gdn_prefill as gdn_prefill_mod
from kernelgate.ops.indexer import fp8_paged_mqa_logits as fp8_paged_mqa_logits_mod
from kernelgate.ops.indexer import indexer_q as indexer_q_mod
from kernelgate.ops.moe import fused_experts as fused_experts_mod
from kernelgate.ops.moe import fused_experts_fp8 as fused_experts_fp8_mod
from kernelgate.ops.quant import fp8_linear as fp8_linear_mod
from kernelgate.tools.testing import assert_close

from helpers.contract import all_params, clone, params, run

F32 = torch.float32
POOL = 4


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _cu(lens):
    return torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32)


# -- builders: (args list, kwargs) in fp32 on CPU, slots given, a pool of POOL slots --------
def conv(slots, lens=None, D=12):
    lens = lens or (3, 5, 2, 4)[:slots.shape[0]]
    g = _gen()
    T = sum(lens)
    return [torch.randn(T, D, generator=g), 0.5 * torch.randn(D, 4, generator=g), torch.randn(D, generator=g),
            torch.randn(POOL, D, 3, generator=g), _cu(lens), slots], {}


def conv_update(slots):
    g = _gen(1)
    N, D = slots.shape[0], 12
    return [torch.randn(N, D, generator=g), 0.5 * torch.randn(D, 4, generator=g), torch.randn(D, generator=g),
            torch.randn(POOL, D, 3, generator=g), slots], {}


def decode(slots):
    args, kw = kda_decode_mod.decode_case(slots.shape[0], [0], H=2, K=8, V=8, pool=POOL).make("cpu", F32, _gen(2))
    return [*args[:6], slots], kw


def packed(slots):
    args, kw = kda_decode_mod.packed_case(slots.shape[0], [0], H=2, K=8, V=8, pool=POOL).make("cpu", F32, _gen(3))
    return [*args[:6], slots, *args[7:]], kw


def prefill(slots, lens=None):
    lens = lens or (3, 5, 2, 4)[:slots.shape[0]]
    args = kda_prefill_mod.make_inputs(list(lens), [0] * len(lens), 2, 8, 8, "cpu", F32, _gen(4), pool=POOL)
    return [*args[:7], slots], {}


def gdn_prefill(slots, lens=None):
    lens = lens or (3, 5, 2, 4)[:slots.shape[0]]
    args = gdn_prefill_mod.gdn_inputs(list(lens), [0] * len(lens), 1, 2, 8, 8, "cpu", F32, _gen(4), pool=POOL)
    return [*args[:7], slots], {}


def gdn_decode(slots):
    args, kw = gdn_decode_mod.decode_case(slots.shape[0], [0], HK=1, HV=2, K=8, V=8, pool=POOL).make("cpu", F32, _gen(2))
    return [*args[:6], slots], kw


def gdn_packed(slots):
    args, kw = gdn_decode_mod.packed_case(slots.shape[0], [0], HK=1, HV=2, K=8, V=8, pool=POOL).make("cpu", F32, _gen(3))
    return [*args[:6], slots, *args[7:]], kw


# op -> (builder, position of slots, position of the state pool, positions of per-token args)
SLOT_OPS = {
    "short_conv": (conv, 5, 3, (0,)),
    "short_conv_update": (conv_update, 4, 3, (0,)),
    "kda_decode": (decode, 6, 5, (0, 1, 2, 3, 4)),
    "kda_packed_decode": (packed, 6, 5, (0, 1, 2)),
    "kda_prefill": (prefill, 7, 5, (0, 1, 2, 3, 4)),
    "gdn_decode": (gdn_decode, 6, 5, (0, 1, 2, 3, 4)),
    "gdn_packed_decode": (gdn_packed, 6, 5, (0, 1, 2)),
    "gdn_prefill": (gdn_prefill, 7, 5, (0, 1, 2, 3, 4)),
}


def _native(op, args, kwargs):
    return registry.get(op).reference(*args, **kwargs)


@pytest.mark.parametrize("bad,dtype", [(POOL, torch.int32), (9, torch.int32), (2**33 + 1, torch.int64)],
                         ids=["slot_eq_pool", "slot9", "slot2e33_int64"])
@pytest.mark.parametrize("op,plat,impl", all_params(SLOT_OPS))
def test_out_of_range_slot_is_skipped(op, plat, impl, bad, dtype):
    build, si, sti, _ = SLOT_OPS[op]
    args, kw = build(torch.tensor([2, bad, 0], dtype=dtype))
    before = args[sti].clone()
    a, k = clone(args, kw)
    with registry.checked(True), pytest.raises(
            KernelgateError, match=rf"^{op}: slots\[1\] = {bad} outside \[0, {POOL}\) \(negative = skip\)$"):
        run(op, plat, impl, a, k)
    assert torch.equal(a[sti], before), "checked mode wrote state before raising"

    skip_args, skip_kw = clone(args, kw)
    skip_args[si] = torch.tensor([2, -1, 0], dtype=dtype)
    nat_args, nat_kw = clone(skip_args, skip_kw)
    with registry.checked(False):
        out = run(op, plat, impl, a, k)
        ref = run(op, plat, impl, skip_args, skip_kw)
    # exactly the call with that sequence skipped (-1), which matches the native reference
    assert torch.equal(out, ref) and torch.equal(a[sti], skip_args[sti])
    assert_close(out, _native(op, nat_args, nat_kw), 1e-5)
    assert_close(a[sti], nat_args[sti], 1e-5, what="state")
    for s in (1, 3):  # slots the call does not own: bit-identical
        assert torch.equal(a[sti][s], before[s]), f"state slot {s} modified"
    if op.startswith(("kda", "gdn")):  # a skipped sequence's output is zeros
        rows = slice(3, 8) if op.endswith("_prefill") else 1
        assert (out[rows] == 0).all()


@pytest.mark.parametrize("op,plat,impl", all_params(SLOT_OPS))
def test_duplicate_slots_are_an_error_in_checked_mode(op, plat, impl):
    build, _, _, _ = SLOT_OPS[op]
    args, kw = build(torch.tensor([2, 0, 2], dtype=torch.int32))
    with registry.checked(True), pytest.raises(KernelgateError, match=rf"^{op}: slots holds slot 2 at \[0, 2\]"):
        run(op, plat, impl, args, kw)


# -- cu_seqlens that do not start at 0, decrease, or end elsewhere than T (T = 8 rows) --------
# (id, cu_seqlens, slots, rows the valid sequences cover, their cu / slots as a well-formed batch, error)
BAD_CU = [
    ("start2", [2, 5, 8], [1, 0], (2, 8), [0, 3, 6], [1, 0], r"cu_seqlens\[0\] = 2, must be 0"),
    ("negative", [-3, 2, 8], [1, 0], (2, 8), [0, 6], [0], r"cu_seqlens\[0\] = -3, must be 0"),
    ("end_short", [0, 3, 5], [1, 0], (0, 5), [0, 3, 5], [1, 0], r"cu_seqlens\[-1\] = 5 != the token count 8"),
    ("past_end", [0, 3, 12], [1, 0], (0, 3), [0, 3], [1], r"cu_seqlens\[-1\] = 12 != the token count 8"),
    ("decreasing", [0, 6, 2, 2], [1, 0, 2], (0, 6), [0, 6], [1],
     r"cu_seqlens\[2\] = 2 < cu_seqlens\[1\] = 6 \(must be non-decreasing\)"),
]
CU_OPS = {"short_conv": (conv, 4, 5, 3, (0,)), "kda_prefill": (prefill, 6, 7, 5, (0, 1, 2, 3, 4)),
          "gdn_prefill": (gdn_prefill, 6, 7, 5, (0, 1, 2, 3, 4))}


@pytest.mark.parametrize("case", BAD_CU, ids=[c[0] for c in BAD_CU])
@pytest.mark.parametrize("op,plat,impl", all_params(CU_OPS))
def test_bad_cu_seqlens(op, plat, impl, case):
    _, cu, slots, (r0, r1), sub_cu, sub_slots, err = case
    build, ci, si, sti, tok = CU_OPS[op]
    args, kw = build(torch.tensor(slots, dtype=torch.int32), lens=(8,))
    args[ci] = torch.tensor(cu, dtype=torch.int32)
    before = args[sti].clone()
    a, k = clone(args, kw)
    with registry.checked(True), pytest.raises(KernelgateError, match=rf"^{op}: {err}"):
        run(op, plat, impl, a, k)
    with registry.checked(False):
        out = run(op, plat, impl, a, k)
    # expected: the valid sequences as a well-formed batch of their rows, zeros elsewhere
    sub, sub_kw = clone(args, kw)
    for i in tok:
        sub[i] = sub[i][r0:r1]
    sub[ci], sub[si] = torch.tensor(sub_cu, dtype=torch.int32), torch.tensor(sub_slots, dtype=torch.int32)
    want = torch.zeros_like(out)
    want[r0:r1] = _native(op, sub, sub_kw)
    assert_close(out, want, 1e-5)
    assert (out[:r0] == 0).all() and (out[r1:] == 0).all(), "rows outside every sequence must be zeros"
    assert_close(a[sti], sub[sti], 1e-5, what="state")
    for s in set(range(POOL)) - set(sub_slots):
        assert torch.equal(a[sti][s], before[s]), f"state slot {s} of a skipped sequence modified"


def test_host_hint_must_match_in_checked_mode():
    args, kw = conv(torch.tensor([1, 0, 2], dtype=torch.int32))
    with registry.checked(True), pytest.raises(KernelgateError, match=r"^short_conv: cu_seqlens_cpu \[0, 3, 8, 9\]"):
        ops.short_conv(*args, cu_seqlens_cpu=torch.tensor([0, 3, 8, 9], dtype=torch.int32))


# -- expert ids ------------------------------------------------------------------------------
EXPERTS = {"fused_experts": fused_experts_mod.make_inputs, "fused_experts_fp8": fused_experts_fp8_mod.make_inputs}


def _one_token(op, impl) -> bool:
    """An implementation that takes one token only (the FP8 experts GEMV): its bad-input tests use T=1."""
    args, kw = EXPERTS[op](5, 32, 16, 8, 2, F32, "cpu", _gen(0))
    supports = registry.get(op).impls[impl].supports
    return supports is not None and supports(*args, **kw) is not None


@pytest.mark.parametrize("op,plat,impl", all_params(EXPERTS))
def test_expert_ids_out_of_range(op, plat, impl):
    if _one_token(op, impl):   # a one-token form: the three bad ids in one row of 4
        args, kw = EXPERTS[op](1, 32, 16, 8, 4, F32, "cpu", _gen(5))
        bad = ((0, 1), (0, 2), (0, 3))
    else:
        args, kw = EXPERTS[op](5, 32, 16, 8, 2, F32, "cpu", _gen(5))
        bad = ((0, 1), (2, 0), (3, 1))
    args = list(args)
    ids = args[4].long()
    ids[bad[0]], ids[bad[1]], ids[bad[2]] = 8, 2**32 + 1, -7      # == E, wraps to 1 as int32, negative
    args[4] = ids
    with registry.checked(True), pytest.raises(
            KernelgateError, match=rf"^{op}: topk_ids\[0, 1\] = 8 outside \[0, 8\) \(expert ids"):
        run(op, plat, impl, args, kw)
    with registry.checked(False):
        out = run(op, plat, impl, args, kw)
    skip = list(args)
    skip[4] = torch.where((ids >= 0) & (ids < 8), ids, -1)
    ref = _native(op, skip, kw)
    assert_close(out, ref, 1e-5)
    keep = skip[4].clone()
    keep[bad[1]] = 1    # a wrapped id must not be read as expert 1
    assert (ref - _native(op, [*skip[:4], keep, *skip[5:]], kw)).abs().max() > 1e-3


@pytest.mark.parametrize("op,plat,impl", all_params(EXPERTS))
def test_strided_expert_tensors(op, plat, impl):
    """topk_ids / topk_weights (and fp8 scales) as views of every other row of a bigger buffer:
    the gaps hold expert id 99 (skipped if read) and weight 99."""
    args, kw = EXPERTS[op](1 if _one_token(op, impl) else 5, 32, 16, 8, 2, F32, "cpu", _gen(9))
    dense = list(args)
    views = [*args[:3], _every_other(args[3]), _every_other(args[4]), *(_every_other(a) for a in args[5:])]
    assert views[4].stride(0) == 2 * views[4].shape[1]
    with registry.checked(True):
        out = run(op, plat, impl, views, kw)
        ref = run(op, plat, impl, dense, kw)
    assert torch.equal(out, ref)


# -- strided index tensors (views) read through their strides --------------------------------
def _every_other(t):
    buf = torch.full((2 * t.shape[0], *t.shape[1:]), 99, dtype=t.dtype)
    buf[::2] = t
    return buf[::2]


STRIDED = {   # op -> (builder, positions of the index / small tensors to pass as [::2] views)
    "short_conv": (conv, (2, 4, 5)),             # bias, cu_seqlens, slots
    "short_conv_update": (conv_update, (2, 4)),  # bias, slots
    "kda_decode": (decode, (6,)),
    "kda_packed_decode": (packed, (3, 4, 6)),    # A_log, dt_bias, slots
    "kda_prefill": (prefill, (6, 7)),
    "gdn_decode": (gdn_decode, (6,)),
    "gdn_packed_decode": (gdn_packed, (3, 4, 6)),    # A_log, dt_bias, slots
    "gdn_prefill": (gdn_prefill, (6, 7)),
}


@pytest.mark.parametrize("op,plat,impl", all_params(STRIDED))
def test_strided_index_tensors(op, plat, impl):
    build, views = STRIDED[op]
    si, sti = SLOT_OPS[op][1], SLOT_OPS[op][2]
    args, kw = build(torch.tensor([0, 1, 3, 5], dtype=torch.int32)[::2].contiguous())   # slots 0, 3 (issue 20)
    dense, dense_kw = clone(args, kw)
    for i in views:
        if args[i] is not None:
            args[i] = _every_other(args[i])
    assert args[si].stride(0) == 2
    before = args[sti].clone()
    with registry.checked(True):
        out = run(op, plat, impl, args, kw)
        ref = run(op, plat, impl, dense, dense_kw)
    assert torch.equal(out, ref) and torch.equal(args[sti], dense[sti])
    assert torch.equal(args[sti][1], before[1]) and torch.equal(args[sti][2], before[2])
    assert not torch.equal(args[sti][3], before[3]), "slot 3 (slots[1] of the view) not updated"


# -- edge shapes and argument types ------------------------------------------------------------
@pytest.mark.parametrize("flat", [True, False], ids=["flat", "3d"])
def test_kda_gate_empty_batch(flat):
    f = torch.randn(0, 2 * 16) if flat else torch.randn(0, 2, 16)
    g = ops.kda_gate(f, torch.randn(2), torch.randn(32))
    assert g.shape == (0, 2, 16) and g.dtype == F32


@pytest.mark.parametrize("op,plat,impl", params("gated_rms_norm"))
def test_gated_rms_norm_empty(op, plat, impl):
    with pytest.raises(KernelgateError, match=r"^gated_rms_norm: x last dim \(channels\) must be > 0"):
        run(op, plat, impl, (torch.randn(4, 0), torch.randn(0), torch.randn(4, 0)))
    y = run(op, plat, impl, (torch.randn(0, 64), torch.randn(64), torch.randn(0, 64)))
    assert y.shape == (0, 64)


def _x(*s):
    return torch.randn(*s)


def _fp8_experts(ids=lambda t: t):
    args = list(fused_experts_fp8_mod.make_inputs(2, 16, 8, 4, 2, F32, "cpu", _gen())[0])
    args[4] = ids(args[4])
    return args


WRONG_TYPES = [   # (id, call, message): a float where an int is required, strings for numbers
    ("topk_float", lambda: ops.biased_grouped_topk(_x(3, 16), None, 2.0, 1, 1, True, 1.0),
     r"topk must be an int >= 1, got 2.0"),
    ("topk_bool", lambda: ops.biased_grouped_topk(_x(3, 16), None, True, 1, 1, True, 1.0),
     r"topk must be an int >= 1, got True"),
    ("num_heads_float", lambda: ops.kda_packed_decode(*packed(torch.tensor([0]))[0][:7], 2.0, 8),
     r"num_heads must be a positive int, got 2.0"),
    ("group_size_float", lambda: ops.gated_rms_norm(_x(2, 8), _x(8), None, 1e-6, 4.0),
     r"group_size 4.0 must be a positive divisor"),
    ("eps_str", lambda: ops.gated_rms_norm(_x(2, 8), _x(8), None, "1e-6"), r"eps must be a number > 0, got '1e-6'"),
    ("prenorm_int", lambda: ops.gated_rms_norm(_x(2, 8), _x(8), prenorm=1), r"prenorm must be a bool, got 1"),
    ("weight_int", lambda: ops.gated_rms_norm(_x(2, 8), torch.ones(8, dtype=torch.int32)),
     r"weight dtype int32 not in"),
    ("scale_str", lambda: ops.kda_decode(*decode(torch.tensor([0]))[0], scale="0.1"),
     r"scale must be None or a number > 0, got '0.1'"),
    ("limit_str", lambda: ops.silu_and_mul_clamp(_x(2, 8), "7"), r"limit must be a number > 0, got '7'"),
    ("lower_bound_str", lambda: ops.kda_gate(_x(2, 16), _x(2), None, "-1"), r"lower_bound '-1' not None or a number"),
    ("slots_float", lambda: ops.short_conv_update(*conv_update(torch.tensor([0.0]))[0]),
     r"slots dtype float32 not in \(int32, int64\)"),
    ("cu_seqlens_float", lambda: ops.short_conv(*conv(torch.tensor([0, 1, 2], dtype=torch.int32))[0][:4],
                                                torch.tensor([0.0, 3, 8, 10]), torch.tensor([0, 1, 2])),
     r"cu_seqlens dtype float32 not in"),
    ("swiglu_limit_bool", lambda: ops.fused_experts(*fused_experts_mod.make_inputs(2, 16, 8, 4, 2, F32, "cpu", _gen())[0],
                                                    swiglu_limit=True), r"swiglu_limit must be None or a number > 0"),
    ("fp8_block_float", lambda: ops.fp8_linear(*fp8_linear_mod.make_inputs(2, 8, 32, (8, 16), F32, "cpu", _gen())[0],
                                               block_size=(8.0, 16)),
     r"block_size must be None \(per-channel scales\) or two ints > 0, got \(8.0, 16\)"),
    ("fp8_weight_uint8", lambda: ops.fp8_linear(_x(2, 32), torch.zeros(8, 32, dtype=torch.uint8), torch.ones(1, 1)),
     r"weight dtype uint8 not in"),
    ("fp8_experts_ids_float", lambda: ops.fused_experts_fp8(*_fp8_experts(ids=lambda t: t.float())),
     r"topk_ids dtype float32 not in \(int32, int64\)"),
    ("fp8_experts_block_str", lambda: ops.fused_experts_fp8(*_fp8_experts(), block_size="128"),
     r"block_size must be None \(per-channel scales\) or two ints > 0, got '128'"),
    ("fp8_experts_limit_str", lambda: ops.fused_experts_fp8(*_fp8_experts(), swiglu_limit="7"),
     r"swiglu_limit must be None or a number > 0, got '7'"),
    ("too_few_args", lambda: ops.kda_decode(_x(1, 2, 8)), r"missing a required argument: 'k'"),
    ("too_many_args", lambda: ops.silu_and_mul_clamp(_x(2, 8), 1.0, 2.0), r"too many positional arguments"),
]


@pytest.mark.parametrize("call,message", [(c, m) for _, c, m in WRONG_TYPES], ids=[i for i, _, _ in WRONG_TYPES])
def test_wrong_argument_types(call, message):
    with pytest.raises(KernelgateError, match=r"^\w+: .*" + message):
        call()


# -- indexer: positions, cache slots, block tables and context lengths --------------------------
@pytest.mark.parametrize("op,plat,impl", params("fused_q_indexer_rope_hadamard_quant"))
def test_indexer_q_positions(op, plat, impl):
    g = _gen(6)
    q, w = 3 * torch.randn(4, 3, 128, generator=g), torch.randn(4, 3, generator=g)
    freqs = indexer_q_mod.precompute_freqs_cis(32)
    pos = torch.tensor([5, -1, 31, 32], dtype=torch.int32)
    with registry.checked(True), pytest.raises(
            KernelgateError, match=rf"^{op}: positions\[1\] = -1 outside \[0, 32\) \(rows of freqs_cis\)$"):
        run(op, plat, impl, (q, w, 0.125, freqs, pos))
    with registry.checked(False):
        codes, w_out = run(op, plat, impl, (q, w, 0.125, freqs, pos))
        # a strided view of the positions reads the same values
        strided = run(op, plat, impl, (q, w, 0.125, freqs, _every_other(pos)))
    assert torch.equal(codes.view(torch.uint8), strided[0].view(torch.uint8)) and torch.equal(w_out, strided[1])
    # out-of-range positions (-1 no longer wraps to the last row): zero codes, zero weight
    assert (codes[[1, 3]].view(torch.uint8) == 0).all() and (w_out[[1, 3]] == 0).all()
    keep = [0, 2]
    ref = registry.get(op).reference(q[keep], w[keep], 0.125, freqs, pos[keep])
    registry.get(op).compare((codes[keep], w_out[keep]), ref, F32, None)


@pytest.mark.parametrize("op,plat,impl", params("indexer_k_quant_and_cache"))
def test_k_cache_slots(op, plat, impl):
    g = _gen(7)
    k = 2 * torch.randn(4, 128, generator=g)
    kv = torch.randint(0, 256, (2, 16 * 132), generator=g, dtype=torch.uint8)
    slots = torch.tensor([3, 32, -1, 40])              # 32 cache slots: 32 and 40 are past the end
    before = kv.clone()
    with registry.checked(True), pytest.raises(
            KernelgateError, match=rf"^{op}: slot_mapping\[1\] = 32 outside \[0, 32\) \(cache slots; negative = skip\)$"):
        run(op, plat, impl, (k, kv, slots, 16))
    assert torch.equal(kv, before)
    with registry.checked(False):
        run(op, plat, impl, (k, kv, _every_other(slots), 16))     # a strided view of the slots, too
        want = before.clone()
        run(op, plat, impl, (k[:1], want, torch.tensor([3]), 16))
    assert torch.equal(kv, want), "only token slot 3 may change"
    assert not torch.equal(kv, before)


def _logits_inputs():
    case = fp8_paged_mqa_logits_mod._logits_case(2, 1, 4, [20, 17], 16)
    return list(case.make("cpu", torch.float8_e4m3fn, _gen(8))[0])   # q, kv, w, ctx, tables [2, 2], L=20


@pytest.mark.parametrize("op,plat,impl", params("fp8_paged_mqa_logits"))
def test_logits_block_ids_and_context(op, plat, impl):
    args = _logits_inputs()
    with registry.checked(False):
        good = run(op, plat, impl, args)
    bad_blk, bad_ctx = list(args), list(args)
    bad_blk[4] = args[4].clone()
    bad_blk[4][0, 1] = 999                              # tokens 16..19 of sequence 0
    bad_ctx[3] = torch.tensor([20, 33], dtype=torch.int32)   # the table maps 2 x 16 = 32 tokens
    nb = args[1].shape[0]
    with registry.checked(True):
        with pytest.raises(KernelgateError, match=rf"^{op}: block_tables\[0, 1\] = 999 outside \[0, {nb}\)"):
            run(op, plat, impl, bad_blk)
        with pytest.raises(KernelgateError, match=rf"^{op}: context_lens\[1\] = 33 outside \[0, 32\]"):
            run(op, plat, impl, bad_ctx)
    with registry.checked(False):
        out_blk = run(op, plat, impl, bad_blk)
        out_ctx = run(op, plat, impl, bad_ctx)
        # strided context_lens / block_tables (column-major) read as they are
        strided = run(op, plat, impl, [*args[:3], _every_other(args[3]), args[4].t().contiguous().t(), args[5]])
    assert torch.isneginf(out_blk[0, 16:20]).all(), "a block outside the cache must give -inf (no clamp)"
    assert torch.equal(out_blk[0, :16], good[0, :16]) and torch.equal(out_blk[1], good[1])
    assert torch.isneginf(out_ctx[1]).all() and torch.equal(out_ctx[0], good[0])
    assert torch.equal(strided, good)
    assert_close(out_blk, registry.get(op).reference(*bad_blk), 2e-4)
