"""Attention over a long context in pieces (`mla_prefill`, `paged_attention_prefill` through
torch's kernels): each piece gives its output o and the log-sum-exp of its scores per query, and
`LseSum` folds them into one softmax over all the keys, in fp32, in place.

Why in place: at a 128k prompt's chunk (Kimi, 8,192 queries x 32 heads x 128 values) the running
sum is 134 MB of fp32 per piece, so each pass over it is ~70 µs on the H200; folding a piece with
temporaries (o.float(), acc * a_old, po * a_new, their sum, the copy back) made ~10 such passes,
~15 % of a 128k prefill's kernel time (bench/RESULTS.md, Session 23). Here a piece costs two: the
sum scaled in place, then the piece's o (in its own dtype) added with its weight."""
from __future__ import annotations

import torch


class LseSum:
    """sum_i exp(lse_i - m) o_i / sum_i exp(lse_i - m) over pieces i, per (head, query).

    `add(o [H, m, D], lse [H, m], first)` folds in a piece seen by queries first..first + m - 1
    (a causal piece of the chunk is seen only by the queries from its start on; the first piece
    added is seen by all of them); `finish(out)`
    writes the result into `out` [n, H, D] (the op's output rows, in their dtype)."""

    def __init__(self, H: int, n: int, D: int, device):
        self.acc = torch.empty(H, n, D, dtype=torch.float32, device=device)
        self.mx = torch.empty(H, n, dtype=torch.float32, device=device)
        self.den = torch.empty(H, n, dtype=torch.float32, device=device)
        self.started = False

    def add(self, o: torch.Tensor, lse: torch.Tensor, first: int = 0) -> None:
        if not self.started:   # the first piece (a prefix piece, or the chunk's first) is copied: no zero pass
            assert first == 0, "LseSum: the first piece must be seen by every query"
            self.started = True
            self.acc.copy_(o)
            self.mx.copy_(lse)
            self.den.fill_(1.0)
            return
        mx = self.mx[:, first:]
        m_new = torch.maximum(mx, lse)
        a_old, a_new = (mx - m_new).exp_(), (lse - m_new).exp_()
        self.acc[:, first:].mul_(a_old[..., None]).addcmul_(o, a_new[..., None])
        self.den[:, first:].mul_(a_old).add_(a_new)
        mx.copy_(m_new)

    def finish(self, out: torch.Tensor) -> torch.Tensor:
        out.copy_(self.acc.div_(self.den[..., None]).transpose(0, 1))
        return out
