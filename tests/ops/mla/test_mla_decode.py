"""mla_decode against attention expanded per head in float64 (explicit W_uk / W_uv keys and
values, the test's own paged layout), a hand-computed case, masking of everything a sequence
does not own, and the argument checks. Every implementation that runs here: native, and the
Triton kernel under TRITON_INTERPRET=1 with the launch choices of simulated CUDA and XPU."""
import math
import re
from types import SimpleNamespace

import pytest
import torch

from kernelgate import KernelgateError, alloc, forcing, platform, registry
from helpers.impls import on_device
from mla_refs import Problem, rel

OP = "mla_decode"
VARIANTS = [("native", None), ("triton", "cuda"), ("triton", "xpu")]
BOUND = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


def run(impl, plat, *args, **kwargs):
    """Dispatch through the registry with `impl` forced, as if on `plat` (None: the real one)."""
    op = registry.get(OP)
    if impl not in op.impls:
        pytest.skip(f"{OP}: no {impl} implementation registered")
    why = op.impls[impl].unavailable(platform.current())
    if why and plat is None:
        pytest.skip(why)
    with platform.simulate(plat or platform.current().name), forcing({OP: impl}):
        if op.impls[impl].unavailable(platform.current()):
            pytest.skip(op.impls[impl].unavailable(platform.current()))
        return on_device(op, *args, **kwargs)


def _ids(v):
    return f"{v[0]}-{v[1]}" if v[1] else v[0]


SHAPES = [  # lens, H, R, Dr, Dn, Dv, bs, next_n
    pytest.param([1, 16, 17, 40], 4, 32, 16, 24, 20, 16, 1, id="N4-L1_16_17_40-H4-R32-Dr16-BS16"),
    pytest.param([2, 33, 9], 3, 48, 8, 16, 16, 8, 2, id="N3-L2_33_9-H3-R48-Dr8-BS8-nn2"),
    pytest.param([63, 0, 65], 5, 32, 16, 16, 32, 16, 1, id="N3-L63_0_65-H5-R32-Dr16-BS16-pad"),
    pytest.param([3, 64], 32, 512, 64, 128, 128, 64, 1, id="N2-L3_64-H32-R512-Dr64-BS64-kimi"),
]


# (the interpreter's Python time per program is the CI cost: bf16 on simulated XPU is left out,
# its launch on a CPU machine is the simulated CUDA one)
VARIANT_DTYPES = [pytest.param(v, d, id=f"{_ids(v)}-{str(d)[6:]}") for v in VARIANTS
                  for d in (torch.float32, torch.bfloat16) if not (v[1] == "xpu" and d == torch.bfloat16)]


@pytest.mark.parametrize("variant,dtype", VARIANT_DTYPES)
@pytest.mark.parametrize("lens,H,R,Dr,Dn,Dv,bs,next_n", SHAPES)
def test_matches_expanded_float64(variant, dtype, lens, H, R, Dr, Dn, Dv, bs, next_n):
    if "xpu" in variant and "triton" in variant and dtype == torch.float32 and R > 256:
        pytest.skip("declared: Triton mla_decode at fp32, R > 256 exceeds Intel's 128 KiB SLM (native runs)")
    pb = Problem(lens, [next_n] * len(lens), H, R, Dr, Dn, Dv, bs, dtype)
    q = pb.absorbed_q(dtype)
    o_lat, lse = run(*variant, q, pb.cache, pb.table, pb.seq_lens, pb.scale, R, next_n=next_n, return_lse=True)
    assert o_lat.shape == (len(lens) * next_n, H, R) and o_lat.dtype == dtype
    assert lse.shape == (len(lens) * next_n, H) and lse.dtype == torch.float32
    o = torch.einsum("thr,hvr->thv", o_lat.double(), pb.w_uv)              # W_uv after attention
    ref = pb.expanded()
    assert rel(o, ref) < BOUND[dtype], rel(o, ref)
    for i, L in enumerate(lens):
        rows = slice(i * next_n, (i + 1) * next_n)
        if L == 0:   # padding row: zeros and -inf, though its table row points at real blocks
            assert torch.equal(o_lat[rows].float(), torch.zeros_like(o_lat[rows].float()))
            assert torch.isneginf(lse[rows]).all()
        else:
            assert torch.isfinite(lse[rows]).all()


