"""mla_prefill against attention expanded per head in float64 (the test's own paged layout and
keys), agreement with mla_decode on a chunk's last token, and the argument checks. Every
implementation that runs here; the SDPA one also with tiny context pieces (so the log-sum-exp
merge of pieces is exercised) and with its portable fp32 math path forced."""
import re
import warnings

import pytest
import torch

from kernelgate import KernelgateError, forcing, platform, registry
from kernelgate.registry import FallbackWarning
from helpers.planned import planned_stand_in
from mla_refs import Problem, rel

OP = "mla_prefill"
BOUND = {torch.float32: 2e-5, torch.bfloat16: 2e-2}
IMPLS = ["native", "sdpa"]


def run(impl, *args):
    op = registry.get(OP)
    if impl not in op.impls:
        pytest.skip(f"{OP}: no {impl} implementation registered")
    why = op.impls[impl].unavailable(platform.current())
    if why:
        pytest.skip(why)
    with forcing({OP: impl}):
        return op(*args)


SHAPES = [  # chunks, lens, H, R, Dr, Dn, Dv, bs
    pytest.param([9], [9], 2, 32, 16, 24, 16, 16, id="start-n9-L9"),
    pytest.param([7], [40], 3, 32, 16, 24, 20, 16, id="prefix-n7-L40"),
    pytest.param([1, 16, 5, 0], [1, 33, 16, 7], 2, 32, 8, 16, 24, 16, id="N4-n1_16_5_0-L1_33_16_7"),
    pytest.param([17, 4], [64, 65], 4, 48, 16, 32, 32, 8, id="N2-n17_4-L64_65-BS8"),
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("chunks,lens,H,R,Dr,Dn,Dv,bs", SHAPES)
def test_matches_expanded_float64(impl, dtype, chunks, lens, H, R, Dr, Dn, Dv, bs):
    pb = Problem(lens, chunks, H, R, Dr, Dn, Dv, bs, dtype)
    w_kv = pb.w_kv(dtype)
    q = torch.cat([pb.q_nope, pb.q_rope], dim=-1).to(dtype)
    o = run(impl, q, pb.cache, pb.table, pb.cu, pb.seq_lens, w_kv, pb.scale, Dv)
    assert o.shape == (sum(chunks), H, Dv) and o.dtype == dtype
    w = w_kv.double()
    ref = pb.expanded(w[:, :Dn], w[:, Dn:])
    assert rel(o, ref) < BOUND[dtype], rel(o, ref)


@pytest.mark.parametrize("lse_path", ["fused", "math"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_sdpa_context_pieces_merge(monkeypatch, lse_path, dtype):
    # pieces of 8 positions: prefixes of 0 / 13 / 40 / 56 positions cut into pieces, chunks of
    # 9 / 3 / 17 / 8 tokens cut at 8 (causal pieces), merged by log-sum-exp; then the fused
    # lse kernel of this device, or the fp32 math fallback
    from kernelgate.ops.mla import mla_prefill_sdpa as S
    monkeypatch.setattr(S, "PIECE", 8)
    monkeypatch.setattr(S, "FORCE_LSE", "math" if lse_path == "math" else None)
    pb = Problem([9, 16, 57, 64], [9, 3, 17, 8], 3, 32, 16, 24, 16, 8, dtype, seed=3)
    w_kv = pb.w_kv(dtype)
    q = torch.cat([pb.q_nope, pb.q_rope], dim=-1).to(dtype)
    with warnings.catch_warnings():
        if lse_path == "fused":   # CPU and CUDA have a fused lse kernel: no silent math fallback
            warnings.simplefilter("error", FallbackWarning)
        o = run("sdpa", q, pb.cache, pb.table, pb.cu, pb.seq_lens, w_kv, pb.scale, 16)
    w = w_kv.double()
    ref = pb.expanded(w[:, :24], w[:, 24:])
    assert rel(o, ref) < BOUND[dtype], rel(o, ref)


def test_cudnn_pieces_padded_to_planned_lengths(monkeypatch):
    """A mixed step's chunk is the budget minus its decode tokens: its query count is padded up
    to the planned multiple (cuDNN plans each shape once), causal square pieces pad their keys
    too; the padded rows change nothing. A stand-in for the cuDNN kernel takes only multiples of
    4 (as cuDNN here takes multiples of CUDNN_MULTIPLE) and computes in fp32; every piece it cannot
    take (a non-causal piece of other length, too much padding) goes to the next kernel."""
    from kernelgate.ops.mla import mla_prefill_sdpa as S
    calls, stand_in = planned_stand_in(monkeypatch)
    monkeypatch.setattr(S, "PIECE", 8)
    # chunks of 7 / 15 / 9 / 8 tokens after prefixes of 16 / 9 / 23 / 15: padded to 8 / 16 / 12 / 8 queries
    pb = Problem([23, 24, 32, 23], [7, 15, 9, 8], 2, 32, 16, 24, 16, 8, torch.float32, seed=5)
    w_kv = pb.w_kv(torch.float32)
    q = torch.cat([pb.q_nope, pb.q_rope], dim=-1).float()
    o = run("sdpa", q, pb.cache, pb.table, pb.cu, pb.seq_lens, w_kv, pb.scale, 16)
    w = w_kv.double()
    assert rel(o, pb.expanded(w[:, :24], w[:, 24:])) < 1e-5
    assert any(nq == nk and causal and nq % 4 == 0 for nq, nk, causal in calls)      # a padded causal piece
    assert any(not causal for _, _, causal in calls)                                 # a prefix piece
    # the prefix of 23: pieces [0, 8), [8, 16), [16, 23), the last cut at 20 (merged into the output above)
    assert S.prefix_pieces(23, "cpu") == [(0, 8, False), (8, 16, False), (16, 20, False), (20, 23, False)]
    assert S.prefix_pieces(23, "rocm") == [(0, 8, False), (8, 16, False), (16, 23, False)]   # (no cuDNN there)
    # the prefix remainder [12, 15) of the last: 3 keys padded to 4, the padded one hidden by the bias
    assert (8, 4, 1) in stand_in.masked, stand_in.masked
    assert S.planned(stand_in, 5, 8, False, 4) is None                               # pads 3 of 5 queries
    assert S.planned(stand_in, 8, 2, False, 4) is None                               # pads 2 of 2 keys
    assert S.planned(stand_in, 8, 6, True, 4) is None                                # causal, not square


def test_unmasked_piece_padded_keys_hidden_by_bias(monkeypatch):
    """A prefix piece of unplanned key length padded to the planned multiple: the padded keys
    (zero rows, whose scores would be 0, not -inf) are hidden by the bias, so the output and lse
    equal the piece's own; fp32 against the unpadded math."""
    from kernelgate.ops.mla import mla_prefill_sdpa as S
    _, stand_in = planned_stand_in(monkeypatch)
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, 3, n, d, generator=g) for n, d in ((7, 12), (6, 12), (6, 5)))
    run_ = S.planned(stand_in, 7, 6, False, 4)
    o, lse = run_(q, k, v, 0.3, False)
    ro, rl = S._math_lse(q, k, v, 0.3, False)
    assert o.shape == ro.shape and rel(o, ro) < 1e-6 and (lse - rl).abs().max() < 1e-5
    assert stand_in.masked == [(8, 8, 2)]                                            # 7 -> 8 queries, 6 -> 8 keys


def test_lse_kernels_skipped_for_dtypes_they_never_take(monkeypatch):
    """cuDNN's and FlashAttention-2's attention take half precision only: an fp32 piece skips them
    without a call (no refusal per call, no FallbackWarning) and goes to the next kernel."""
    from kernelgate.ops.mla import mla_prefill_sdpa as S

    def never(*a, **k):
        raise AssertionError("called with a dtype it never takes")
    monkeypatch.setitem(S.LSE_KERNELS, "cudnn", never)
    monkeypatch.setitem(S.LSE_ORDER, "cpu", ("cudnn", "cpu_flash"))
    q, k, v = (torch.randn(1, 2, 8192, 8) for _ in range(3))
    with warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)
        o, lse = S.attend_lse(q, k, v, 0.3, False)
    ro, rl = S._math_lse(q[:, :, :64], k, v, 0.3, False)
    assert rel(o[:, :, :64], ro) < 1e-5 and (lse[:, :, :64] - rl).abs().max() < 1e-4


