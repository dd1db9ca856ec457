"""`mla_prefill` through torch's scaled_dot_product_attention (every platform).

Per sequence, the context's latents are gathered from the paged cache and expanded to
per-head keys [W_uk c, k_r] and values W_uv c in the query's dtype, PIECE positions at a
time, so memory is bounded in the context (Kimi, bf16: ~0.5 GB of transients per 16k
positions) and linear in the chunk.

- A chunk that starts its sequence and fits one piece (L <= PIECE, a prompt's first chunk):
  ONE causal call over [0, L) through `attend_lse` (below), not the public SDPA: on NVIDIA that
  sends every new length to cuDNN, which plans each shape on first use -- ~75 ms inside a
  request whenever a served prompt's first chunk is the budget minus its step's decodes and
  the previous prompt's tail (bench/RESULTS.md, Session 18).
- A chunk after a cached prefix, or a longer context: the prefix [0, p0) and the chunk
  [p0, L) are cut into pieces at p0 (no bottom-right causal mask: torch's builds on
  torch._dynamo, seconds to import in a request), so
  a prefix piece needs no mask (every query sees all of it; on NVIDIA a piece of unplanned
  length is cut at its last multiple of CUDNN_MULTIPLE: `prefix_pieces`, and the rest padded to
  a planned length with its padded keys masked, where that pays: `planned`) and a chunk piece [a, b) is
  plain top-left causal for the queries from a - p0 on (query a - p0 + t sees keys a..a+t;
  earlier queries see none of it and are left out). Each piece returns (o, lse) and the
  pieces are merged by log-sum-exp in fp32. The public SDPA returns no lse, so `attend_lse`
  uses torch's fused kernels that do (private ops), fastest first (`LSE_ORDER`): on NVIDIA
  cuDNN's attention (for pieces whose lengths are multiples of CUDNN_MULTIPLE, as it plans
  each shape once, slowly), then FlashAttention-2 (v padded to q's width), then the
  memory-efficient kernel; on ROCm flash, then memory-efficient; on the CPU torch's flash
  kernel (widths padded to one). Explicit fp32 math in query tiles elsewhere or when every
  one of them refuses the call (a FallbackWarning names each refusal once). A causal piece
  with more queries than keys is cut into a square causal part and an unmasked rest, so no
  kernel's own alignment of a non-square causal mask matters.

- Many short sequences (a server's step: prompts and decodes of a few hundred positions):
  consecutive sequences of at most VARLEN_MAX_LEN positions form runs of at most PIECE
  positions, and a run is gathered, expanded and attended in one go by a varlen kernel
  (`VARLEN`: torch's memory-efficient kernel with bottom-right causal masking on CUDA / ROCm),
  instead of ~10 launches per sequence. A refusal is warned once; that run goes one by one.

Why not one SDPA over the whole context with a mask: the expanded keys and values of a
128k context are ~2.7 GB per layer call (Kimi, bf16); pieces cap that at PIECE positions
and cost one extra fp32 pass over [H, n, Dv] per piece.
"""
from __future__ import annotations

import itertools
import warnings

import torch
import torch.nn.functional as F

from ... import alloc
from ...platform import current
from ...registry import FallbackWarning
from ..common.lse_merge import LseSum
from . import paged

PIECE = 16384            # context positions expanded at a time
MATH_BYTES = 1 << 28     # fp32 score tile budget of the math fallback
FORCE_LSE: str | None = None   # tests / bench: one LSE_KERNELS name, or "math" (the portable path)
_warned: set = set()


def kv_weight(w_kv, value_dim: int, rope_dim: int, dtype):
    """w_kv [H, Dn + Dv, R] -> [H * (Dn + Dr + Dv), R] in `dtype`: per head W_uk, Dr zero rows, W_uv.
    One GEMM by it gives each position's keys and values side by side with an empty slot where each
    head's key takes the shared rope key (`keys_values`)."""
    H, _, R = w_kv.shape
    Dn = w_kv.shape[1] - value_dim
    w = w_kv.new_zeros(H, Dn + rope_dim + value_dim, R, dtype=dtype)
    w[:, :Dn] = w_kv[:, :Dn]
    w[:, Dn + rope_dim:] = w_kv[:, Dn:]
    return w.view(-1, R)


