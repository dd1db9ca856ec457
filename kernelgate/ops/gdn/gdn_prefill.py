"""GDN varlen prefill: chunked gated delta rule with one decay per value head, slot-held state.

    gdn_prefill(q, k [T, HK, K], v [T, HV, V], g [T, HV] fp32, beta [T, HV], state [S, HV, K, V] fp32,
                cu_seqlens [N+1], slots [N], scale=None, qk_l2norm=True, *, cu_seqlens_cpu=None, slots_cpu=None)

Per value head h (q/k head h // (HV // HK)), state S [K, V] fp32 (K-first, like KDA's pool and
fla's), per token t (g log-space decay, beta already sigmoid'ed):
    S = exp(g_t) S;  S += beta_t k_t (v_t - S^T k_t)^T;  o_t = S^T (scale * q_t)
q, k L2-normalised first (`x / sqrt(sum x^2 + 1e-6)`) when qk_l2norm; scale = K^-0.5 by default.
This is transformers' `torch_chunk_gated_delta_rule` (Qwen3-Next, Qwen3.5) per sequence.

The batch contract is kda_prefill's: sequence n starts from `state[slots[n]]` and its final
state is written back there. slot < 0: skipped, its outputs are zeros and no state is read or
written. Out-of-range values are skipped the same way: a slot >= the pool size, a sequence
whose bounds are not 0 <= cu_seqlens[n] <= cu_seqlens[n+1] <= T; rows no sequence runs are
zeros. Checked mode (KERNELGATE_CHECKS=1) raises instead (slots in range and distinct,
cu_seqlens from 0, non-decreasing, ending at T, host hints equal to the device values). Output
in v's dtype. Host hints `cu_seqlens_cpu` / `slots_cpu`: as in kda_prefill (only their dtype,
shape and device are checked).

The native path is KDA's chunked matrix form with the decay broadcast over K and the q/k heads
repeated per value head.
"""
from __future__ import annotations

import torch

from ... import checks
from ...registry import GPU_TRITON, Case, declare
from ..common.varlen import host_hints
from ..kda.kda_prefill import check_batch_values, kda_prefill_native, make_inputs, validate_batch

OP = "gdn_prefill"


def expand_heads(q, k, num_v_heads):
    """q, k [T, HK, K] -> [T, HV, K]: v head h reads q/k head h // (HV // HK) (transformers' repeat_interleave)."""
    group = num_v_heads // q.shape[1]
    if group == 1:
        return q, k
    return q.repeat_interleave(group, dim=1), k.repeat_interleave(group, dim=1)


def gdn_prefill_native(q, k, v, g, beta, state, cu_seqlens, slots, scale=None, qk_l2norm=True, *,
                       cu_seqlens_cpu=None, slots_cpu=None):
    """GDN varlen prefill reference (chunked matrix form); state updated in place at slots."""
    q, k = expand_heads(q, k, v.shape[1])
    return kda_prefill_native(q, k, v, g[..., None], beta, state, cu_seqlens, slots, scale, qk_l2norm,
                              cu_seqlens_cpu=cu_seqlens_cpu, slots_cpu=slots_cpu)


def validate_heads(op, q, k, v, g, beta, state, rows_name="T"):
    """q, k [R, HK, K], v [R, HV, V], g and beta [R, HV], state [S, HV, K, V] fp32, HV % HK == 0."""
    checks.tensor(op, "q", q, ndim=3, dtype=checks.FLOATS)
    R, HK, K = q.shape
    dev = q.device
    checks.tensor(op, "k", k, shape=(R, HK, K), dtype=checks.FLOATS, device=dev)
    checks.tensor(op, "v", v, shape=(R, None, None), dtype=checks.FLOATS, device=dev)
    HV = v.shape[1]
    checks.require(HV % HK == 0, op, f"v has {HV} heads, not a multiple of the {HK} q/k heads "
                                     "(each q/k head serves HV // HK value heads)")
    checks.tensor(op, "g", g, shape=(R, HV), dtype=checks.FLOATS, device=dev)
    checks.tensor(op, "beta", beta, shape=(R, HV), dtype=checks.FLOATS, device=dev)
    checks.tensor(op, "state", state, shape=(None, HV, K, v.shape[2]), dtype=torch.float32, device=dev)


