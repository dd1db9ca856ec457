"""paged_attention_decode against dense float64 attention over the unpaged keys and values (KV
heads repeated per query head), a hand-computed case, masking of everything a sequence does not
own, the split / merge machinery, and the argument checks. Every implementation that runs here:
native, and the Triton kernel under TRITON_INTERPRET=1 with the launch choices of simulated CUDA
and XPU."""
import dataclasses
import math
import re

import pytest
import torch

from kernelgate import KernelgateError, alloc, forcing, platform, registry
from kernelgate.registry import checked
from attn_refs import Problem, rel
from helpers.impls import on_device

OP = "paged_attention_decode"
VARIANTS = [("native", None), ("triton", "cuda"), ("triton", "xpu")]
BOUND = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 1e-2}


def run(impl, plat, *args, **kwargs):
    """Dispatch through the registry with `impl` forced, as if on `plat` (None: the real one), on
    this machine's device."""
    op = registry.get(OP)
    with platform.simulate(plat or platform.current().name), forcing({OP: impl}), alloc.poisoned():
        why = op.impls[impl].unavailable(platform.current())
        if why:
            pytest.skip(why)
        return on_device(op, *args, **kwargs)


def _ids(v):
    return f"{v[0]}-{v[1]}" if v[1] else v[0]


SHAPES = [  # lens, Hq, Hkv, D, bs
    pytest.param([1, 16, 17, 40], 6, 2, 60, 16, id="N4-L1_16_17_40-Hq6-Hkv2-D60-BS16"),
    pytest.param([63, 0, 65], 8, 1, 64, 16, id="N3-L63_0_65-Hq8-Hkv1-D64-BS16-pad"),
    pytest.param([5, 33], 4, 4, 128, 64, id="N2-L5_33-Hq4-Hkv4-D128-BS64-mha"),
    pytest.param([3, 64, 130], 16, 2, 256, 64, id="N3-L3_64_130-Hq16-Hkv2-D256-BS64-qwen3next"),
]
# (the interpreter's Python time per program is the CI cost: fp16 once, on simulated CUDA)
VARIANT_DTYPES = [pytest.param(v, d, id=f"{_ids(v)}-{str(d)[6:]}") for v in VARIANTS
                  for d in (torch.float32, torch.bfloat16, torch.float16) if d != torch.float16 or v[1] != "xpu"]


@pytest.mark.parametrize("variant,dtype", VARIANT_DTYPES)
@pytest.mark.parametrize("lens,Hq,Hkv,D,bs", SHAPES)
def test_matches_dense_float64(variant, dtype, lens, Hq, Hkv, D, bs):
    pb = Problem(lens, [1] * len(lens), Hq, Hkv, D, bs, dtype)
    o = run(*variant, pb.q, pb.k_cache, pb.v_cache, pb.table, pb.seq_lens, pb.scale)
    assert o.shape == (len(lens), Hq, D) and o.dtype == dtype
    ref = pb.reference()
    assert rel(o, ref) < BOUND[dtype], rel(o, ref)
    for i, L in enumerate(lens):
        if L == 0:   # padding row: zeros, though its table row holds ids
            assert torch.equal(o[i].float(), torch.zeros_like(o[i].float()))


@pytest.mark.parametrize("variant", VARIANTS, ids=_ids)
def test_hand_computed(variant):
    # Hq 2 on Hkv 1, D 2, block_size 1, positions in physical blocks 5 and 2: keys (0, 0) and
    # (ln 3, 0); head 0 (q = (1, 0)) scores 0 and ln 3 -> p = (1/4, 3/4), head 1 (q = 0) p = (1/2, 1/2);
    # values (4, 0) and (0, 8): o = (1, 6) and (2, 4).
    k = torch.full((6, 1, 1, 2), float("nan"))
    v = torch.full((6, 1, 1, 2), float("nan"))
    k[5, 0, 0], v[5, 0, 0] = torch.tensor([0.0, 0.0]), torch.tensor([4.0, 0.0])
    k[2, 0, 0], v[2, 0, 0] = torch.tensor([math.log(3), 0.0]), torch.tensor([0.0, 8.0])
    q = torch.tensor([[[1.0, 0.0], [0.0, 0.0]]])
    o = run(*variant, q, k, v, torch.tensor([[5, 2, 7]], dtype=torch.int32), torch.tensor([2], dtype=torch.int32), 1.0)
    assert torch.allclose(o[0], torch.tensor([[1.0, 6.0], [2.0, 4.0]]), atol=1e-6)


