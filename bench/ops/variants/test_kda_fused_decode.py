"""bench/ops/variants/kda_fused_decode.py: the one-launch KDA decode equals the chain it replaces (the up
batched matmul, short_conv_update, kda_packed_decode and gated_rms_norm, each the native reference): the
output, the conv and recurrent states, slots out of range skipped, other slots untouched; fp32 to
rounding, bf16 to a few units of its last place. And a tiny Kimi model decodes the same greedy tokens
with it installed. Not part of CI (the kernel runs under the interpreter):
    TRITON_INTERPRET=1 python -m pytest -q bench/ops/variants/test_kda_fused_decode.py"""
import os
import sys

import pytest
import torch

from kernelgate.ops.conv.short_conv import short_conv_update_native
from kernelgate.ops.kda.kda_decode import kda_packed_decode_native
from kernelgate.ops.norm.gated_rms_norm import gated_rms_norm_native

sys.path.insert(0, os.path.dirname(__file__))
import kda_fused_decode  # noqa: E402

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                                reason="the Triton kernel needs a GPU or TRITON_INTERPRET=1")
DEV = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"


def chain(mixed, fg_a, b, conv_w, conv_state, up, A_log, dt_bias, state, slots, norm_w, eps, H, K):
    T = mixed.shape[0]
    fg = torch.bmm(fg_a.reshape(T, 2, K).transpose(0, 1), up.view(2, H * K, K).transpose(1, 2))
    f, gate = fg[0], fg[1].view(T, H, K)
    qkv = short_conv_update_native(mixed, conv_w, None, conv_state, slots, "silu")
    o = kda_packed_decode_native(qkv, f, b, A_log, dt_bias, state, slots, H, K)
    return gated_rms_norm_native(o, norm_w, gate, eps, activation="sigmoid").reshape(T, H * K)


def inputs(N, H, K, W, pool, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    C = 3 * H * K
    y = r(N, C + 2 * K + H + 5).to(dtype).to(DEV)               # in_proj's output, with columns to spare
    t = dict(conv_w=r(C, W) * 0.5, conv_state=r(pool, C, W - 1), up=r(2 * H * K, K) / K ** 0.5, norm_w=1 + 0.1 * r(K))
    t = {k: v.to(dtype).to(DEV) for k, v in t.items()}
    t.update(mixed=y[:, :C], fg_a=y[:, C:C + 2 * K], b=y[:, C + 2 * K:C + 2 * K + H],   # views, as the layer's
             A_log=torch.rand(H, generator=g).mul(3).add(0.5).log().to(DEV), dt_bias=(r(H * K) - 3).to(DEV),
             state=(r(pool, H, K, K) * 0.1).to(DEV))
    return t


def run(fn, t, slots, H, K):
    conv_state, state = t["conv_state"].clone(), t["state"].clone()
    out = fn(t["mixed"], t["fg_a"], t["b"], t["conv_w"], conv_state, t["up"], t["A_log"], t["dt_bias"], state,
             slots, t["norm_w"], 1e-5, H, K)
    return out, conv_state, state


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("N,H,K,W,slots", [
    (1, 2, 32, 4, [1]),
    (3, 3, 16, 4, [2, -1, 0]),            # a padded row (slot -1)
    (4, 2, 24, 3, [0, 5, 3, 1]),          # K not a power of two, W = 3, a slot past the pool (5 of 4)
])
def test_equals_the_chain(dtype, N, H, K, W, slots):
    pool = 4
    t = inputs(N, H, K, W, pool, dtype)
    sl = torch.tensor(slots, dtype=torch.int32, device=DEV)
    ref, ref_conv, ref_state = run(chain, t, sl, H, K)
    out, conv, state = run(kda_fused_decode.fused_decode, t, sl, H, K)
    assert out.shape == ref.shape == (N, H * K) and out.dtype == dtype
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(out, ref, **tol)
    torch.testing.assert_close(state, ref_state, **tol)
    torch.testing.assert_close(conv, ref_conv, rtol=0, atol=0)          # shifted inputs: copied, never computed
    bad = [i for i, s in enumerate(slots) if not 0 <= s < pool]
    assert all(out[i].eq(0).all() for i in bad)
    untouched = sorted(set(range(pool)) - {s for s in slots if 0 <= s < pool})
    for s in untouched:                                                  # other slots bit-identical
        assert torch.equal(state[s], t["state"][s]) and torch.equal(conv[s], t["conv_state"][s])
    if dtype == torch.float32:                                           # the update is not a no-op
        assert not torch.equal(state, t["state"])


def test_tiny_model_decodes_the_same_greedy_tokens(monkeypatch):
    import kernelgate
    from kernelgate.models import build, tiny
    c = tiny(vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
             linear_num_heads=2, linear_head_dim=32, num_attention_heads=2, qk_nope_head_dim=16,
             qk_rope_head_dim=16, v_head_dim=16, kv_lora_rank=32)
    model = build(c, device=DEV, dtype=torch.float32, seed=3)
    prompts = [[5, 9, 17, 33, 2], [7, 7, 1]]
    ref = [r.token_ids for r in kernelgate.generate(model, prompts, max_new_tokens=6, stop_token_ids=())]
    calls = []
    fused = kda_fused_decode.fused_decode
    monkeypatch.setattr(kda_fused_decode, "fused_decode", lambda *a, **kw: calls.append(1) or fused(*a, **kw))
    kda_fused_decode.install(num_warps=4)
    try:
        got = [r.token_ids for r in kernelgate.generate(model, prompts, max_new_tokens=6, stop_token_ids=())]
    finally:
        kda_fused_decode.uninstall()
    assert got == ref
    assert len(calls) >= 3 * 5                        # 3 KDA layers of 4, every decode step (prefill: the chain)


def test_uninstall_gives_the_forward_back():
    from kernelgate.models.kda import KimiDeltaAttention
    before = KimiDeltaAttention.forward
    assert kda_fused_decode.install().startswith("kda_fused_decode")
    assert KimiDeltaAttention.forward is not before
    kda_fused_decode.uninstall()
    assert KimiDeltaAttention.forward is before


def test_bf16_error_like_the_chains():
    """In bf16 the kernel's error against the fp32 chain is the bf16 chain's, within what the interpreter's
    truncating casts add (compiled Triton rounds to nearest, as torch does)."""
    H, K, W, N, pool = 4, 64, 4, 6, 8
    sl = torch.arange(N, dtype=torch.int32, device=DEV)
    t32 = inputs(N, H, K, W, pool, torch.float32, seed=1)
    t16 = {k: v if k in ("A_log", "dt_bias", "state") else v.to(torch.bfloat16) for k, v in t32.items()}
    truth = run(chain, t32, sl, H, K)[0]
    err = {name: float((run(fn, t16, sl, H, K)[0].float() - truth).norm() / truth.norm())
           for name, fn in (("chain", chain), ("fused", kda_fused_decode.fused_decode))}
    assert 0 < err["fused"] < 1.5 * err["chain"] + 1e-3, err
