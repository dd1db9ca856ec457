"""gemv_split (probe): the launches it picks; the split kernel and fp8_linear through the probe equal to the
definition (interpreter)."""
import pytest
import torch

import gemv_split
from kernelgate import alloc, platform, registry
from kernelgate.ops.quant import dequantize_fp8, quantize_fp8_block, quantize_fp8_channel
from kernelgate.tools.testing import assert_close

interpreted = pytest.mark.skipif(not platform.interpreting(), reason="runs under TRITON_INTERPRET=1 only")
FP8_LINEAR = registry.get("fp8_linear").impls["triton"]


def test_launches_by_shape():
    assert gemv_split.launch_for(2304, 4096, 16384, 4, 0) == dict(S=4, C=512)      # o_proj: 7.1 -> at most 4
    assert gemv_split.launch_for(6144, 2304, 16384, 4, 0) == dict(S=3, C=512)      # MLA q_proj: 2.67 -> 3
    assert gemv_split.launch_for(12576, 2304, 16384, 4, 0) == {}                   # KDA in_proj: 1.3 -> 1
    assert gemv_split.launch_for(12576, 2304, 16384, 4, 1) == dict(R=8, C=512, num_warps=2)
    assert gemv_split.launch_for(8192, 512, 16384, 4, 0) == {}                     # K < 2,048: never split


@pytest.mark.parametrize("KW,S,bkw,one,parts", [(128, 2, 32, False, 2), (96, 3, 32, False, 3), (96, 4, 32, False, 3),
                                                (50, 4, 32, False, 1), (64, 4, 64, True, 4)])
def test_split_k_cuts_to_whole_steps_and_scale_blocks(KW, S, bkw, one, parts):
    s, W, even = gemv_split.split_k(KW, S, 128, bkw, one)
    assert s == parts and (s == 1 or (even and (KW // s) % W == 0 and (one or (KW // s) % bkw == 0)))


@interpreted
@pytest.mark.parametrize("S,K,block", [(2, 512, (128, 128)), (4, 512, (128, 128)), (3, 384, (128, 128)),
                                       (4, 256, None), (4, 200, (128, 128))],
                         ids=["2-parts", "4-parts", "3-parts", "one-k-block", "k-tail-no-split"])
def test_split_kernel_matches_the_definition(S, K, block):
    """Each part on its own scale blocks, the row block's last program summing the parts: fp32 equal to the
    definition to round-off, bf16 x (words) to its rounding; three calls in a row (the counters reset
    themselves); 100 rows: a partial last row block; outputs poisoned (an unwritten row fails)."""
    g = torch.Generator().manual_seed(7)
    w = torch.randn(100, K, generator=g) * K ** -0.5
    wq, s = quantize_fp8_channel(w) if block is None else quantize_fp8_block(w, block)
    ref = dequantize_fp8(wq, s, block).double()
    gemv_split.install(split_rows=0)
    try:
        with alloc.poisoned():
            for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 2e-2), (torch.float32, 1e-6)):
                x = torch.randn(1, K, generator=g).to(dtype)
                out = FP8_LINEAR.callable()(x, wq, s, block, form="gemv", R=16, C=128, num_warps=4, S=S)
                assert_close(out, torch.nn.functional.linear(x.double(), ref).to(dtype), tol, what=f"{dtype}")
    finally:
        gemv_split.uninstall()


@interpreted
def test_dispatch_through_the_probe_matches_the_definition():
    g = torch.Generator().manual_seed(0)
    wq, s = quantize_fp8_block(torch.randn(40, 2048, generator=g) * 0.02, (128, 128))
    x = torch.randn(1, 2048, generator=g)
    want = torch.nn.functional.linear(x.double(), dequantize_fp8(wq, s, (128, 128)).double()).float()
    gemv_split.install(split_rows=160)                                             # 160 / 40 rows: 4 parts
    try:
        got = FP8_LINEAR.callable()(x, wq, s, (128, 128))
    finally:
        gemv_split.uninstall()
    assert_close(got, want, 1e-6, what="split in 4")
