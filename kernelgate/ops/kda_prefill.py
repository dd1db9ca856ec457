"""KDA varlen prefill: chunked (chunk 64) delta rule with per-channel decay, slot-held state.

Per head, state S [K, V] fp32, per token t (g log-space decay, beta already sigmoid'ed):
    S = diag(exp(g_t)) S;  S += beta_t k_t (v_t - S^T k_t)^T;  o_t = S^T (scale * q_t)
q, k L2-normalised first (`x / sqrt(sum x^2 + 1e-6)`) when qk_l2norm. Sequences are packed
along dim 0 (`cu_seqlens` [N+1]); sequence n starts from `state[slots[n]]` and its final
state is written back there. slot < 0: skipped, its outputs are zeros and no state is
read or written. Output in v's dtype.

The native path is the matrix (WY / UT) form, vectorised over all chunks of a sequence;
only the chunk-to-chunk state hand-off is a loop. Inside a chunk with cumulative decay
gc_i = sum_{s<=i} g_s and start state S0:
    u = (I + A)^-1 (v - (k * e^gc) S0),   A[i,j] = beta_j k_i.(e^(gc_i-gc_j) k_j), j < i
    o = (q * e^gc) S0 + P u,               P[i,j] = beta_j q_i.(e^(gc_i-gc_j) k_j), j <= i
    S = e^gc_last * S0 + (beta * k * e^(gc_last-gc))^T u
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import checks
from ..registry import GPU_TRITON, Case, declare

OP = "kda_prefill"
CHUNK = 64
BLOCK = 8     # sub-block of a chunk for the stable decayed Gram matrices
INDEX = (torch.int32, torch.int64)


def l2norm(x: torch.Tensor) -> torch.Tensor:
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def _decayed_grams(q, k, gc):
    """(Mkk, Mqk)[..., i, j] = sum_c {k_i, q_i}[c] k_j[c] exp(gc_i[c] - gc_j[c]) for j in a
    sub-block at or before i's (pairs with j after i inside a sub-block are 0; callers mask).

    q, k, gc: [..., C, K]. exp(gc_i - gc_j) is split at the end r of j's sub-block as
    exp(gc_i - r) * exp(r - gc_j): both factors <= 1 for decays <= 0, so nothing overflows
    however strong the decay. Pairs inside one sub-block use the pairwise difference.
    """
    C = k.shape[-2]
    Mkk, Mqk = k.new_zeros(*k.shape[:-1], C), k.new_zeros(*k.shape[:-1], C)
    upper = torch.ones(BLOCK, BLOCK, dtype=torch.bool, device=k.device).triu(1)[..., None]
    for lo in range(0, C, BLOCK):
        hi = lo + BLOCK
        r = gc[..., hi - 1:hi, :]                                            # [..., 1, K]
        if hi < C:
            kj = (k[..., lo:hi, :] * torch.exp(r - gc[..., lo:hi, :])).transpose(-1, -2)   # [..., K, B]
            di = torch.exp(gc[..., hi:, :] - r)                               # [..., C-hi, K]
            Mkk[..., hi:, lo:hi] = (k[..., hi:, :] * di) @ kj
            Mqk[..., hi:, lo:hi] = (q[..., hi:, :] * di) @ kj
        E = gc[..., lo:hi, None, :] - gc[..., None, lo:hi, :]                 # [..., B, B, K]
        E.masked_fill_(upper, float("-inf")).exp_().mul_(k[..., None, lo:hi, :])
        Mkk[..., lo:hi, lo:hi] = torch.einsum("...ijc,...ic->...ij", E, k[..., lo:hi, :])
        Mqk[..., lo:hi, lo:hi] = torch.einsum("...ijc,...ic->...ij", E, q[..., lo:hi, :])
    return Mkk, Mqk


def _unit_lower_inverse(A, eye):
    """(I + A)^-1 for strictly lower-triangular A [..., C, C] (nilpotent: A^C = 0), as
    (I - A)(I + A^2)(I + A^4)...(I + A^(C/2)) = I - A^C: log2(C) batched matmul pairs, which
    CPUs run far faster than a batched triangular solve of small matrices."""
    inv, p = eye - A, A @ A
    for _ in range(CHUNK.bit_length() - 2):
        inv = inv + inv @ p
        p = p @ p
    return inv


def _chunks(x, L, pad):
    """[L, H, ...] -> [H, NC, CHUNK, ...] zero-padded; padded steps are identity (g=beta=k=0)."""
    x = F.pad(x, (0, 0) * (x.dim() - 1) + (0, pad))
    return x.view((L + pad) // CHUNK, CHUNK, *x.shape[1:]).movedim(2, 0)


def kda_chunked(q, k, v, g, beta, S, scale, qk_l2norm):
    """One sequence: q, k, g [L, H, K], v [L, H, V], beta [L, H], S [H, K, V] fp32
    -> (o [L, H, V] fp32, final S [H, K, V] fp32)."""
    L, H, K = q.shape
    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    if qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    q = q * scale
    pad = (-L) % CHUNK
    q, k, v, g = (_chunks(t, L, pad) for t in (q, k, v, g))                   # [H, NC, C, *]
    beta = _chunks(beta[..., None], L, pad)[..., 0]                           # [H, NC, C]
    gc = g.cumsum(-2)
    eye = torch.eye(CHUNK, device=q.device)
    Mkk, Mqk = _decayed_grams(q, k, gc)
    A = (Mkk * beta[..., None, :]).tril(-1)
    P = (Mqk * beta[..., None, :]).tril(0)
    # (I + A) [Tv | W] = [v | k e^gc]: u = Tv - W S0 once S0 is known
    Tinv = _unit_lower_inverse(A, eye)
    Tv, W = Tinv @ v, Tinv @ (k * gc.exp())
    Qg = q * gc.exp()
    glast = gc[..., -1:, :]                                                   # [H, NC, 1, K]
    Kd = (k * (glast - gc).exp() * beta[..., None]).transpose(-1, -2)         # [H, NC, K, C]
    decay = glast.exp().transpose(-1, -2)                                     # [H, NC, K, 1]
    o = torch.empty_like(v)
    S = S.float()
    for c in range(q.shape[1]):
        u = Tv[:, c] - W[:, c] @ S                                            # [H, C, V]
        o[:, c] = Qg[:, c] @ S + P[:, c] @ u
        S = decay[:, c] * S + Kd[:, c] @ u
    o = o.movedim(0, 2).reshape(-1, H, v.shape[-1])[:L]
    return o, S


def kda_prefill_native(q, k, v, g, beta, state, cu_seqlens, slots, scale=None, qk_l2norm=True):
    """KDA varlen prefill reference (chunked matrix form); state updated in place at slots."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    o = torch.zeros(v.shape, dtype=v.dtype, device=v.device)
    bounds = cu_seqlens.tolist()
    for n, slot in enumerate(slots.tolist()):
        s, e = bounds[n], bounds[n + 1]
        if slot < 0 or e == s:
            continue
        out, S = kda_chunked(q[s:e], k[s:e], v[s:e], g[s:e], beta[s:e], state[slot], scale, qk_l2norm)
        o[s:e] = out.to(v.dtype)
        state[slot] = S
    return o


