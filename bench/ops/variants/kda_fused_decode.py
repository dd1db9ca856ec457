"""Probe (issue 37's Kimi side, not dispatched): a KDA layer's decode between its two projections in one
Triton launch -- four kernels of the chain in one.

A one-token KDA layer runs, between in_proj and o_proj (kernelgate/models/kda.py):
    f, gate = up(f_a, g_a)                 cuBLAS batched matmul (f_b, g_b: [H*K, K] each, bf16)
    qkv     = short_conv_update(mixed)     conv taps + silu, conv state shifted in place
    o       = kda_packed_decode(qkv, f, b) gate, beta, q/k L2 norm, delta rule on the fp32 state
    o       = gated_rms_norm(o, w, gate)   per head over V, sigmoid gate
four dependent launches, the first outside the PDL chain (Session 31's profile, PDL off: 3.3 + 2 + 4 + 2.2
µs a layer). Each is a few µs of latency around little work; the step of 20 KDA layers pays them in
series. Here one program per (sequence, head) does all four on its head's channels: it owns that head's
conv channels (q, k and v: KDA has one value head per key head), its [K, V] state tile and its output
row, so no other program reads what it writes. The f_b / g_b rows of the head (2 x 32 KB) and the conv
taps are loaded before the PDL wait. Intermediates are rounded to the model dtype where the chain
rounds them (the conv output, f and the gate, o), so the output equals the chain's but for the order of
the fp32 sums.

The cost: a program streams its whole 64 KB state tile, where kda_packed_decode splits V over 8
programs at batch 1 (32 programs instead of 256 on Kimi's 32 heads); the device call measures whether
the three launches saved pay for it. Compiled here for sm_90 (Triton 3.9's ptxas, Kimi's H = 32, K = 128):
161 registers at 8 warps, 123 at 16, no spills (255 and a stack at 4 warps).

    sys.path.insert(0, "bench/ops/variants"); import kda_fused_decode; kda_fused_decode.install(num_warps=8)
    bench/e2e/fp8_decode.py --forms "none;kda_fused_decode;kda_fused_decode:num_warps=16"
"""
from __future__ import annotations

import triton
import triton.language as tl

from kernelgate import alloc
from kernelgate.models import quant
from kernelgate.models.kda import KimiDeltaAttention
from kernelgate.ops.common.pdl import inputs_ready, pdl_args
from kernelgate.ops.kda.kda_decode_triton import delta_rule_step

_ORIGINAL = KimiDeltaAttention.forward
_SETTINGS = dict(num_warps=8, max_tokens=8)


@triton.jit
def _conv_head(x_ptr, w_ptr, cs_ptr, ch, ok, sxd, swc, sww, scc, scw, W: tl.constexpr, WP: tl.constexpr):
    """silu(causal conv) of channels `ch` for one token: taps w [C, W], state cs [C, W-1] (the last W-1
    inputs) shifted in place. -> fp32 [len(ch)], not yet rounded."""
    j = tl.arange(0, WP)
    jw = j < W
    taps = tl.load(w_ptr + ch[:, None] * swc + j[None, :] * sww, mask=ok[:, None] & jw[None, :], other=0).to(tl.float32)
    x = tl.load(x_ptr + ch * sxd, mask=ok, other=0)
    ctx = tl.load(cs_ptr + ch[:, None] * scc + j[None, :] * scw, mask=ok[:, None] & (j < W - 1)[None, :], other=0)
    full = tl.where((j == W - 1)[None, :], x.to(tl.float32)[:, None], ctx.to(tl.float32))    # [C, WP]
    y = tl.sum(full * taps, 1)
    # the new state: inputs 1..W-1 of the window, shifted in registers (new[:, j] = full[:, j + 1]) -- never
    # re-read from memory, where another thread of this program may already have stored its column
    i = tl.arange(0, WP)
    new = tl.sum(tl.where(i[None, None, :] == j[None, :, None] + 1, full[:, None, :], 0.0), 2)
    tl.store(cs_ptr + ch[:, None] * scc + j[None, :] * scw, new.to(cs_ptr.dtype.element_ty),
             mask=ok[:, None] & (j < W - 1)[None, :])
    return y * tl.sigmoid(y)


