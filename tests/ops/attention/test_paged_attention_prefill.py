"""paged_attention_prefill against dense float64 attention over the unpaged keys and values (KV
heads repeated per query head), prefill in chunks == prefill at once, the host-copy hints, and
the argument checks. Every implementation that runs here (Triton under TRITON_INTERPRET=1 with the
launch choices of simulated CUDA and XPU); the SDPA one also with tiny context pieces (the
log-sum-exp merge of pieces) through the fused lse kernel and the fp32 math path."""
import re
import warnings

import pytest
import torch

from kernelgate import KernelgateError, alloc, forcing, platform, registry
from kernelgate.registry import FallbackWarning, checked
from attn_refs import Problem, rel
from helpers.planned import planned_stand_in
from helpers.impls import on_device, on_platform

OP = "paged_attention_prefill"
VARIANTS = [("native", None), ("sdpa", None), ("triton", "cuda"), ("triton", "xpu")]
BOUND = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 1e-2}


def run(impl, plat, *args, **kwargs):
    """Dispatch through the registry with `impl` forced, as if on `plat` (None: the real one)."""
    op = registry.get(OP)
    with platform.simulate(plat or platform.current().name), forcing({OP: impl}), alloc.poisoned():
        why = op.impls[impl].unavailable(platform.current())
        if why:
            pytest.skip(why)
        return on_device(op, *args, **kwargs)


def _ids(v):
    return f"{v[0]}-{v[1]}" if v[1] else v[0]


def hints(pb):
    return dict(cu_seqlens_cpu=pb.cu.clone(), seq_lens_cpu=pb.seq_lens.clone())


SHAPES = [  # chunks, lens, Hq, Hkv, D, bs
    pytest.param([1], [1], 4, 2, 60, 16, id="first-token-n1-L1-D60"),
    pytest.param([63], [63], 8, 1, 64, 16, id="prompt-n63-L63-Hkv1"),
    pytest.param([7], [65], 6, 2, 60, 64, id="prefix-n7-L65-BS64"),
    pytest.param([1, 16, 5, 0, 65], [1, 33, 16, 7, 65], 4, 4, 32, 16, id="N5-n1_16_5_0_65-mha"),
    pytest.param([3, 12], [40, 12], 16, 2, 256, 16, id="N2-n3_12-L40_12-qwen3next"),
]


# (the interpreter's Python time per program is the CI cost: fp16 once, on simulated CUDA)
VARIANT_DTYPES = [pytest.param(v, d, id=f"{_ids(v)}-{str(d)[6:]}") for v in VARIANTS
                  for d in (torch.float32, torch.bfloat16, torch.float16) if d != torch.float16 or v[1] != "xpu"]


@pytest.mark.parametrize("variant,dtype", VARIANT_DTYPES)
@pytest.mark.parametrize("chunks,lens,Hq,Hkv,D,bs", SHAPES)
def test_matches_dense_float64(variant, dtype, chunks, lens, Hq, Hkv, D, bs):
    pb = Problem(lens, chunks, Hq, Hkv, D, bs, dtype)
    o = run(*variant, pb.q, pb.k_cache, pb.v_cache, pb.table, pb.cu, pb.seq_lens, pb.scale, **hints(pb))
    assert o.shape == (sum(chunks), Hq, D) and o.dtype == dtype
    ref = pb.reference()
    assert rel(o, ref) < BOUND[dtype], rel(o, ref)


@pytest.mark.parametrize("variant", VARIANTS[:3], ids=_ids)
def test_chunks_equal_prefill_at_once(variant):
    # two sequences prefilled in chunks (one per step, each seeing the cache written so far) give
    # the rows of one prefill of the whole prompts; the cache already holds every position (a
    # later chunk's keys are never read by an earlier one: they sit past its length)
    lens, pieces = [65, 40], [[20, 1, 30, 14], [40]]
    pb = Problem(lens, lens, 6, 3, 60, 16, torch.float32, seed=3)
    whole = run(*variant, pb.q, pb.k_cache, pb.v_cache, pb.table, pb.cu, pb.seq_lens, pb.scale)
    got = torch.full_like(whole, float("nan"))
    done = [0, 0]
    for step in range(4):
        chunks = [p[step] if step < len(p) else 0 for p in pieces]
        rows = torch.cat([torch.arange(pb.cu[i] + done[i], pb.cu[i] + done[i] + n) for i, n in enumerate(chunks)])
        done = [d + n for d, n in zip(done, chunks)]
        cu = torch.tensor([0] + torch.tensor(chunks).cumsum(0).tolist(), dtype=torch.int32)
        got[rows] = run(*variant, pb.q[rows], pb.k_cache, pb.v_cache, pb.table, cu,
                        torch.tensor(done, dtype=torch.int32), pb.scale)
    assert rel(got, whole) < 1e-6
    assert rel(whole, pb.reference()) < 1e-5


