"""The model runner: owns the state pool, the decode graphs and sampling; runs one step.

The scheduler decides which requests run and which of their tokens; the runner turns that
into a `StepBatch`, calls the model (eagerly, or through a captured decode graph) and
samples each sequence's next token. It never decides who runs.
"""
from __future__ import annotations

import torch

from .. import alloc
from ..models.batch import StepBatch
from .graphs import DecodeGraphs, graph_api
from .sampling import sample


class ModelRunner:
    def __init__(self, model, max_slots: int, max_len: int, graphs: bool = True):
        """graphs: decode through captured device graphs where the platform has them
        (engine/graphs.py); the pool then keeps one extra slot as the padding rows' scratch."""
        self.model = model
        api, self.graphs_reason = graph_api(model.device) if graphs else (None, "graphs=False")
        self.pool = model.new_pool(max_slots + (api is not None), max_len)
        self.graphs = DecodeGraphs(model, self.pool, self.pool.reserve()) if api is not None else None

    def execute(self, reqs: list, inputs: list, starts: list, decode: bool) -> list[int]:
        """Feed inputs[i] (token ids) to request i at positions starts[i]..; -> one sampled token each."""
        flat = [t for x in inputs for t in x]
        logits = None
        if decode and self.graphs is not None:
            logits = self.graphs.run(flat, [r.slot for r in reqs], starts)   # None: decode eagerly
        if logits is None:
            device = self.model.device
            batch = StepBatch.build([len(x) for x in inputs], [r.slot for r in reqs], starts, device)
            batch.decode = decode
            tokens = alloc.upload(torch.tensor(flat, dtype=torch.long), device)
            logits = self.model.step(tokens, batch, self.pool)                # [N, V] fp32
        return sample(logits, [r.params for r in reqs], [r.generator for r in reqs])
