"""`mla_prefill` through torch's scaled_dot_product_attention (every platform).

Per sequence, the context's latents are gathered from the paged cache and expanded to
per-head keys [W_uk c, k_r] and values W_uv c in the query's dtype, PIECE positions at a
time, so memory is bounded in the context (Kimi, bf16: ~0.5 GB of transients per 16k
positions) and linear in the chunk.

- The context fits one piece (L <= PIECE, the usual chunk): ONE public SDPA call over
  [0, L) with bottom-right causal alignment (is_causal when the chunk starts the sequence,
  else `causal_lower_right`, which CUDA/ROCm run as a mask-free fused kernel and other
  backends materialise). 4-D [1, H, n, D] inputs: the fused kernels take only batched
  inputs (3-D falls back to the unfused math path).
- Longer contexts: the prefix [0, p0) and the chunk [p0, L) are cut into pieces at p0, so
  a prefix piece needs no mask (every query sees all of it) and a chunk piece [a, b) is
  plain top-left causal for the queries from a - p0 on (query a - p0 + t sees keys a..a+t;
  earlier queries see none of it and are left out). Each piece returns (o, lse) and the
  pieces are merged by log-sum-exp in fp32. The public SDPA returns no lse, so `attend_lse`
  uses torch's fused kernels that do where they exist -- the memory-efficient kernel on
  CUDA / ROCm (`_scaled_dot_product_efficient_attention`, different q/v widths allowed),
  the CPU flash kernel (`_scaled_dot_product_flash_attention_for_cpu`, widths padded to
  one) -- and explicit fp32 math in query tiles elsewhere or when one of them refuses the
  call (a FallbackWarning says so once).

Why not one SDPA over the whole context with a mask: the expanded keys and values of a
128k context are ~2.7 GB per layer call (Kimi, bf16); pieces cap that at PIECE positions
and cost one extra fp32 pass over [H, n, Dv] per piece.
"""
from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

from ... import alloc
from ...registry import FallbackWarning
from . import paged

PIECE = 16384            # context positions expanded at a time
MATH_BYTES = 1 << 28     # fp32 score tile budget of the math fallback
FORCE_LSE: str | None = None   # tests: "math" forces the portable path
_warned: set = set()


def _lower_right():
    """torch's bottom-right causal bias, imported on first use: torch.nn.attention.bias imports
    torch._dynamo (~3 s of a CPU start-up; a prompt prefilled in one step never needs it)."""
    from torch.nn.attention.bias import causal_lower_right
    return causal_lower_right


def expand(cache, table_row, start, end, w, H, Dn, Dv, R, dtype):
    """Positions start..end-1 -> keys [1, H, P, Dn + Dr], values [1, H, P, Dv] in `dtype`."""
    lat = paged.gather(cache, table_row, end, start).to(dtype)              # [P, R + Dr]
    P = lat.shape[0]
    kv = (lat[:, :R] @ w.t()).view(P, H, Dn + Dv)                           # [P, H, Dn + Dv]
    k = torch.cat([kv[..., :Dn], lat[:, None, R:].expand(P, H, lat.shape[1] - R)], dim=-1)
    return k.transpose(0, 1)[None], kv[..., Dn:].transpose(0, 1)[None]


def _math_lse(q, k, v, scale, causal):
    """fp32 (o [1, H, nq, Dv], lse [1, H, nq]) in query tiles of at most MATH_BYTES of scores."""
    H, nq, nk = q.shape[1], q.shape[2], k.shape[2]
    kf, vf = k.float(), v.float()
    o = torch.empty(1, H, nq, v.shape[3], dtype=torch.float32, device=q.device)
    lse = torch.empty(1, H, nq, dtype=torch.float32, device=q.device)
    step = max(1, MATH_BYTES // (4 * H * nk))
    for s in range(0, nq, step):
        e = min(s + step, nq)
        sc = (q[:, :, s:e].float() @ kf.transpose(-1, -2)) * scale           # [1, H, e - s, nk]
        if causal:   # top-left: query t sees keys 0..t
            hide = torch.arange(nk, device=q.device)[None, :] > torch.arange(s, e, device=q.device)[:, None]
            sc = sc.masked_fill(hide, float("-inf"))
        lse[:, :, s:e] = torch.logsumexp(sc, dim=-1)
        o[:, :, s:e] = torch.exp(sc - lse[:, :, s:e, None]) @ vf
    return o, lse


def _fused_lse(q, k, v, scale, causal):
    """Torch's fused kernels that return the lse (private ops), or None where there is none."""
    n = q.shape[2]
    if q.device.type == "cuda":   # CUDA and ROCm
        out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
            q, k, v, None, True, 0.0, causal, scale=scale)[:2]
        return out.float(), lse[..., :n].float()      # lse may be padded along the queries
    if q.device.type == "cpu":
        Dqk, Dv = q.shape[3], v.shape[3]
        D = max(Dqk, Dv)   # the CPU flash kernel wants one width: zero columns change nothing
        pad = lambda t: F.pad(t, (0, D - t.shape[3])) if t.shape[3] < D else t  # noqa: E731
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            pad(q), pad(k), pad(v), 0.0, causal, scale=scale)
        return out[..., :Dv].float(), lse.float()
    return None


