"""Exact prefix caching for a hybrid model: reuse a cached prompt prefix across requests.

An attention layer's cache is per token, so its blocks could be shared block by block; a
linear-attention layer (KDA / GDN) keeps one recurrent + conv state per sequence that summarises
the whole prefix, so a prefix can be skipped only where that state was saved. A *snapshot* is
both: the state slots' contents after exactly `length` tokens (a row of the cache's snapshot
pool) and references to the attention blocks holding positions 0..length-1 (the full ones
shared as they are, the partial last one copied into a fresh block on restore, since the new
request writes the rest of it).

Snapshots are taken (`take`)
- at the end of every prompt, and at every other prefill chunk boundary (so a long shared
  document resumes near its end);
- at the last block boundary of a prompt of 4 blocks or more that found nothing cached (a hit
  must leave one token to compute, so the prompt sent again, or the next question after the same
  system prompt, resumes there, not at its start). Each point splits a chunk (a step more for a
  prompt that is not cached at all); no others are added before a long prompt's end: a later
  prompt that diverges there resumes at the last chunk end, and its remaining tokens fit one step;
- where a new prompt diverges from what is cached (the longest run of full blocks it shares
  with some snapshot's tokens, found by their chained hashes): its prefill chunk ends there, so
  the next prompt sharing that prefix resumes exactly at it (a shared system prompt);
- when a request finishes (stop, length, abort), over every token its state consumed: turn N+1
  of a conversation resumes at the end of turn N.
Granularity is one block (64 tokens by default) -- vLLM's hybrid "align" mode reuses only at
multiples of 1,920 tokens -- bounded by the snapshot pool (`prefix_snapshots`), evicted least
recently used; a snapshot holds its blocks, and the blocks' LRU is the snapshots'.

Never a wrong hit: a snapshot records the exact tokens it summarises (length, a blake2b digest;
the chained 64-bit hashes only index) and the model it belongs to; a restore recomputes the
digest of the request's tokens and refuses a mismatch. A snapshot used by this step's restores
is pinned until the step is planned, so it is neither evicted nor overwritten before it is read;
every block it refers to holds a reference, so no request is handed one of them.
The device work (save a slot into the pool, restore it, copy a partial block) travels in the
step's `CacheOps` (executor/plan.py), in stream order with the step.
"""
from __future__ import annotations

import hashlib
import logging
from array import array
from collections import OrderedDict
from dataclasses import dataclass

from ..executor.plan import CacheOps
from .block_manager import BlockManager

log = logging.getLogger("kernelgate.engine")

ROOT = 0x6B67                                  # the chained hash of no blocks


def digest(tokens) -> bytes:
    return hashlib.blake2b(array("q", tokens).tobytes(), digest_size=16).digest()


@dataclass
class Snapshot:
    index: int                     # row of the cache's snapshot pool
    length: int                    # it summarises tokens[0:length]
    digest: bytes                  # of those tokens
    key: int                       # chained hash of its full blocks (length // block_size of them)
    tail: tuple                    # tokens[length // bs * bs:length], the partial block's
    hashes: list                   # chained hashes of its full blocks, 1..length // bs
    blocks: list                   # cache blocks of positions 0..length-1 (references held)
    model: tuple                   # the model it belongs to
    pinned: bool = False           # read by a restore planned in this step


@dataclass
class Hit:
    snapshot: Snapshot | None      # the longest usable snapshot, or None
    diverge: int                   # longest run of cached full blocks shared with the tokens, in tokens