def validate(q, k, v, g, beta, state, cu_seqlens, slots, scale=None, qk_l2norm=True):
    checks.tensor(OP, "q", q, ndim=3, dtype=checks.FLOATS)
    T, H, K = q.shape
    dev = q.device
    checks.tensor(OP, "k", k, shape=(T, H, K), dtype=checks.FLOATS, device=dev)
    checks.tensor(OP, "v", v, shape=(T, H, None), dtype=checks.FLOATS, device=dev)
    checks.tensor(OP, "g", g, shape=(T, H, K), dtype=checks.FLOATS, device=dev)
    checks.tensor(OP, "beta", beta, shape=(T, H), dtype=checks.FLOATS, device=dev)
    checks.tensor(OP, "state", state, shape=(None, H, K, v.shape[2]), dtype=torch.float32, device=dev)
    checks.tensor(OP, "cu_seqlens", cu_seqlens, ndim=1, dtype=INDEX, device=dev)
    checks.require(cu_seqlens.shape[0] >= 2, OP, "cu_seqlens needs N+1 >= 2 entries")
    checks.tensor(OP, "slots", slots, shape=(cu_seqlens.shape[0] - 1,), dtype=INDEX, device=dev)
    checks.require(scale is None or scale > 0, OP, f"scale must be > 0, got {scale}")


# -- parity cases -------------------------------------------------------------------------
def make_inputs(lens, slots, H, K, V, device, dtype, gen, pool=None):
    """Random KDA inputs in the ranges a model produces (decay <= 0, beta in (0, 1))."""
    T = sum(lens)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    q, k, v = r(T, H, K), r(T, H, K), r(T, H, V)
    g = F.logsigmoid(r(T, H, K) + 3.0)                    # mostly mild decay, some strong
    beta = torch.sigmoid(r(T, H))
    state = 0.3 * r(pool or max(slots) + 2, H, K, V)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    sl = torch.tensor(slots, dtype=torch.int32)
    to = lambda t, dt=dtype: t.to(device=device, dtype=dt)  # noqa: E731
    return (to(q), to(k), to(v), to(g, torch.float32), to(beta), to(state, torch.float32),
            cu.to(device), sl.to(device))


def _case(lens, slots, H=2, K=32, V=32, l2=True):
    def make(device, dtype, gen):
        return make_inputs(lens, slots, H, K, V, device, dtype, gen), dict(qk_l2norm=l2)
    return Case(f"L{'_'.join(map(str, lens))}-H{H}-K{K}-V{V}-slots{'_'.join(map(str, slots))}"
                + ("" if l2 else "-nol2"), make)


def cases():
    return [_case([1], [0]), _case([63], [1], K=60, V=60), _case([65, 3], [0, -1]),
            _case([130, 1, 64, 17], [3, 0, 5, 1], H=3, V=16), _case([40, 24], [1, 0], l2=False)]


def bench_cases():
    def make(lens):
        def f(device, dtype, gen):
            args = make_inputs(lens, list(range(len(lens))), 32, 128, 128, "cpu", dtype, gen)
            return tuple(a.to(device) for a in args), {}
        return f
    return [Case(f"T{sum(ls)}-N{len(ls)}-H32-K128", make(ls), dtypes=(torch.bfloat16,))
            for ls in ([8192], [2048] * 4)]


kda_prefill = declare(OP, kda_prefill_native, validate=validate, cases=cases, bench_cases=bench_cases,
                      mutates=("state",), rtol={torch.float32: 1e-4, torch.bfloat16: 2e-2})
kda_prefill.implementation("fla", "kernelgate.ops.kda_fla:chunk_prefill", provider="fla", platforms=GPU_TRITON,
                           requires=("fla", "triton-compiled"), priority=10,
                           # fla's chunk kernels run fp32 inputs through TF32 tensor-core dots
                           # (measured on the H200: 9e-4 .. 7e-3 relative error at fp32)
                           rtol={torch.float32: 1.5e-2},
                           doc="fla chunk_kda, varlen, states gathered from / scattered to the slot pool")
