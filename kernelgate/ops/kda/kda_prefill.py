"""KDA varlen prefill: chunked (chunk 64) delta rule with per-channel decay, slot-held state.

Per head, state S [K, V] fp32, per token t (g log-space decay, beta already sigmoid'ed):
    S = diag(exp(g_t)) S;  S += beta_t k_t (v_t - S^T k_t)^T;  o_t = S^T (scale * q_t)
q, k L2-normalised first (`x / sqrt(sum x^2 + 1e-6)`) when qk_l2norm. Sequences are packed
along dim 0 (`cu_seqlens` [N+1]); sequence n starts from `state[slots[n]]` and its final
state is written back there. slot < 0: skipped, its outputs are zeros and no state is
read or written. Out-of-range values are skipped the same way: a slot >= the pool size, a
sequence whose bounds are not 0 <= cu_seqlens[n] <= cu_seqlens[n+1] <= T; rows no sequence
runs are zeros. Checked mode (KERNELGATE_CHECKS=1) raises instead (slots in range and
distinct, cu_seqlens from 0, non-decreasing, ending at T, host hints equal to the device
values). Output in v's dtype.

Host hints (keyword-only, optional): `cu_seqlens_cpu` [N+1] and `slots_cpu` [N], CPU int
tensors holding the same values as `cu_seqlens` / `slots`. A caller that already knows the
batch layout on the host (the engine's StepBatch) passes them so that implementations need
no device->host copy (a sync that would expose the launch cost of the kernels after it).
Only their dtype, shape and device are checked; that the values match is the caller's
responsibility (a mismatch gives wrong results, not an error).

The native path is the matrix (WY / UT) form: the intra-chunk terms are batched over heads
and a few chunks at a time (so they stay in cache), the chunk-to-chunk state hand-off is
a loop of [H, C, K] @ [H, K, V] matmuls. Inside a chunk with cumulative decay
gc_i = sum_{s<=i} g_s and start state S0:
    u = (I + A)^-1 (v - (k * e^gc) S0),   A[i,j] = beta_j k_i.(e^(gc_i-gc_j) k_j), j < i
    o = (q * e^gc) S0 + P u,               P[i,j] = beta_j q_i.(e^(gc_i-gc_j) k_j), j <= i
    S = e^gc_last * S0 + (beta * k * e^(gc_last-gc))^T u
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ... import checks
from ...registry import GPU_TRITON, Case, declare
from ..common import index_checks
from ..common.varlen import INDEX, host_hints, seq_range, validate_host_hint  # noqa: F401

OP = "kda_prefill"
CHUNK = 64
GROUP = 4     # chunks whose intra-chunk terms are formed together: a few MB, stays in cache
SPAN = 30.0   # largest decay span (nats) inside a block whose Gram is one factored matmul


def l2norm(x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """scale * x / sqrt(sum(x^2) + 1e-6) over the last dim (one full-size pass after the norm)."""
    return x * (scale * torch.rsqrt(torch.linalg.vector_norm(x, dim=-1, keepdim=True).square_() + 1e-6))


def _blocks(M, nb, s, row, col):
    """View of the (row half, col half) s x s block of each of the nb diagonal 2s-blocks of
    M [..., C, C], as [..., s, s, nb] (row, col in {0, 1})."""
    M6 = M.unflatten(-1, (nb, 2, s)).unflatten(-4, (nb, 2, s))               # [..., nb, 2, s, nb, 2, s]
    return M6.diagonal(dim1=-6, dim2=-3)[..., row, :, col, :, :]


def _decayed_grams(q, k, gc):
    """Mkk[..., i, j] = sum_c k_i[c] k_j[c] exp(gc_i[c] - gc_j[c]) and Mqk likewise with q_i,
    for j <= i (0 above the diagonal). q, k: [..., C, K]; gc: [..., C, K], or [..., C, 1] for one
    decay per head (GDN; broadcast over K); gc non-increasing along C.

    Inside a block whose decay span (gc at its first row minus gc at its last) is at most
    SPAN, exp(gc_i - gc_j) = exp(gc_i - r) exp(r - gc_j) with r = gc at the first row: factors
    within [e^-SPAN, e^SPAN], far from fp32 overflow or denormals, and the whole block is one
    matmul. A block with a stronger decay is split in halves: the halves recurse, and the
    (right half x left half) cross term takes r = gc at the left half's last row, where both
    factors lie in [0, 1] (gc_i <= r <= gc_j), so any decay is safe. Blocks of one size are
    all decided together (one check per size); size 1 is the plain diagonal.
    """
    C = k.shape[-2]
    Mkk, Mqk = k.new_zeros(*k.shape[:-1], C), k.new_zeros(*k.shape[:-1], C)
    s = C
    while s > 1:
        nb = C // s
        blk = lambda x: x.unflatten(-2, (nb, s))  # noqa: E731       [..., nb, s, K]
        gb = blk(gc)
        if (gb[..., 0, :] - gb[..., -1, :]).max() <= SPAN:
            r = gb[..., :1, :]
            col = torch.mul(torch.sub(r, gb).exp_(), blk(k)).transpose(-1, -2)   # [..., nb, K, s]
            row = torch.sub(gb, r).exp_()
            for M, x in ((Mkk, k), (Mqk, q)):
                diag = M.unflatten(-1, (nb, s)).unflatten(-3, (nb, s)).diagonal(dim1=-4, dim2=-2)
                diag.copy_(((blk(x) * row) @ col).tril_().movedim(-3, -1))      # [..., s, s, nb]
            return Mkk, Mqk
        s //= 2
        halves = lambda x: x.unflatten(-2, (nb, 2, s)).unbind(-3)  # noqa: E731  [..., nb, s, K] x2
        (gl, gr), (kl, kr), (_, qr) = halves(gc), halves(k), halves(q)
        r = gl[..., -1:, :]
        col = torch.mul(torch.sub(r, gl).exp_(), kl).transpose(-1, -2)       # [..., nb, K, s]
        row = torch.sub(gr, r).exp_()
        for M, x in ((Mkk, kr), (Mqk, qr)):
            _blocks(M, nb, s, 1, 0).copy_(((x * row) @ col).movedim(-3, -1))
    Mkk.diagonal(dim1=-2, dim2=-1).copy_(torch.linalg.vecdot(k, k))
    Mqk.diagonal(dim1=-2, dim2=-1).copy_(torch.linalg.vecdot(q, k))
    return Mkk, Mqk


def _to_chunks(x, n):
    """[n*CHUNK - pad, H, *] -> [n, H, CHUNK, *] fp32 contiguous, zero-padded at the end
    (padded steps are identity: g = beta = k = 0)."""
    x = x.float()
    if x.shape[0] < n * CHUNK:
        x = F.pad(x, (0, 0) * (x.dim() - 1) + (0, n * CHUNK - x.shape[0]))
    return x.view(n, CHUNK, *x.shape[1:]).transpose(1, 2).contiguous()


def kda_chunked(q, k, v, g, beta, S, scale, qk_l2norm):
    """One sequence: q, k, g [L, H, K], v [L, H, V], beta [L, H], S [H, K, V]
    -> (o [L, H, V] fp32, final S [H, K, V] fp32). g may be [L, H, 1]: one decay per head (GDN).

    Chunks are taken GROUP at a time: the intra-chunk terms of a group are batched over its
    chunks and heads ([n, H, C, *]); then the group's chunks hand the state over in order."""
    L, H, _ = q.shape
    o = torch.empty(*v.shape, dtype=torch.float32, device=v.device)
    S = S.float()
    for t0 in range(0, L, GROUP * CHUNK):
        t1 = min(L, t0 + GROUP * CHUNK)
        n = -(-(t1 - t0) // CHUNK)
        qc, kc, vc, gc = (_to_chunks(x[t0:t1], n) for x in (q, k, v, g))         # [n, H, C, *]
        bc = _to_chunks(beta[t0:t1, :, None], n)[..., 0]                          # [n, H, C]
        if qk_l2norm:
            qc, kc = l2norm(qc, scale), l2norm(kc)
        else:
            qc = qc * scale
        gc = gc.cumsum(-2)
        Mkk, Mqk = _decayed_grams(qc, kc, gc)
        # (I + A)^-1 with A = Mkk * beta_j (strictly lower; the solve takes its diagonal as 1)
        eye = torch.eye(CHUNK, device=q.device).expand(n, H, CHUNK, CHUNK)
        Tinv = torch.linalg.solve_triangular(Mkk * bc[..., None, :], eye, upper=False, unitriangular=True)
        P = Mqk * bc[..., None, :]
        eg = gc.exp()
        Kg, Qg = kc * eg, qc * eg
        glast = gc[..., -1:, :]                                                   # [n, H, 1, K]
        Kd = (kc * (glast - gc).exp() * bc[..., None]).transpose(-1, -2)          # [n, H, K, C]
        decay = glast.exp().transpose(-1, -2)                                     # [n, H, K, 1]
        oc = torch.empty_like(vc)
        for c in range(n):
            u = Tinv[c] @ torch.baddbmm(vc[c], Kg[c], S, alpha=-1)               # [H, C, V]
            oc[c] = torch.baddbmm(P[c] @ u, Qg[c], S)
            S = torch.baddbmm(decay[c] * S, Kd[c], u)
        o[t0:t1] = oc.transpose(1, 2).reshape(n * CHUNK, H, -1)[:t1 - t0]
    return o, S


def kda_prefill_native(q, k, v, g, beta, state, cu_seqlens, slots, scale=None, qk_l2norm=True, *,
                       cu_seqlens_cpu=None, slots_cpu=None):
    """KDA varlen prefill reference (chunked matrix form); state updated in place at slots."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    o = torch.zeros(v.shape, dtype=v.dtype, device=v.device)
    T, pool = q.shape[0], state.shape[0]
    bounds = (cu_seqlens if cu_seqlens_cpu is None else cu_seqlens_cpu).tolist()
    for n, slot in enumerate((slots if slots_cpu is None else slots_cpu).tolist()):
        rows = seq_range(bounds, n, T)
        if not 0 <= slot < pool or rows is None or rows[0] == rows[1]:
            continue
        s, e = rows
        out, S = kda_chunked(q[s:e], k[s:e], v[s:e], g[s:e], beta[s:e], state[slot], scale, qk_l2norm)
        o[s:e] = out.to(v.dtype)
        state[slot] = S
    return o


def validate(q, k, v, g, beta, state, cu_seqlens, slots, scale=None, qk_l2norm=True, *,
             cu_seqlens_cpu=None, slots_cpu=None):
    checks.tensor(OP, "q", q, ndim=3, dtype=checks.FLOATS)
    T, H, K = q.shape
    dev = q.device
    checks.tensor(OP, "k", k, shape=(T, H, K), dtype=checks.FLOATS, device=dev)
    checks.tensor(OP, "v", v, shape=(T, H, None), dtype=checks.FLOATS, device=dev)
    checks.tensor(OP, "g", g, shape=(T, H, K), dtype=checks.FLOATS, device=dev)
    checks.tensor(OP, "beta", beta, shape=(T, H), dtype=checks.FLOATS, device=dev)
    checks.tensor(OP, "state", state, shape=(None, H, K, v.shape[2]), dtype=torch.float32, device=dev)
    validate_batch(OP, dev, cu_seqlens, slots, scale, qk_l2norm, cu_seqlens_cpu, slots_cpu)


def validate_batch(op, dev, cu_seqlens, slots, scale, qk_l2norm, cu_seqlens_cpu, slots_cpu):
    """The varlen delta-rule prefills' batch arguments (KDA, GDN): metadata, scale, flags, hints."""
    checks.tensor(op, "cu_seqlens", cu_seqlens, ndim=1, dtype=INDEX, device=dev)
    checks.require(cu_seqlens.shape[0] >= 2, op, "cu_seqlens needs N+1 >= 2 entries")
    checks.tensor(op, "slots", slots, shape=(cu_seqlens.shape[0] - 1,), dtype=INDEX, device=dev)
    check_scale(op, scale, qk_l2norm)
    validate_host_hint(op, "cu_seqlens_cpu", cu_seqlens_cpu, cu_seqlens)
    validate_host_hint(op, "slots_cpu", slots_cpu, slots)


def check_scale(op, scale, qk_l2norm=True):
    checks.require(scale is None or (isinstance(scale, (int, float)) and not isinstance(scale, bool)
                                     and scale > 0), op, f"scale must be None or a number > 0, got {scale!r}")
    checks.require(isinstance(qk_l2norm, bool), op, f"qk_l2norm must be a bool, got {qk_l2norm!r}")


def check_batch_values(op, T, pool, cu_seqlens, slots, cu_seqlens_cpu, slots_cpu):
    index_checks.cu_seqlens(op, cu_seqlens, T)
    index_checks.hint(op, "cu_seqlens_cpu", cu_seqlens_cpu, cu_seqlens)
    index_checks.slots(op, "slots", slots, pool)
    index_checks.hint(op, "slots_cpu", slots_cpu, slots)


def check_values(q, k, v, g, beta, state, cu_seqlens, slots, scale=None, qk_l2norm=True, *,
                 cu_seqlens_cpu=None, slots_cpu=None):
    check_batch_values(OP, q.shape[0], state.shape[0], cu_seqlens, slots, cu_seqlens_cpu, slots_cpu)


# -- parity cases -------------------------------------------------------------------------
def make_inputs(lens, slots, H, K, V, device, dtype, gen, pool=None, num_k_heads=None, head_decay=False):
    """Random KDA inputs in the ranges a model produces (decay <= 0, beta in (0, 1)). GDN:
    q, k with num_k_heads heads (H value heads), one decay per head (head_decay: g [T, H])."""
    T = sum(lens)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    q, k, v = r(T, num_k_heads or H, K), r(T, num_k_heads or H, K), r(T, H, V)
    g = F.logsigmoid(r(T, H, *(() if head_decay else (K,))) + 3.0)     # mostly mild decay, some strong
    beta = torch.sigmoid(r(T, H))
    state = 0.3 * r(pool or max(slots) + 2, H, K, V)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    sl = torch.tensor(slots, dtype=torch.int32)
    to = lambda t, dt=dtype: t.to(device=device, dtype=dt)  # noqa: E731
    return (to(q), to(k), to(v), to(g, torch.float32), to(beta), to(state, torch.float32),
            cu.to(device), sl.to(device))



def _case(lens, slots, H=2, K=32, V=32, l2=True, hints=False):
    def make(device, dtype, gen):
        args = make_inputs(lens, slots, H, K, V, device, dtype, gen)
        return args, dict(qk_l2norm=l2, **(host_hints(*args[6:8]) if hints else {}))
    return Case(f"L{'_'.join(map(str, lens))}-H{H}-K{K}-V{V}-slots{'_'.join(map(str, slots))}"
                + ("" if l2 else "-nol2") + ("-hints" if hints else ""), make)


def cases():
    return [_case([1], [0]), _case([63], [1], K=60, V=60), _case([65, 3], [0, -1]),
            _case([130, 1, 64, 17], [3, 0, 5, 1], H=3, V=16), _case([40, 24], [1, 0], l2=False),
            _case([17, 0, 70, 5], [2, 0, -1, 1], hints=True)]   # zero-length + skipped, host hints


def bench_cases():
    def make(lens):
        def f(device, dtype, gen):
            args = make_inputs(lens, list(range(len(lens))), 32, 128, 128, "cpu", dtype, gen)
            return tuple(a.to(device) for a in args), host_hints(*args[6:8])   # as the engine calls it
        return f
    return [Case(f"T{sum(ls)}-N{len(ls)}-H32-K128", make(ls), dtypes=(torch.bfloat16,))
            for ls in ([8192], [2048] * 4)]


kda_prefill = declare(OP, kda_prefill_native, validate=validate, check_values=check_values, cases=cases,
                      bench_cases=bench_cases,
                      mutates=("state",), rtol={torch.float32: 1e-4, torch.bfloat16: 2e-2})
kda_prefill.implementation("fla", ".kda_fla:chunk_prefill", provider="fla", platforms=GPU_TRITON,
                           requires=("fla", "triton-compiled"), priority=10,
                           # fla's chunk kernels run fp32 inputs through TF32 tensor-core dots
                           # (10-bit mantissas: about 1e-3 per product, compounded over the chunks)
                           rtol={torch.float32: 1.5e-2},
                           doc="fla chunk_kda, varlen, states gathered from / scattered to the slot pool")
