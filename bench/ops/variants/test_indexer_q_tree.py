"""The sweep-only split-tree form of the indexer q kernel (bench/ops/variants/indexer_q_tree.py) against the op's native reference with the op's own parity compare, and its 128-point Hadamard
against hand-built one-hot cases (the Sylvester column, known exactly) for every piece width
(8 pieces of 16, 4 of 32, 2 of 64).

Runs on CPU under TRITON_INTERPRET=1 (portable arithmetic: the integer fp8 encoder), so the index
arithmetic of every piece layout, cos/sin source (FREQ) and head mask is checked here; the GPU-only
hardware cvt is checked by bench/ops/indexer_sweep.py before timing. Not part of CI (tests/ only):
    TRITON_INTERPRET=1 python -m pytest -q bench/ops/variants/test_indexer_q_tree.py"""
import math
import os
import sys

import pytest
import torch

from kernelgate import KernelgateError, alloc, platform
from kernelgate.ops.common import fp8 as _fp8
from kernelgate.ops.indexer.indexer_q import _case, compare, indexer_q_native, precompute_freqs_cis

sys.path.insert(0, os.path.dirname(__file__))
import indexer_q_tree as kq  # noqa: E402

pytestmark = pytest.mark.skipif(not platform.interpreting(), reason="CPU tensors: needs TRITON_INTERPRET=1")

def check_form(cfg, case):
    """The tree launch against the native reference: the op's parity compare, and (fp32 arithmetic,
    exact encoder) at least 99% of the fp8 codes identical."""
    B, H, variant, fmt, had = case
    args, kw = _case(B, H, variant, fmt, had).make("cpu", torch.bfloat16, torch.Generator().manual_seed(B * H))
    ref = indexer_q_native(*args, **kw)
    with alloc.poisoned():
        out = kq.launch(*args, **kw, **cfg)
    compare(out, ref, torch.bfloat16, args)
    assert (_fp8.code_distance(out[0], ref[0]) == 0).float().mean() > 0.99


FORMS = {   # id -> launch overrides
    "p8-tok2-freq0": dict(pieces=8, tok=2, freq=0),   # per-token cos/sin broadcast over 2 tokens
    "p8-tok1-freq1-heads2": dict(pieces=8, tok=1, freq=1, heads=2),  # several head blocks
    "p4-tok1-freq2": dict(pieces=4, tok=1, freq=2),
    "p2-tok1-freq0": dict(pieces=2, tok=1, freq=0),
    "p2-tok2-freq2": dict(pieces=2, tok=2, freq=2),
    "p2-tok1-freq1-heads4": dict(pieces=2, tok=1, freq=1, heads=4),
    "p8-tok1-freq2-fastdiv": dict(pieces=8, tok=1, freq=2, fast_div=True),  # NORM folded into 1/scale
}
CASES = [   # (tokens, heads, variant, fp8 format, hadamard)
    (3, 64, "v4", "e4m3fn", None),
    (5, 3, "v4", "e4m3fnuz", None),
    (1, 5, "v4", "e4m3fn", False),
    (7, 5, "v32", "e4m3fn", None),
    (3, 6, "v32", "e4m3fnuz", True),
]


def _cid(c):
    return f"B{c[0]}-H{c[1]}-{c[2]}-{c[3]}" + ("" if c[4] is None else f"-hadamard{c[4]}")


# several head blocks per token are slow under the interpreter at H = 64: small H only there
PAIRS = [pytest.param(f, c, id=f"{f}-{_cid(c)}") for f in FORMS for c in CASES
         if not (FORMS[f].get("heads") and c[1] > 8)]


@pytest.mark.parametrize("form,case", PAIRS)
def test_tree_matches_native(form, case):
    check_form(FORMS[form], case)


@pytest.mark.parametrize("pieces", [8, 4, 2])
@pytest.mark.parametrize("j", [3, 64, 77, 126])
def test_hadamard_one_hot(pieces, j):
    # position 0: RoPE is the identity; H e_j / sqrt(128) = (-1)^popcount(i & j) / sqrt(128) for
    # every i, so every code is +-448 with the sign pattern of column j
    q = torch.zeros(2, 5, 128)
    q[:, :, j] = 2.0
    weight = torch.ones(2, 5)
    q_fp8, w_out = kq.launch(q, weight, 1.0, precompute_freqs_cis(4), torch.zeros(2, dtype=torch.int32),
                             variant="v4", tok=1, pieces=pieces)
    signs = torch.tensor([(-1.0) ** bin(i & j).count("1") for i in range(128)])
    assert torch.equal(q_fp8.float(), (448.0 * signs).expand(2, 5, 128))
    torch.testing.assert_close(w_out, torch.full((2, 5, 1), 2.0 / (math.sqrt(128) * 448.0)), rtol=1e-6, atol=0)


@pytest.mark.parametrize("pieces", [8, 4, 2])
def test_rope_then_hadamard_one_pair(pieces):
    # one v4 pair (dims 64 + 2i, 65 + 2i) = (1, 0) at pair i = 13, rotated by pi/2 -> (0, 1): the
    # result is the Hadamard of e_65+2i, so codes are +-448 with column 65 + 2i's signs
    i = 13
    freqs = torch.ones(3, 32, dtype=torch.complex64)
    freqs[2, i] = complex(0.0, 1.0)
    q = torch.zeros(1, 3, 128)
    q[:, :, 64 + 2 * i] = 1.0
    q_fp8, _ = kq.launch(q, torch.ones(1, 3), 1.0, freqs, torch.tensor([2]), variant="v4", pieces=pieces)
    signs = torch.tensor([(-1.0) ** bin(k & (65 + 2 * i)).count("1") for k in range(128)])
    assert torch.equal(q_fp8.float(), (448.0 * signs).expand(1, 3, 128))


def test_bad_pieces_raises():
    q = torch.zeros(1, 2, 128)
    with pytest.raises(KernelgateError, match="pieces must be one of"):
        kq.launch(q, torch.ones(1, 2), 1.0, precompute_freqs_cis(4), torch.zeros(1, dtype=torch.int32),
                  pieces=16)