def _launch(*args, **kwargs):
    pytest.importorskip("triton")
    if not platform.interpreting() and platform.current().device == "cpu":
        pytest.skip("Triton needs a GPU or TRITON_INTERPRET=1")
    from kernelgate.ops.attention import paged_attention_decode_triton
    with alloc.poisoned():
        return on_device(paged_attention_decode_triton.launch, *args, **kwargs)


def _dense(q, k, v, scale, keep):
    """o [Hq, D] float64 of one query over keys / values [L, Hkv, D] at positions `keep` (bool [L])."""
    G = q.shape[0] // k.shape[1]
    s = torch.einsum("hd,lhd->hl", q.double(), k.double().repeat_interleave(G, 1)) * scale
    p = torch.softmax(s.masked_fill(~keep, float("-inf")), dim=-1)
    return torch.einsum("hl,lhd->hd", p, v.double().repeat_interleave(G, 1))


@pytest.mark.parametrize("bad_id", [-3, 10**6], ids=["negative", "past-the-cache"])
def test_triton_skips_out_of_range_blocks(bad_id):
    # device kernels cannot raise on values: a block id outside [0, num_blocks) is never read, its
    # positions leave the softmax; lengths past the table width stop at the table; negative = 0
    pb = Problem([40, 9, 5], [1, 1, 1], 4, 2, 16, 8, torch.float32)
    kc, vc = pb.k_cache.nan_to_num(0.25), pb.v_cache.nan_to_num(0.5)   # slots past a length hold data here
    table = pb.table.clone()                                   # width 6; unused entries are 10**6
    table[0, 2] = bad_id                                       # positions 16..23 of sequence 0
    seq = torch.tensor([40, 9 + 100, -4], dtype=torch.int32)   # 109 > the table's 6 x 8: cut at 48
    o = _launch(pb.q, kc, vc, table, seq, pb.scale, cfg=dict(_cfg(), splits=3, block_n=16))
    keep = torch.ones(40, dtype=torch.bool)
    keep[16:24] = False
    assert rel(o[0], _dense(pb.q[0], pb.keys[0], pb.values[0], pb.scale, keep)) < 1e-5
    # sequence 1 owns two real blocks (positions 0..15), then out-of-range ids up to position 47
    k1 = torch.stack([kc[table[1, p // 8], p % 8] for p in range(16)])
    v1 = torch.stack([vc[table[1, p // 8], p % 8] for p in range(16)])
    assert rel(o[1], _dense(pb.q[1], k1, v1, pb.scale, torch.ones(16, dtype=torch.bool))) < 1e-5
    assert torch.equal(o[2], torch.zeros_like(o[2]))


def _cfg():
    from kernelgate.ops.attention import paged_attention_decode_triton as T
    return T.launch_config()


@pytest.mark.parametrize("splits,block_n", [(1, 16), (7, 16), (3, 64), (40, 16)],
                         ids=["one-split", "7-splits", "3-splits-tile64", "40-splits-mostly-empty"])
def test_triton_splits_and_merge(splits, block_n):
    # a 100-token sequence in tiles of 16 over 7 splits leaves the last split empty; over 40 splits
    # (a table sized for a long context) 33 of them: their programs return without writing and the
    # merge stops at the live ones (the scratch is NaN-poisoned: a read of one would show); a
    # padding row and a one-token row; tiles spanning cache blocks of 8
    pb = Problem([100, 0, 1, 37], [1] * 4, 6, 3, 40, 8, torch.float32, seed=2)
    o = _launch(pb.q, pb.k_cache, pb.v_cache, pb.table, pb.seq_lens, pb.scale,
                cfg=dict(_cfg(), splits=splits, block_n=block_n))
    assert rel(o, pb.reference()) < 1e-5
    assert torch.equal(o[1], torch.zeros_like(o[1]))


def test_triton_strided_inputs():
    # q a slice of a wider projection, k / v caches views of one [nb, bs, 2, Hkv, D] buffer
    pb = Problem([21, 50], [1, 1], 4, 2, 32, 16, torch.float32, seed=4)
    kv = torch.stack([pb.k_cache, pb.v_cache], dim=2)                   # [nb, bs, 2, Hkv, D]
    q_wide = torch.cat([pb.q, torch.randn_like(pb.q)], dim=-1)[..., :32]
    o = _launch(q_wide, kv[:, :, 0], kv[:, :, 1], pb.table, pb.seq_lens, pb.scale, cfg=dict(_cfg(), splits=2))
    assert rel(o, pb.reference()) < 1e-5


def test_launch_choices_follow_the_platform():
    from kernelgate.ops.attention import paged_attention_decode_triton as T
    here = platform.current()
    h200 = T.launch_config(dataclasses.replace(here, name="cuda", capability="sm_90"))
    mi300 = T.launch_config(dataclasses.replace(here, name="rocm", capability="gfx942"))
    xpu = T.launch_config(dataclasses.replace(here, name="xpu", capability="pvc"))
    if not platform.interpreting():
        assert (h200["programs"], mi300["programs"], xpu["programs"]) == (528, 608, 512)
        assert (h200["num_stages"], mi300["num_stages"], xpu["num_stages"]) == (2, 1, 1)
    assert T.block_n(h200, 256, 2) == 32 and T.block_n(h200, 128, 2) == 64 and T.block_n(h200, 256, 4) == 16
    assert T.block_n(h200, 64, 4) == 64 and T.block_n(h200, 16, 2) == 64
    cfg = dict(programs=528, min_split=128)
    assert T.num_splits(1 * 2, 2048, 64, cfg) == 264       # Qwen3-Next, batch 1, 128k: whole GPU
    assert T.num_splits(64 * 2, 2048, 64, cfg) == 4
    assert T.num_splits(512 * 2, 2048, 64, cfg) == 1
    assert T.num_splits(1 * 2, 2, 64, cfg) == 1            # a table of 128 positions: one split
    cfg["max_split"] = 4096                                 # a long context among many short ones
    assert T.num_splits(128 * 2, 513, 64, cfg) == 9         # 32,832 positions: 4096 or fewer per program
    assert T.num_splits(512 * 2, 32, 64, cfg) == 1
    cfg["max_partials"] = 128 << 20                         # 512 rows x 8 KiB a split: 32 splits at most
    assert T.num_splits(256 * 2, 2048, 64, cfg, 8 << 10) == 32 and T.num_splits(1024 * 2, 2048, 64, cfg, 8 << 10) == 8


def test_decode_equals_the_prefills_last_row():
    # a chunk's last token, decoded over the same cache, is what the prefill computed for it
    pb = Problem([21, 50, 1], [6, 3, 1], 6, 2, 60, 16, torch.float32, seed=7)
    o = registry.get("paged_attention_prefill")(pb.q, pb.k_cache, pb.v_cache, pb.table, pb.cu, pb.seq_lens, pb.scale)
    last = pb.cu[1:].long() - 1
    for variant in VARIANTS:
        got = run(*variant, pb.q[last], pb.k_cache, pb.v_cache, pb.table, pb.seq_lens, pb.scale)
        assert rel(got, o[last]) < 1e-5, variant


def _args(N=2, Hq=4, Hkv=2, D=8, bs=4, width=3, nb=6, lens=(3, 5)):
    q = torch.randn(N, Hq, D)
    k, v = torch.randn(nb, bs, Hkv, D), torch.randn(nb, bs, Hkv, D)
    table = torch.arange(N * width, dtype=torch.int32).view(N, width) % nb
    return [q, k, v, table, torch.tensor(lens, dtype=torch.int32), 0.5]


def _set(i, value):
    def f(a):
        a[i] = value(a) if callable(value) else value
    return f


BAD = {
    "q-2d": (_set(0, torch.randn(2, 8)), "q must have 3 dims"),
    "q-int": (_set(0, torch.zeros(2, 4, 8, dtype=torch.int32)), "q dtype int32"),
    "k-3d": (_set(1, torch.randn(6, 4, 8)), "k_cache must have 4 dims"),
    "v-shape": (_set(2, torch.randn(6, 4, 2, 6)), "v_cache shape (6, 4, 2, 6) != k_cache shape (6, 4, 2, 8)"),
    "v-dtype": (_set(2, lambda a: a[2].half()), "v_cache dtype float16 != k_cache dtype float32"),
    "k-strided": (_set(1, lambda a: a[1].transpose(2, 3).contiguous().transpose(2, 3)),
                  "k_cache last dim must be contiguous"),
    "head-dim": (_set(0, torch.randn(2, 4, 6)), "q head dim 6 != k_cache head dim 8"),
    "groups": (_set(0, torch.randn(2, 3, 8)), "q heads 3 are not a multiple of the cache's KV heads 2"),
    "table-int64": (_set(3, lambda a: a[3].long()), "block_table dtype int64"),
    "seq-lens-rows": (_set(4, torch.tensor([3], dtype=torch.int32)), "seq_lens length 1 != block_table rows 2"),
    "table-rows": (_set(0, torch.randn(3, 4, 8)), "block_table rows 2 != 3 sequences"),
    "table-too-narrow": (_set(4, torch.tensor([3, 13], dtype=torch.int32)),
                         "needs 4 blocks of 4 > block_table width 3"),
    "negative-len": (_set(4, torch.tensor([-1, 5], dtype=torch.int32)), "seq_lens[0] = -1 is negative"),
    "block-id": (lambda a: a[3].__setitem__((1, 1), 6), "block_table[1, 1] = 6 is outside [0, 6)"),
    "scale": (_set(5, -1.0), "scale must be a positive number"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_arguments_raise(case):
    args = _args()
    BAD[case][0](args)
    with pytest.raises(KernelgateError, match=f"^{OP}: .*{re.escape(BAD[case][1])}"):
        registry.get(OP)(*args)


def test_checked_mode_checks_values_on_every_call():
    # a cached choice skips validate; checked mode still reads the values of each call
    op = registry.get(OP)
    args = _args()
    op(*args)
    args[3] = args[3].clone()
    args[3][0, 0] = -1
    with checked(True), pytest.raises(KernelgateError, match=r"block_table\[0, 0\] = -1 is outside"):
        op.check_values(*args)
    with checked(True), pytest.raises(KernelgateError, match=r"block_table\[0, 0\] = -1 is outside"):
        op(*args)


def test_triton_declines_what_it_cannot_hold():
    from kernelgate.ops.attention.paged_attention_decode import _triton_supports
    args = _args()
    assert _triton_supports(*args) is None
    args[0] = args[0].half()
    assert "q dtype float16 != cache dtype float32" in _triton_supports(*args)
    big = [torch.randn(1, 128, 256), torch.randn(2, 4, 1, 256), torch.randn(2, 4, 1, 256)] + _args(N=1)[3:]
    assert "128 query heads per KV head x head dim 256" in _triton_supports(*big)


def test_doctor_lists_triton_for_xpu():
    op = registry.get(OP)
    with platform.simulate("xpu"):
        reasons = {i.name: r for i, r in op.explain()}
    assert "triton" in reasons
    if not platform.current().triton:
        assert reasons["triton"] is None


@pytest.mark.parametrize("splits", [1, 40], ids=["one-split", "40-splits"])
def test_triton_output_gate(splits):
    # o * sigmoid(gate), the gate a strided view of the [q | gate] projection: applied where o is
    # final -- the partial kernel with one split, the merge with more -- never to a partial
    pb = Problem([100, 0, 1, 37], [1] * 4, 6, 3, 40, 8, torch.float32, seed=5)
    gate = torch.randn(4, 6, 80, generator=torch.Generator().manual_seed(6))[..., 40:]
    o = _launch(pb.q, pb.k_cache, pb.v_cache, pb.table, pb.seq_lens, pb.scale,
                cfg=dict(_cfg(), splits=splits, block_n=16), gate=gate)
    assert rel(o, pb.reference() * torch.sigmoid(gate.double())) < 1e-5
    assert torch.equal(o[1], torch.zeros_like(o[1]))


@pytest.mark.parametrize("gate,msg", [
    (torch.randn(2, 4, 6), "gate shape (2, 4, 6) != (2, 4, 8)"),
    (torch.randn(2, 4, 8, dtype=torch.float64), "gate dtype float64"),
], ids=["shape", "dtype"])
def test_bad_gate_raises(gate, msg):
    with pytest.raises(KernelgateError, match=f"^{OP}: .*{re.escape(msg)}"):
        registry.get(OP)(*_args(), gate=gate)
