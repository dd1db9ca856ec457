"""bench/ops/variants/greedy_one_launch.py against executor.sampling.sample_async's greedy path (the
engine's, itself tested against hand cases in tests/executor): ties across and inside blocks (the first
maximum wins), NaN / +inf / -inf rows (-1), a last block cut short, one block, repeated calls (the row
counters reset), a batch with a sampled row left to sample_async. Under TRITON_INTERPRET=1 on CPU. Not in CI:
    TRITON_INTERPRET=1 python -m pytest -q bench/ops/variants/test_greedy_one_launch.py"""
import os
import sys

import pytest
import torch

from kernelgate import platform
from kernelgate.engine.params import SamplingParams
from kernelgate.executor import model_runner, sampling

sys.path.insert(0, os.path.dirname(__file__))
import greedy_one_launch as g1  # noqa: E402

pytestmark = pytest.mark.skipif(not platform.interpreting(), reason="CPU tensors: needs TRITON_INTERPRET=1")


def _rows(V):
    gen = torch.Generator().manual_seed(V)
    x = torch.randn(7, V, generator=gen)
    x[1, 5] = x[1, V - 3] = x[1].max() + 1                # a tie across blocks: the first wins
    x[2, 10] = x[2, 11] = x[2].max() + 1                  # a tie inside a block
    x[3, V // 2] = float("nan")
    x[4, V - 1] = float("inf")
    x[5, 0] = float("-inf")
    x[6] = -1e30                                          # all equal: token 0
    return x


@pytest.mark.parametrize("V,block", [(1000, 64), (1000, 1024), (4096, 512), (163, 32)])
def test_matches_sample_async(monkeypatch, V, block):
    monkeypatch.setattr(g1, "BLOCK", block)
    x = _rows(V)
    params = [SamplingParams(temperature=0.0)] * x.shape[0]
    want = sampling.sample_async(x, params, [None] * x.shape[0])
    for _ in range(3):                                    # the counters reset between calls
        got = g1.greedy_tokens(x)
        assert got.tolist() == want.tolist()
    assert want[3] == want[4] == want[5] == -1 and want[1] == 5 and want[2] == 10 and want[6] == 0
    assert g1.sample_async(x, params, [None] * x.shape[0]).tolist() == want.tolist()


def test_a_sampled_row_keeps_sample_async():
    x = _rows(300)
    params = [SamplingParams(temperature=0.0)] * 6 + [SamplingParams(temperature=1.0, seed=3)]
    gens = [None] * 6 + [sampling.make_generator(3, "cpu")]
    want = sampling.sample_async(x, params, [None] * 6 + [sampling.make_generator(3, "cpu")])
    assert g1.sample_async(x, params, gens).tolist() == want.tolist()


def test_install_and_uninstall():
    before = model_runner.sample_async
    assert g1.install().startswith("greedy_one_launch")
    assert model_runner.sample_async is g1.sample_async
    g1.uninstall()
    assert model_runner.sample_async is before
