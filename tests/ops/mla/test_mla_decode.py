"""mla_decode against attention expanded per head in float64 (explicit W_uk / W_uv keys and
values, the test's own paged layout), a hand-computed case, masking of everything a sequence
does not own, and the argument checks. Every implementation that runs here: native, and the
Triton kernel under TRITON_INTERPRET=1 with the launch choices of simulated CUDA and XPU."""
import math
import re

import pytest
import torch

from kernelgate import KernelgateError, forcing, platform, registry
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
        return op(*args, **kwargs)


def _ids(v):
    return f"{v[0]}-{v[1]}" if v[1] else v[0]


SHAPES = [  # lens, H, R, Dr, Dn, Dv, bs, next_n
    pytest.param([1, 16, 17, 40], 4, 32, 16, 24, 20, 16, 1, id="N4-L1_16_17_40-H4-R32-Dr16-BS16"),
    pytest.param([2, 33, 9], 3, 48, 8, 16, 16, 8, 2, id="N3-L2_33_9-H3-R48-Dr8-BS8-nn2"),
    pytest.param([63, 0, 65], 5, 32, 16, 16, 32, 16, 1, id="N3-L63_0_65-H5-R32-Dr16-BS16-pad"),
    pytest.param([3, 64], 32, 512, 64, 128, 128, 64, 1, id="N2-L3_64-H32-R512-Dr64-BS64-kimi"),
]


@pytest.mark.parametrize("variant", VARIANTS, ids=_ids)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("lens,H,R,Dr,Dn,Dv,bs,next_n", SHAPES)
def test_matches_expanded_float64(variant, dtype, lens, H, R, Dr, Dn, Dv, bs, next_n):
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
    registry.get(OP)(*args, **kwargs)                       # a good call caches the choice
    args[3] = torch.tensor([3, -2], dtype=torch.int32)
    with pytest.raises(KernelgateError, match="is negative"):
        registry.get(OP).reference(*args, **kwargs)
