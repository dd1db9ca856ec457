"""Probe (issue 38, not dispatched): a Gated DeltaNet layer's decode between its two projections in one
Triton launch -- the conv update, the packed decode step and the gated norm.

A one-token GDN layer runs, between in_proj and out_proj (kernelgate/models/gdn.py):
    qkv = short_conv_update(mixed)               conv taps + silu, conv state shifted in place
    o   = gdn_packed_decode(qkv, a, b)           gate, beta, q/k L2 norm, delta rule on the fp32 state
    o   = gated_rms_norm(o, w, z, silu)          per value head over V
three dependent launches (Session 29's Qwen profile: conv ~2 µs, the norm ~2 µs, the step 4 at batch 1).
Here one program per (sequence, key head) does the three for the key head's q / k channels and its
GROUP value heads (Qwen3.5: 2), one after the other: it owns the conv channels of q, k and of those
value heads, their state tiles and their output rows, so no other program reads what it writes (a
program per value head would race on the shared q / k conv state). Intermediates are rounded to the
model dtype where the chain rounds them (the conv output, o), so the output equals the chain's but for
the order of the fp32 sums. The issue's "packed form that fuses gate + conv + delta rule" is this form.

The cost: HK programs (16 on Qwen3.5 at batch 1, against 256 of kda_packed_decode's V split), each
streaming GROUP 64 KB state tiles; the device call measures whether two saved launches pay for it.
Compiled here for sm_90 (Triton 3.9's ptxas, Qwen3.5's HK = 16, HV = 32, K = V = 128): 195 registers at 8
warps, 99 at 16, no spills (255 and a 272-byte stack at 4 warps).

    sys.path.insert(0, "bench/ops/variants"); import gdn_fused_decode; gdn_fused_decode.install(num_warps=8)
    bench/e2e/qwen_e2e.py --parts full --forms "none;gdn_fused_decode"
"""
from __future__ import annotations

import triton
import triton.language as tl

from kernelgate import alloc
from kernelgate.models import quant
from kernelgate.models.gdn import GatedDeltaNet
from kernelgate.ops.common.pdl import inputs_ready, pdl_args
from kernelgate.ops.kda.kda_decode_triton import delta_rule_step
from kda_fused_decode import _conv_head

_ORIGINAL = GatedDeltaNet.forward
_SETTINGS = dict(num_warps=8, max_tokens=8)


@triton.jit
def _fused_kernel(mixed, z, a, b, conv_w, conv_state, A_log, dt_bias, state, slots, norm_w, out,
                  smn, smd, szn, szd, san, sah, sbn, sbh, swc, sww, scs, scc, scw, ssl, ss0, ss1, ss2, ss3, son,
                  pool, scale, eps,
                  HK: tl.constexpr, GROUP: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
                  BV: tl.constexpr, W: tl.constexpr, WP: tl.constexpr, PDL: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    hk = tl.program_id(1)
    o_k = tl.arange(0, BK)
    o_v = tl.arange(0, BV)
    mk, mv = o_k < K, o_v < V
    ms = mk[:, None] & mv[None, :]
    w_norm = tl.load(norm_w + o_v, mask=mv, other=0).to(tl.float32)       # a weight: before the wait
    inputs_ready(PDL)
    slot = tl.load(slots + n * ssl).to(tl.int64)
    if (slot < 0) | (slot >= pool):               # the chain: zero output, no state read or written
        for gi in tl.static_range(GROUP):
            tl.store(out + n * son + (hk * GROUP + gi) * V + o_v, tl.zeros([BV], dtype=tl.float32).to(
                out.dtype.element_ty), mask=mv)
        return
    dt = out.dtype.element_ty
    x_n, cs = mixed + n * smn, conv_state + slot * scs
    q = _conv_head(x_n, conv_w, cs, hk * K + o_k, mk, smd, swc, sww, scc, scw, W, WP).to(dt).to(tl.float32)
    k = _conv_head(x_n, conv_w, cs, HK * K + hk * K + o_k, mk, smd, swc, sww, scc, scw, W, WP).to(dt).to(tl.float32)
    for gi in tl.static_range(GROUP):
        h = hk * GROUP + gi
        v = _conv_head(x_n, conv_w, cs, 2 * HK * K + h * V + o_v, mv, smd, swc, sww, scc, scw, W, WP)
        v = v.to(dt).to(tl.float32)
        g = tl.load(a + n * san + h * sah).to(tl.float32) + tl.load(dt_bias + h).to(tl.float32)
        g = -tl.exp(tl.load(A_log + h).to(tl.float32)) * tl.where(g > 20.0, g, tl.log(1.0 + tl.exp(tl.minimum(g, 20.0))))
        beta = tl.sigmoid(tl.load(b + n * sbn + h * sbh).to(tl.float32))
        p_s = state + slot * ss0 + h * ss1 + o_k[:, None] * ss2 + o_v[None, :] * ss3
        s, o = delta_rule_step(tl.load(p_s, mask=ms, other=0), q, k, v, g, beta, scale, True, True)
        tl.store(p_s, s, mask=ms)
        # the gated RMSNorm over the head's V (o rounded first, as gdn_packed_decode's output is)
        o = tl.where(mv, o.to(dt).to(tl.float32), 0.0)
        zg = tl.load(z + n * szn + (h * V + o_v) * szd, mask=mv, other=0).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(o * o) / V + eps)
        tl.store(out + n * son + h * V + o_v, (o * rstd * w_norm * (zg * tl.sigmoid(zg))).to(dt), mask=mv)


