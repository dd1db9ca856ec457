"""GDN decode: one recurrent step per sequence on a slot pool of states.

    gdn_decode(q, k [N, HK, K], v [N, HV, V], g [N, HV] fp32, beta [N, HV], state [S, HV, K, V] fp32, slots [N])
    gdn_packed_decode(qkv [N, 2*HK*K + HV*V], a [N, HV], b [N, HV], A_log [HV], dt_bias [HV], state, slots,
                      num_k_heads, num_v_heads, head_k_dim)

Step per value head h (q/k head h // (HV // HK)): S = exp(g) S; S += beta k (v - S^T k)^T;
o = S^T (scale q), q and k L2-normalised. The packed form takes the short-conv output q|k|v,
the raw gate input a (g = -exp(A_log) softplus(a + dt_bias), as gdn_gate) and beta logits b
(beta = sigmoid(b)), and fuses them with the step: the fused Triton kernel, the `chain` of
registry ops, or native. The slot contract is kda_decode's: slot < 0 or >= the pool size:
output zeros, no state read or written; other slots are left bit-identical; checked mode
(KERNELGATE_CHECKS=1) raises for a slot >= the pool size or a slot given twice.
"""
from __future__ import annotations

import torch

from ... import checks
from ...registry import ALL_PLATFORMS, GPU_TRITON, Case, declare
from ..common import index_checks
from ..kda.kda_decode import decode_inputs, kda_decode_native, packed_bytes, unpack
from ..kda.kda_prefill import INDEX, check_scale
from .gdn_gate import gdn_gate_native
from .gdn_prefill import expand_heads, validate_heads

OP, PACKED = "gdn_decode", "gdn_packed_decode"


def gdn_decode_native(q, k, v, g, beta, state, slots, scale=None, qk_l2norm=True):
    """One GDN recurrent step for N sequences; state updated in place at slots."""
    q, k = expand_heads(q, k, v.shape[1])
    return kda_decode_native(q, k, v, g[..., None], beta, state, slots, scale, qk_l2norm)


def gdn_packed_decode_native(qkv, a, b, A_log, dt_bias, state, slots, num_k_heads, num_v_heads, head_k_dim,
                             scale=None):
    """Fused GDN decode step from the packed conv output and raw gate / beta inputs."""
    q, k, v = unpack(qkv, num_k_heads, head_k_dim, num_v_heads)
    g = gdn_gate_native(a, A_log, dt_bias)
    return gdn_decode_native(q, k, v, g, torch.sigmoid(b.float()), state, slots, scale, True)


def gdn_packed_decode_chain(qkv, a, b, A_log, dt_bias, state, slots, num_k_heads, num_v_heads, head_k_dim,
                            scale=None):
    """gdn_gate + gdn_decode through the registry (each picks its best implementation)."""
    from .gdn_gate import gdn_gate
    q, k, v = unpack(qkv, num_k_heads, head_k_dim, num_v_heads)
    return gdn_decode(q, k, v, gdn_gate(a, A_log, dt_bias), torch.sigmoid(b.float()), state, slots, scale, True)


# -- validation --------------------------------------------------------------------------
def validate(q, k, v, g, beta, state, slots, scale=None, qk_l2norm=True):
    validate_heads(OP, q, k, v, g, beta, state)
    checks.tensor(OP, "slots", slots, shape=(q.shape[0],), dtype=INDEX, device=q.device)
    check_scale(OP, scale, qk_l2norm)


def check_values(q, k, v, g, beta, state, slots, scale=None, qk_l2norm=True):
    index_checks.slots(OP, "slots", slots, state.shape[0])