def keys_values(lat, w, H, Dn, Dv, R):
    """Latents [P, R + Dr] -> keys [P, H, Dn + Dr] and values [P, H, Dv], views of one GEMM's output
    (by `kv_weight`) with the rope key copied into each head's slot: no concatenated copy of the
    keys (at a 128k prompt's chunk that copy moved ~350 MB per 16k-position piece)."""
    P, Dr = lat.shape[0], lat.shape[1] - R
    kv = (lat[:, :R] @ w.t()).view(P, H, Dn + Dr + Dv)
    kv[..., Dn:Dn + Dr] = lat[:, None, R:]
    return kv[..., :Dn + Dr], kv[..., Dn + Dr:]


def expand(cache, table_row, start, end, w, H, Dn, Dv, R, dtype):
    """Positions start..end-1 -> keys [1, H, P, Dn + Dr], values [1, H, P, Dv] in `dtype`."""
    lat = paged.gather(cache, table_row, end, start).to(dtype)              # [P, R + Dr]
    k, v = keys_values(lat, w, H, Dn, Dv, R)
    return k.transpose(0, 1)[None], v.transpose(0, 1)[None]


def _math_lse(q, k, v, scale, causal, bias=None):
    """fp32 (o [1, H, nq, Dv], lse [1, H, nq]) in query tiles of at most MATH_BYTES of scores;
    `bias` [1, *, *, nk] (broadcast) is added to the scores."""
    H, nq, nk = q.shape[1], q.shape[2], k.shape[2]
    kf, vf = k.float(), v.float()
    o = torch.empty(1, H, nq, v.shape[3], dtype=torch.float32, device=q.device)
    lse = torch.empty(1, H, nq, dtype=torch.float32, device=q.device)
    step = max(1, MATH_BYTES // (4 * H * nk))
    for s in range(0, nq, step):
        e = min(s + step, nq)
        sc = (q[:, :, s:e].float() @ kf.transpose(-1, -2)) * scale           # [1, H, e - s, nk]
        if bias is not None:
            sc = sc + bias[:, :, s:e if bias.shape[2] > 1 else 1].float()
        if causal:   # top-left: query t sees keys 0..t
            hide = torch.arange(nk, device=q.device)[None, :] > torch.arange(s, e, device=q.device)[:, None]
            sc = sc.masked_fill(hide, float("-inf"))
        lse[:, :, s:e] = torch.logsumexp(sc, dim=-1)
        o[:, :, s:e] = torch.exp(sc - lse[:, :, s:e, None]) @ vf
    return o, lse


def _one_batch(t):
    """t [1, ...] with its batch stride set to its element count: torch keys cuDNN's plans on every
    stride, also the unused one of a batch of one, which differs between a query view of the
    packed tokens and the same query padded (a new plan, ~40 ms, inside a request)."""
    return t.as_strided(t.shape, (t[0].numel(), *t.stride()[1:]))


def _lse_cudnn(q, k, v, scale, causal, bias=None):
    q, k, v = _one_batch(q), _one_batch(k), _one_batch(v)
    out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, bias, True, 0.0, causal, False,
                                                                  scale=scale)[:2]
    return out, lse.reshape(q.shape[:3]).float()


def _lse_flash(q, k, v, scale, causal):
    """FlashAttention-2 wants one width for q, k and v, a multiple of 8: zero columns (they change
    neither q . k, the scale being given, nor the kept output columns)."""
    Dv = v.shape[3]
    D = -(-max(q.shape[3], Dv) // 8) * 8
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention(_pad(q, D), _pad(k, D), _pad(v, D), 0.0, causal,
                                                                  False, scale=scale)[:2]
    return out[..., :Dv], lse.float()


def _lse_efficient(q, k, v, scale, causal):
    out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal,
                                                                      scale=scale)[:2]
    return out, lse[..., :q.shape[2]].float()      # lse may be padded along the queries


def _lse_cpu_flash(q, k, v, scale, causal):
    Dqk, Dv = q.shape[3], v.shape[3]
    D = max(Dqk, Dv)   # the CPU flash kernel wants one width
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(_pad(q, D), _pad(k, D), _pad(v, D), 0.0,
                                                                          causal, scale=scale)
    return out[..., :Dv], lse.float()


def _pad(t, width):
    return F.pad(t, (0, width - t.shape[3])) if t.shape[3] < width else t


def _pad_rows(t, m):
    """t [1, H, n, D] with zero rows appended up to m, in t's own layout where its rows are the
    outermost stride (a view of packed tokens: keys, values and queries as the op builds them), so
    a padded piece meets cuDNN with the strides of an unpadded one (its plans key on strides)."""
    n, s = t.shape[2], t.stride()
    if m == n:
        return t
    if s[2] < max(s[1], s[3]):
        return F.pad(t, (0, 0, 0, m - n))
    out = t.new_zeros(m * s[2]).as_strided((1, t.shape[1], m, t.shape[3]), (m * s[2], s[1], s[2], s[3]))
    out[:, :, :n] = t
    return out


