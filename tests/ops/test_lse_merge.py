"""LseSum: pieces of keys attended one by one and folded by log-sum-exp equal one softmax over
all the keys (hand-built pieces, fp32 and bf16 piece outputs, a causal tail seen by later queries)."""
import pytest
import torch

from kernelgate.ops.common.lse_merge import LseSum


def _piece(q, k, v, visible):
    """(o, lse) of queries q [H, n, D] over keys k / values v [H, m, D], `visible` [n, m] bool."""
    s = (q @ k.transpose(-1, -2)).masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(s, -1)
    return torch.softmax(s, -1) @ v, lse


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pieces_fold_to_one_softmax(dtype):
    g = torch.Generator().manual_seed(0)
    H, n, D, P = 3, 10, 8, 13                     # 13 prefix keys, then the 10 queries' own (causal)
    q = torch.randn(H, n, D, generator=g, dtype=torch.float64)
    k = torch.randn(H, P + n, D, generator=g, dtype=torch.float64)
    v = torch.randn(H, P + n, D, generator=g, dtype=torch.float64)
    visible = torch.ones(n, P + n, dtype=torch.bool)
    visible[:, P:] = torch.ones(n, n, dtype=torch.bool).tril()
    want, _ = _piece(q, k, v, visible)
    total = LseSum(H, n, D, "cpu")
    for a, b in ((0, 6), (6, P)):                 # two prefix pieces, every query sees them
        o, lse = _piece(q, k[:, a:b], v[:, a:b], visible[:, a:b])
        total.add(o.to(dtype), lse.float())
    for a, b in ((P, P + 4), (P + 4, P + n)):     # the chunk in two causal pieces, from query a - P on
        first = a - P
        o, lse = _piece(q[:, first:], k[:, a:b], v[:, a:b], visible[first:, a:b])
        total.add(o.to(dtype), lse.float(), first)
    out = torch.empty(n, H, D, dtype=torch.float32)
    total.finish(out)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out, want.transpose(0, 1).float(), atol=tol, rtol=tol)
