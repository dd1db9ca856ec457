"""bench/ops/variants/kda_up_gemv.py: a KDA layer's f_b / g_b at one token as two `linear` calls equal the
batched matmul they replace (fp32, to rounding), more tokens keep the batched matmul, and uninstall()
gives it back. On CPU the calls take the native linear (the Triton GEMV's parity, a strided x included, is
the linear op's own suite). Not part of CI:
    python -m pytest -q bench/ops/variants/test_kda_up_gemv.py"""
import os
import sys

import pytest
import torch

from kernelgate.models import tiny
from kernelgate.models.kda import KimiDeltaAttention
from kernelgate.models.parallel import allocate_fused

sys.path.insert(0, os.path.dirname(__file__))
import kda_up_gemv  # noqa: E402


@pytest.fixture
def layer():
    torch.manual_seed(0)
    c = tiny(hidden_size=64, linear_num_heads=3, linear_head_dim=32)
    m = KimiDeltaAttention(c, 0)
    allocate_fused(m, torch.float32, "cpu")
    with torch.no_grad():
        for p in m.parameters():
            p.normal_()
    yield m
    kda_up_gemv.uninstall()


@pytest.mark.parametrize("T", [1, 3])
def test_two_gemvs_equal_the_batched_matmul(layer, T):
    fg_a = torch.randn(T, 4 * 32)[:, 32:96]          # f_a | g_a as a column slice, as the layer gets it
    f0, g0 = layer._up(fg_a)
    assert kda_up_gemv.install().startswith("kda_up_gemv")
    f1, g1 = layer._up(fg_a)
    assert f1.shape == f0.shape == (T, 3 * 32) and g1.shape == g0.shape == (T, 3, 32)
    torch.testing.assert_close(f1, f0, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(g1, g0, rtol=1e-5, atol=1e-5)
    by_hand = fg_a[:, :32] @ layer.f_b_proj.weight.t()
    torch.testing.assert_close(f1, by_hand, rtol=1e-5, atol=1e-5)


def test_uninstall_gives_the_batched_matmul_back(layer):
    before = KimiDeltaAttention._up
    kda_up_gemv.install()
    assert KimiDeltaAttention._up is not before
    kda_up_gemv.uninstall()
    assert KimiDeltaAttention._up is before
