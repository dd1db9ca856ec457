"""The sweep-only prefetching gate/up GEMV (bench/ops/variants/fp8_gemv_prefetch.py) against the
package's kernel at the same launch: the same arithmetic in the same order, so the same bits, for
uniform and per-row scale blocks, one K block, a masked K tail and invalid ids. Runs on CPU under
TRITON_INTERPRET=1; not part of CI (tests/ only):
    TRITON_INTERPRET=1 python -m pytest -q bench/ops/variants/test_fp8_gemv_prefetch.py"""
import os
import sys

import pytest
import torch

from kernelgate import platform
from kernelgate.ops.moe import fused_experts_fp8 as fe8

sys.path.insert(0, os.path.dirname(__file__))
import fp8_gemv_prefetch as v  # noqa: E402

pytestmark = pytest.mark.skipif(not platform.interpreting(), reason="CPU tensors: needs TRITON_INTERPRET=1")


@pytest.mark.parametrize("D,I,block,bi,width", [(200, 64, (128, 128), 4, 128), (200, 48, (8, 64), 16, 128),
                                                (96, 32, (128, 128), 8, 64)],
                         ids=["uniform-tail", "per-row-scales", "one-k-block"])
def test_prefetch_equals_the_package_kernel(D, I, block, bi, width):
    gen = torch.Generator().manual_seed(3)
    (x, wgu, _, _, ids, sgu, _), _ = fe8.make_inputs(3, D, I, 6, 3, torch.float32, "cpu", gen, ids="shared",
                                                    block=block)
    want = v.package_gate_up(x, wgu, ids, sgu, block, BLOCK_I=bi, WIDTH=width)
    got = v.gate_up_prefetch(x, wgu, ids, sgu, block, BLOCK_I=bi, WIDTH=width)
    assert torch.equal(got, want)
    assert (ids < 0).any() and want.abs().sum() > 0
