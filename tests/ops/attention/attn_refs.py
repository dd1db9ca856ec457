"""Independent references for the paged attention tests: dense per-sequence keys and values
written into a paged cache with the test's own index arithmetic, and softmax attention computed
from the dense (unpaged) tensors in float64, KV heads repeated per query head."""
import math

import torch

NAN_FILL = float("nan")


class Problem:
    """Keys and values of N sequences in paged caches, and chunks of queries ending each one.

    Cache slots no sequence uses are NaN and unused table entries are out-of-range ids, so an
    implementation that reads past a sequence (or its table row) shows it in its output."""

    def __init__(self, lens, chunks, Hq, Hkv, D, bs, dtype, seed=0, pad_id=10**6):
        g = torch.Generator().manual_seed(seed)
        self.lens, self.chunks = list(lens), list(chunks)
        self.Hq, self.Hkv, self.D, self.bs, self.dtype = Hq, Hkv, D, bs, dtype
        N = len(lens)
        per = [math.ceil(L / bs) for L in lens]
        width = max(per + [1]) + 1                                    # one spare column per row
        nb = sum(per) + 2
        ids = torch.randperm(nb, generator=g).tolist()
        self.k_cache = torch.full((nb, bs, Hkv, D), NAN_FILL, dtype=dtype)
        self.v_cache = torch.full((nb, bs, Hkv, D), NAN_FILL, dtype=dtype)
        self.table = torch.full((N, width), pad_id, dtype=torch.int32)
        self.keys, self.values = [], []
        for i, L in enumerate(lens):
            k = torch.randn(L, Hkv, D, generator=g).to(dtype)
            v = torch.randn(L, Hkv, D, generator=g).to(dtype)
            self.keys.append(k.double())
            self.values.append(v.double())
            for b in range(per[i]):                                   # logical block b -> a random one
                self.table[i, b] = ids.pop()
                self.k_cache[self.table[i, b], :k[b * bs:(b + 1) * bs].shape[0]] = k[b * bs:(b + 1) * bs]
                self.v_cache[self.table[i, b], :v[b * bs:(b + 1) * bs].shape[0]] = v[b * bs:(b + 1) * bs]
        self.q = (torch.randn(sum(chunks), Hq, D, generator=g) * 2 / math.sqrt(D)).to(dtype)
        self.scale = D ** -0.5
        self.seq_lens = torch.tensor(lens, dtype=torch.int32)
        self.cu = torch.tensor([0] + torch.tensor(chunks, dtype=torch.int64).cumsum(0).tolist(), dtype=torch.int32)

    def reference(self):
        """o [T, Hq, D] float64: token j of an n-token chunk ending at L sees positions 0..L-n+j."""
        G = self.Hq // self.Hkv
        out = torch.zeros(sum(self.chunks), self.Hq, self.D, dtype=torch.float64)
        t = 0
        for i, (L, n) in enumerate(zip(self.lens, self.chunks)):
            if L == 0:                                                # a padding row: zeros
                t += n
                continue
            k = self.keys[i].repeat_interleave(G, dim=1)              # [L, Hq, D]
            v = self.values[i].repeat_interleave(G, dim=1)
            q = self.q[t:t + n].double()                              # [n, Hq, D]
            s = torch.einsum("nhd,lhd->hnl", q, k) * self.scale
            pos = L - n + torch.arange(n)
            s = s.masked_fill(torch.arange(L)[None, :] > pos[:, None], float("-inf"))
            out[t:t + n] = torch.einsum("hnl,lhd->nhd", torch.softmax(s, dim=-1), v)
            t += n
        return out


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()
