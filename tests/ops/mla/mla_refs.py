"""Independent MLA references for the tests: a paged cache written with the test's own index
arithmetic, and attention expanded per head (explicit keys and values) in float64."""
import math

import torch

NAN_FILL = float("nan")


class Problem:
    """Latents of N sequences in a paged cache, per-head W_uk / W_uv, and queries.

    Cache slots no sequence uses are NaN and unused table entries are out-of-range ids, so an
    implementation that reads past a sequence (or its table row) shows it in its output."""

    def __init__(self, lens, chunks, H, R, Dr, Dn, Dv, bs, dtype, seed=0, pad_id=10**6):
        g = torch.Generator().manual_seed(seed)
        self.lens, self.chunks = list(lens), list(chunks)
        self.H, self.R, self.Dr, self.Dn, self.Dv, self.bs = H, R, Dr, Dn, Dv, bs
        N, C = len(lens), R + Dr
        per = [math.ceil(L / bs) for L in lens]
        width = max(per + [1]) + 1                                    # one spare column per row
        nb = sum(per) + 2
        ids = torch.randperm(nb, generator=g).tolist()
        self.cache = torch.full((nb, bs, C), NAN_FILL, dtype=dtype)
        self.table = torch.full((N, width), pad_id, dtype=torch.int32)
        self.latents = []
        for i, L in enumerate(lens):
            lat = torch.randn(L, C, generator=g).to(dtype)
            self.latents.append(lat.double())
            for b in range(per[i]):                                   # logical block b -> a random one
                self.table[i, b] = ids.pop()
                rows = lat[b * bs:(b + 1) * bs]
                self.cache[self.table[i, b], :rows.shape[0]] = rows
        self.w_uk = torch.randn(H, Dn, R, generator=g).double() / math.sqrt(R)
        self.w_uv = torch.randn(H, Dv, R, generator=g).double() / math.sqrt(R)
        T = sum(chunks)
        self.q_nope = torch.randn(T, H, Dn, generator=g).double()
        self.q_rope = torch.randn(T, H, Dr, generator=g).double()
        self.scale = (Dn + Dr) ** -0.5
        self.seq_lens = torch.tensor(lens, dtype=torch.int32)
        self.cu = torch.tensor([0] + list(torch.tensor(chunks, dtype=torch.int64).cumsum(0).tolist()), dtype=torch.int32)

    def expanded(self, w_uk=None, w_uv=None):
        """o [T, H, Dv] float64: softmax over explicit per-head keys [W_uk c, k_r] of values W_uv c."""
        w_uk = self.w_uk if w_uk is None else w_uk
        w_uv = self.w_uv if w_uv is None else w_uv
        out = torch.zeros(sum(self.chunks), self.H, self.Dv, dtype=torch.float64)
        t = 0
        for i, (L, n) in enumerate(zip(self.lens, self.chunks)):
            if L == 0:                                                # a padding row: zeros
                t += n
                continue
            lat = self.latents[i]
            c, k_r = lat[:, :self.R], lat[:, self.R:]
            k = torch.cat([torch.einsum("lr,hdr->hld", c, w_uk),
                           k_r[None].expand(self.H, L, self.Dr)], dim=2)     # [H, L, Dn + Dr]
            v = torch.einsum("lr,hvr->hlv", c, w_uv)                          # [H, L, Dv]
            for j in range(n):
                pos = L - n + j                                               # this token's position
                qj = torch.cat([self.q_nope[t + j], self.q_rope[t + j]], dim=1)  # [H, Dn + Dr]
                s = torch.einsum("hld,hd->hl", k[:, :pos + 1], qj) * self.scale
                out[t + j] = torch.einsum("hl,hlv->hv", torch.softmax(s, dim=1), v[:, :pos + 1])
            t += n
        return out

    def absorbed_q(self, dtype):
        """[T, H, R + Dr]: q_nope through W_uk (in float64), then the shared-key part."""
        q_lat = torch.einsum("thd,hdr->thr", self.q_nope, self.w_uk)
        return torch.cat([q_lat, self.q_rope], dim=-1).to(dtype)

    def w_kv(self, dtype):
        return torch.cat([self.w_uk, self.w_uv], dim=1).to(dtype)   # [H, Dn + Dv, R]


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()