def validate(q, k, v, g, beta, state, cu_seqlens, slots, scale=None, qk_l2norm=True, *,
             cu_seqlens_cpu=None, slots_cpu=None):
    validate_heads(OP, q, k, v, g, beta, state)
    validate_batch(OP, q.device, cu_seqlens, slots, scale, qk_l2norm, cu_seqlens_cpu, slots_cpu)


def check_values(q, k, v, g, beta, state, cu_seqlens, slots, scale=None, qk_l2norm=True, *,
                 cu_seqlens_cpu=None, slots_cpu=None):
    check_batch_values(OP, q.shape[0], state.shape[0], cu_seqlens, slots, cu_seqlens_cpu, slots_cpu)


# -- parity cases -------------------------------------------------------------------------
def gdn_inputs(lens, slots, HK, HV, K, V, device, dtype, gen, pool=None):
    """Random GDN inputs: (q, k, v, g [T, HV], beta, state, cu_seqlens, slots)."""
    return make_inputs(lens, slots, HV, K, V, device, dtype, gen, pool, num_k_heads=HK, head_decay=True)


def _case(lens, slots, HK=2, HV=2, K=32, V=32, l2=True, hints=False):
    def make(device, dtype, gen):
        args = gdn_inputs(lens, slots, HK, HV, K, V, device, dtype, gen)
        if not l2:   # as a caller that normalises q, k itself (raw keys make the delta rule diverge)
            args = tuple(x / x.float().norm(dim=-1, keepdim=True).to(dtype) for x in args[:2]) + args[2:]
        return args, dict(qk_l2norm=l2, **(host_hints(*args[6:8]) if hints else {}))
    return Case(f"L{'_'.join(map(str, lens))}-HK{HK}-HV{HV}-K{K}-V{V}-slots{'_'.join(map(str, slots))}"
                + ("" if l2 else "-nol2") + ("-hints" if hints else ""), make)


def cases():
    return [_case([1], [0]), _case([63], [1], HK=1, K=60, V=60),
            _case([65, 3, 0, 17], [0, -1, 2, 1], HV=4, V=16, hints=True),   # skipped, zero-length, host hints
            _case([40, 24], [1, 0], l2=False)]


def bench_cases():
    def make(lens):
        def f(device, dtype, gen):
            args = gdn_inputs(lens, list(range(len(lens))), 16, 32, 128, 128, "cpu", dtype, gen)
            return tuple(a.to(device) for a in args), host_hints(*args[6:8])   # as the engine calls it
        return f
    return [Case(f"T{sum(ls)}-N{len(ls)}-HK16-HV32-K128", make(ls), dtypes=(torch.bfloat16,))
            for ls in ([8192], [2048] * 4)]


def fla_supports(q, k, v, g, beta, state, cu_seqlens, slots, scale=None, qk_l2norm=True, **_):
    if not (q.dtype == k.dtype == v.dtype):
        return f"fla takes one dtype for q, k, v (got {q.dtype}, {k.dtype}, {v.dtype})"
    if q.shape[2] > 256:
        return f"fla's chunk kernels take K <= 256 (got {q.shape[2]})"
    return None


gdn_prefill = declare(OP, gdn_prefill_native, validate=validate, check_values=check_values, cases=cases,
                      bench_cases=bench_cases,
                      mutates=("state",), rtol={torch.float32: 1e-4, torch.bfloat16: 2e-2})
gdn_prefill.implementation("fla", ".gdn_fla:chunk_prefill", provider="fla", platforms=GPU_TRITON,
                           requires=("fla", "triton-compiled"), priority=10, supports=fla_supports,
                           # fla's chunk kernels run fp32 inputs through TF32 tensor-core dots (as kda_prefill's)
                           rtol={torch.float32: 1.5e-2},
                           doc="fla chunk_gated_delta_rule (GVA, varlen, in-kernel L2 norm), states via the slot pool")
gdn_prefill.implementation("triton", ".gdn_prefill_triton:gdn_prefill_chunk", provider="triton",
                           platforms=GPU_TRITON, requires=("triton",), priority=6,
                           doc="portable Triton, chunked (16 tokens, WY form), grid (sequence, v head, V-block)")
gdn_prefill.implementation("triton_recurrent", ".gdn_prefill_triton:gdn_prefill_recurrent", provider="triton",
                           platforms=GPU_TRITON, requires=("triton",), priority=5,
                           doc="portable Triton, token by token (KDA's decode step), grid (sequence, v head, V-block)")
