"""KDA decode: one recurrent step per sequence on a slot pool of states.

    kda_decode(q, k, v [N, H, K|V], g [N, H, K] fp32, beta [N, H], state [S, H, K, V] fp32, slots [N])
    kda_packed_decode(qkv [N, 2HK + HV], f [N, HK], b [N, H], A_log, dt_bias, state, slots, H, K)

Step per head (DESIGN.md): S = diag(exp(g)) S; S += beta k (v - S^T k)^T; o = S^T (scale q),
with q, k L2-normalised. The packed form takes the short-conv output q|k|v, the raw gate
input f (pre dt_bias) and raw beta logits b, and does gate, sigmoid, L2 norm, update and
output in one step: the runtime always calls it for decode and the registry picks the fused
Triton kernel, the `chain` of registry ops, or native. slot < 0: output zeros, no state read
or written; other slots of the pool are left bit-identical. A slot >= the pool size is
skipped the same way (checked mode, KERNELGATE_CHECKS=1, raises instead). Slots in one call
must differ (checked mode raises).
"""
from __future__ import annotations

import torch

from ... import checks
from ...registry import ALL_PLATFORMS, GPU_TRITON, Case, declare
from ..common import index_checks
from .kda_gate import kda_gate_native
from .kda_prefill import INDEX, check_scale, l2norm

OP, PACKED = "kda_decode", "kda_packed_decode"


def kda_decode_native(q, k, v, g, beta, state, slots, scale=None, qk_l2norm=True):
    """One KDA recurrent step for N sequences; state updated in place at slots."""
    N, H, K = q.shape
    scale = K ** -0.5 if scale is None else scale
    pool = state.shape[0]
    valid = (slots >= 0) & (slots < pool)                                  # others: skipped, o = 0
    idx = torch.where(valid, slots, 0).long()
    S = state[idx].float() if pool else state.new_zeros(N, H, K, v.shape[-1])   # [N, H, K, V]
    qf, kf = q.float(), k.float()
    if qk_l2norm:
        qf, kf = l2norm(qf), l2norm(kf)
    S = S * g.float().exp()[..., None]
    u = beta.float()[..., None] * (v.float() - torch.einsum("nhkv,nhk->nhv", S, kf))
    S = S + kf[..., None] * u[..., None, :]
    o = torch.einsum("nhkv,nhk->nhv", S, qf * scale) * valid.view(N, 1, 1)
    state.index_copy_(0, idx[valid], S[valid])
    return o.to(v.dtype)


