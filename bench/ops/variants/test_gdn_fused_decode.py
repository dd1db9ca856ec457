"""bench/ops/variants/gdn_fused_decode.py: the one-launch GDN decode equals the chain it replaces
(short_conv_update, gdn_packed_decode and gated_rms_norm with silu(z), each the native reference): the
output, the conv and recurrent states, slots out of range skipped, other slots untouched, value heads
grouped on key heads (GVA); fp32 to rounding. And a tiny Qwen3-Next model decodes the same greedy tokens
with it installed. Not part of CI (the kernel runs under the interpreter):
    TRITON_INTERPRET=1 python -m pytest -q bench/ops/variants/test_gdn_fused_decode.py"""
import os
import sys

import pytest
import torch

from kernelgate.ops.conv.short_conv import short_conv_update_native
from kernelgate.ops.gdn.gdn_decode import gdn_packed_decode_native
from kernelgate.ops.norm.gated_rms_norm import gated_rms_norm_native

sys.path.insert(0, os.path.dirname(__file__))
import gdn_fused_decode  # noqa: E402

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                                reason="the Triton kernel needs a GPU or TRITON_INTERPRET=1")
DEV = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"


def chain(mixed, z, a, b, conv_w, conv_state, A_log, dt_bias, state, slots, norm_w, eps, HK, HV, K):
    T = mixed.shape[0]
    qkv = short_conv_update_native(mixed, conv_w, None, conv_state, slots, "silu")
    o = gdn_packed_decode_native(qkv, a, b, A_log, dt_bias, state, slots, HK, HV, K)
    V = o.shape[-1]
    return gated_rms_norm_native(o, norm_w, z.reshape(T, HV, V), eps, activation="silu").reshape(T, HV * V)


def inputs(N, HK, HV, K, V, W, pool, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    C = 2 * HK * K + HV * V
    y = r(N, C + HV * V + 2 * HV + 3).to(dtype).to(DEV)          # in_proj's output, with columns to spare
    t = dict(conv_w=r(C, W) * 0.5, conv_state=r(pool, C, W - 1), norm_w=1 + 0.1 * r(V))
    t = {k: v.to(dtype).to(DEV) for k, v in t.items()}
    t.update(mixed=y[:, :C], z=y[:, C:C + HV * V], b=y[:, C + HV * V:C + HV * V + HV],
             a=y[:, C + HV * V + HV:C + HV * V + 2 * HV],       # views, as the layer's
             A_log=torch.rand(HV, generator=g).mul(3).add(0.5).log().to(DEV), dt_bias=r(HV).to(DEV),
             state=(r(pool, HV, K, V) * 0.1).to(DEV))
    return t


def run(fn, t, slots, HK, HV, K):
    conv_state, state = t["conv_state"].clone(), t["state"].clone()
    out = fn(t["mixed"], t["z"], t["a"], t["b"], t["conv_w"], conv_state, t["A_log"], t["dt_bias"], state, slots,
             t["norm_w"], 1e-6, HK, HV, K)
    return out, conv_state, state


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("N,HK,HV,K,V,W,slots", [
    (1, 2, 4, 32, 16, 4, [1]),            # GVA 2, V != K
    (3, 1, 3, 16, 16, 4, [2, -1, 0]),     # GVA 3, a padded row (slot -1)
    (4, 2, 2, 24, 20, 3, [0, 5, 3, 1]),   # no grouping, sizes not powers of two, W = 3, a slot past the pool
])
def test_equals_the_chain(dtype, N, HK, HV, K, V, W, slots):
    pool = 4
    t = inputs(N, HK, HV, K, V, W, pool, dtype)
    sl = torch.tensor(slots, dtype=torch.int32, device=DEV)
    ref, ref_conv, ref_state = run(chain, t, sl, HK, HV, K)
    out, conv, state = run(gdn_fused_decode.fused_decode, t, sl, HK, HV, K)
    assert out.shape == ref.shape == (N, HV * V) and out.dtype == dtype
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(out, ref, **tol)
    torch.testing.assert_close(state, ref_state, **tol)
    torch.testing.assert_close(conv, ref_conv, rtol=0, atol=0)
    bad = [i for i, s in enumerate(slots) if not 0 <= s < pool]
    assert all(out[i].eq(0).all() for i in bad)
    for s in sorted(set(range(pool)) - {s for s in slots if 0 <= s < pool}):
        assert torch.equal(state[s], t["state"][s]) and torch.equal(conv[s], t["conv_state"][s])
    if dtype == torch.float32:
        assert not torch.equal(state, t["state"])


def test_tiny_model_decodes_the_same_greedy_tokens(monkeypatch):
    import kernelgate
    from kernelgate.models.qwen3_next import build
    from kernelgate.models.qwen3_next_config import tiny
    model = build(tiny(), device=DEV, dtype=torch.float32, seed=3)
    prompts = [[5, 9, 17, 33, 2], [7, 7, 1]]
    ref = [r.token_ids for r in kernelgate.generate(model, prompts, max_new_tokens=6, stop_token_ids=())]
    calls = []
    fused = gdn_fused_decode.fused_decode
    monkeypatch.setattr(gdn_fused_decode, "fused_decode", lambda *a, **kw: calls.append(1) or fused(*a, **kw))
    gdn_fused_decode.install(num_warps=4)
    try:
        got = [r.token_ids for r in kernelgate.generate(model, prompts, max_new_tokens=6, stop_token_ids=())]
    finally:
        gdn_fused_decode.uninstall()
    assert got == ref
    assert len(calls) >= 3 * 5                        # 3 GDN layers of 4, every decode step


def test_uninstall_gives_the_forward_back():
    from kernelgate.models.gdn import GatedDeltaNet
    before = GatedDeltaNet.forward
    assert gdn_fused_decode.install().startswith("gdn_fused_decode")
    assert GatedDeltaNet.forward is not before
    gdn_fused_decode.uninstall()
    assert GatedDeltaNet.forward is before