@pytest.mark.parametrize("lse_path", ["fused", "math"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_sdpa_context_pieces_merge(monkeypatch, lse_path, dtype):
    # pieces of 8 positions: prefixes of 0 / 13 / 40 / 56 positions cut into pieces (grouped
    # queries, no mask), chunks of 9 / 3 / 17 / 8 tokens cut at 8 (causal pieces, keys repeated per
    # query head), merged by log-sum-exp; the fused lse kernel of this device, or fp32 math
    from kernelgate.ops.attention import paged_attention_prefill_sdpa as S
    from kernelgate.ops.mla import mla_prefill_sdpa as M
    monkeypatch.setattr(S, "PIECE", 8)
    monkeypatch.setattr(M, "FORCE_LSE", "math" if lse_path == "math" else None)
    pb = Problem([9, 16, 57, 64], [9, 3, 17, 8], 6, 2, 60, 8, dtype, seed=5)
    with warnings.catch_warnings():
        if lse_path == "fused":   # CPU and CUDA have a fused lse kernel: no silent math fallback
            warnings.simplefilter("error", FallbackWarning)
        o = run("sdpa", None, pb.q, pb.k_cache, pb.v_cache, pb.table, pb.cu, pb.seq_lens, pb.scale, **hints(pb))
    assert rel(o, pb.reference()) < BOUND[dtype], rel(o, pb.reference())


def test_sdpa_prefix_pieces_cut_at_planned_lengths(monkeypatch):
    """Where cuDNN serves planned lengths only (a stand-in taking multiples of 4 here), a prefix
    piece of another length is cut at its last multiple: the prefix of 21 in pieces of 8 is
    [0, 8), [8, 16), [16, 20) planned and [20, 21) for the next kernel; the merged output is the
    reference's."""
    from kernelgate.ops.attention import paged_attention_prefill_sdpa as S
    calls, _ = planned_stand_in(monkeypatch)
    monkeypatch.setattr(S, "PIECE", 8)
    pb = Problem([30], [9], 6, 2, 60, 8, torch.float32, seed=7)       # 3 query heads per KV head: 27 -> 28 rows
    o = run("sdpa", None, pb.q, pb.k_cache, pb.v_cache, pb.table, pb.cu, pb.seq_lens, pb.scale, **hints(pb))
    assert rel(o, pb.reference()) < BOUND[torch.float32]
    assert (28, 4, False) in calls and (28, 8, False) in calls, calls


def test_sdpa_plans_from_the_hints_alone():
    # the SDPA implementation plans from the host copies alone: the lengths tensors (garbage here;
    # the implementation is called directly, past validation) are never read
    from kernelgate.ops.attention.paged_attention_prefill_sdpa import paged_attention_prefill_sdpa
    pb = Problem([40, 12], [3, 12], 4, 2, 32, 16, torch.float32, seed=1)
    bad_cu, bad_lens = torch.full_like(pb.cu, 10**6), torch.full_like(pb.seq_lens, -5)
    o = paged_attention_prefill_sdpa(pb.q, pb.k_cache, pb.v_cache, pb.table, bad_cu, bad_lens, pb.scale, **hints(pb))
    assert rel(o, pb.reference()) < 1e-5


def test_lengths_on_the_device_or_the_host():
    # cu_seqlens / seq_lens may live on q's device or on the host; hints are optional
    dev = platform.default_device()
    pb = Problem([40, 12], [3, 12], 4, 2, 32, 16, torch.float32, seed=1)
    args = [t.to(dev) for t in (pb.q, pb.k_cache, pb.v_cache, pb.table)]
    ref = pb.reference()
    for cu, lens, kw in ((pb.cu.to(dev), pb.seq_lens.to(dev), {}), (pb.cu, pb.seq_lens, {}),
                         (pb.cu.to(dev), pb.seq_lens.to(dev), hints(pb))):
        for variant in VARIANTS[:3]:
            assert rel(run(*variant, *args, cu, lens, pb.scale, **kw).cpu(), ref) < 1e-5


def _launch(*args, **kwargs):
    pytest.importorskip("triton")
    if not platform.interpreting() and platform.current().device == "cpu":
        pytest.skip("Triton needs a GPU or TRITON_INTERPRET=1")
    from kernelgate.ops.attention import paged_attention_prefill_triton
    with alloc.poisoned():
        return on_device(paged_attention_prefill_triton.launch, *args, **kwargs)


@pytest.mark.parametrize("bq,block_n", [(1, 16), (4, 32), (16, 64)], ids=["BQ1-BN16", "BQ4-BN32", "BQ16-BN64"])
def test_triton_tiles_and_many_sequences(bq, block_n):
    # a server's step: decodes (1 token after a context), fresh prompts, continued chunks, empty
    # chunks (first, middle, last): every program finds its sequence by binary search over
    # cu_seqlens, tiles past a sequence's tokens leave; tiles of keys span cache blocks of 8
    from kernelgate.ops.attention import paged_attention_prefill_triton as P
    chunks = [0, 1, 12, 1, 5, 0, 2, 33, 1, 0]
    lens = [4, 30, 12, 17, 21, 20, 2, 40, 9, 0]
    pb = Problem(lens, chunks, 6, 2, 40, 8, torch.float32, seed=5)
    o = _launch(pb.q, pb.k_cache, pb.v_cache, pb.table, pb.cu, pb.seq_lens, pb.scale,
                cfg=dict(P.launch_config(), bq=bq, block_n=block_n))
    assert rel(o, pb.reference()) < 1e-5


@pytest.mark.parametrize("bad_id", [-3, 10**6], ids=["negative", "past-the-cache"])
def test_triton_skips_out_of_range_blocks(bad_id):
    # device kernels cannot raise on values: a block id outside [0, num_blocks) is never read,
    # its positions leave the softmax; a length past the table width stops at the table
    pb = Problem([40, 9], [5, 9], 4, 2, 16, 8, torch.float32)
    kc, vc = pb.k_cache.nan_to_num(0.25), pb.v_cache.nan_to_num(0.5)
    table = pb.table.clone()
    table[0, 2] = bad_id                                         # positions 16..23 of sequence 0
    o = _launch(pb.q, kc, vc, table, pb.cu, pb.seq_lens, pb.scale)
    G = 2
    k, v = pb.keys[0].repeat_interleave(G, 1), pb.values[0].repeat_interleave(G, 1)
    for j in range(5):                                           # positions 35..39
        keep = torch.arange(40) <= 35 + j
        keep[16:24] = False
        s = torch.einsum("hd,lhd->hl", pb.q[j].double(), k) * pb.scale
        ref = torch.einsum("hl,lhd->hd", torch.softmax(s.masked_fill(~keep, float("-inf")), -1), v)
        assert rel(o[j], ref) < 1e-5
    assert rel(o[5:], pb.reference()[5:]) < 1e-5                 # sequence 1 untouched


def test_triton_strided_inputs():
    # q a slice of a wider projection, k / v caches views of one [nb, bs, 2, Hkv, D] buffer
    pb = Problem([21, 50], [4, 50], 4, 2, 32, 16, torch.float32, seed=4)
    kv = torch.stack([pb.k_cache, pb.v_cache], dim=2)
    q_wide = torch.cat([pb.q, torch.randn_like(pb.q)], dim=-1)[..., :32]
    o = _launch(q_wide, kv[:, :, 0], kv[:, :, 1], pb.table, pb.cu, pb.seq_lens, pb.scale)
    assert rel(o, pb.reference()) < 1e-5


def test_triton_tile_shapes():
    from kernelgate.ops.attention import paged_attention_prefill_triton as P
    cfg = dict(rows=128, row_values=16384, tile_bytes=16384)
    assert P.tile_shape(cfg, 8, 256, 2) == (8, 8, 256, 32)       # Qwen3-Next: 8 tokens x 8 heads
    assert P.tile_shape(cfg, 8, 128, 2) == (16, 8, 128, 64)
    assert P.tile_shape(cfg, 1, 60, 4) == (128, 1, 64, 64)
    assert P.tile_shape(cfg, 16, 256, 4) == (4, 16, 256, 16)


def _args(lens=(3, 5), chunks=(2, 5), Hq=4, Hkv=2, D=8, bs=4, width=2, nb=6):
    q = torch.randn(sum(chunks), Hq, D)
    k, v = torch.randn(nb, bs, Hkv, D), torch.randn(nb, bs, Hkv, D)
    table = torch.arange(len(lens) * width, dtype=torch.int32).view(len(lens), width) % nb
    cu = torch.tensor([0] + torch.tensor(chunks).cumsum(0).tolist(), dtype=torch.int32)
    return [q, k, v, table, cu, torch.tensor(lens, dtype=torch.int32), 0.4]


def _set(i, value):
    def f(a, kw):
        a[i] = value(a) if callable(value) else value
    return f


def _hint(name, value):
    def f(a, kw):
        kw[name] = value
    return f


BAD = {
    "q-2d": (_set(0, torch.randn(7, 8)), "q must have 3 dims"),
    "v-shape": (_set(2, torch.randn(6, 4, 1, 8)), "v_cache shape (6, 4, 1, 8) != k_cache shape (6, 4, 2, 8)"),
    "groups": (_set(0, torch.randn(7, 3, 8)), "q heads 3 are not a multiple of the cache's KV heads 2"),
    "cu-length": (_set(4, torch.tensor([0, 7], dtype=torch.int32)), "cu_seqlens length 2 != 2 / 3"),
    "cu-total": (_set(4, torch.tensor([0, 2, 6], dtype=torch.int32)), "cu_seqlens[-1] = 6 != q tokens 7"),
    "cu-start": (_set(4, torch.tensor([1, 2, 7], dtype=torch.int32)), "cu_seqlens[0] = 1 != 0"),
    "cu-decreasing": (lambda a, kw: (_set(4, torch.tensor([0, 8, 7], dtype=torch.int32))(a, kw),
                                     _set(5, torch.tensor([8, 5], dtype=torch.int32))(a, kw)),
                      "cu_seqlens decreases at 2 (8 -> 7)"),
    "len-short": (_set(5, torch.tensor([1, 5], dtype=torch.int32)), "seq_lens[0] = 1 < its 2 chunk tokens"),
    "table-narrow": (_set(5, torch.tensor([3, 9], dtype=torch.int32)), "needs 3 blocks of 4 > block_table width 2"),
    "block-id": (lambda a, kw: a[3].__setitem__((0, 0), -1), "block_table[0, 0] = -1 is outside [0, 6)"),
    "table-dtype": (_set(3, lambda a: a[3].long()), "block_table dtype int64"),
    "scale": (_set(6, 0.0), "scale must be a positive number"),
    "hint-shape": (_hint("seq_lens_cpu", torch.tensor([3], dtype=torch.int32)), "seq_lens_cpu shape (1,) != (2,)"),
    "hint-dtype": (_hint("cu_seqlens_cpu", torch.tensor([0, 2, 7])), "cu_seqlens_cpu dtype int64"),
    "hint-value": (_hint("seq_lens_cpu", torch.tensor([3, 6], dtype=torch.int32)),
                   "seq_lens_cpu[1] = 6 != seq_lens[1] = 5 (a hint must equal its tensor)"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_arguments_raise(case):
    args, kw = _args(), {}
    BAD[case][0](args, kw)
    with pytest.raises(KernelgateError, match=f"^{OP}: .*{re.escape(BAD[case][1])}"):
        registry.get(OP)(*args, **kw)


def test_checked_mode_compares_hints_with_the_device_values():
    op = registry.get(OP)
    args = _args()
    with checked(True), pytest.raises(KernelgateError, match=r"cu_seqlens_cpu\[1\] = 3 != cu_seqlens\[1\] = 2"):
        op.check_values(*args, cu_seqlens_cpu=torch.tensor([0, 3, 7], dtype=torch.int32))


def test_doctor_lists_triton_for_xpu():
    # the portable kernel is declared for XPU too and ranks first (one launch for every sequence)
    op = registry.get(OP)
    with platform.simulate("xpu"):
        reasons = {i.name: r for i, r in op.explain()}
        usable = platform.current().triton is None          # (None: no reason against Triton)
    if usable:
        assert reasons["triton"] is None and reasons["sdpa"] == "lower priority than triton"
    else:
        assert reasons["sdpa"] is None


@pytest.mark.parametrize("chunks, lens, want", [
    ((4096,), (4096,), "sdpa"),                  # one long prompt: the fused kernels
    ((2048, 2048), (2048, 6000), "sdpa"),        # few sequences, >= 2,048 tokens each on average
    ((16,) * 9, (16,) * 9, "triton"),            # many sequences: one launch
    ((2047,), (2047,), "triton"),                # short chunks
    ((4000, 1, 1), (4000, 50, 60), "triton"),    # a long chunk beside decodes: under 2,048 on average
])
def test_few_long_chunks_go_to_sdpa(chunks, lens, want):
    op = registry.get(OP)
    width = -(-max(lens) // 16)
    args = _args(lens=lens, chunks=chunks, bs=16, width=width, nb=len(lens) * width)
    with platform.simulate("xpu"):
        if platform.current().triton is not None:
            pytest.skip(f"Triton unusable here: {platform.current().triton}")
        assert op.select(on_platform(args), {}).name == want