def unpack(qkv, num_heads, head_k_dim, num_v_heads=None):
    """qkv [N, 2*H*K + HV*V] -> q, k [N, H, K], v [N, HV, V] (views; HV = num_v_heads, default H)."""
    N, H, K = qkv.shape[0], num_heads, head_k_dim
    HV = num_v_heads or H
    width = qkv.shape[1] - 2 * H * K
    q, k, v = qkv.split([H * K, H * K, width], dim=1)
    return q.view(N, H, K), k.view(N, H, K), v.view(N, HV, width // HV)     # (N may be 0: no -1)


def kda_packed_decode_native(qkv, f, b, A_log, dt_bias, state, slots, num_heads, head_k_dim,
                             scale=None, lower_bound=None):
    """Fused KDA decode step from the packed conv output and raw gate / beta inputs."""
    q, k, v = unpack(qkv, num_heads, head_k_dim)
    g = kda_gate_native(f, A_log, dt_bias, lower_bound)
    return kda_decode_native(q, k, v, g, torch.sigmoid(b.float()), state, slots, scale, True)


def kda_packed_decode_chain(qkv, f, b, A_log, dt_bias, state, slots, num_heads, head_k_dim,
                            scale=None, lower_bound=None):
    """kda_gate + kda_decode through the registry (each picks its best implementation)."""
    from .kda_gate import kda_gate
    q, k, v = unpack(qkv, num_heads, head_k_dim)
    g = kda_gate(f, A_log, dt_bias, lower_bound)
    return kda_decode(q, k, v, g, torch.sigmoid(b.float()), state, slots, scale, True)


# -- validation --------------------------------------------------------------------------
def check_values(q, k, v, g, beta, state, slots, scale=None, qk_l2norm=True):
    index_checks.slots(OP, "slots", slots, state.shape[0])


def check_packed(qkv, f, b, A_log, dt_bias, state, slots, num_heads, head_k_dim, scale=None, lower_bound=None):
    index_checks.slots(PACKED, "slots", slots, state.shape[0])


def validate(q, k, v, g, beta, state, slots, scale=None, qk_l2norm=True):
    checks.tensor(OP, "q", q, ndim=3, dtype=checks.FLOATS)
    N, H, K = q.shape
    dev = q.device
    checks.tensor(OP, "k", k, shape=(N, H, K), dtype=checks.FLOATS, device=dev)
    checks.tensor(OP, "v", v, shape=(N, H, None), dtype=checks.FLOATS, device=dev)
    checks.tensor(OP, "g", g, shape=(N, H, K), dtype=checks.FLOATS, device=dev)
    checks.tensor(OP, "beta", beta, shape=(N, H), dtype=checks.FLOATS, device=dev)
    checks.tensor(OP, "state", state, shape=(None, H, K, v.shape[2]), dtype=torch.float32, device=dev)
    checks.tensor(OP, "slots", slots, shape=(N,), dtype=INDEX, device=dev)
    check_scale(OP, scale, qk_l2norm)


def validate_packed(qkv, f, b, A_log, dt_bias, state, slots, num_heads, head_k_dim, scale=None,
                    lower_bound=None):
    checks.tensor(PACKED, "qkv", qkv, ndim=2, dtype=checks.FLOATS)
    N, H, K = qkv.shape[0], num_heads, head_k_dim
    dev = qkv.device
    for name, n in (("num_heads", H), ("head_k_dim", K)):
        checks.require(isinstance(n, int) and not isinstance(n, bool) and n > 0, PACKED,
                       f"{name} must be a positive int, got {n!r}")
    rest = qkv.shape[1] - 2 * H * K
    checks.require(rest > 0 and rest % H == 0, PACKED,
                   f"qkv width {qkv.shape[1]} != 2*{H}*{K} + {H}*V for some V > 0")
    V = rest // H
    checks.tensor(PACKED, "f", f, shape=(N, H * K), dtype=checks.FLOATS, device=dev)
    checks.tensor(PACKED, "b", b, shape=(N, H), dtype=checks.FLOATS, device=dev)
    checks.tensor(PACKED, "A_log", A_log, shape=(H,), dtype=checks.FLOATS, device=dev)
    checks.tensor(PACKED, "dt_bias", dt_bias, shape=(H * K,), dtype=checks.FLOATS, device=dev, optional=True)
    checks.tensor(PACKED, "state", state, shape=(None, H, K, V), dtype=torch.float32, device=dev)
    checks.tensor(PACKED, "slots", slots, shape=(N,), dtype=INDEX, device=dev)
    check_scale(PACKED, scale)
    checks.require(lower_bound is None or (isinstance(lower_bound, (int, float)) and -5.0 <= lower_bound < 0.0),
                   PACKED, f"lower_bound {lower_bound!r} not None or a number in [-5, 0)")


# -- cases ---------------------------------------------------------------------------------
def decode_inputs(N, slots, H, K, V, device, dtype, gen, pool):
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    to = lambda t, dt=dtype: t.to(device=device, dtype=dt)  # noqa: E731
    sl = torch.tensor(slots, dtype=torch.int32, device=device)
    return r, to, sl, to(0.3 * r(pool, H, K, V), torch.float32)


def decode_case(N, slots, H=2, K=32, V=32, l2=True, pool=None):
    def make(device, dtype, gen):
        r, to, sl, state = decode_inputs(N, slots, H, K, V, device, dtype, gen, pool or max(slots) + 2)
        g = torch.nn.functional.logsigmoid(r(N, H, K) + 2.0)
        args = (to(r(N, H, K)), to(r(N, H, K)), to(r(N, H, V)), to(g, torch.float32),
                to(torch.sigmoid(r(N, H))), state, sl)
        return args, dict(qk_l2norm=l2)
    return Case(f"N{N}-H{H}-K{K}-V{V}-slots{'_'.join(map(str, slots))}" + ("" if l2 else "-nol2"), make)


def packed_case(N, slots, H=2, K=32, V=32, lb=None, pool=None, bias=True):
    def make(device, dtype, gen):
        r, to, sl, state = decode_inputs(N, slots, H, K, V, device, dtype, gen, pool or max(slots) + 2)
        qkv = to(r(N, 2 * H * K + H * V))
        f, b = to(r(N, H * K)), to(r(N, H))
        A_log, dt_bias = to(r(H) - 1.0, torch.float32), (to(r(H * K), torch.float32) if bias else None)
        return (qkv, f, b, A_log, dt_bias, state, sl, H, K), dict(lower_bound=lb)
    return Case(f"N{N}-H{H}-K{K}-V{V}-slots{'_'.join(map(str, slots))}"
                + (f"-lb{lb}" if lb is not None else "") + ("" if bias else "-nobias"), make)


def decode_cases():
    return [decode_case(1, [0]), decode_case(3, [2, -1, 0], K=60, V=60), decode_case(5, [4, 1, 6, 0, 3], H=3, V=16),
            decode_case(2, [1, 0], l2=False)]


def packed_cases():
    return [packed_case(1, [0]), packed_case(3, [2, -1, 0], K=60, V=60), packed_case(4, [3, 0, 5, 1], H=3, V=16),
            packed_case(2, [1, 0], lb=-5.0, bias=False)]


def packed_bench_cases():
    H, K, V = 32, 128, 128

    def make(N):
        def f(device, dtype, gen):
            args, kw = packed_case(N, list(range(N)), H, K, V, pool=N).make("cpu", dtype, gen)
            return tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args), kw
        return f

    return [Case(f"N{n}-H{H}-K{K}-V{V}", make(n), dtypes=(torch.bfloat16,), bytes=packed_bytes) for n in (1, 32, 256)]