def attend_lse(q, k, v, scale, causal):
    """(o fp32 [1, H, nq, Dv], lse fp32 [1, H, nq]) of one piece; top-left causal if asked."""
    if FORCE_LSE != "math":
        try:
            got = _fused_lse(q, k, v, scale, causal)
        except Exception as e:  # noqa: BLE001 - an unsupported shape/dtype/backend: the math path
            key = (q.device.type, q.dtype, type(e).__name__)
            if key not in _warned:
                _warned.add(key)
                warnings.warn(f"kernelgate: mla_prefill (sdpa) uses fp32 math for context pieces: the fused "
                              f"lse kernel refused ({type(e).__name__}: {str(e).splitlines()[0][:120]})",
                              FallbackWarning, stacklevel=3)
            got = None
        if got is not None:
            return got
    return _math_lse(q, k, v, scale, causal)


def mla_prefill_sdpa(q, cache, block_table, cu_seqlens, seq_lens, w_kv, scale, value_dim):
    T, H, _ = q.shape
    R = w_kv.shape[2]
    Dn, Dv = w_kv.shape[1] - value_dim, value_dim
    w = w_kv.to(q.dtype).reshape(H * (Dn + Dv), R)
    bounds, lens = cu_seqlens.tolist(), seq_lens.tolist()   # host copies: no sync; device ones: one
    o = alloc.empty((T, H, Dv), q.dtype, q.device)
    for i, L in enumerate(lens):
        t0, t1 = bounds[i], bounds[i + 1]
        n = t1 - t0
        if n == 0:
            continue
        p0 = L - n
        qi = q[t0:t1].transpose(0, 1)[None]                                  # [1, H, n, Dn + Dr]
        if L <= PIECE:
            k, v = expand(cache, block_table[i], 0, L, w, H, Dn, Dv, R, q.dtype)
            mask = None if p0 == 0 else _lower_right()(n, L)
            out = F.scaled_dot_product_attention(qi, k, v, attn_mask=mask, is_causal=p0 == 0, scale=scale)
            o[t0:t1] = out[0].transpose(0, 1)
            continue
        acc = torch.zeros(H, n, Dv, dtype=torch.float32, device=q.device)
        mx = torch.full((H, n), float("-inf"), dtype=torch.float32, device=q.device)
        den = torch.zeros(H, n, dtype=torch.float32, device=q.device)
        pieces = [(a, min(a + PIECE, p0), False) for a in range(0, p0, PIECE)] + \
                 [(a, min(a + PIECE, L), True) for a in range(p0, L, PIECE)]
        for a, b, in_chunk in pieces:
            first = a - p0 if in_chunk else 0                                # queries that see this piece
            k, v = expand(cache, block_table[i], a, b, w, H, Dn, Dv, R, q.dtype)
            po, plse = attend_lse(qi[:, :, first:], k, v, scale, causal=in_chunk)
            m_new = torch.maximum(mx[:, first:], plse[0])
            a_old, a_new = torch.exp(mx[:, first:] - m_new), torch.exp(plse[0] - m_new)
            acc[:, first:] = acc[:, first:] * a_old[..., None] + po[0] * a_new[..., None]
            den[:, first:] = den[:, first:] * a_old + a_new
            mx[:, first:] = m_new
        o[t0:t1] = (acc / den[..., None]).transpose(0, 1).to(q.dtype)
    return o
