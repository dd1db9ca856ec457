"""The greedy token of each row of a step's logits, and whether the row can be sampled at all.

    greedy_tokens(logits[N, V]) -> int64 [N]: the index of each row's first maximum, or -1 where the row
                                   holds a NaN or an infinity (the engine ends that request with an error)

The executor takes an all-greedy step's tokens from this op, and a sampled row's finiteness from its -1
(executor/sampling.py). In torch it is six launches after a step's device graph (max with its indices,
amin, two isfinite, and, where: ~25 µs a step over Kimi's 163,840 logits, Session 31's profile); the
Triton implementation is one (bench/RESULTS.md, Session 34: Kimi FP8 batch 1 +1.5 %).
"""
from __future__ import annotations

import torch

from ... import checks
from ...registry import GPU_TRITON, Case, declare

OP = "greedy_tokens"


def greedy_tokens_native(logits):
    """torch.max's first maximum per row; -1 where the row's max or min is not finite (max propagates NaN)."""
    top, idx = logits.max(dim=-1)
    finite = torch.isfinite(top) & torch.isfinite(logits.amin(dim=-1))
    return torch.where(finite, idx, -1)


def validate(logits):
    checks.tensor(OP, "logits", logits, ndim=2, dtype=checks.FLOATS)
    checks.require(logits.shape[1] > 0, OP, "logits must have at least one column (the vocabulary)")


def _case(N, V, special=()):
    """Rows of random logits with a tie for the maximum planted in each (the first must win); `special`:
    (row, column, value) written over them (NaN, +-inf)."""
    def make(device, dtype, gen):
        x = torch.randn(N, V, generator=gen)
        best = x.max().item() + 1.0
        for n in range(N):
            cols = torch.randperm(V, generator=gen)[:2].sort().values
            x[n, cols] = best                                   # two equal maxima: the lower index wins
        for n, v, val in special:
            x[n, v] = val
        return (x.to(device=device, dtype=dtype),), {}
    return Case(f"N{N}-V{V}" + ("-special" if special else ""), make, dtypes=(torch.float32, torch.bfloat16))


def cases():
    nan, inf = float("nan"), float("inf")
    return [_case(1, 7), _case(1, 163840), _case(3, 10000), _case(5, 8193, ((1, 8192, nan), (2, 0, inf),
                                                                            (3, 4000, -inf)))]


def bench_cases():
    def make(N):
        def f(device, dtype, gen):
            return (torch.randn(N, 163840, device=device, dtype=dtype),), {}
        return f
    return [Case(f"N{n}-V163840", make(n), dtypes=(torch.float32,), bytes=lambda a, k: a[0].numel() * 4)
            for n in (1, 64)]


greedy_tokens = declare(OP, greedy_tokens_native, validate=validate, cases=cases, bench_cases=bench_cases)
greedy_tokens.implementation(
    "triton", ".greedy_tokens_triton:greedy_tokens_triton", provider="triton", platforms=GPU_TRITON,
    requires=("triton",), priority=10, doc="one launch: blocks of a row, the row's last program reduces them")