def validate_packed(qkv, a, b, A_log, dt_bias, state, slots, num_k_heads, num_v_heads, head_k_dim, scale=None):
    checks.tensor(PACKED, "qkv", qkv, ndim=2, dtype=checks.FLOATS)
    N, HK, HV, K = qkv.shape[0], num_k_heads, num_v_heads, head_k_dim
    dev = qkv.device
    for name, n in (("num_k_heads", HK), ("num_v_heads", HV), ("head_k_dim", K)):
        checks.require(isinstance(n, int) and not isinstance(n, bool) and n > 0, PACKED,
                       f"{name} must be a positive int, got {n!r}")
    checks.require(HV % HK == 0, PACKED, f"num_v_heads {HV} is not a multiple of num_k_heads {HK}")
    rest = qkv.shape[1] - 2 * HK * K
    checks.require(rest > 0 and rest % HV == 0, PACKED,
                   f"qkv width {qkv.shape[1]} != 2*{HK}*{K} + {HV}*V for some V > 0")
    checks.tensor(PACKED, "a", a, shape=(N, HV), dtype=checks.FLOATS, device=dev)
    checks.tensor(PACKED, "b", b, shape=(N, HV), dtype=checks.FLOATS, device=dev)
    checks.tensor(PACKED, "A_log", A_log, shape=(HV,), dtype=checks.FLOATS, device=dev)
    checks.tensor(PACKED, "dt_bias", dt_bias, shape=(HV,), dtype=checks.FLOATS, device=dev)
    checks.tensor(PACKED, "state", state, shape=(None, HV, K, rest // HV), dtype=torch.float32, device=dev)
    checks.tensor(PACKED, "slots", slots, shape=(N,), dtype=INDEX, device=dev)
    check_scale(PACKED, scale)


def check_packed(qkv, a, b, A_log, dt_bias, state, slots, num_k_heads, num_v_heads, head_k_dim, scale=None):
    index_checks.slots(PACKED, "slots", slots, state.shape[0])


# -- cases ---------------------------------------------------------------------------------
def _slots_id(slots):
    return "slots" + "_".join(map(str, slots))


def decode_case(N, slots, HK=2, HV=2, K=32, V=32, l2=True, pool=None):
    def make(device, dtype, gen):
        r, to, sl, state = decode_inputs(N, slots, HV, K, V, device, dtype, gen, pool or max(slots) + 2)
        g = torch.nn.functional.logsigmoid(r(N, HV) + 2.0)
        args = (to(r(N, HK, K)), to(r(N, HK, K)), to(r(N, HV, V)), to(g, torch.float32),
                to(torch.sigmoid(r(N, HV))), state, sl)
        return args, dict(qk_l2norm=l2)
    return Case(f"N{N}-HK{HK}-HV{HV}-K{K}-V{V}-{_slots_id(slots)}" + ("" if l2 else "-nol2"), make)


def packed_case(N, slots, HK=2, HV=2, K=32, V=32, pool=None):
    def make(device, dtype, gen):
        r, to, sl, state = decode_inputs(N, slots, HV, K, V, device, dtype, gen, pool or max(slots) + 2)
        qkv = to(r(N, 2 * HK * K + HV * V))
        a, b = to(2 * r(N, HV)), to(r(N, HV))
        A_log, dt_bias = to(r(HV) - 1.0, torch.float32), to(r(HV), torch.float32)
        return (qkv, a, b, A_log, dt_bias, state, sl, HK, HV, K), {}
    return Case(f"N{N}-HK{HK}-HV{HV}-K{K}-V{V}-{_slots_id(slots)}", make)


def decode_cases():
    return [decode_case(1, [0]), decode_case(3, [2, -1, 0], HK=1, K=60, V=60),
            decode_case(5, [4, 1, 6, 0, 3], HV=4, V=16), decode_case(2, [1, 0], l2=False)]


def packed_cases():
    return [packed_case(1, [0]), packed_case(3, [2, -1, 0], HK=1, K=60, V=60), packed_case(4, [3, 0, 5, 1], HV=4, V=16)]


def packed_bench_cases():
    HK, HV, K, V = 16, 32, 128, 128

    def make(N):
        def f(device, dtype, gen):
            args, kw = packed_case(N, list(range(N)), HK, HV, K, V, pool=N).make("cpu", dtype, gen)
            return tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args), kw
        return f
    return [Case(f"N{n}-HK{HK}-HV{HV}-K{K}-V{V}", make(n), dtypes=(torch.bfloat16,), bytes=packed_bytes)
            for n in (1, 32, 256)]


def fla_supports(q, k, v, *_, **__):
    if not (q.dtype == k.dtype == v.dtype):
        return f"fla takes one dtype for q, k, v (got {q.dtype}, {k.dtype}, {v.dtype})"
    return None


gdn_decode = declare(OP, gdn_decode_native, validate=validate, check_values=check_values, cases=decode_cases,
                     mutates=("state",), rtol={torch.float32: 1e-5, torch.bfloat16: 1e-2})
gdn_packed_decode = declare(PACKED, gdn_packed_decode_native, validate=validate_packed, check_values=check_packed,
                            cases=packed_cases, bench_cases=packed_bench_cases, mutates=("state",))

gdn_decode.implementation("triton", ".gdn_decode_triton:gdn_decode", provider="triton",
                          platforms=GPU_TRITON, requires=("triton",), priority=10,
                          doc="portable Triton step (KDA's kernel, one decay per head), grid (sequence, v head, V-block)")
gdn_decode.implementation("fla", ".gdn_fla:fused_recurrent_decode", provider="fla", platforms=GPU_TRITON,
                          requires=("fla", "triton-compiled"), priority=5, supports=fla_supports,
                          doc="fla fused_recurrent_gated_delta_rule (GVA) on the gathered valid slots")
gdn_packed_decode.implementation("triton", ".gdn_decode_triton:gdn_packed_decode", provider="triton",
                                 platforms=GPU_TRITON, requires=("triton",), priority=10,
                                 doc="one fused Triton kernel: gate, beta, L2 norm, update, output")
gdn_packed_decode.implementation("chain", gdn_packed_decode_chain, provider="native", platforms=ALL_PLATFORMS,
                                 priority=5, doc="gdn_gate + gdn_decode through the registry")
