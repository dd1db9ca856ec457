"""Grouped-query attention decode over the paged K/V cache (layout: `paged.py`).

    paged_attention_decode(q, k_cache, v_cache, block_table, seq_lens, scale, gate=None)
        q            [N, Hq, D]   one query token per sequence (Hq a multiple of Hkv)
        k_cache      [num_blocks, block_size, Hkv, D]
        v_cache      [num_blocks, block_size, Hkv, D]   same shape and dtype as k_cache
        block_table  [N, max_blocks] int32
        seq_lens     [N] int32    cached length INCLUDING the new token (already written)
        scale        float        softmax scale (Qwen3-Next: head_dim ** -0.5)
        gate         [N, Hq, D] in q's dtype, or None: the layer's output gate (Qwen3-Next /
                     Qwen3.5: the gate half of the q projection, a strided view is fine);
                     o = attention * sigmoid(gate), in fp32 before o's one rounding
        -> o [N, Hq, D] in q's dtype

Sequence i's query head h attends to positions 0 .. seq_lens[i] - 1 of KV head h // (Hq // Hkv);
fp32 scores, softmax and accumulation. seq_lens[i] == 0 is a padding row (a captured graph's
spare rows): o = 0, nothing read.

Bad values (a negative length, a length the table is too narrow for, a block id outside
[0, num_blocks) among the blocks a sequence uses): the native reference, any call on CPU tensors
and checked mode (KERNELGATE_CHECKS=1) raise KernelgateError. Device kernels cannot check values
without a host sync (decode runs in captured CUDA graphs); the Triton kernel never reads such a
block or past the table: positions in an out-of-range block are left out of the softmax, lengths
past the table are cut at the table's width, negative lengths count as 0.
"""
from __future__ import annotations

import torch

from ... import checks
from ...registry import GPU_TRITON, Case, declare
from . import paged

OP = "paged_attention_decode"
# query rows x padded head dim a Triton program holds in fp32 registers (o and the q tile)
TRITON_MAX_ROWS_X_DIM = 64 * 256


