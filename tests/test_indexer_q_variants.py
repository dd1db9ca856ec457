"""The indexer q kernel's launch forms (kernelgate.ops.indexer.indexer_q_triton CONFIG keys), each against
the op's native reference with the op's own parity compare, and the 128-point Hadamard of every
piece layout against a hand-built one-hot case (the Sylvester column, known exactly).

Runs the Triton kernels on CPU under TRITON_INTERPRET=1 (portable arithmetic: fp32 dots, integer
fp8 encoder), so each form's index arithmetic (pieces, RoPE pairs, head masks) is checked here; the
GPU-only choices (3xTF32, hardware cvt) are checked by bench/indexer_sweep.py before timing."""
import math

import pytest
import torch

from kernelgate import alloc, platform
from kernelgate.platform import KernelgateError
from kernelgate.ops.common import fp8 as _fp8
from kernelgate.ops.indexer.indexer_q import _case, compare, indexer_q_native, precompute_freqs_cis

kq = pytest.importorskip("kernelgate.ops.indexer.indexer_q_triton")
pytestmark = pytest.mark.skipif(not platform.interpreting(), reason="CPU tensors: needs TRITON_INTERPRET=1")

FORMS = {   # id -> launch overrides
    "tok1-p4-bf16x3": dict(form="tok", tok=1, pieces=4, hmode="bf16x3"),
    "tok2-p8-fp32": dict(form="tok", tok=2, pieces=8, hmode="fp32"),
    "tok1-p8-butterfly": dict(form="tok", tok=1, pieces=8, hmode="butterfly"),
    "tok1-p16": dict(form="tok", tok=1, pieces=16),
    "tok4-p16-heads4": dict(form="tok", tok=4, pieces=16, heads=4),  # several head blocks per token
    "rows-R32": dict(form="rows", block_r=32, hmode="fp32"),
    "tok1-p4-lanes": dict(form="tok", tok=1, pieces=4, hmode="lanes", maxnreg=80),   # the CUDA CONFIG
    "tok1-p4-lanes2": dict(form="tok", tok=1, pieces=4, hmode="lanes2"),
    "tok2-p4-lanes-heads4": dict(form="tok", tok=2, pieces=4, hmode="lanes", heads=4),
}
CASES = [   # (tokens, heads, variant, fp8 format, hadamard)
    (3, 64, "v4", "e4m3fn", None),
    (5, 3, "v4", "e4m3fnuz", None),
    (7, 5, "v32", "e4m3fn", None),
    (3, 6, "v32", "e4m3fnuz", True),
]


def _cid(c):
    return f"B{c[0]}-H{c[1]}-{c[2]}-{c[3]}" + ("" if c[4] is None else "-hadamard")


@pytest.mark.parametrize("case", CASES, ids=_cid)
@pytest.mark.parametrize("form", list(FORMS))
def test_form_matches_native(form, case):
    check_form(FORMS[form], case)


def check_form(cfg, case):
    """kq.launch(**cfg) against the native reference: the op's parity compare, and (fp32
    arithmetic throughout, exact encoder) at least 99% of the fp8 codes identical."""
    B, H, variant, fmt, had = case
    args, kw = _case(B, H, variant, fmt, had).make("cpu", torch.bfloat16, torch.Generator().manual_seed(B * H))
    ref = indexer_q_native(*args, **kw)
    with alloc.poisoned():
        out = kq.launch(*args, **kw, **cfg)
    assert out[0].dtype == ref[0].dtype and out[0].shape == ref[0].shape
    compare(out, ref, torch.bfloat16, args)
    assert (_fp8.code_distance(out[0], ref[0]) == 0).float().mean() > 0.99


@pytest.mark.parametrize("pieces,hmode", [(4, "fp32"), (8, "fp32"), (16, "fp32"), (4, "lanes"), (4, "lanes2")])
@pytest.mark.parametrize("j", [3, 77, 126])
def test_hadamard_one_hot_by_pieces(pieces, hmode, j):
    # position 0: RoPE is the identity; H e_j / sqrt(128) = (-1)^popcount(i & j) / sqrt(128) for
    # every i, so every code is +-448 with the sign pattern of column j
    q = torch.zeros(2, 5, 128)
    q[:, :, j] = 2.0
    weight = torch.ones(2, 5)
    q_fp8, w_out = kq.launch(q, weight, 1.0, precompute_freqs_cis(4), torch.zeros(2, dtype=torch.int32),
                             variant="v4", form="tok", tok=1, pieces=pieces, hmode=hmode)
    signs = torch.tensor([(-1.0) ** bin(i & j).count("1") for i in range(128)])
    assert torch.equal(q_fp8.float(), (448.0 * signs).expand(2, 5, 128))
    torch.testing.assert_close(w_out, torch.full((2, 5, 1), 2.0 / (math.sqrt(128) * 448.0)), rtol=1e-6, atol=0)


def test_lanes_needs_quarters():
    args, kw = _case(2, 4).make("cpu", torch.bfloat16, torch.Generator().manual_seed(0))
    with pytest.raises(KernelgateError, match="fused_q_indexer_rope_hadamard_quant.*lanes.*pieces=4"):
        kq.launch(*args, **kw, form="tok", pieces=8, hmode="lanes")
