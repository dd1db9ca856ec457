"""The sweep-only GEMV forms of bench/ops/variants/gemv_inflight.py against the ops' native references:
the FP8 linear GEMV with tiles 1-3 K steps ahead, on steps that tile K or end masked, in fp32 (the decode
is exact: 1e-6) and bf16; the bf16 linear GEMV 2 steps ahead; the experts' word GEMVs (FP8 and bf16
weights) 2 steps ahead; on shapes whose step counts exercise the clamped and the masked tails; and
uninstall() giving dispatch's kernels back.

Runs on CPU under TRITON_INTERPRET=1 with the L2 prefetch off (inline PTX: checked on the GPU by
bench/e2e/fp8_decode.py --variant before timing, the logits against the run without). Not part of CI
(tests/ only):
    TRITON_INTERPRET=1 python -m pytest -q bench/ops/variants/test_gemv_inflight.py"""
import os
import sys

import pytest
import torch

from kernelgate import platform
from kernelgate.ops.linear import linear_gemv_triton as lg
from kernelgate.ops.moe import fused_experts as fe
from kernelgate.ops.moe import fused_experts_fp8 as fe8
from kernelgate.ops.moe import fused_experts_gemv_triton as ge
from kernelgate.ops.moe import fused_experts_words_triton as ew
from kernelgate.ops.quant import fp8_gemv_triton as gt
from kernelgate.ops.quant import fp8_linear as fl
from kernelgate.ops.quant import fp8_linear_triton as flt
from kernelgate.tools.testing import rel_err

sys.path.insert(0, os.path.dirname(__file__))
import gemv_inflight as gi  # noqa: E402

pytestmark = pytest.mark.skipif(not platform.interpreting(), reason="CPU tensors: needs TRITON_INTERPRET=1")


@pytest.fixture
def installed():
    yield gi.install
    gi.uninstall()


# (N, K, C): 9 steps of 256 that tile K = 2,304; one step (K = 128); 5 steps of 512 with the last masked
# (K = 2,304); 3 of 64 and a per-channel weight (block None); K = 4,096 as 4 steps of 1,024
@pytest.mark.parametrize("N,K,C,block", [(40, 2304, 256, (128, 128)), (24, 128, 256, (128, 128)),
                                         (40, 2304, 512, (128, 128)), (33, 192, 64, None),
                                         (16, 4096, 1024, (128, 128))])
@pytest.mark.parametrize("ahead", [1, 2, 3])
def test_ahead_matches_the_reference(installed, N, K, C, block, ahead):
    installed(pf_bytes=0, ahead=ahead, fp8_c=C, bf16=False)
    gen = torch.Generator().manual_seed(N * K + ahead)
    (x, w, s), kw = fl.make_inputs(1, N, K, block, torch.float32, "cpu", gen)
    ref = fl.fp8_linear_native(x, w, s, **kw)
    launch = dict(form="gemv", R=16, C=C, num_warps=4)       # (the interpreter's own launch has C = 128)
    assert isinstance(gt._gemv_kernel, gi._With) and gt.step(K, C)[0] == min(C, K) // 4
    assert rel_err(flt.fp8_linear_triton(x, w, s, **kw, **launch), ref) < 1e-6
    (xb, _, _), _ = fl.make_inputs(1, N, K, block, torch.bfloat16, "cpu", torch.Generator().manual_seed(1))
    assert rel_err(flt.fp8_linear_triton(xb, w, s, **kw, **launch), fl.fp8_linear_native(xb, w, s, **kw)) < 2e-2


@pytest.mark.parametrize("N,K,width", [(20, 2304, 1024), (9, 100, 64), (12, 256, 128)])
def test_bf16_linear_two_ahead_matches_the_reference(installed, N, K, width):
    installed(ahead=2)
    gen = torch.Generator().manual_seed(N + K)
    x, w = torch.randn(1, K, generator=gen), torch.randn(N, K, generator=gen)
    assert isinstance(lg._gemv_kernel, gi._With)
    got = lg.linear_gemv(x, w, ROWS=4, WIDTH=width)
    assert rel_err(got, x @ w.t()) < 1e-6


# Kimi-like widths cut down (D, I): steps that tile both K; D = 2,304 as 9 steps of 256 with C = 256
@pytest.mark.parametrize("D,I,C", [(256, 128, 64), (2304, 64, 256), (96, 32, 64)])
@pytest.mark.parametrize("fp8", [True, False])
def test_experts_two_ahead_match_the_reference(installed, D, I, C, fp8):
    """Bitwise the dispatched (one step ahead) kernels' output: the same sums in the same order, only the
    loads moved; and the native reference to fp32 round-off of a D-term sum (about sqrt(D) ulps: D = 2,304
    measured 1.1e-6 in both forms) or bf16's."""
    gen = torch.Generator().manual_seed(D + I)
    launch = dict(gate_up=(16, C, 4), down=(16, C, 4))
    if fp8:
        args, kw = fe8.make_inputs(1, D, I, 8, 3, torch.float32, "cpu", gen)
        ref, run = fe8.fused_experts_fp8_native(*args, **kw), lambda: ew.fused_experts_fp8_gemv(*args, **kw, launch=launch)
    else:
        args, kw = fe.make_inputs(1, D, I, 8, 3, torch.bfloat16, "cpu", gen)
        ref, run = fe.fused_experts_native(*args, **kw), lambda: ge.fused_experts_gemv(*args, **kw, launch=launch)
    one_ahead = run()
    installed(experts_ahead=2)
    got = run()
    assert isinstance(ew._gate_up_kernel, gi._With)
    assert torch.equal(got, one_ahead)
    assert rel_err(got, ref) < (4e-8 * D ** 0.5 if fp8 else 2e-2)


def test_uninstall_gives_dispatch_back(installed):
    before = (gt._gemv_kernel, lg._gemv_kernel, gt.step, ew._gate_up_kernel, ew._down_kernel,
              {k: dict(v) for k, v in gt.LINEAR.items()})
    installed(pf_bytes=4096, ahead=2, experts_ahead=2, fp8_c=1024)
    assert gt._gemv_kernel is not before[0] and gt.step is not before[2] and ew._down_kernel is not before[4]
    gi.uninstall()
    assert (gt._gemv_kernel, lg._gemv_kernel, gt.step, ew._gate_up_kernel, ew._down_kernel, gt.LINEAR) == before


def test_ahead_out_of_range_is_refused():
    with pytest.raises(ValueError, match="ahead must be 1, 2 or 3 and experts_ahead 1 or 2, got 4, 1"):
        gi.install(ahead=4)