def packed_bytes(args, kwargs):
    """Bytes a packed decode step moves (KDA, GDN): args start qkv, gate input, b, A_log, dt_bias, state."""
    qkv, f, b, _, _, state = args[:6]
    N, (H, K, V) = qkv.shape[0], state.shape[1:]
    # state read + written once, inputs read once, output written once
    return (2 * N * H * K * V * 4 + qkv.numel() * qkv.element_size() + f.numel() * f.element_size()
            + b.numel() * b.element_size() + N * H * V * qkv.element_size())


kda_decode = declare(OP, kda_decode_native, validate=validate, check_values=check_values, cases=decode_cases,
                     mutates=("state",),
                     rtol={torch.float32: 1e-5, torch.bfloat16: 1e-2})

kda_packed_decode = declare(PACKED, kda_packed_decode_native, validate=validate_packed, check_values=check_packed,
                            cases=packed_cases,
                            bench_cases=packed_bench_cases, mutates=("state",))
kda_decode.implementation("triton", ".kda_decode_triton:kda_decode", provider="triton",
                          platforms=GPU_TRITON, requires=("triton",), priority=10,
                          doc="portable Triton step, grid (sequence, head, V-block), state updated in place")
kda_decode.implementation("fla", ".kda_fla:fused_recurrent_decode", provider="fla",
                          platforms=GPU_TRITON, requires=("fla", "triton-compiled"), priority=5,
                          doc="fla fused_recurrent_kda on the gathered valid slots")

kda_packed_decode.implementation("triton", ".kda_decode_triton:kda_packed_decode", provider="triton",
                                 platforms=GPU_TRITON, requires=("triton",), priority=10, doc="one fused Triton kernel: gate, beta, L2 norm, update, output")
kda_packed_decode.implementation("chain", kda_packed_decode_chain, provider="native", platforms=ALL_PLATFORMS,
                                 priority=5, doc="kda_gate + kda_decode through the registry")
