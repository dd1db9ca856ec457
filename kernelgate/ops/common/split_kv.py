"""How many splits a split-KV decode kernel cuts each sequence into (`mla_decode`,
`paged_attention_decode`): programs of (row, split) each stream one split of a sequence's
keys, and a merge kernel combines the splits by log-sum-exp. A row is a sequence (MLA) or a
(sequence, KV head) pair (grouped-query attention); each sequence is cut by its own length, so
a short one's extra splits are empty or a tile: they return without writing, and the merge
reads only the splits before them (live_splits)."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def split_len(L, cap, splits, BLOCK_N: tl.constexpr):
    """-> (L cut to [0, cap], tiles of BLOCK_N positions per split): a split sp of the sequence
    holds positions [sp * per * BLOCK_N, (sp + 1) * per * BLOCK_N) of its L."""
    L = tl.minimum(tl.maximum(L, 0), cap)                          # never past the table row
    return L, tl.cdiv(tl.cdiv(L, BLOCK_N), splits)


@triton.jit
def live_splits(L, cap, splits, BLOCK_N: tl.constexpr):
    """How many of the sequence's splits hold positions: a prefix [0, live) of them (0 when L is 0)."""
    L, per = split_len(L, cap, splits, BLOCK_N)
    return tl.cdiv(tl.cdiv(L, BLOCK_N), tl.maximum(per, 1))


def num_splits(rows: int, max_blocks: int, block_size: int, cfg: dict, split_bytes: int = 0) -> int:
    """Splits per row from the launch choice `cfg`:
    - programs // rows, a whole number of waves when `programs` is one (or a few) per SM;
    - at least enough that a sequence as long as the table (its longest) gives no program more
      than `max_split` positions, as far as the fp32 partials stay within `max_partials` bytes
      (`split_bytes`: one row's partials per split);
    - at least 1, at most one per `min_split` positions of the table.
    Why max_split: a server's decode batch holds a few long contexts among many short ones. From
    programs // rows alone, 64 short streams beside 8 sequences of 32k tokens (128 rows after the
    decode graphs' padding) got one split: one program streamed each 32k context, ~1 ms per MLA
    layer on the H200 (bench/probes/served_mix.py --kernels), where the short ones alone take
    microseconds. Why max_partials: the decode graphs keep their partials in a pool with a fixed
    reserve (executor/memory.py); 256 rows x 32 splits of Kimi's 64 KiB would be 512 MiB."""
    W = max_blocks * block_size
    cap = -(-W // cfg["min_split"])
    longest = -(-W // cfg["max_split"]) if cfg.get("max_split") else 1
    if split_bytes and cfg.get("max_partials"):
        longest = min(longest, max(1, cfg["max_partials"] // (max(rows, 1) * split_bytes)))
    want = max(cfg["programs"] // max(rows, 1), longest)
    return max(1, min(want, cap))