class PrefixCache:
    def __init__(self, blocks: BlockManager, num_snapshots: int, model_key: tuple):
        self.blocks, self.bs, self.model = blocks, blocks.block_size, model_key
        blocks.evict = self.evict_blocks
        self.num_snapshots = num_snapshots
        self._free = list(range(num_snapshots - 1, -1, -1))
        self._lru: OrderedDict[int, Snapshot] = OrderedDict()       # index -> snapshot, oldest first
        self._by_key: dict[int, list] = {}
        self._prefixes: dict[int, int] = {}                         # chained hash -> snapshots covering it
        self._ops = CacheOps()
        self._deferred: list = []                                   # (request, length, slot, blocks) that ended
        self.queries = self.hits = 0                                # in tokens (vLLM's counters)
        self.evictions = 0

    # ---- hashing
    def hashes(self, req, upto: int) -> list:
        """Chained hashes of the request's full blocks within its first `upto` tokens (cached on
        the request): element j covers blocks 0..j."""
        hs = req.block_hashes
        n = upto // self.bs
        while len(hs) < n:
            j = len(hs)
            hs.append(hash((hs[-1] if hs else ROOT, tuple(req.tokens(j * self.bs, (j + 1) * self.bs)))))
        return hs[:n]

    # ---- lookup and restore
    def lookup(self, req) -> Hit:
        """The longest snapshot of a prefix of the request's tokens, leaving at least one token to
        compute (the step must produce logits), and how far its tokens run along cached blocks."""
        limit = req.known_tokens - 1
        hs = self.hashes(req, limit)
        shared = next((j for j in range(len(hs), 0, -1) if hs[j - 1] in self._prefixes), 0)
        diverge = shared * self.bs + self._common_tail(req, shared, limit)
        for j in range(len(hs), -1, -1):
            cands = self._by_key.get(hs[j - 1] if j else ROOT, ())
            best = None
            for s in cands:
                if s.length <= limit and (best is None or s.length > best.length) \
                        and tuple(req.tokens(j * self.bs, s.length)) == s.tail:
                    best = s
            if best is not None:
                if self.verify(best, req):
                    return Hit(best, diverge)
                log.error("kernelgate: prefix cache: snapshot %d (%d tokens) matched by hash but not by its "
                          "recorded tokens or model; refused (request %s)", best.index, best.length, req.request_id)
                return Hit(None, diverge)
        return Hit(None, diverge)

    def _common_tail(self, req, j: int, limit: int) -> int:
        """How many tokens after the request's first j blocks agree with the partial block of
        some snapshot of exactly those j full blocks (the divergence point within the block)."""
        cands = self._by_key.get(self.hashes(req, j * self.bs)[-1] if j else ROOT, ())
        if not cands:
            return 0
        mine = req.tokens(j * self.bs, min(limit, (j + 1) * self.bs))
        best = 0
        for s in cands:
            n = 0
            for a, b in zip(mine, s.tail):
                if a != b:
                    break
                n += 1
            best = max(best, n)
        return best

    def verify(self, s: Snapshot, req) -> bool:
        """Whether `s` summarises exactly the request's first s.length tokens, on this model."""
        return s.model == self.model and s.length <= req.num_tokens and digest(req.tokens(0, s.length)) == s.digest

    def attach(self, req, s: Snapshot) -> None:
        """`req` (joining, no blocks yet) shares the full blocks of `s`; `s` is pinned until this
        step is planned (neither evicted nor overwritten before its restore reads it). The
        caller then grows the blocks (the partial block's copy, the new tokens') and, once the
        request has a slot, calls `restore`."""
        req.blocks = list(s.blocks[:s.length // self.bs])
        self.blocks.share(req.blocks)
        s.pinned = True

    def restore(self, req, s: Snapshot) -> None:
        """Plan the device work that gives `req` (attached, blocks grown, a slot taken) the state
        of `s`: restore the slot, copy the partial block's positions into its own block."""
        full, rows = divmod(s.length, self.bs)
        if rows:
            self._ops.copies.append((s.blocks[full], req.blocks[full], rows))
        self._ops.restores.append((s.index, req.slot))
        self._lru.move_to_end(s.index)
        req.num_computed = s.length

    # ---- taking snapshots
    def take(self, req, length: int, slot: int | None = None, blocks: list | None = None) -> None:
        """Snapshot the request's slot, which holds its state after `length` tokens once the steps
        launched so far have run: saved before the next step (before its zeroing may hand the
        slot to someone else, before its model may advance the state). A request that ended
        gives its former slot and blocks."""
        slot = req.slot if slot is None else slot
        blocks = req.blocks if blocks is None else blocks
        if length < 1 or slot is None or length > len(blocks) * self.bs:
            return
        tokens = req.tokens(0, length)
        hs = self.hashes(req, length)
        key = hs[-1] if hs else ROOT
        tail = tuple(tokens[len(hs) * self.bs:])
        for s in self._by_key.get(key, ()):
            if s.length == length and s.tail == tail:
                self._lru.move_to_end(s.index)       # already cached (the same tokens): keep that one
                return
        if not self._free and not self._evict_one():
            return
        idx = self._free.pop()
        blocks = blocks[:-(-length // self.bs)]
        self.blocks.share(blocks, cache=True)
        s = Snapshot(idx, length, digest(tokens), key, tail, list(hs), list(blocks), self.model)
        self._lru[idx] = s
        self._by_key.setdefault(key, []).append(s)
        for h in hs:
            self._prefixes[h] = self._prefixes.get(h, 0) + 1
        self._ops.saves.append((slot, idx))

    # ---- eviction
    def _evict_one(self) -> bool:
        for idx, s in self._lru.items():             # oldest first
            if not s.pinned:
                self._drop(s)
                return True
        return False

    def evict_blocks(self, n: int) -> None:
        """Evict least recently used snapshots until `n` blocks are free (or none is left)."""
        want = self.blocks.free_blocks + n
        while self.blocks.free_blocks < want and self._evict_one():
            pass

    def _drop(self, s: Snapshot) -> None:
        self.evictions += 1
        del self._lru[s.index]
        same = self._by_key[s.key]
        same.remove(s)
        if not same:
            del self._by_key[s.key]
        for h in s.hashes:
            left = self._prefixes[h] - 1
            if left:
                self._prefixes[h] = left
            else:
                del self._prefixes[h]
        self.blocks.release(s.blocks, cache=True)
        ops = self._ops                              # its save was never run: nothing to write now
        ops.saves = [p for p in ops.saves if p[1] != s.index]
        self._free.append(s.index)

    def clear(self) -> None:
        """Drop every snapshot (their blocks go back)."""
        for s in list(self._lru.values()):
            s.pinned = False
            self._drop(s)

    # ---- the step
    def take_ops(self) -> CacheOps:
        """The device work planned since the last call (for the step about to launch)."""
        ops, self._ops = self._ops, CacheOps()
        for s in self._lru.values():
            s.pinned = False
        return ops

    # ---- finished requests
    def defer(self, req, length: int) -> None:
        """A request ends with its state after `length` tokens in its slot: hold its blocks now
        (they are released next), snapshot it at `settle` -- within this engine step, once a
        token it consumed but the host has not read yet is known."""
        if length < 1 or req.slot is None or length > len(req.blocks) * self.bs:
            return
        blocks = req.blocks[:-(-length // self.bs)]
        self.blocks.share(blocks, cache=True)
        self._deferred.append((req, length, req.slot, blocks))

    def settle(self) -> None:
        """Snapshot the requests that ended (before the next step: its zeroing may hand their
        slots to others)."""
        deferred, self._deferred = self._deferred, []
        for req, length, slot, blocks in deferred:
            if None not in req.output[:max(length - len(req.prompt), 0)]:    # (its prompt is known)
                self.take(req, length, slot=slot, blocks=blocks)
            self.blocks.release(blocks, cache=True)

    @property
    def size(self) -> int:
        return len(self._lru)


def snapshot_points(prompt_len: int, start: int, diverge: int, bs: int) -> list:
    """Chunk ends that get a snapshot, besides every chunk end within the prompt: the divergence
    point; for a prompt of 4 blocks or more that found nothing cached, its last block boundary (a
    hit must leave a token to compute: the same prompt sent again resumes there)."""
    pts = set()
    if start < diverge < prompt_len:
        pts.add(diverge)
    if start == 0 and prompt_len >= 4 * bs:         # (a request that resumed has its snapshots already)
        pts.add((prompt_len - 1) // bs * bs)
    return sorted(p for p in pts if start < p < prompt_len)