@pytest.mark.parametrize("variant", VARIANTS, ids=_ids)
def test_lse_is_log_of_the_softmax_denominator(variant):
    pb = Problem([5, 17], [1, 1], 2, 16, 16, 8, 8, 16, torch.float32)
    q = pb.absorbed_q(torch.float32)
    _, lse = run(*variant, q, pb.cache, pb.table, pb.seq_lens, pb.scale, 16, return_lse=True)
    for i, L in enumerate(pb.lens):
        s = q[i].double() @ pb.latents[i].T * pb.scale                        # [H, L]
        assert torch.allclose(lse[i].double(), torch.logsumexp(s, dim=-1), rtol=0, atol=1e-5)


@pytest.mark.parametrize("variant", VARIANTS, ids=_ids)
def test_hand_computed(variant):
    # one head, R = 2, Dr = 1, block_size 1, positions in physical blocks 5 and 2:
    # q = (1, 0, 1), latents (0, 2 | 0) and (ln 3 - 1, 4 | 1): scores 0 and ln 3 -> p = (1/4, 3/4),
    # o = (0.75 (ln 3 - 1), 3.5), lse = ln 4.
    cache = torch.full((6, 1, 3), float("nan"))
    cache[5, 0] = torch.tensor([0.0, 2.0, 0.0])
    cache[2, 0] = torch.tensor([math.log(3) - 1, 4.0, 1.0])
    q = torch.tensor([[[1.0, 0.0, 1.0]]])
    o, lse = run(*variant, q, cache, torch.tensor([[5, 2, 7]], dtype=torch.int32),
                 torch.tensor([2], dtype=torch.int32), 1.0, 2, return_lse=True)
    assert torch.allclose(o[0, 0], torch.tensor([0.75 * (math.log(3) - 1), 3.5]), atol=1e-6)
    assert abs(lse[0, 0].item() - math.log(4)) < 1e-6


@pytest.mark.parametrize("variant", VARIANTS, ids=_ids)
def test_next_n_tokens_are_causal(variant):
    # next_n = 2 over one sequence of 3: token 0 sees positions 0..1, token 1 sees 0..2; a latent at
    # position 2 with a huge key pulls only token 1 onto its value.
    cache = torch.zeros(1, 4, 3)
    cache[0, :3, 0] = torch.tensor([1.0, 2.0, 3.0])      # values (R = 2: columns 0, 1)
    cache[0, 2, 2] = 50.0                                 # shared key of position 2
    q = torch.tensor([[[0.0, 0.0, 1.0]], [[0.0, 0.0, 1.0]]])
    o = run(*variant, q, cache, torch.tensor([[0]], dtype=torch.int32), torch.tensor([3], dtype=torch.int32),
            1.0, 2, next_n=2)
    assert torch.allclose(o[:, 0, 0], torch.tensor([1.5, 3.0]), atol=1e-6)


def _args(N=2, H=2, R=8, Dr=4, bs=4, width=3, nb=6, next_n=1, lens=(3, 5)):
    q = torch.randn(N * next_n, H, R + Dr)
    cache = torch.randn(nb, bs, R + Dr)
    table = torch.arange(N * width, dtype=torch.int32).view(N, width) % nb
    return [q, cache, table, torch.tensor(lens, dtype=torch.int32), 0.5, R], dict(next_n=next_n)


def _bad(i, value):
    def f(a, k):
        a[i] = value
    return f