def paged_attention_decode_native(q, k_cache, v_cache, block_table, seq_lens, scale, gate=None):
    """GQA decode over the paged K/V cache: per sequence, gather, fp32 softmax; o * sigmoid(gate)."""
    paged.check_values(OP, k_cache, block_table, seq_lens)
    N, Hq, D = q.shape
    Hkv = k_cache.shape[2]
    o = torch.zeros(N, Hq, D, dtype=torch.float32, device=q.device)
    for i, L in enumerate(seq_lens.tolist()):
        if L == 0:
            continue
        k = paged.gather(k_cache, block_table[i], L).float()                   # [L, Hkv, D]
        v = paged.gather(v_cache, block_table[i], L).float()
        qi = q[i].float().view(Hkv, Hq // Hkv, D)                              # [Hkv, G, D]
        p = torch.softmax(torch.einsum("kgd,lkd->kgl", qi, k) * scale, dim=-1)  # [Hkv, G, L]
        o[i] = torch.einsum("kgl,lkd->kgd", p, v).reshape(Hq, D)
    if gate is not None:
        o = o * torch.sigmoid(gate.float())
    return o.to(q.dtype)


def validate(q, k_cache, v_cache, block_table, seq_lens, scale, gate=None):
    checks.tensor(OP, "q", q, ndim=3, dtype=checks.FLOATS)
    if gate is not None:
        checks.tensor(OP, "gate", gate, shape=tuple(q.shape), dtype=q.dtype, device=q.device)
    paged.check_kv_cache(OP, k_cache, v_cache, q.device)
    paged.check_heads(OP, q, k_cache)
    paged.check_table(OP, block_table, seq_lens, q.device, rows=q.shape[0])
    checks.require(isinstance(scale, (int, float)) and not isinstance(scale, bool) and scale > 0, OP,
                   f"scale must be a positive number, got {scale!r}")
    if q.device.type == "cpu":   # values are free to read on the host (never a device sync here)
        paged.check_values(OP, k_cache, block_table, seq_lens)


def check_values(q, k_cache, v_cache, block_table, seq_lens, scale, gate=None):
    paged.check_values(OP, k_cache, block_table, seq_lens)


def make_inputs(lens, Hq, Hkv, D, bs, dtype, gen, device="cpu"):
    """(q, k_cache, v_cache, block_table, seq_lens) with shuffled blocks; q ~ N(0, 1) * 2 / sqrt(D)
    so that the softmax is neither flat nor one-hot."""
    k, v, table = paged.random_paged([max(L, 1) for L in lens], bs, Hkv, D, dtype, gen)
    q = (torch.randn(len(lens), Hq, D, generator=gen) * 2 / D ** 0.5).to(dtype)
    seq = torch.tensor(lens, dtype=torch.int32)
    return tuple(t.to(device) for t in (q, k, v, table, seq))


def _case(lens, Hq, Hkv, D, bs, dtypes=(torch.float32, torch.bfloat16), gate=False):
    def make(device, dtype, gen):
        args = make_inputs(lens, Hq, Hkv, D, bs, dtype, gen, device) + (D ** -0.5,)
        if not gate:
            return args, {}
        qg = torch.randn(len(lens), Hq, 2 * D, generator=gen).to(dtype).to(device)   # [q_h | gate_h] per head
        return args, {"gate": qg[..., D:]}                                          # a strided view
    return Case(f"N{len(lens)}-L{'_'.join(map(str, lens))}-Hq{Hq}-Hkv{Hkv}-D{D}-BS{bs}" + ("-gate" if gate else ""),
                make, dtypes=dtypes)


def cases():
    return [
        _case([1], 4, 2, 60, 16),                                   # first token, odd head dim
        _case([16, 17, 63, 0, 65], 8, 2, 128, 16, dtypes=(torch.bfloat16,)),   # block edges, a padding row
        _case([40, 1], 6, 3, 60, 64, dtypes=(torch.float16,)),      # block_size 64, fp16, 2 per group
        _case([5, 130], 16, 2, 256, 64),                            # Qwen3-Next heads; splits on GPUs
        _case([1, 0, 70], 8, 2, 64, 16, gate=True),                 # the output gate (a padding row: 0)
        _case([300], 16, 2, 256, 64, dtypes=(torch.bfloat16,), gate=True),   # gated, split on GPUs
    ]


def _bytes(args, kwargs):
    q, k_cache, _, table, seq, _ = args
    ctx = int(seq[0])   # bench cases: every sequence has the same length
    return 2 * table.shape[0] * ctx * k_cache.shape[2] * k_cache.shape[3] * k_cache.element_size() + \
        2 * q.numel() * q.element_size()


def bench_inputs(B, ctx, device, dtype=torch.bfloat16, Hq=16, Hkv=2, D=256, bs=64):
    nblk = -(-ctx // bs)
    k = torch.randn(B * nblk, bs, Hkv, D, device=device, dtype=dtype)
    v = torch.randn(B * nblk, bs, Hkv, D, device=device, dtype=dtype)
    table = torch.randperm(B * nblk, device=device, dtype=torch.int32).view(B, nblk)
    q = torch.randn(B, Hq, D, device=device, dtype=dtype) / D ** 0.5
    seq = torch.full((B,), ctx, device=device, dtype=torch.int32)
    return q, k, v, table, seq


def bench_cases():
    def make(B, ctx):
        def f(device, dtype, gen):
            return bench_inputs(B, ctx, device, dtype) + (256 ** -0.5,), {}
        return f
    return [Case(f"B{B}-ctx{ctx}-Hq16-Hkv2-D256-BS64", make(B, ctx), dtypes=(torch.bfloat16,), bytes=_bytes)
            for ctx in (4096, 32768, 131072) for B in (1, 8, 64)]


paged_attention_decode = declare(OP, paged_attention_decode_native, validate=validate, check_values=check_values,
                                 cases=cases, bench_cases=bench_cases)


def _triton_supports(q, k_cache, v_cache, block_table, seq_lens, scale, gate=None):
    if q.dtype != k_cache.dtype:
        return f"q dtype {str(q.dtype)[6:]} != cache dtype {str(k_cache.dtype)[6:]} (one tl.dot operand type)"
    G, D = q.shape[1] // k_cache.shape[2], q.shape[2]
    rows, width = max(16, 1 << (G - 1).bit_length()), max(16, 1 << (D - 1).bit_length())
    if rows * width > TRITON_MAX_ROWS_X_DIM:
        return (f"{G} query heads per KV head x head dim {D} (padded {rows} x {width}) > "
                f"{TRITON_MAX_ROWS_X_DIM} fp32 values per program (register budget)")
    return None


paged_attention_decode.implementation(
    "triton", ".paged_attention_decode_triton:paged_attention_decode_triton", provider="triton",
    platforms=GPU_TRITON, requires=("triton",), dtypes=(torch.float32, torch.float16, torch.bfloat16),
    supports=_triton_supports, priority=10,
    doc="split-KV flash decoding: one program per (sequence, KV head, split) holds the group's query heads "
        "(K/V read once per group), online softmax, lse merge of the splits (the output gate applied there)")
