"""The model runner every rank uses: the engine's ModelRunner, kept in step with the other ranks.

- Decode graphs (where the device has them: CUDA / ROCm): every rank captures the same step
  shape at the same moment (the driver's metadata decides it) and replays it, NCCL
  collectives inside the graph. Whether a new graph is used is agreed over the ranks: if
  any rank's capture failed, all of them decode that shape eagerly from then on, so no rank
  replays while another steps eagerly. Gloo (the CPU) has no graphs: eager, as before.
- Cache size: every rank takes the smallest block count any rank could afford.
- A failure inside the profile step (model collectives on every rank) is marked
  `kernelgate_midstep`: the ranks are out of step, which ends the group (launch.lockstep).
"""
from __future__ import annotations

import dataclasses

from ..graphs import DecodeGraphs
from ..model_runner import ModelRunner


class LockstepGraphs(DecodeGraphs):
    """DecodeGraphs whose use of each newly captured shape all ranks agree on."""

    def __init__(self, groups, *args):
        self.groups = groups
        super().__init__(*args)

    def prepare(self, max_batch: int) -> int:
        """Nothing ahead of time: the ranks capture each shape together when a step first meets it."""
        return len(self.graphs)

    def agree(self, why):
        whys = self.groups.gather(why)
        bad = [(r, w) for r, w in enumerate(whys) if w is not None]
        if not bad:
            self.groups.graph_state = (len(self.graphs) + 1, None)
            return None
        r, w = next(((r, w) for r, w in bad if r == self.groups.rank), bad[0])
        why = w if r == self.groups.rank else f"rank {r}: {w}"
        self.groups.graph_state = (0, why)
        return why


class RankRunner(ModelRunner):
    def __init__(self, groups, model, config):
        self.groups = groups
        super().__init__(model, config)
        self.groups.graph_state = (0, self.graphs_reason)

    def _new_graphs(self) -> DecodeGraphs:
        return LockstepGraphs(self.groups, self.model, self.cache, self.scratch, self.config.max_model_len)

    def _profile(self, tokens: int) -> int:
        try:
            return super()._profile(tokens)
        except BaseException as e:
            e.kernelgate_midstep = True     # the other ranks may still be inside its collectives
            raise

    def reconcile(self) -> None:
        """Every rank takes the smallest cache block count any rank could afford."""
        counts = self.groups.gather(self.capacity.num_blocks)
        least = min(counts)
        if self.capacity.num_blocks == least:
            return
        cap = dataclasses.replace(self.capacity, num_blocks=least, source=self.capacity.source + ", least over ranks")
        self.capacity = cap
        self._make_cache()
        self.groups.graph_state = (0, self.graphs_reason)
