"""FP8 weight helpers against hand-computed blocks and a block-by-block loop (odd N, K; partial edge blocks)."""
import math

import pytest
import torch

from kernelgate import KernelgateError
from kernelgate.ops.quant import dequantize_fp8, quantize_fp8_block, quantize_fp8_channel, quantize_fp8_groups
from kernelgate.ops.quant.fp8_weights import AMAX_FLOOR, scale_shape

FP8 = torch.float8_e4m3fn


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def test_hand_computed_blocks_round_trip_exactly():
    # N=3, K=5, block (2, 3): blocks rows {0,1} x cols {0,1,2}, {0,1} x {3,4}, {2} x {0,1,2}, {2} x {3,4}
    # with amax 448, 0.5, 6 and 0. Every value is an e4m3 value times its block's scale amax / 448.
    w = torch.tensor([[448.0, -224.0, 1.5, 0.25, -0.5],
                      [3.0, 0.0, -448.0, 0.125, 0.0625],
                      [-6.0, 3.0, 1.5, 0.0, 0.0]])
    wq, s = quantize_fp8_block(w, (2, 3))
    assert s.shape == (2, 2) and s.dtype == torch.float32
    assert s[0, 0] == 1.0 and s[0, 1] == torch.tensor(0.5) / 448 and s[1, 0] == torch.tensor(6.0) / 448
    assert s[1, 1] == torch.tensor(AMAX_FLOOR) / 448                    # the all-zero block: finite, > 0
    assert wq.dtype == FP8 and float(wq[0, 0].float()) == 448.0 and float(wq[0, 3].float()) == 224.0
    assert torch.equal(wq[2, 3:].float(), torch.zeros(2))
    deq = dequantize_fp8(wq, s, (2, 3))
    assert torch.allclose(deq, w, rtol=1e-6, atol=0), (deq - w).abs().max()
    assert wq[2].float().tolist() == [-448.0, 224.0, 112.0, 0.0, 0.0]


def test_rounding_is_to_nearest_even_on_the_e4m3_grid():
    # One block, amax 448 -> scale 1: 17 lies between e4m3 values 16 and 18 (a tie: 16 has the even
    # mantissa), 19 between 18 and 20 (tie: 20), 17.5 nearer 18.
    w = torch.tensor([[448.0, 17.0, 19.0, 17.5, -17.0]])
    wq, s = quantize_fp8_block(w, (128, 128))
    assert float(s) == 1.0
    assert wq.float().tolist() == [[448.0, 16.0, 20.0, 18.0, -16.0]]


def _loop_reference(w, bn, bk):
    """Block by block, independent of the helper's reshaping: amax, scale, codes, dequantized values."""
    N, K = w.shape
    nb, kb = math.ceil(N / bn), math.ceil(K / bk)
    scale = torch.empty(nb, kb)
    deq = torch.empty(N, K)
    for i in range(nb):
        for j in range(kb):
            blk = w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk].float()
            sc = max(blk.abs().max().item(), AMAX_FLOOR) / 448.0
            scale[i, j] = sc
            codes = (blk / torch.tensor(sc, dtype=torch.float32)).clamp(-448, 448).to(FP8)
            deq[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] = codes.float() * torch.tensor(sc, dtype=torch.float32)
    return scale, deq


@pytest.mark.parametrize("N,K,block", [(150, 200, (128, 128)), (65, 63, (32, 16)), (1, 129, (128, 128))],
                         ids=["N150-K200-b128", "N65-K63-b32x16", "N1-K129-b128"])
def test_odd_shapes_match_a_block_loop(N, K, block):
    w = torch.randn(N, K, generator=_gen(1)) * (0.5 * torch.randn(N, 1, generator=_gen(2))).exp()
    wq, s = quantize_fp8_block(w, block)
    ref_scale, ref_deq = _loop_reference(w, *block)
    assert s.shape == scale_shape((N, K), block) == ref_scale.shape
    torch.testing.assert_close(s, ref_scale, rtol=2e-7, atol=0)
    torch.testing.assert_close(dequantize_fp8(wq, s, block), ref_deq, rtol=2e-7, atol=0)
    # round trip: at most half the widest e4m3 step (32, between 256 and 448) times the block's scale
    step = s.repeat_interleave(block[0], 0)[:N].repeat_interleave(block[1], 1)[:, :K]
    assert bool(((dequantize_fp8(wq, s, block) - w).abs() <= 16 * step * (1 + 1e-6)).all())


def test_stacked_experts_quantize_each_expert_alone():
    w = torch.randn(3, 70, 50, generator=_gen(3)).bfloat16()
    wq, s = quantize_fp8_block(w, (32, 32))
    assert s.shape == (3, 3, 2)
    for e in range(3):
        q1, s1 = quantize_fp8_block(w[e], (32, 32))
        assert torch.equal(wq[e].view(torch.uint8), q1.view(torch.uint8)) and torch.equal(s[e], s1)
    assert torch.equal(dequantize_fp8(wq, s, (32, 32))[1], dequantize_fp8(wq[1], s[1], (32, 32)))


def test_per_channel_is_one_scale_per_row():
    w = torch.randn(7, 45, generator=_gen(4))
    wq, s = quantize_fp8_channel(w)
    assert s.shape == (7, 1)
    torch.testing.assert_close(s[:, 0], w.abs().amax(1) / 448, rtol=2e-7, atol=0)
    q2, s2 = quantize_fp8_block(w, (1, 45))
    assert torch.equal(wq.view(torch.uint8), q2.view(torch.uint8)) and torch.equal(s, s2)
    torch.testing.assert_close(dequantize_fp8(wq, s, None), wq.float() * s, rtol=0, atol=0)


def test_activation_groups():
    x = torch.randn(5, 300, generator=_gen(5)).bfloat16()
    q, s = quantize_fp8_groups(x, 128)
    assert q.shape == (5, 300) and s.shape == (5, 3)
    for t in range(5):
        for g in range(3):
            cols = slice(g * 128, (g + 1) * 128)
            assert s[t, g] == x[t, cols].float().abs().max() / torch.tensor(448.0)
            torch.testing.assert_close(q[t, cols].float() * s[t, g], x[t, cols].float(), rtol=2 ** -4, atol=1e-6)


def test_bad_block_is_an_error():
    with pytest.raises(KernelgateError, match="block"):
        quantize_fp8_block(torch.ones(4, 4), (0, 128))
