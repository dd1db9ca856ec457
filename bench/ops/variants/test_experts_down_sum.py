"""bench/ops/variants/experts_down_sum.py: the one-token experts' word GEMV with the slots summed by the
down kernel's last program gives bitwise the output of the dispatched three launches (the same fp32 sums in
the same order), FP8 and bf16 weights, a -1 id and the shared-expert slot, row blocks that do not tile D,
repeated calls (counters reset). Not part of CI (the kernels run under the interpreter):
    TRITON_INTERPRET=1 python -m pytest -q bench/ops/variants/test_experts_down_sum.py"""
import os
import sys

import pytest
import torch

from kernelgate.ops.moe import fused_experts_words_triton as ew
from kernelgate.ops.moe.fused_experts_fp8 import make_inputs

sys.path.insert(0, os.path.dirname(__file__))
import experts_down_sum  # noqa: E402

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs under TRITON_INTERPRET=1")


@pytest.fixture(autouse=True)
def _restore():
    yield
    experts_down_sum.uninstall()


def both(fn):
    """(dispatched, probe) outputs of fn(), three calls each."""
    outs = []
    for probe in (False, True):
        (experts_down_sum.install if probe else experts_down_sum.uninstall)()
        outs.append([fn(call) for call in range(3)])
    return outs


@pytest.mark.parametrize("D,I,rows", [(160, 72, 16), (256, 128, 8), (200, 64, 32)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_equals_the_three_launches(D, I, rows, dtype):
    launch = dict(gate_up=(8, 128, 4), down=(rows, 64, 2))

    def run(call):
        gen = torch.Generator().manual_seed(call)
        (x, gu, dn, tw, ti, gus, dns), kw = make_inputs(1, D, I, 6, 3, dtype, "cpu", gen, ids="shared", block=(128, 128))
        ti[0, 0] = -1
        return ew.fused_experts_fp8_gemv(x, gu, dn, tw, ti, gus, dns, **kw, launch=launch)
    ref, got = both(run)
    for a, b in zip(ref, got):
        assert torch.equal(a, b) and a.abs().sum() > 0
    assert int(experts_down_sum._COUNTERS[torch.device("cpu")].abs().sum()) == 0


def test_bf16_words_equal_the_three_launches():
    D, I, E, k = 192, 96, 5, 4
    gen = torch.Generator().manual_seed(3)
    wgu = torch.randn(E, 2 * I, D, generator=gen).bfloat16()
    wdn = torch.randn(E, D, I, generator=gen).bfloat16()

    def run(call):
        g = torch.Generator().manual_seed(10 + call)
        x = torch.randn(1, D, generator=g).bfloat16()
        ids = torch.randperm(E, generator=g)[:k].view(1, k).int()
        ids[0, 1] = E                                            # out of range: contributes nothing
        tw = torch.rand(1, k, generator=g)
        out = torch.empty(1, D, dtype=torch.bfloat16)
        return ew.fused_experts_bf16_words(x, ew.bf16_words(wgu), ew.bf16_words(wdn), tw, ids, out)
    ref, got = both(run)
    for a, b in zip(ref, got):
        assert torch.equal(a, b) and a.abs().sum() > 0
