"""moe_align (the parallel token permutation behind the Triton fused_experts) against a pure-torch
reference built from a stable argsort: exact equality of both outputs, plus the contract checked
directly (every valid pair once inside its expert's run, runs padded to BLOCK_M in expert order,
padding = P, block_expert -1 past the end). Runs under TRITON_INTERPRET=1 on CPU."""
import pytest
import torch

from kernelgate import KernelgateError, alloc, platform
from helpers.impls import on_device

pytestmark = pytest.mark.skipif(platform.current().triton is not None,
                                reason="Triton cannot run here (set TRITON_INTERPRET=1 on CPU)")


def align_reference(ids: torch.Tensor, E: int, block_m: int, num_blocks: int):
    """Stable sort of the valid pairs by expert; each expert's run starts at a multiple of block_m."""
    flat = ids.flatten().long()
    P = flat.numel()
    valid = (flat >= 0) & (flat < E)
    key = torch.where(valid, flat, torch.full_like(flat, E))          # invalid ids sort last
    order = torch.sort(key, stable=True).indices[:int(valid.sum())]   # valid pairs, by expert then p
    counts = torch.bincount(flat[valid], minlength=E)
    padded = (counts + block_m - 1) // block_m * block_m
    starts = torch.cumsum(padded, 0) - padded
    sorted_pairs = torch.full((num_blocks * block_m,), P, dtype=torch.int32)
    block_expert = torch.full((num_blocks,), -1, dtype=torch.int32)
    done = 0
    for e in range(E):
        n = int(counts[e])
        s = int(starts[e])
        sorted_pairs[s:s + n] = order[done:done + n].to(torch.int32)
        block_expert[s // block_m:(s + int(padded[e])) // block_m] = e
        done += n
    return sorted_pairs, block_expert


def _ids(P, E, seed, invalid=True):
    """[P] ids; with `invalid`, about 1 in 8 is -1 or >= E (masked / other ranks' experts)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, E, (P,), generator=g, dtype=torch.int32)
    if invalid:
        bad = torch.rand(P, generator=g) < 0.125
        ids[bad] = torch.where(torch.rand(P, generator=g) < 0.5, -1, E + 3)[bad].to(torch.int32)
    return ids


def _check_contract(pairs, block_expert, ids, E, block_m):
    flat, P = ids.flatten().long(), ids.numel()
    live = block_expert >= 0
    n_live = int(live.sum())
    assert bool(live[:n_live].all()), "live blocks come first"
    assert bool((block_expert[:n_live][1:] >= block_expert[:n_live][:-1]).all()), "runs in expert order"
    assert bool((pairs[n_live * block_m:] == P).all()), "dead blocks hold only padding"
    rows = pairs[:n_live * block_m].view(n_live, block_m).long()
    assert bool(((rows >= 0) & (rows <= P)).all()), "pair index or padding P"
    real = rows < P
    own = block_expert[:n_live, None].long().expand_as(rows)
    assert torch.equal(flat[rows[real]], own[real]), "each pair sits in its expert's run"
    valid = ((flat >= 0) & (flat < E)).nonzero().flatten()
    assert torch.equal(rows[real].sort().values, valid), "every valid pair exactly once"
    counts = torch.bincount(flat[valid], minlength=E)
    assert n_live == int(((counts + block_m - 1) // block_m).sum()), "padding is minimal"


def _run(ids, E, block_m, chunk=None):
    from kernelgate.ops.moe.moe_align_triton import max_blocks, moe_align
    with alloc.poisoned():
        pairs, block_expert = on_device(moe_align, ids, E, block_m, chunk=chunk)
    nb = max_blocks(ids.numel(), E, block_m)
    assert pairs.shape == (nb * block_m,) and block_expert.shape == (nb,)
    assert pairs.dtype == block_expert.dtype == torch.int32
    return pairs, block_expert


CASES = [  # (P, E, block_m, chunk)
    (1, 8, 16, None), (1, 384, 64, None),
    (7, 60, 32, None), (7, 256, 16, None),
    (512, 256, 16, None), (512, 8, 64, None), (512, 384, 32, None),
    (4097, 256, 64, None), (4097, 60, 16, None),
    (512, 60, 32, 16),     # 32 chunks: scan tile [32, 64] covers them in one step
    (4097, 384, 16, 16),   # 257 chunks: several scan steps with a carry, partial last chunk
]


@pytest.mark.parametrize("P,E,block_m,chunk", CASES,
                         ids=[f"P{p}-E{e}-BM{b}" + (f"-C{c}" if c else "") for p, e, b, c in CASES])
def test_matches_stable_argsort_reference(P, E, block_m, chunk):
    ids = _ids(P, E, seed=P + E + block_m)
    pairs, block_expert = _run(ids, E, block_m, chunk)
    _check_contract(pairs, block_expert, ids, E, block_m)
    want_pairs, want_blocks = align_reference(ids, E, block_m, block_expert.numel())
    assert torch.equal(block_expert, want_blocks)
    assert torch.equal(pairs, want_pairs)


def test_hand_computed():
    # ids of 6 pairs, E=3, block_m=2: expert 0 <- p1, p4; expert 1 <- none; expert 2 <- p0, p2, p5
    ids = torch.tensor([[2, 0], [2, -1], [0, 2]], dtype=torch.int32)
    pairs, block_expert = _run(ids, 3, 2)
    # max_blocks = cdiv(6 + 3*1, 2) = 5 blocks: [0: p1 p4] [2: p0 p2] [2: p5 pad] [-1] [-1]
    assert block_expert.tolist() == [0, 2, 2, -1, -1]
    assert pairs.tolist() == [1, 4, 0, 2, 5, 6, 6, 6, 6, 6]


def test_all_invalid_and_one_expert():
    ids = torch.full((5, 3), -1, dtype=torch.int32)
    pairs, block_expert = _run(ids, 4, 16)
    assert bool((block_expert == -1).all()) and bool((pairs == 15).all())
    ids = torch.full((65, 8), 5, dtype=torch.int64)          # every pair to one expert, int64 ids
    pairs, block_expert = _run(ids, 6, 32)
    want_pairs, want_blocks = align_reference(ids, 6, 32, block_expert.numel())
    assert torch.equal(block_expert, want_blocks) and torch.equal(pairs, want_pairs)
    assert block_expert[:17].tolist() == [5] * 17            # 520 pairs -> 17 blocks of 32


def test_deterministic_across_calls_and_chunks():
    ids = _ids(1000, 60, seed=5)
    a = _run(ids, 60, 32)
    for chunk in (None, 16, 64):
        b = _run(ids, 60, 32, chunk)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]), chunk


def test_bad_chunk_raises():
    from kernelgate.ops.moe.moe_align_triton import moe_align
    with pytest.raises(KernelgateError, match="moe_align: chunk 24 must be a power of two"):
        moe_align(torch.zeros(4, 2, dtype=torch.int32), 4, 16, chunk=24)
