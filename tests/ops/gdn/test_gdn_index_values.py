"""The bad-index contract (tests/ops/test_bad_inputs.py's) for the GDN ops, on every implementation
that runs on CPU (native, chain; Triton under the interpreter, dispatched as on cuda and xpu):
checked mode turns an out-of-range slot, a slot given twice or malformed cu_seqlens into one
KernelgateError before anything is written; with checks off such a sequence is skipped (zeros,
its state untouched) and the rest is the well-formed call's result; index tensors are read
through their strides."""
import pytest
import torch

from kernelgate import KernelgateError, registry
from kernelgate.ops.gdn.gdn_decode import decode_case, packed_case
from kernelgate.ops.gdn.gdn_prefill import gdn_inputs
from kernelgate.testing import assert_close

from helpers.contract import TRITON, clone, run

POOL = 4
IMPLS = {
    "gdn_prefill": [("cpu", "native")] + TRITON + [("xpu", "triton_recurrent")],
    "gdn_decode": [("cpu", "native")] + TRITON,
    "gdn_packed_decode": [("cpu", "native"), ("cpu", "chain")] + TRITON,
}


def params(ops):
    return [pytest.param(op, plat, impl, id=f"{op}-{impl}-{plat}") for op in ops for plat, impl in IMPLS[op]]


def prefill(slots, lens=None):
    lens = list(lens or (3, 5, 2, 4)[:slots.shape[0]])
    args = gdn_inputs(lens, [0] * len(lens), 1, 2, 8, 8, "cpu", torch.float32, torch.Generator().manual_seed(4),
                      pool=POOL)
    return [*args[:7], slots], {}


def decode(slots):
    args, kw = decode_case(slots.shape[0], [0], HK=1, HV=2, K=8, V=8, pool=POOL).make("cpu", torch.float32,
                                                                                     torch.Generator().manual_seed(2))
    return [*args[:6], slots], kw


def packed(slots):
    args, kw = packed_case(slots.shape[0], [0], HK=1, HV=2, K=8, V=8, pool=POOL).make("cpu", torch.float32,
                                                                                     torch.Generator().manual_seed(3))
    return [*args[:6], slots, *args[7:]], kw


# op -> (builder, position of slots, position of the state pool, rows of sequence 1 in the output)
SLOT_OPS = {"gdn_prefill": (prefill, 7, 5, slice(3, 8)), "gdn_decode": (decode, 6, 5, 1),
            "gdn_packed_decode": (packed, 6, 5, 1)}


@pytest.mark.parametrize("bad,dtype", [(POOL, torch.int32), (2**33 + 1, torch.int64)], ids=["slot_eq_pool", "slot2e33_int64"])
@pytest.mark.parametrize("op,plat,impl", params(SLOT_OPS))
def test_out_of_range_slot(op, plat, impl, bad, dtype):
    build, si, sti, rows = SLOT_OPS[op]
    args, kw = build(torch.tensor([2, bad, 0], dtype=dtype))
    before = args[sti].clone()
    a, k = clone(args, kw)
    with registry.checked(True), pytest.raises(
            KernelgateError, match=rf"^{op}: slots\[1\] = {bad} outside \[0, {POOL}\) \(negative = skip\)$"):
        run(op, plat, impl, a, k)
    assert torch.equal(a[sti], before), "checked mode wrote state before raising"
    skip, skip_kw = clone(args, kw)
    skip[si] = torch.tensor([2, -1, 0], dtype=dtype)
    nat, nat_kw = clone(skip, skip_kw)
    with registry.checked(False):
        out = run(op, plat, impl, a, k)
        ref = run(op, plat, impl, skip, skip_kw)
    assert torch.equal(out, ref) and torch.equal(a[sti], skip[sti])
    assert (out[rows] == 0).all()
    assert_close(out, registry.get(op).reference(*nat, **nat_kw), 1e-5)
    assert_close(a[sti], nat[sti], 1e-5, what="state")
    for s in (1, 3):
        assert torch.equal(a[sti][s], before[s]), f"state slot {s} modified"


