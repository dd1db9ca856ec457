"""Absorbed MLA decode over the paged latent cache (layout: `paged.py`).

    mla_decode(q, cache, block_table, seq_lens, scale, kv_lora_rank, next_n=1, return_lse=False)
        q            [N * next_n, H, R + Dr]  query absorbed through W_uk, then its shared-key part
                                               (row i * next_n + j: query token j of sequence i)
        cache        [num_blocks, block_size, R + Dr]  latents c [R] | shared key k_r [Dr]
        block_table  [N, max_blocks] int32
        seq_lens     [N] int32   cached length INCLUDING the next_n new tokens (already written)
        scale        float       softmax scale (Kimi: qk_head_dim ** -0.5)
        kv_lora_rank int         R, the latent width = the value width (values are cache[..., :R])
        -> o_lat [N * next_n, H, R] in q's dtype (before W_uv), and with return_lse=True also
           lse [N * next_n, H] fp32 (natural log of the softmax denominator of the scaled scores)

Query token j of sequence i sees positions 0 .. seq_lens[i] - next_n + j (causal among the
next_n: MTP / speculative verification). fp32 scores, softmax and accumulation.
seq_lens[i] == 0 is a padding row (a captured graph's spare rows): o = 0, lse = -inf, no read.

Bad values (a negative length, 0 < length < next_n, a length the table is too narrow for, a
block id outside [0, num_blocks) among the blocks a sequence uses): the native reference and
any call on CPU tensors raise KernelgateError. Device kernels cannot check values without a
host sync (decode is captured in CUDA graphs); the Triton kernel never reads such a block or
past the table: positions in an out-of-range block are left out of the softmax, lengths past
the table are cut at the table's width, negative lengths count as 0.
"""
from __future__ import annotations

import torch

from ... import checks
from ...registry import GPU_TRITON, Case, declare
from . import paged

OP = "mla_decode"


def mla_decode_native(q, cache, block_table, seq_lens, scale, kv_lora_rank, next_n=1, return_lse=False):
    """Absorbed MLA decode over the paged latent cache: per sequence, gather, fp32 softmax."""
    paged.check_values(OP, cache, block_table, seq_lens, min_len=next_n)
    R = kv_lora_rank
    H = q.shape[1]
    o = torch.zeros(q.shape[0], H, R, dtype=torch.float32, device=q.device)
    lse = torch.full((q.shape[0], H), float("-inf"), dtype=torch.float32, device=q.device)
    for i, L in enumerate(seq_lens.tolist()):
        if L == 0:
            continue
        kv = paged.gather(cache, block_table[i], L).float()                  # [L, R + Dr]
        rows = slice(i * next_n, (i + 1) * next_n)
        s = torch.einsum("jhc,lc->jhl", q[rows].float(), kv) * scale          # [next_n, H, L]
        last = L - next_n + torch.arange(next_n, device=q.device)             # [next_n] last visible
        visible = torch.arange(L, device=q.device)[None, :] <= last[:, None]  # [next_n, L]
        s = s.masked_fill(~visible[:, None, :], float("-inf"))
        lse[rows] = torch.logsumexp(s, dim=-1)
        p = torch.exp(s - lse[rows][..., None])
        o[rows] = torch.einsum("jhl,lr->jhr", p, kv[:, :R])
    o = o.to(q.dtype)
    return (o, lse) if return_lse else o