def test_cudnn_plans_one_layout_for_padded_and_unpadded_queries():
    """cuDNN's plan cache keys on every stride: a query that is a view of the packed tokens
    and the same length padded (a copy) must reach it with the same strides."""
    from kernelgate.ops.mla import mla_prefill_sdpa as S
    H, D = 3, 8
    packed = torch.randn(16, H, D)
    view = packed[:8].transpose(0, 1)[None]                                          # [1, H, 8, D]
    padded = S._pad_rows(packed[:7].transpose(0, 1)[None], 8)
    assert view.shape == padded.shape and view.stride() != padded.stride()          # (the batch stride)
    assert S._one_batch(view).stride() == S._one_batch(padded).stride()
    assert torch.equal(S._one_batch(view), view) and torch.equal(padded[:, :, :7], view[:, :, :7])
    assert not padded[:, :, 7].any()
    # values: a slice of the expanded [n, H, Dn + Dv] rows keep that row stride when padded
    kv = torch.randn(16, H, 5 + D)
    v = kv[:7, :, 5:].transpose(0, 1)[None]
    assert S._one_batch(S._pad_rows(v, 8)).stride() == S._one_batch(kv[:8, :, 5:].transpose(0, 1)[None]).stride()


def test_first_chunks_take_planned_lengths_not_the_public_sdpa(monkeypatch):
    """A prompt's first chunk (no cached prefix) of odd length -- the budget minus a step's decodes
    and another prompt's tail -- goes through the same planned kernel choice as every piece: padded
    to the planned multiple for the cuDNN stand-in, never the public SDPA (on NVIDIA that hands any
    new length to cuDNN, which plans it inside the request)."""
    from kernelgate.ops.mla import mla_prefill_sdpa as S
    calls, _ = planned_stand_in(monkeypatch)

    def public(*a, **k):
        raise AssertionError("the public SDPA picks its backend per call")
    monkeypatch.setattr(S.F, "scaled_dot_product_attention", public)
    monkeypatch.setitem(S.VARLEN, "cpu", None)       # one sequence at a time: the first-chunk path
    pb = Problem([7, 15], [7, 15], 2, 32, 16, 24, 16, 8, torch.float32, seed=6)   # whole prompts: no prefix
    w_kv = pb.w_kv(torch.float32)
    q = torch.cat([pb.q_nope, pb.q_rope], dim=-1).float()
    o = run("sdpa", q, pb.cache, pb.table, pb.cu, pb.seq_lens, w_kv, pb.scale, 16)
    w = w_kv.double()
    assert rel(o, pb.expanded(w[:, :24], w[:, 24:])) < 1e-5
    assert sorted(calls) == [(8, 8, True), (16, 16, True)]                          # 7 -> 8, 15 -> 16