# cuDNN builds an execution plan per shape on first use (slowly): it gets only pieces whose
# lengths are multiples of CUDNN_MULTIPLE (a few shapes per process, met by the warm-up). A
# piece's queries are padded up to the next multiple when that adds at most a quarter (a mixed
# step's chunk is the budget minus its decode tokens); a causal (square) piece pads its keys
# alike -- top-left causal, the padded keys are seen by the padded queries alone. A prefix piece
# (no mask) pads its keys when that adds at most CUDNN_KEY_PAD of them, the padded keys hidden by
# an additive -inf bias (the remainder of a prefix that a mixed step's chunks leave: 8,064 keys
# took FlashAttention-2 5.27 ms at Kimi's widths, cuDNN padded to 8,192 with the bias 3.02 ms;
# cuDNN's cost is that of the padded piece, FA2's grows with the keys: even at ~4,650 keys, so
# shorter remainders stay with FA2; bench/probes/cudnn_bias.py). Other lengths (a prompt's short
# last chunk, a short remainder of the prefix) take the next kernel.
CUDNN_MULTIPLE = 8192
CUDNN_PAD = 0.25
CUDNN_KEY_PAD = 0.75

# torch's fused kernels that return the lse (private ops), fastest first, per device type
LSE_KERNELS = {"cudnn": _lse_cudnn, "flash": _lse_flash, "efficient": _lse_efficient, "cpu_flash": _lse_cpu_flash}
# (by device type; ROCm's "cuda" tensors by the platform's name: no cuDNN there)
LSE_ORDER = {"cuda": ("cudnn", "flash", "efficient"), "rocm": ("flash", "efficient"), "cpu": ("cpu_flash",)}
# the dtypes a kernel takes at all (cuDNN's and FlashAttention-2's: half precision): others skip it
# without a try (a refusal per call, and a warning, for a choice known ahead)
LSE_DTYPES = {"cudnn": (torch.float16, torch.bfloat16), "flash": (torch.float16, torch.bfloat16)}


def device_kind(q) -> str:
    """The device type, with ROCm's "cuda" tensors by the platform's name."""
    return "rocm" if q.device.type == "cuda" and current().name == "rocm" else q.device.type


def attend_lse(q, k, v, scale, causal):
    """(o [1, H, nq, Dv] in q's dtype (fp32 from the math path), lse fp32 [1, H, nq]) of one piece;
    top-left causal if asked."""
    nk = k.shape[2]
    if causal and q.shape[2] > nk:
        # queries nk.. see the whole piece: a square causal part and an unmasked rest, so no
        # kernel's own alignment of a non-square causal mask (top- or bottom-right) matters
        o1, l1 = attend_lse(q[:, :, :nk], k, v, scale, True)
        o2, l2 = attend_lse(q[:, :, nk:], k, v, scale, False)
        return torch.cat([o1, o2], 2), torch.cat([l1, l2], 2)
    order = (FORCE_LSE,) if FORCE_LSE else LSE_ORDER.get(device_kind(q), ())
    for name in order:
        if name == "math":
            break
        if q.dtype not in LSE_DTYPES.get(name, (q.dtype,)) and not FORCE_LSE:
            continue
        fn = LSE_KERNELS[name]
        if name == "cudnn" and not FORCE_LSE:
            fn = planned(fn, q.shape[2], nk, causal, CUDNN_MULTIPLE)
            if fn is None:
                continue
        try:
            return fn(q, k, v, scale, causal)
        except Exception as e:  # noqa: BLE001 - an unsupported shape/dtype/backend: the next one
            key = (q.device.type, q.dtype, name)
            if key not in _warned:
                _warned.add(key)
                warnings.warn(f"kernelgate: mla_prefill (sdpa): the {name} lse kernel refused a context piece "
                              f"({type(e).__name__}: {str(e).splitlines()[0][:120]}); trying the next "
                              f"(last: fp32 math)", FallbackWarning, stacklevel=3)
    return _math_lse(q, k, v, scale, causal)