def fused_decode(mixed, z, a, b, conv_w, conv_state, A_log, dt_bias, state, slots, norm_w, eps, HK, HV, K,
                 num_warps=8):
    """mixed [N, 2*HK*K + HV*V] (pre-conv q|k|v), z [N, HV*V], a / b [N, HV] gate / beta inputs, conv_w [C, W],
    conv_state [S, C, W-1], A_log / dt_bias [HV], state [S, HV, K, V] fp32, slots [N], norm_w [V]
    -> gated_rms_norm(gdn_packed_decode(...), silu(z)) [N, HV*V] in mixed's dtype; both states in place."""
    N = mixed.shape[0]
    V = (mixed.shape[1] - 2 * HK * K) // HV
    out = alloc.empty((N, HV * V), mixed.dtype, mixed.device)
    if N == 0:
        return out
    W = conv_w.shape[1]
    _fused_kernel[(N, HK)](
        mixed, z, a, b, conv_w, conv_state, A_log, dt_bias, state, slots, norm_w, out,
        *mixed.stride(), *z.stride(), *a.stride(), *b.stride(), *conv_w.stride(), *conv_state.stride(),
        slots.stride(0), *state.stride(), out.stride(0), state.shape[0], float(K ** -0.5), float(eps),
        HK=HK, GROUP=HV // HK, K=K, V=V, BK=max(16, triton.next_power_of_2(K)), BV=max(16, triton.next_power_of_2(V)),
        W=W, WP=triton.next_power_of_2(W), num_warps=num_warps, **pdl_args())
    return out


def supports(layer) -> bool:
    """A conv of W >= 2 taps and the parameters read without strides (A_log, dt_bias, the norm's weight) dense."""
    return layer.conv1d.weight.shape[1] >= 2 and all(
        t.is_contiguous() for t in (layer.A_log, layer.dt_bias, layer.norm.weight))


def forward(self, x, batch, cache):
    """GatedDeltaNet.forward with an all-decode batch of at most max_tokens through fused_decode."""
    if not batch.decode or not supports(self) or x.shape[0] > _SETTINGS["max_tokens"]:
        return _ORIGINAL(self, x, batch, cache)
    HV, V = self.HV, self.V
    T = x.shape[0]
    mixed, z, b, a = quant.linear(x, self, "in_proj").split([self.C, HV * V, HV, HV], dim=-1)
    o = fused_decode(mixed, z, a, b, self.conv1d.weight, cache.conv_state[self.layer_idx], self.A_log, self.dt_bias,
                     cache.gdn_state[self.layer_idx], batch.slots, self.norm.weight, self.eps, self.HK, HV, self.K,
                     num_warps=_SETTINGS["num_warps"])
    return self.par.all_reduce(self.out_proj(o.view(T, HV * V)))


def install(num_warps: int = 8, max_tokens: int = 8) -> str:
    """max_tokens: larger decode steps keep the chain (the V split there fills the device)."""
    _SETTINGS.update(num_warps=num_warps, max_tokens=max_tokens)
    GatedDeltaNet.forward = forward
    return (f"gdn_fused_decode: a GDN layer's conv update, decode step and gated norm in one launch "
            f"({num_warps} warps, up to {max_tokens} tokens)")


def uninstall() -> None:
    GatedDeltaNet.forward = _ORIGINAL
