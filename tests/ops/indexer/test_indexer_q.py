"""fused_q_indexer_rope_hadamard_quant against hand-computed cases and HF transformers' RoPE.

Every test runs the native reference and the Triton kernel (interpreted on CPU)."""
import math

import pytest
import torch

from kernelgate import KernelgateError, platform, registry
from helpers.impls import poisoned_impl
from kernelgate.ops.indexer.indexer_q import precompute_freqs_cis

OP = "fused_q_indexer_rope_hadamard_quant"
FMAX = {"e4m3fn": 448.0, "e4m3fnuz": 240.0}
DTYPE = {"e4m3fn": torch.float8_e4m3fn, "e4m3fnuz": torch.float8_e4m3fnuz}


@pytest.fixture(params=["native", "triton_tok", "triton"])
def run(request):
    return poisoned_impl(OP, request.param)


def _scale(w_out, weight, weight_scale):
    return w_out.squeeze(-1) / (weight.float() * weight_scale)


def _popcount(n):
    return bin(n).count("1")


@pytest.mark.parametrize("fmt", ["e4m3fn", "e4m3fnuz"])
@pytest.mark.parametrize("j", [0, 5, 64, 127])
def test_hadamard_of_one_hot(run, j, fmt):
    # position 0 makes RoPE the identity; H e_j = column j of the Sylvester matrix / sqrt(128),
    # whose entries are (-1)^popcount(i & j) / sqrt(128): all of magnitude amax, so every code
    # is exactly +-FP8_MAX and the scale is 1/(sqrt(128) * FP8_MAX)
    B, H = 1, 3
    q = torch.zeros(B, H, 128)
    q[:, :, j] = 1.0
    weight = torch.tensor([[1.0, -2.0, 0.5]])
    q_fp8, w_out = run(q, weight, 0.25, precompute_freqs_cis(8), torch.zeros(B, dtype=torch.int32),
                       variant="v4", fp8_format=fmt)
    signs = torch.tensor([(-1.0) ** _popcount(i & j) for i in range(128)])
    assert q_fp8.dtype == DTYPE[fmt]
    assert torch.equal(q_fp8.float(), (FMAX[fmt] * signs).expand(B, H, 128))
    scale = 1 / (math.sqrt(128) * FMAX[fmt])
    torch.testing.assert_close(w_out, (weight * 0.25 * scale).unsqueeze(-1), rtol=1e-6, atol=0)


def _quant_expected(x, fmt):
    """Hand-written per-row quantization: codes and scale."""
    scale = x.abs().amax(-1, keepdim=True).clamp(min=1e-4) / FMAX[fmt]
    return (x / scale).clamp(-FMAX[fmt], FMAX[fmt]).to(DTYPE[fmt]), scale


@pytest.mark.parametrize("variant", ["v4", "v32"])
def test_rope_at_position_zero_is_identity(run, variant):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(5, 4, 128, generator=g)
    weight = torch.rand(5, 4, generator=g) + 0.5
    q_fp8, w_out = run(q, weight, 1.0, precompute_freqs_cis(16), torch.zeros(5, dtype=torch.int64),
                       variant=variant, hadamard=False)
    codes, scale = _quant_expected(q, "e4m3fn")
    assert torch.equal(q_fp8.view(torch.uint8), codes.view(torch.uint8))
    torch.testing.assert_close(_scale(w_out, weight, 1.0), scale.squeeze(-1), rtol=1e-6, atol=0)


@pytest.mark.parametrize("variant,pair", [("v4", (64 + 2 * 7, 64 + 2 * 7 + 1)), ("v32", (7, 32 + 7))])
def test_rope_by_known_angle(run, variant, pair):
    # one pair (a, b) = (1, 0) at frequency index 7, rotated by pi/3 -> (cos, sin) = (1/2, sqrt(3)/2);
    # a constant 0.25 elsewhere shows that nothing else moves
    theta = math.pi / 3
    freqs = torch.ones(4, 32, dtype=torch.complex64)
    freqs[3, 7] = complex(math.cos(theta), math.sin(theta))
    q = torch.full((1, 1, 128), 0.25)
    q[0, 0, pair[0]], q[0, 0, pair[1]] = 1.0, 0.0
    q_fp8, w_out = run(q, torch.ones(1, 1), 1.0, freqs, torch.tensor([3]), variant=variant, hadamard=False)
    want = torch.full((128,), 0.25)
    want[pair[0]], want[pair[1]] = 0.5, math.sqrt(3) / 2
    codes, scale = _quant_expected(want, "e4m3fn")
    assert torch.equal(q_fp8.view(torch.uint8).flatten(), codes.view(torch.uint8))
    torch.testing.assert_close(w_out.flatten(), scale, rtol=1e-6, atol=0)