def validate(q, cache, block_table, seq_lens, scale, kv_lora_rank, next_n=1, return_lse=False):
    checks.tensor(OP, "q", q, ndim=3, dtype=checks.FLOATS)
    paged.check_cache(OP, cache, q.device)
    C = cache.shape[2]
    checks.require(isinstance(kv_lora_rank, int) and 0 < kv_lora_rank <= C, OP,
                   f"kv_lora_rank must be an int in [1, {C}] (cache width), got {kv_lora_rank!r}")
    checks.require(q.shape[2] == C, OP, f"q width {q.shape[2]} != cache width {C} (R + Dr)")
    checks.require(isinstance(next_n, int) and next_n >= 1, OP, f"next_n must be an int >= 1, got {next_n!r}")
    checks.require(q.shape[0] % next_n == 0, OP, f"q rows {q.shape[0]} are not a multiple of next_n {next_n}")
    paged.check_table(OP, block_table, seq_lens, q.device, rows=q.shape[0] // next_n)
    checks.require(isinstance(scale, (int, float)) and scale > 0, OP, f"scale must be a positive number, got {scale!r}")
    checks.require(isinstance(return_lse, bool), OP, f"return_lse must be a bool, got {return_lse!r}")
    if q.device.type == "cpu":   # values are free to read on the host (never a device sync here)
        paged.check_values(OP, cache, block_table, seq_lens, min_len=next_n)


def make_inputs(lens, H, R, Dr, bs, dtype, gen, next_n=1, device="cpu"):
    """(q, cache, block_table, seq_lens) with shuffled blocks; q ~ N(0, 1) / sqrt(R + Dr) so the
    softmax is neither flat nor one-hot."""
    C = R + Dr
    cache, table = paged.random_paged([max(L, 1) for L in lens], bs, C, dtype, gen)
    q = (torch.randn(len(lens) * next_n, H, C, generator=gen) * 2 / C ** 0.5).to(dtype)
    seq = torch.tensor(lens, dtype=torch.int32)
    return tuple(t.to(device) for t in (q, cache, table, seq))


def _case(lens, H, R, Dr, bs, next_n=1, lse=False, dtypes=(torch.float32, torch.bfloat16), tag=""):
    def make(device, dtype, gen):
        q, cache, table, seq = make_inputs(lens, H, R, Dr, bs, dtype, gen, next_n, device)
        return (q, cache, table, seq, (R + Dr) ** -0.5, R), dict(next_n=next_n, return_lse=lse)
    lens_id = "_".join(map(str, lens)) if len(lens) <= 4 else f"{len(lens)}seqs{min(lens)}-{max(lens)}"
    return Case(f"N{len(lens)}-H{H}-R{R}-Dr{Dr}-BS{bs}-L{lens_id}-nn{next_n}{'-lse' if lse else ''}{tag}",
                make, dtypes=dtypes)


def cases():
    g = torch.Generator().manual_seed(7)
    many = torch.randint(1, 20, (64,), generator=g).tolist()
    return [
        _case([1], 4, 32, 16, 16),                                  # first token
        _case([16, 17, 15, 33], 4, 32, 16, 16, lse=True),           # on / one past / short of a block
        _case([63, 0, 65], 3, 48, 16, 16, lse=True),                # padding row, odd H and R
        _case([2, 37, 16], 5, 32, 8, 8, next_n=2, lse=True),        # MTP: causal among the 2
        _case([5, 3], 2, 64, 0, 16, next_n=3),                      # no shared-key part
        _case(many, 2, 16, 16, 16, dtypes=(torch.bfloat16,)),       # B = 64
        _case([40, 1], 4, 32, 16, 64, dtypes=(torch.float16,)),     # block_size 64, fp16
        _case([5, 70], 32, 512, 64, 64, lse=True),                  # Kimi-shaped heads and widths
    ]


def _bytes(args, kwargs):
    q, cache, table, seq, _, R = args
    N = table.shape[0]
    ctx = int(seq[0])   # bench cases: every sequence has the same length
    return N * ctx * cache.shape[2] * cache.element_size() + q.numel() * q.element_size() + \
        q.shape[0] * q.shape[1] * R * q.element_size()


def bench_inputs(B, ctx, device, dtype=torch.bfloat16, H=32, R=512, Dr=64, bs=64, next_n=1):
    nblk = -(-ctx // bs)
    cache = torch.randn(B * nblk, bs, R + Dr, device=device, dtype=dtype)
    table = torch.randperm(B * nblk, device=device, dtype=torch.int32).view(B, nblk)
    q = torch.randn(B * next_n, H, R + Dr, device=device, dtype=dtype) / (R + Dr) ** 0.5
    seq = torch.full((B,), ctx, device=device, dtype=torch.int32)
    return q, cache, table, seq


def bench_cases():
    def make(B, ctx):
        def f(device, dtype, gen):
            return bench_inputs(B, ctx, device, dtype) + ((512 + 64) ** -0.5, 512), {}
        return f
    return [Case(f"B{B}-ctx{ctx}-H32-R512-Dr64-BS64", make(B, ctx), dtypes=(torch.bfloat16,), bytes=_bytes)
            for ctx in (32768, 131072) for B in (1, 8, 64)]


mla_decode = declare(OP, mla_decode_native, validate=validate, cases=cases, bench_cases=bench_cases)


def _triton_supports(q, cache, block_table, seq_lens, scale, kv_lora_rank, next_n=1, return_lse=False):
    if q.dtype != cache.dtype:
        return f"q dtype {q.dtype} != cache dtype {cache.dtype} (one tl.dot operand type)"
    if q.shape[1] * next_n > 256:
        return f"{q.shape[1] * next_n} query rows per sequence (heads x next_n) > 256 (register budget)"
    return None


mla_decode.implementation(
    "triton", ".mla_decode_triton:mla_decode_triton", provider="triton", platforms=GPU_TRITON,
    requires=("triton",), dtypes=(torch.float32, torch.float16, torch.bfloat16), supports=_triton_supports,
    priority=10, doc="split-KV flash decoding: each latent tile loaded once for all heads (tl.dot, heads as M), "
                     "online softmax, lse merge of the splits")