@triton.jit
def _fused_kernel(mixed, fg_a, b, conv_w, conv_state, up, A_log, dt_bias, state, slots, norm_w, out,
                  smn, smd, sfn, sfd, sbn, sbh, swc, sww, scs, scc, scw, sur, suk, ssl, ss0, ss1, ss2, ss3, son,
                  pool, scale, eps,
                  H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, W: tl.constexpr, WP: tl.constexpr,
                  PDL: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    o_k = tl.arange(0, BK)
    mk = o_k < K
    m2 = mk[:, None] & mk[None, :]
    HK = H * K
    # weights only before the wait (the PDL contract): this head's f_b and g_b rows, the norm, the decay
    f_b = tl.load(up + (h * K + o_k)[:, None] * sur + o_k[None, :] * suk, mask=m2, other=0)            # [K, K]
    g_b = tl.load(up + (HK + h * K + o_k)[:, None] * sur + o_k[None, :] * suk, mask=m2, other=0)
    w_norm = tl.load(norm_w + o_k, mask=mk, other=0).to(tl.float32)
    a = tl.exp(tl.load(A_log + h).to(tl.float32))
    bias = tl.load(dt_bias + h * K + o_k, mask=mk, other=0).to(tl.float32)
    p_out = out + n * son + h * K + o_k
    inputs_ready(PDL)
    slot = tl.load(slots + n * ssl).to(tl.int64)
    if (slot < 0) | (slot >= pool):               # the chain: zero output, no state read or written
        tl.store(p_out, tl.zeros([BK], dtype=tl.float32).to(out.dtype.element_ty), mask=mk)
        return
    dt = out.dtype.element_ty
    # the conv of this head's q, k and v channels, rounded as short_conv_update's output is
    x_n, cs = mixed + n * smn, conv_state + slot * scs
    q = _conv_head(x_n, conv_w, cs, h * K + o_k, mk, smd, swc, sww, scc, scw, W, WP).to(dt).to(tl.float32)
    k = _conv_head(x_n, conv_w, cs, HK + h * K + o_k, mk, smd, swc, sww, scc, scw, W, WP).to(dt).to(tl.float32)
    v = _conv_head(x_n, conv_w, cs, 2 * HK + h * K + o_k, mk, smd, swc, sww, scc, scw, W, WP).to(dt).to(tl.float32)
    # f_b(f_a) and g_b(g_a) of this head, rounded as the batched matmul's output is
    f_a = tl.load(fg_a + n * sfn + o_k * sfd, mask=mk, other=0).to(tl.float32)
    g_a = tl.load(fg_a + n * sfn + (K + o_k) * sfd, mask=mk, other=0).to(tl.float32)
    f = tl.sum(f_b.to(tl.float32) * f_a[None, :], 1).to(dt).to(tl.float32)
    gate = tl.sum(g_b.to(tl.float32) * g_a[None, :], 1).to(dt).to(tl.float32)
    # the gate and beta (kda_packed_decode's: softplus linear above 20 like torch's)
    g = f + bias
    g = -a * tl.where(g > 20.0, g, tl.log(1.0 + tl.exp(tl.minimum(g, 20.0))))
    beta = tl.sigmoid(tl.load(b + n * sbn + h * sbh).to(tl.float32))
    p_s = state + slot * ss0 + h * ss1 + o_k[:, None] * ss2 + o_k[None, :] * ss3
    s, o = delta_rule_step(tl.load(p_s, mask=m2, other=0), q, k, v, g, beta, scale, False, True)
    tl.store(p_s, s, mask=m2)
    # the gated RMSNorm of the head's output (rounded to the model dtype first, as kda_packed_decode's is)
    o = tl.where(mk, o.to(dt).to(tl.float32), 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(o * o) / K + eps)
    tl.store(p_out, (o * rstd * w_norm * tl.sigmoid(gate)).to(dt), mask=mk)


def fused_decode(mixed, fg_a, b, conv_w, conv_state, up, A_log, dt_bias, state, slots, norm_w, eps, H, K,
                 num_warps=8):
    """mixed [N, 3HK] (pre-conv q|k|v), fg_a [N, 2K], b [N, H] beta logits, conv_w [3HK, W], conv_state
    [S, 3HK, W-1], up [2HK, K] (f_b | g_b), A_log [H], dt_bias [HK], state [S, H, K, K] fp32, slots [N],
    norm_w [K] -> gated_rms_norm(kda_packed_decode(...)) [N, HK] in mixed's dtype; both states in place."""
    N = mixed.shape[0]
    out = alloc.empty((N, H * K), mixed.dtype, mixed.device)
    if N == 0:
        return out
    W = conv_w.shape[1]
    _fused_kernel[(N, H)](
        mixed, fg_a, b, conv_w, conv_state, up, A_log, dt_bias, state, slots, norm_w, out,
        *mixed.stride(), *fg_a.stride(), *b.stride(), *conv_w.stride(), *conv_state.stride(), *up.stride(),
        slots.stride(0), *state.stride(), out.stride(0), state.shape[0], float(K ** -0.5), float(eps),
        H=H, K=K, BK=max(16, triton.next_power_of_2(K)), W=W, WP=triton.next_power_of_2(W),
        num_warps=num_warps, **pdl_args())
    return out


def supports(layer) -> bool:
    """The layers this kernel covers: V = K (Kimi's heads), a conv of W >= 2 taps, and the parameters it
    reads without strides (A_log, dt_bias, the norm's weight) dense. (KDA has one value head per key head
    and no lower bound in the model.)"""
    dense = all(t.is_contiguous() for t in (layer.A_log, layer.dt_bias, layer.o_norm.weight))
    return layer.conv1d.weight.shape[1] >= 2 and layer.o_norm.weight.shape[0] == layer.K and dense


def forward(self, x, batch, cache):
    """KimiDeltaAttention.forward with an all-decode batch through fused_decode."""
    if not batch.decode or not supports(self) or x.shape[0] > _SETTINGS["max_tokens"]:
        return _ORIGINAL(self, x, batch, cache)
    H, K = self.H, self.K
    T = x.shape[0]
    y = quant.linear(x, self, "in_proj")
    mixed, fg_a, b = y.split([3 * H * K, 2 * K, H], dim=-1)
    o = fused_decode(mixed, fg_a, b, self.conv1d.weight, cache.conv_state[self.layer_idx], self.up_proj, self.A_log,
                     self.dt_bias, cache.kda_state[self.layer_idx], batch.slots, self.o_norm.weight, self.eps, H, K,
                     num_warps=_SETTINGS["num_warps"])
    return self.par.all_reduce(self.o_proj(o.view(T, H * K)))


def install(num_warps: int = 8, max_tokens: int = 8) -> str:
    """max_tokens: larger decode steps keep the chain (each program re-reads its head's 64 KB of f_b / g_b
    from the L2: at 64 tokens 128 MB a layer, where the batched matmul reads 2 MB once)."""
    _SETTINGS.update(num_warps=num_warps, max_tokens=max_tokens)
    KimiDeltaAttention.forward = forward
    return (f"kda_fused_decode: a KDA layer's up matmul, conv update, decode step and gated norm in one launch "
            f"({num_warps} warps, up to {max_tokens} tokens)")


def uninstall() -> None:
    KimiDeltaAttention.forward = _ORIGINAL