def planned(kernel, nq: int, nk: int, causal: bool, multiple: int, most: float = CUDNN_PAD,
            most_keys: float = CUDNN_KEY_PAD):
    """`kernel` run on a piece padded to lengths that are multiples of `multiple` (zero rows:
    queries appended and dropped from the output; for a causal square piece keys and values too,
    seen only by the padded queries; for a piece without a mask, keys and values too, hidden from
    every query by a -inf bias: `kernel(..., bias=)`), or None where that would pad more than
    `most` of the queries or `most_keys` of an unmasked piece's keys, or the keys of a causal
    piece that is not square."""
    mq, mk = (-(-n // multiple) * multiple for n in (nq, nk))
    if nq == 0 or mq - nq > most * nq:
        return None
    square = causal and nq == nk
    if nk % multiple and not square and (causal or mk - nk > most_keys * nk):
        return None
    if mq == nq and mk == nk:
        return kernel

    def run(q, k, v, scale, causal):
        bias = None
        if square:
            k, v = _pad_rows(k, mq), _pad_rows(v, mq)
        elif mk > nk:
            k, v = _pad_rows(k, mk), _pad_rows(v, mk)
            row = torch.zeros(mk, dtype=q.dtype, device=q.device)
            row[nk:] = float("-inf")
            bias = row.view(1, 1, 1, mk).expand(1, q.shape[1], mq, mk)
        q = _pad_rows(q, mq)
        o, lse = kernel(q, k, v, scale, causal) if bias is None else kernel(q, k, v, scale, causal, bias=bias)
        return o[:, :, :nq], lse[:, :, :nq]
    return run


def _runs(bounds, lens, batched: bool):
    """The sequences with new tokens, in order, as runs sharing one attention call: consecutive
    ones of at most VARLEN_MAX_LEN positions, at most PIECE positions per run (where `batched`);
    every other sequence alone."""
    run, size = [], 0
    for i, L in enumerate(lens):
        if bounds[i + 1] == bounds[i]:
            continue                       # no new tokens: nothing to compute (its q rows are none)
        if batched and L <= VARLEN_MAX_LEN:
            if run and size + L > PIECE:
                yield run
                run, size = [], 0
            run.append(i)
            size += L
            continue
        if run:
            yield run
            run, size = [], 0
        yield [i]
    if run:
        yield run


def _varlen_efficient(q, k, v, cu_q, cu_k, ns, Ls, scale):
    """torch's memory-efficient kernel over packed sequences, causal from the bottom right."""
    return torch.ops.aten._efficient_attention_forward(q.contiguous()[None], k[None], v[None], None, cu_q, cu_k, max(ns), max(Ls),
                                                       0.0, 2, False, scale=scale)[0][0]


def _varlen_math(q, k, v, cu_q, cu_k, ns, Ls, scale):
    """fp32 per sequence (tests: the batching around it on any device)."""
    o = torch.empty(q.shape[0], q.shape[1], v.shape[2], dtype=q.dtype, device=q.device)
    a = b = 0
    for n, L in zip(ns, Ls):
        sc = torch.einsum("nhd,lhd->hnl", q[a:a + n].float(), k[b:b + L].float()) * scale
        hide = torch.arange(L, device=q.device)[None, :] > (L - n + torch.arange(n, device=q.device))[:, None]
        p = torch.softmax(sc.masked_fill(hide, float("-inf")), dim=-1)
        o[a:a + n] = torch.einsum("hnl,lhv->nhv", p, v[b:b + L].float()).to(q.dtype)
        a, b = a + n, b + L
    return o


# Sequences this short share one attention call per run (a server's step: many prompts and
# decodes of a few hundred positions each, where launching per sequence costs more than the
# attention): a run's latents are gathered and expanded at once and attended by a varlen kernel.
VARLEN_MAX_LEN = 2048
VARLEN_KERNELS = {"efficient": _varlen_efficient, "math": _varlen_math}
VARLEN = {"cuda": "efficient", "rocm": "efficient"}   # by device type; elsewhere one call per sequence
FORCE_VARLEN: str | None = None                        # tests: a VARLEN_KERNELS name, or "off"


def _attend_run(q, cache, block_table, bounds, lens, run, w, H, Dn, Dv, R, scale, how):
    """Output rows [bounds[run[0]], bounds[run[-1] + 1]) of a run, from one gather, one expansion
    and one varlen attention; None if the kernel refused (the caller goes one by one)."""
    Ls = torch.tensor([lens[i] for i in run])
    ns = [bounds[i + 1] - bounds[i] for i in run]
    member = torch.repeat_interleave(torch.arange(len(run)), Ls)                # run member of each position
    pos = torch.arange(int(Ls.sum())) - (torch.cumsum(Ls, 0) - Ls)[member]
    cu = torch.tensor([0] + list(itertools.accumulate(ns)) + [0] + list(itertools.accumulate(Ls.tolist())),
                      dtype=torch.int32)
    where = alloc.upload(torch.cat([torch.tensor(run)[member], pos, cu.long()]), q.device)   # one copy
    K, bs = pos.shape[0], cache.shape[1]
    rows, pos_d, cu_d = where[:K], where[K:2 * K], where[2 * K:].int()
    lat = cache[block_table[rows, pos_d // bs].long(), pos_d % bs].to(q.dtype)   # [K, R + Dr]
    k, v = keys_values(lat, w, H, Dn, Dv, R)
    t0, t1 = bounds[run[0]], bounds[run[-1] + 1]
    try:
        return VARLEN_KERNELS[how](q[t0:t1], k, v, cu_d[:len(run) + 1], cu_d[len(run) + 1:],
                                   ns, Ls.tolist(), scale)
    except Exception as e:  # noqa: BLE001 - an unsupported shape/dtype/backend: one call per sequence
        key = (q.device.type, q.dtype, "varlen-" + how)
        if key not in _warned:
            _warned.add(key)
            warnings.warn(f"kernelgate: mla_prefill (sdpa): the {how} varlen kernel refused a run of "
                          f"{len(run)} sequences ({type(e).__name__}: {str(e).splitlines()[0][:120]}); "
                          "attending one sequence at a time", FallbackWarning, stacklevel=3)
        return None


def prefix_pieces(p0: int, kind: str, piece: int | None = None) -> list:
    """[(a, b, False)] key pieces of a prefix [0, p0): `piece` (PIECE) positions each; where cuDNN serves the
    planned lengths (LSE_ORDER's first), a piece of another length is cut at its last multiple of
    CUDNN_MULTIPLE, so only the rest goes to the next kernel (a mixed step's chunks are the budget
    minus the decodes: the prefix they leave is no multiple of it)."""
    out, piece = [], piece or PIECE
    for a in range(0, p0, piece):
        b = min(a + piece, p0)
        cut = a + (b - a) // CUDNN_MULTIPLE * CUDNN_MULTIPLE
        if a < cut < b and LSE_ORDER.get(kind, ("",))[0] == "cudnn":
            out += [(a, cut, False), (cut, b, False)]
        else:
            out.append((a, b, False))
    return out


def _attend_one(q, cache, table_row, t0, t1, L, w, H, Dn, Dv, R, scale, out):
    """Output rows [t0, t1) of one sequence of L positions, written into `out` [t1 - t0, H, Dv]."""
    n = t1 - t0
    p0 = L - n
    qi = q[t0:t1].transpose(0, 1)[None]                                      # [1, H, n, Dn + Dr]
    if p0 == 0 and L <= PIECE:
        k, v = expand(cache, table_row, 0, L, w, H, Dn, Dv, R, q.dtype)
        o, _ = attend_lse(qi, k, v, scale, causal=True)
        out.copy_(o[0].transpose(0, 1))
        return
    total = LseSum(H, n, Dv, q.device)
    pieces = prefix_pieces(p0, device_kind(q)) + [(a, min(a + PIECE, L), True) for a in range(p0, L, PIECE)]
    for a, b, in_chunk in pieces:
        first = a - p0 if in_chunk else 0                                    # queries that see this piece
        k, v = expand(cache, table_row, a, b, w, H, Dn, Dv, R, q.dtype)
        po, plse = attend_lse(qi[:, :, first:], k, v, scale, causal=in_chunk)
        total.add(po[0], plse[0], first)
    total.finish(out)


def mla_prefill_sdpa(q, cache, block_table, cu_seqlens, seq_lens, w_kv, scale, value_dim):
    T, H, _ = q.shape
    R = w_kv.shape[2]
    Dn, Dv = w_kv.shape[1] - value_dim, value_dim
    w = kv_weight(w_kv, Dv, cache.shape[-1] - R, q.dtype)
    bounds, lens = cu_seqlens.tolist(), seq_lens.tolist()   # host copies: no sync; device ones: one
    o = alloc.empty((T, H, Dv), q.dtype, q.device)
    how = FORCE_VARLEN or VARLEN.get(device_kind(q))
    for run in _runs(bounds, lens, how is not None and how != "off"):
        if len(run) > 1:
            out = _attend_run(q, cache, block_table, bounds, lens, run, w, H, Dn, Dv, R, scale, how)
            if out is not None:
                o[bounds[run[0]]:bounds[run[-1] + 1]] = out
                continue
        for i in run:
            t0, t1 = bounds[i], bounds[i + 1]
            _attend_one(q, cache, block_table[i], t0, t1, lens[i], w, H, Dn, Dv, R, scale, o[t0:t1])
    return o
