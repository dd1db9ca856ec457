"""The Sylvester Hadamard matrix the indexer query transform uses (reference and kernels)."""
from __future__ import annotations

import torch


def sylvester_hadamard(n: int, device=None) -> torch.Tensor:
    """Unnormalised Sylvester Hadamard matrix: H[i, j] = (-1)^popcount(i & j)."""
    h = torch.ones(1, 1, device=device)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h