def _hf_rope(q, freqs_cis, pos, variant):
    """RoPE by HF transformers' own DeepSeek code (the pair convention under test); cos/sin
    are the table's, so that only the pairing and the sign convention are compared."""
    cos, sin = freqs_cis[pos].real, freqs_cis[pos].imag                     # [B, 32]
    if variant == "v4":
        from transformers.models.deepseek_v4.modeling_deepseek_v4 import apply_rotary_pos_emb
        # HF V4 takes half-size cos/sin [B, S, 32] and rotates the trailing 64 dims, x [B, H, S, D]
        return apply_rotary_pos_emb(q.unsqueeze(2), cos[:, None], sin[:, None], unsqueeze_dim=1).squeeze(2)
    from transformers.models.deepseek_v32.modeling_deepseek_v32 import apply_rotary_pos_emb
    # HF V3.2 indexer: non-interleaved (rotate_half) on the leading 64 dims, x [B, S, H, 64]
    c2, s2 = torch.cat([cos, cos], -1)[:, None], torch.cat([sin, sin], -1)[:, None]
    rot, _ = apply_rotary_pos_emb(q[:, None, :, :64], q[:, None, :, :64], c2, s2, unsqueeze_dim=2)
    return torch.cat([rot[:, 0], q[..., 64:]], -1)


@pytest.mark.parametrize("variant", ["v4", "v32"])
@pytest.mark.parametrize("hadamard", [False, True])
@pytest.mark.parametrize("fmt", ["e4m3fn", "e4m3fnuz"])
def test_matches_hf_rope_then_hadamard_within_fp8_bound(run, variant, hadamard, fmt):
    g = torch.Generator().manual_seed(1)
    B, H = 63, 3
    q = torch.randn(B, H, 128, generator=g) * 4
    weight = torch.randn(B, H, generator=g)
    pos = torch.randint(0, 4000, (B,), generator=g)
    freqs = precompute_freqs_cis(4096)
    q_fp8, w_out = run(q, weight, 0.5, freqs, pos, variant=variant, fp8_format=fmt, hadamard=hadamard)
    x = _hf_rope(q, freqs, pos, variant).double()
    if hadamard:
        hm = torch.tensor([[(-1.0) ** _popcount(i & j) for j in range(128)] for i in range(128)], dtype=torch.float64)
        x = x @ hm / math.sqrt(128)
    scale = x.abs().amax(-1, keepdim=True) / FMAX[fmt]
    torch.testing.assert_close(_scale(w_out, weight, 0.5).double(), scale.squeeze(-1), rtol=1e-5, atol=0)
    # round-trip bound: e4m3 keeps 3 mantissa bits -> half an ulp is <= 2^-4 relative for normals;
    # below the smallest normal the step is 2^-9 (fn) / 2^-10 (fnuz) in code units
    deq = q_fp8.double() * scale
    bound = torch.maximum(x.abs() * 2.0 ** -4, scale * 2.0 ** -10) * (1 + 1e-5)
    assert ((deq - x).abs() <= bound).all(), f"max excess {((deq - x).abs() - bound).max():.3e}"
    assert (q_fp8.float().abs().amax(-1) == FMAX[fmt]).all()            # the amax element maps to FP8_MAX


def test_all_zero_row_uses_amax_floor(run):
    q = torch.zeros(2, 2, 128)
    q_fp8, w_out = run(q, torch.ones(2, 2), 1.0, precompute_freqs_cis(4), torch.zeros(2, dtype=torch.int32))
    assert (q_fp8.float() == 0).all()
    torch.testing.assert_close(w_out, torch.full((2, 2, 1), 1e-4 / 448), rtol=1e-6, atol=0)


def _args(**over):
    a = dict(q=torch.randn(2, 4, 128), weight=torch.randn(2, 4), weight_scale=1.0,
             freqs_cis=precompute_freqs_cis(8), positions=torch.zeros(2, dtype=torch.int32))
    a.update(over)
    return a


@pytest.mark.parametrize("over,match", [
    (dict(q=torch.randn(2, 4, 64)), "q head dim 64 != 128"),
    (dict(weight=torch.randn(2, 3)), "weight shape"),
    (dict(freqs_cis=torch.randn(8, 32)), "freqs_cis dtype"),
    (dict(freqs_cis=precompute_freqs_cis(8)[:, :16]), "freqs_cis shape"),
    (dict(positions=torch.zeros(2)), "positions dtype"),
    (dict(variant="v3"), "variant 'v3'"),
    (dict(fp8_format="e5m2"), "fp8_format 'e5m2'"),
], ids=["head-dim", "weight-shape", "freqs-dtype", "freqs-shape", "pos-dtype", "variant", "format"])
def test_bad_input_names_op_and_argument(over, match):
    op = registry.get(OP)
    with pytest.raises(KernelgateError, match=match) as e:
        op(**_args(**over))
    assert OP in str(e.value)


@pytest.mark.parametrize("op_name", ["fused_q_indexer_rope_hadamard_quant", "silu_and_mul_clamp",
                                     "indexer_k_quant_and_cache", "fp8_paged_mqa_logits"])
@pytest.mark.parametrize("plat", ["xpu", "rocm"])
def test_portable_triton_is_chosen_off_cuda(op_name, plat):
    # the point of the issue: XPU and ROCm get the same Triton kernel as CUDA, by declaration
    op = registry.get(op_name)
    with platform.simulate(plat) as p:
        if p.triton:
            pytest.skip(f"Triton unusable here: {p.triton}")
        args, kwargs = op.cases()[0].make(torch.device(p.device), op.cases()[0].dtypes[0], torch.Generator().manual_seed(0))
        chosen = [impl.name for impl, why in op.explain(args, kwargs) if why is None]
    assert chosen == ["triton"]