BAD = {
    "q-2d": (_bad(0, torch.randn(2, 12)), "q must have 3 dims"),
    "q-int": (_bad(0, torch.zeros(2, 2, 12, dtype=torch.int32)), "q dtype int32"),
    "q-width": (_bad(0, torch.randn(2, 2, 10)), "q width 10 != cache width 12"),
    "rank-too-big": (_bad(5, 13), "kv_lora_rank must be an int in [1, 12]"),
    "table-int64": (lambda a, k: a.__setitem__(2, a[2].long()), "block_table dtype int64"),
    "seq-lens-rows": (_bad(3, torch.tensor([3], dtype=torch.int32)), "seq_lens length 1 != block_table rows 2"),
    "next-n-divides": (lambda a, k: k.update(next_n=3), "q rows 2 are not a multiple of next_n 3"),
    "table-rows": (lambda a, k: k.update(next_n=2), "block_table rows 2 != 1 sequences"),
    "table-too-narrow": (_bad(3, torch.tensor([3, 13], dtype=torch.int32)), "needs 4 blocks of 4 > block_table width 3"),
    "negative-len": (_bad(3, torch.tensor([-1, 5], dtype=torch.int32)), "seq_lens[0] = -1 is negative"),
    "block-id": (lambda a, k: a[2].__setitem__((1, 1), 6), "block_table[1, 1] = 6 is outside [0, 6)"),
    "scale": (_bad(4, -1.0), "scale must be a positive number"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_arguments_raise(case):
    args, kwargs = _args()
    BAD[case][0](args, kwargs)
    with pytest.raises(KernelgateError, match=f"^{OP}: .*{re.escape(BAD[case][1])}"):
        registry.get(OP)(*args, **kwargs)


def test_new_tokens_must_be_cached():
    args, kwargs = _args(N=1, next_n=2, lens=(1,))
    with pytest.raises(KernelgateError, match=r"mla_decode: seq_lens\[0\] = 1 < 2 new tokens"):
        registry.get(OP)(*args, **kwargs)


def test_native_checks_values_every_call():
    args, kwargs = _args()
    on_device(registry.get(OP), *args, **kwargs)           # a good call caches the choice
    args[3] = torch.tensor([3, -2], dtype=torch.int32)
    with pytest.raises(KernelgateError, match="is negative"):
        registry.get(OP).reference(*args, **kwargs)


def _absorbed_f64(q, lat, scale, R, keep):
    """One query row over positions `keep` (bool [L]) of latents lat [L, C], float64."""
    s = (q.double() @ lat.double().T) * scale
    s = s.masked_fill(~keep, float("-inf"))
    return torch.softmax(s, dim=-1) @ lat.double()[:, :R]


def _launch(*args, **kwargs):
    pytest.importorskip("triton")
    if not platform.interpreting() and platform.current().device == "cpu":
        pytest.skip("Triton needs a GPU or TRITON_INTERPRET=1")
    from kernelgate.ops.mla import mla_decode_triton
    with alloc.poisoned():   # scratch and outputs NaN: an element a kernel leaves unwritten and reads shows
        return on_device(mla_decode_triton.launch, *args, **kwargs)


@pytest.mark.parametrize("bad_id", [-3, 10**6], ids=["negative", "past-the-cache"])
def test_triton_skips_out_of_range_blocks(bad_id):
    # device kernels cannot raise on values: a block id outside [0, num_blocks) is never read, its
    # positions leave the softmax; lengths past the table width stop at the table; negative = 0
    pb = Problem([40, 9, 5], [1, 1, 1], 2, 16, 8, 8, 8, 8, torch.float32)
    cache = pb.cache.nan_to_num(0.25)                          # slots past a length hold data here
    table = pb.table.clone()                                   # width 6; unused entries are 10**6
    table[0, 2] = bad_id                                       # positions 16..23 of sequence 0
    seq = torch.tensor([40, 9 + 100, -4], dtype=torch.int32)   # 109 > the table's 6 x 8: cut at 48
    q = pb.absorbed_q(torch.float32)
    o, lse = _launch(q, cache, table, seq, pb.scale, 16, return_lse=True)
    keep = torch.ones(40, dtype=torch.bool)
    keep[16:24] = False
    assert rel(o[0, 0], _absorbed_f64(q[0, 0], pb.latents[0], pb.scale, 16, keep)) < 1e-5
    # sequence 1 owns two real blocks (positions 0..15), then out-of-range ids up to position 47
    lat1 = torch.stack([cache[table[1, p // 8], p % 8] for p in range(16)])
    ref1 = torch.stack([_absorbed_f64(q[1, h], lat1, pb.scale, 16, torch.ones(16, dtype=torch.bool))
                        for h in range(2)])
    assert rel(o[1], ref1) < 1e-5
    assert torch.equal(o[2], torch.zeros_like(o[2])) and torch.isneginf(lse[2]).all()


def test_triton_gpu_merge_layout_and_many_splits():
    # the GPU's merge shape (one query row and 16 latent columns per program) over 7 splits of a
    # 100-token sequence (tiles of 16: the last split is empty), next_n 2; the interpreter's
    # default merges whole rows at once
    from kernelgate.ops.mla import mla_decode_triton as T
    pb = Problem([100], [2], 2, 32, 16, 8, 8, 8, torch.float32)
    q = pb.absorbed_q(torch.float32)
    ref = registry.get(OP).reference(q, pb.cache, pb.table, pb.seq_lens, pb.scale, 32, next_n=2, return_lse=True)
    for splits in (7, 40):   # 40: 33 splits past the length, never written (poisoned) and never merged
        cfg = dict(T.config(), splits=splits, merge_rows=1, merge_br=16, merge_sb=4, block_n=16)
        o, lse = _launch(q, pb.cache, pb.table, pb.seq_lens, pb.scale, 32, next_n=2, return_lse=True, cfg=cfg)
        assert rel(o, ref[0]) < 1e-5 and rel(lse, ref[1]) < 1e-6


@pytest.mark.parametrize("kv_major", [False, True], ids=["heads-major", "kv-major"])
@pytest.mark.parametrize("ahead", [False, True], ids=["table-inline", "table-ahead"])
def test_triton_loop_shapes(kv_major, ahead):
    # both MMA orientations and both block-table load orders, tiles of 16 over blocks of 8, 3 splits
    from kernelgate.ops.mla import mla_decode_triton as T
    pb = Problem([37, 8, 0], [2, 2, 2], 3, 32, 16, 8, 8, 8, torch.float32, seed=5)
    cfg = dict(T.config(), kv_major=kv_major, ahead=ahead, block_n=16, splits=3)
    o_lat = _launch(pb.absorbed_q(torch.float32), pb.cache, pb.table, pb.seq_lens, pb.scale, 32, next_n=2, cfg=cfg)
    assert rel(torch.einsum("thr,hvr->thv", o_lat.double(), pb.w_uv), pb.expanded()) < 2e-5


def test_launch_choices_follow_the_platform():
    import dataclasses

    from kernelgate.ops.mla import mla_decode_triton as T
    here = platform.current()
    h200 = T.config(dataclasses.replace(here, name="cuda", capability="sm_90"))
    mi300 = T.config(dataclasses.replace(here, name="rocm", capability="gfx942"))
    xpu = T.config(dataclasses.replace(here, name="xpu", capability=None))
    if not platform.interpreting():   # (the interpreter runs TMA for any simulated CUDA)
        a100 = T.config(dataclasses.replace(here, name="cuda", capability="sm_80"))
        assert (a100["keys"], mi300["keys"], xpu["keys"]) == ("ptr", "ptr", "ptr")
    assert (h200["keys"], h200["block_n"], h200["num_warps"], h200["kv_major"]) == ("tma", 64, 4, True)
    ptr = T.pointer_choice(h200)   # caches the TMA kernel does not take: sm_80's tile, not the TMA one
    assert (ptr["block_n"], ptr["kv_major"], ptr["num_warps"]) == (32, False, 4)
    assert T.pointer_choice(mi300) == mi300
    assert (mi300["num_stages"], mi300["num_warps"], xpu["num_stages"]) == (1, 8, 1)
    assert T.num_splits(1, 2048, 64, dict(programs=132, min_split=256)) == 132      # B1 128k: one per SM
    assert T.num_splits(64, 2048, 64, dict(programs=132, min_split=256)) == 2       # 128 programs: one wave
    assert T.num_splits(200, 2048, 64, dict(programs=132, min_split=256)) == 1
    assert T.num_splits(1, 3, 16, dict(programs=264, min_split=256)) == 1            # short table: one split
    # max_split: the longest sequence (the table's width) gets no program more than 4096 positions --
    # 64 short streams beside 8 of 32k (N 128 after padding) got one split: one program per 32k context
    cfg = dict(programs=132, min_split=64, max_split=4096)
    assert T.num_splits(128, 513, 64, cfg) == 9                                     # 32,832 positions
    assert T.num_splits(64, 2048, 64, cfg) == 32                                    # B64 128k: 4096 each
    assert T.num_splits(1, 2048, 64, cfg) == 132                                    # B1 128k: as before
    assert T.num_splits(128, 32, 64, cfg) == 1                                      # short contexts: as before
    assert T.config(T.platform.current())["max_split"] == 4096
    # ... while the fp32 partials stay within max_partials (the decode graphs' pool has a fixed reserve)
    cfg["max_partials"] = 128 << 20
    assert T.num_splits(256, 2048, 64, cfg, 64 << 10) == 8                          # 256 x 8 x 64 KiB = 128 MiB
    assert T.num_splits(128, 513, 64, cfg, 64 << 10) == 9                           # 72 MiB: as without the cap
    assert T.num_splits(1, 2048, 64, cfg, 64 << 10) == 132                          # programs // N is not capped


def test_tma_route_reasons():
    from kernelgate.ops.mla import mla_decode_triton as T
    cfg = dict(block_n=32)
    bf = torch.zeros(4, 64, 576, dtype=torch.bfloat16)
    assert T.tma_route(cfg, bf, 512) == (None, 32)
    assert T.tma_route(cfg, bf[:, :16], 512) == (None, 16)                   # a block of 16: tiles of 16
    assert "block_size 8" in T.tma_route(cfg, bf[:, :8], 512)[0]
    assert "kv_lora_rank 640" in T.tma_route(cfg, torch.zeros(4, 64, 704, dtype=torch.bfloat16), 640)[0]
    assert "kv_lora_rank 12" in T.tma_route(cfg, torch.zeros(4, 64, 28, dtype=torch.bfloat16), 12)[0]
    assert "aligned" in T.tma_route(cfg, torch.zeros(4, 64, 580, dtype=torch.bfloat16)[:, :, 1:], 512)[0]


def _tma_or_skip(T, cfg, cache, R) -> int:
    """The TMA kernel's tile for these fp32 problems; on a GPU fp32 latents take the pointer kernel
    (a box of them would not fit shared memory with its stages): these checks run under the
    interpreter, and the bf16 parity cases reach the TMA kernel there."""
    why, tile = T.tma_route(cfg, cache, R)
    if why and not platform.interpreting() and cache.dtype == torch.float32:
        pytest.skip(f"the TMA kernel on this GPU: {why}")
    assert why is None, why
    return tile


@pytest.mark.parametrize("kv_major", [False, True], ids=["heads-major", "kv-major"])
@pytest.mark.parametrize("R,Dr,next_n", [(32, 16, 1), (320, 64, 2), (64, 0, 1)], ids=["R32-Dr16", "R320-Dr64-nn2", "R64-Dr0"])
def test_triton_tma_tiles(kv_major, R, Dr, next_n):
    # the TMA kernel: whole tiles by descriptor (R > 256: two boxes per tile), a sequence's partial
    # last tile masked (the cache past each length is NaN), an empty sequence, a sequence of whole
    # tiles only, splits that start past the length; fp32, against the expanded float64 reference
    from kernelgate.ops.mla import mla_decode_triton as T
    pb = Problem([37, 64, 0, 5, 33], [next_n] * 5, 3, R, Dr, 8, 8, 16, torch.float32, seed=3)
    cfg = dict(T.config(), keys="tma", block_n=16, kv_major=kv_major, splits=3)
    _tma_or_skip(T, cfg, pb.cache, R)
    o, lse = _launch(pb.absorbed_q(torch.float32), pb.cache, pb.table, pb.seq_lens, pb.scale, R, next_n=next_n,
                     return_lse=True, cfg=cfg)
    assert rel(torch.einsum("thr,hvr->thv", o.double(), pb.w_uv), pb.expanded()) < 2e-5
    assert torch.isneginf(lse[2 * next_n:3 * next_n]).all() and torch.isfinite(lse[:2 * next_n]).all()


@pytest.mark.parametrize("bs", [64, 128], ids=["BS64", "BS128"])
def test_triton_tma_shifted_last_tile(bs):
    # tiles of 64 (the H200's): a sequence's partial last tile is loaded shifted back to end at its
    # length -- rows before the block read as zeros (BS64) or repeat the previous tile's (BS128,
    # two tiles a block), rows past the length (NaN) never read; lengths shorter than a tile, one
    # past a tile, one short of a block; a split boundary inside a sequence (splits 2)
    from kernelgate.ops.mla import mla_decode_triton as T
    pb = Problem([5, 64, 65, 127, 130, 1], [1] * 6, 2, 32, 16, 8, 8, bs, torch.float32, seed=11)
    cfg = dict(T.config(), keys="tma", block_n=64, kv_major=True, splits=2)
    assert _tma_or_skip(T, cfg, pb.cache, 32) == 64
    o, lse = _launch(pb.absorbed_q(torch.float32), pb.cache, pb.table, pb.seq_lens, pb.scale, 32,
                     return_lse=True, cfg=cfg)
    assert rel(torch.einsum("thr,hvr->thv", o.double(), pb.w_uv), pb.expanded()) < 2e-5
    ref_lse = registry.get(OP).reference(pb.absorbed_q(torch.float32), pb.cache, pb.table, pb.seq_lens,
                                         pb.scale, 32, return_lse=True)[1]
    assert rel(lse, ref_lse) < 1e-6


@pytest.mark.parametrize("bad_id", [-3, 10**6], ids=["negative", "past-the-cache"])
def test_triton_tma_skips_out_of_range_blocks(bad_id):
    # a whole tile whose table entry is outside the cache: read from past the descriptor (zeros),
    # its positions out of the softmax -- the same result as the pointer kernel's
    from kernelgate.ops.mla import mla_decode_triton as T
    pb = Problem([40, 9, 5], [1, 1, 1], 2, 16, 16, 8, 8, 16, torch.float32)
    cache = pb.cache.nan_to_num(0.25)
    table = pb.table.clone()
    table[0, 1] = bad_id                                          # positions 16..31: a whole tile
    q = pb.absorbed_q(torch.float32)
    cfg = dict(T.config(), keys="tma", block_n=16, kv_major=True, splits=2)
    o = _launch(q, cache, table, pb.seq_lens, pb.scale, 16, cfg=cfg)
    keep = torch.ones(40, dtype=torch.bool)
    keep[16:32] = False
    assert rel(o[0, 0], _absorbed_f64(q[0, 0], pb.latents[0], pb.scale, 16, keep)) < 1e-5
    assert rel(o[1:], _launch(q, cache, table, pb.seq_lens, pb.scale, 16, cfg=dict(cfg, keys="ptr"))[1:]) < 1e-6


def test_prefetch_only_where_it_is_a_valid_hint(monkeypatch):
    # the L2 prefetch is inline PTX: never under the interpreter; on a GPU only where a row of
    # latents is a whole number of 16 bytes (the bulk prefetch's unit) and the cache has a block
    from kernelgate.ops.mla import mla_decode_triton as T
    cfg = dict(prefetch=2)
    bf = torch.zeros(4, 64, 576, dtype=torch.bfloat16)
    assert T.prefetch_tiles(cfg, bf) == (0 if platform.interpreting() else 2)
    monkeypatch.setattr(T, "interpreting", lambda: False)
    assert T.prefetch_tiles(cfg, bf) == 2
    assert T.prefetch_tiles(cfg, torch.zeros(4, 64, 580, dtype=torch.bfloat16)) == 0   # 1,160-byte rows
    assert T.prefetch_tiles(cfg, bf[:0]) == 0
    assert T.prefetch_tiles(dict(), bf) == 0


def test_prefetch_tile_and_dependent_merge_only_where_they_apply(monkeypatch):
    # one prefetch request per tile needs the tile's rows contiguous; the merge as a programmatic
    # dependent (griddepcontrol) needs NVIDIA sm_90+, more than one split, and no interpreter
    from kernelgate.ops.mla import mla_decode_triton as T
    bf = torch.zeros(4, 64, 576, dtype=torch.bfloat16)
    assert T.prefetch_whole_tile(dict(prefetch_block=True), bf)
    assert not T.prefetch_whole_tile(dict(prefetch_block=True), torch.zeros(4, 64, 640)[:, :, :576])
    assert not T.prefetch_whole_tile(dict(prefetch_block=False), bf) and not T.prefetch_whole_tile(dict(), bf)
    assert not T.dependent_merge(dict(pdl=True), 8) or not platform.interpreting()
    monkeypatch.setattr(T, "interpreting", lambda: False)
    for name, cap, splits, want in (("cuda", "sm_90", 8, True), ("cuda", "sm_100", 8, True), ("cuda", "sm_90", 1, False),
                                    ("cuda", "sm_80", 8, False), ("rocm", "gfx942", 8, False), ("xpu", "pvc", 8, False)):
        monkeypatch.setattr(T.platform, "current", lambda n=name, c=cap: SimpleNamespace(name=n, capability=c))
        assert T.dependent_merge(dict(pdl=True), splits) is want, (name, cap, splits)
        assert T.dependent_merge(dict(pdl=False), splits) is False


def test_merge_grid_spreads_the_splits():
    # the GPU's merge: blocks as large as still give ~merge_programs programs; the result matches
    from kernelgate.ops.mla import mla_decode_triton as T
    assert T.merge_grid(1, 32, 512, 32, 512, dict(merge_rows=None, merge_br=None, merge_programs=528)) == (1, 32)
    assert T.merge_grid(64, 32, 512, 32, 512, dict(merge_rows=None, merge_br=None, merge_programs=528)) == (32, 32)
    assert T.merge_grid(64, 32, 512, 32, 512, dict(merge_rows=1, merge_br=128, merge_programs=528)) == (1, 128)
    assert T.merge_step(264, 1, 32, dict(merge_sb=None)) == 256 and T.merge_step(4, 32, 32, dict(merge_sb=None)) == 4
    assert T.merge_step(264, 1, 32, dict(merge_sb=48)) == 32                         # a power of two <= merge_sb
    pb = Problem([100, 30], [1, 1], 4, 64, 16, 8, 8, 8, torch.float32)
    q = pb.absorbed_q(torch.float32)
    ref = registry.get(OP).reference(q, pb.cache, pb.table, pb.seq_lens, pb.scale, 64, return_lse=True)
    cfg = dict(T.config(), keys="ptr", splits=5, merge_rows=None, merge_br=None, merge_programs=12, merge_sb=2)
    assert T.merge_grid(2, 4, 64, 16, 64, cfg) == (1, 32)                     # 16 programs
    o, lse = _launch(q, pb.cache, pb.table, pb.seq_lens, pb.scale, 64, return_lse=True, cfg=cfg)
    assert rel(o, ref[0]) < 1e-5 and rel(lse, ref[1]) < 1e-6