@pytest.mark.parametrize("varlen", ["device", "math"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_sdpa_runs_of_short_sequences(monkeypatch, varlen, dtype):
    # a server's step: decodes (1 token after a context), fresh prompts, a continued chunk, an
    # empty chunk, and one sequence too long for a run (VARLEN_MAX_LEN 32 here) that splits the
    # runs; runs capped at PIECE = 64 positions. "device": this device's varlen kernel (CUDA /
    # ROCm; one call per sequence on a CPU); "math": the fp32 varlen stand-in, so the gathering,
    # expansion and placement of runs are checked on any device
    from kernelgate.ops.mla import mla_prefill_sdpa as S
    monkeypatch.setattr(S, "VARLEN_MAX_LEN", 32)
    monkeypatch.setattr(S, "PIECE", 64)
    monkeypatch.setattr(S, "FORCE_VARLEN", "math" if varlen == "math" else None)
    chunks = [1, 12, 1, 5, 0, 2, 9, 1, 30, 2, 1]
    lens = [30, 12, 17, 21, 20, 2, 9, 25, 40, 18, 32]
    pb = Problem(lens, chunks, 3, 32, 16, 24, 16, 8, dtype, seed=5)
    assert [r for r in S._runs(pb.cu.tolist(), lens, True)] == [[0, 1, 2], [3, 5, 6, 7], [8], [9, 10]]
    dev = platform.default_device()                # (lengths stay on the host, as the model passes them)
    w_kv = pb.w_kv(dtype)
    q = torch.cat([pb.q_nope, pb.q_rope], dim=-1).to(dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)        # no kernel refused a run
        o = run("sdpa", q.to(dev), pb.cache.to(dev), pb.table.to(dev), pb.cu, pb.seq_lens, w_kv.to(dev),
                pb.scale, 16).cpu()
    w = w_kv.double()
    ref = pb.expanded(w[:, :24], w[:, 24:])
    assert rel(o, ref) < BOUND[dtype], rel(o, ref)


def test_last_chunk_token_matches_decode():
    # the last token of a prefill chunk is what a decode step computes for it (absorbed form)
    pb = Problem([21, 50], [6, 3], 3, 32, 16, 16, 16, 16, torch.float32)
    w_kv = pb.w_kv(torch.float32)
    q = torch.cat([pb.q_nope, pb.q_rope], dim=-1).float()
    o = registry.get(OP)(q, pb.cache, pb.table, pb.cu, pb.seq_lens, w_kv, pb.scale, 16)
    last = pb.cu[1:].long() - 1
    dev = platform.default_device()                # (mla_decode's kernels on a GPU take device tensors)
    o_lat = registry.get("mla_decode")(pb.absorbed_q(torch.float32)[last].to(dev), pb.cache.to(dev),
                                       pb.table.to(dev), pb.seq_lens.to(dev), pb.scale, 32).cpu()
    assert rel(torch.einsum("thr,hvr->thv", o_lat.double(), pb.w_uv), o[last].double()) < 1e-5


def _args(lens=(3, 5), chunks=(2, 5), H=2, R=8, Dr=4, Dn=6, Dv=5, bs=4, width=2, nb=6):
    q = torch.randn(sum(chunks), H, Dn + Dr)
    cache = torch.randn(nb, bs, R + Dr)
    table = torch.arange(len(lens) * width, dtype=torch.int32).view(len(lens), width) % nb
    cu = torch.tensor([0] + torch.tensor(chunks).cumsum(0).tolist(), dtype=torch.int32)
    return [q, cache, table, cu, torch.tensor(lens, dtype=torch.int32), torch.randn(H, Dn + Dv, R), 0.4, Dv]


def _set(i, value):
    def f(a):
        a[i] = value(a) if callable(value) else value
    return f


BAD = {
    "q-2d": (_set(0, torch.randn(7, 10)), "q must have 3 dims"),
    "w-heads": (_set(5, torch.randn(3, 11, 8)), "w_kv heads 3 != q heads 2"),
    "w-rows": (_set(5, torch.randn(2, 12, 8)), "w_kv shape (2, 12, 8) != (H, Dn + Dv, R) = (2, 6 + 5, 8)"),
    "value-dim": (_set(7, 0), "value_dim must be a positive int"),
    "cache-narrow": (_set(1, torch.randn(6, 4, 6)), "cache width 6 < w_kv latent width R 8"),
    "cu-length": (_set(3, torch.tensor([0, 7], dtype=torch.int32)), "cu_seqlens length 2 != 2 / 3"),
    "cu-total": (_set(3, torch.tensor([0, 2, 6], dtype=torch.int32)), "cu_seqlens[-1] = 6 != q tokens 7"),
    "len-short": (_set(4, torch.tensor([1, 5], dtype=torch.int32)), "seq_lens[0] = 1 < its 2 chunk tokens"),
    "table-narrow": (_set(4, torch.tensor([3, 9], dtype=torch.int32)), "needs 3 blocks of 4 > block_table width 2"),
    "block-id": (lambda a: a[2].__setitem__((0, 0), -1), "block_table[0, 0] = -1 is outside [0, 6)"),
    "table-dtype": (_set(2, lambda a: a[2].long()), "block_table dtype int64"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_arguments_raise(case):
    args = _args()
    BAD[case][0](args)
    with pytest.raises(KernelgateError, match=f"^{OP}: .*{re.escape(BAD[case][1])}"):
        registry.get(OP)(*args)