@pytest.mark.parametrize("op,plat,impl", params(SLOT_OPS))
def test_duplicate_slots_are_an_error_in_checked_mode(op, plat, impl):
    args, kw = SLOT_OPS[op][0](torch.tensor([2, 0, 2], dtype=torch.int32))
    with registry.checked(True), pytest.raises(KernelgateError, match=rf"^{op}: slots holds slot 2 at \[0, 2\]"):
        run(op, plat, impl, args, kw)


# (id, cu_seqlens over T = 8 rows, slots, rows the valid sequences cover, them as a well-formed batch, error)
BAD_CU = [
    ("start2", [2, 5, 8], [1, 0], (2, 8), [0, 3, 6], [1, 0], r"cu_seqlens\[0\] = 2, must be 0"),
    ("past_end", [0, 3, 12], [1, 0], (0, 3), [0, 3], [1], r"cu_seqlens\[-1\] = 12 != the token count 8"),
    ("decreasing", [0, 6, 2, 2], [1, 0, 2], (0, 6), [0, 6], [1],
     r"cu_seqlens\[2\] = 2 < cu_seqlens\[1\] = 6 \(must be non-decreasing\)"),
]


@pytest.mark.parametrize("case", BAD_CU, ids=[c[0] for c in BAD_CU])
@pytest.mark.parametrize("op,plat,impl", params(["gdn_prefill"]))
def test_bad_cu_seqlens(op, plat, impl, case):
    _, cu, slots, (r0, r1), sub_cu, sub_slots, err = case
    args, kw = prefill(torch.tensor(slots, dtype=torch.int32), lens=(8,))
    args[6] = torch.tensor(cu, dtype=torch.int32)
    before = args[5].clone()
    a, k = clone(args, kw)
    with registry.checked(True), pytest.raises(KernelgateError, match=rf"^{op}: {err}"):
        run(op, plat, impl, a, k)
    with registry.checked(False):
        out = run(op, plat, impl, a, k)
    sub, _ = clone(args, kw)
    for i in range(5):
        sub[i] = sub[i][r0:r1]
    sub[6], sub[7] = torch.tensor(sub_cu, dtype=torch.int32), torch.tensor(sub_slots, dtype=torch.int32)
    want = torch.zeros_like(out)
    want[r0:r1] = registry.get(op).reference(*sub)
    assert_close(out, want, 1e-5)
    assert (out[:r0] == 0).all() and (out[r1:] == 0).all(), "rows outside every sequence must be zeros"
    assert_close(a[5], sub[5], 1e-5, what="state")
    for s in set(range(POOL)) - set(sub_slots):
        assert torch.equal(a[5][s], before[s]), f"state slot {s} of a skipped sequence modified"


def _every_other(t):
    buf = torch.full((2 * t.shape[0], *t.shape[1:]), 99, dtype=t.dtype)
    buf[::2] = t
    return buf[::2]


@pytest.mark.parametrize("op,plat,impl", params(SLOT_OPS))
def test_strided_index_tensors(op, plat, impl):
    build, _, sti, _ = SLOT_OPS[op]
    args, kw = build(torch.tensor([0, 3], dtype=torch.int32))
    dense, dense_kw = clone(args, kw)
    views = (6, 7) if op == "gdn_prefill" else (3, 4, 6) if op == "gdn_packed_decode" else (6,)
    for i in views:       # cu_seqlens / slots / A_log / dt_bias as [::2] views
        args[i] = _every_other(args[i])
    before = args[sti].clone()
    with registry.checked(True):
        out = run(op, plat, impl, args, kw)
        ref = run(op, plat, impl, dense, dense_kw)
    assert torch.equal(out, ref) and torch.equal(args[sti], dense[sti])
    assert torch.equal(args[sti][1], before[1]) and not torch.equal(args[sti][3], before[3])
