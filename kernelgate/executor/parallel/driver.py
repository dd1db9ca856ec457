"""The driver's handle of a sharded model, and the runner that drives every rank.

`ParallelModel` stands where a model does (config, tokenizer, device, `model(token_ids)`):
rank 0 -- this process -- holds its own shard and tells the other ranks what to run. An
`Engine` given one builds a `DriverRunner` on every rank in lockstep (each rank profiles and
sizes its cache; they agree on the smallest block count); each step the driver's scheduler
decides, `DriverRunner.run` broadcasts the step's plan (tokens, lengths, slots, starts,
block tables, slots / blocks to zero: int words, one tensor broadcast), every rank runs the
same step on its shard (the same captured decode graph where the device has graphs), and
the driver samples from the gathered logits. Any failure once the ranks are inside a step
ends the group with an error naming the rank (launch.Workers.lockstep).
"""
from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from ...config import EngineConfig
from ...distributed import launch
from ...errors import KernelgateError
from ...models import quant
from ...models.loader import (
    _dtype,
    load_model,
    load_tokenizer,
    read_config,
    save_checkpoint,
)
from ...models.parallel import check_config
from ..plan import StepPlan
from .rank_runner import RankRunner
from .worker import Worker

RANK_MODULE = "kernelgate.executor.parallel"     # what a spawned rank runs (worker.main)


def _serve(groups) -> None:
    """A torchrun rank > 0: follow rank 0's commands."""
    Worker(groups).serve()


class DriverRunner(RankRunner):
    """Rank 0's runner: each step's metadata goes to every rank before the shared step."""

    feeds_back = False    # the ranks get host token ids: a step cannot take the last one's unread tokens

    def __init__(self, owner: ParallelModel, config: EngineConfig):
        self.owner = owner
        super().__init__(owner.workers.groups, owner.shard, config)

    @property
    def alive(self) -> bool:
        return self.owner.shard is not None and not self.owner.workers.closed

    def run(self, plan: StepPlan, tokens: torch.Tensor | None = None) -> torch.Tensor:
        w = self.owner.live()
        try:
            w.groups.command("step", plan.to_words())
        except Exception as e:  # noqa: BLE001 - a rank is gone: name it
            raise w.failure(e) from None
        with w.lockstep("a step"):
            return super().run(plan)


class ParallelModel:
    """A model (either family) sharded over `size` processes (tensor parallel; expert parallel for
    the routed experts when `expert_parallel`). source: a checkpoint folder, or a model in this
    process (written once to a temporary checkpoint that every rank reads its slices of)."""

    def __init__(self, source, size: int, expert_parallel: bool = False, dtype=None, quantization=None):
        self._tmp = None
        launch.check_world_size(size)
        if isinstance(source, (str, Path)):
            folder = Path(source)
            if not folder.is_dir():
                raise KernelgateError(f"load_model: {source} is not a folder")
            config = read_config(folder)[1]
            tokenizer = None
        else:
            config, tokenizer = source.config, getattr(source, "tokenizer", None)
        if not isinstance(source, (str, Path)):
            self._tmp = tempfile.TemporaryDirectory(prefix="kernelgate-tp-")
            folder = save_checkpoint(source, self._tmp.name)
            dtype = dtype or source.dtype
        check_config(config, size, expert_parallel)       # before any process starts
        dt = _dtype(dtype, config)
        self.size, self.expert_parallel, self.config = size, expert_parallel, config
        self.workers = w = launch.workers(size, RANK_MODULE, _serve)
        if w.owner is not None and w.owner is not self:
            w.owner._detach()
        w.owner = self
        quant.scheme(quantization, "load_model")     # before any rank loads
        arg = {"path": str(folder), "dtype": dt, "expert_parallel": expert_parallel, "quantization": quantization}
        self.shard = None
        w.groups.graph_state = (0, "no runner yet")
        try:
            w.groups.command("load", arg)
            err = None
            try:
                self.shard = load_model(folder, device=w.groups.device, dtype=dt,
                                        par=w.groups.parallel(expert_parallel), quantization=quantization)
            except Exception as e:  # noqa: BLE001 - the other ranks still gather
                err = e
            errs = w.groups.gather(None if err is None else str(err))
        except Exception as e:  # noqa: BLE001
            raise w.failure(e) from None
        if err is not None:
            raise err
        bad = [(r, m) for r, m in enumerate(errs) if m is not None and r != 0]
        if bad:
            raise KernelgateError(f"tensor parallel: rank {bad[0][0]} of {size}: {launch.one_line(bad[0][1])}")
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(folder)

    # ---- model-like surface
    @property
    def device(self) -> torch.device:
        """rank 0's device (also after a fault: an engine's cleanup asks for it)."""
        if self.shard is None:
            self.live()
        return self.shard.device

    @property
    def dtype(self) -> torch.dtype:
        return self.shard.dtype

    @property
    def tp_size(self) -> int:
        return self.size

    def live(self):
        if self.shard is None:
            raise KernelgateError("tensor parallel: this model's ranks now hold another model (or were closed)")
        if self.workers.closed:
            raise KernelgateError("tensor parallel: the worker ranks are gone "
                                  + (f"({self.workers.message()})" if self.workers.failed else "(closed)"))
        return self.workers

    def _detach(self) -> None:
        self.shard = None

    @torch.inference_mode()
    def __call__(self, token_ids: torch.Tensor) -> torch.Tensor:
        """token_ids [B, T] -> logits [B, T, V] (gathered over the vocab-parallel ranks)."""
        w = self.live()
        token_ids = torch.as_tensor(token_ids).cpu()
        V = self.config.vocab_size
        if token_ids.numel() and (int(token_ids.min()) < 0 or int(token_ids.max()) >= V):
            # each rank masks the ids outside its vocabulary rows: out of range would read as zeros
            raise KernelgateError(f"ParallelModel: token ids must be in [0, {V}), got "
                                  f"[{int(token_ids.min())}, {int(token_ids.max())}]")
        try:
            w.groups.command("forward", token_ids)
        except Exception as e:  # noqa: BLE001
            raise w.failure(e) from None
        with w.lockstep("a forward"):
            return self.shard(token_ids)

    def make_runner(self, config: EngineConfig) -> DriverRunner:
        """A runner with `config` on every rank (they profile together), one block count for all."""
        w = self.live()
        try:
            w.groups.command("runner", config)
        except Exception as e:  # noqa: BLE001
            raise w.failure(e) from None
        err, runner = None, None
        with w.lockstep("the runner's profile step"):
            try:
                runner = DriverRunner(self, config)
            except Exception as e:  # outside the profile step: the other ranks still gather
                if getattr(e, "kernelgate_midstep", False):
                    raise
                err = e
        try:
            errs = w.groups.gather(None if err is None else str(err))
            if err is None and not any(errs):
                runner.reconcile()
        except Exception as e:  # noqa: BLE001
            raise w.failure(e) from None
        if err is not None:
            raise err
        bad = [(r, m) for r, m in enumerate(errs) if m is not None]
        if bad:
            raise KernelgateError(f"tensor parallel: rank {bad[0][0]} of {self.size}: {launch.one_line(bad[0][1])}")
        return runner

    def rank_stats(self) -> list:
        """Per rank: {device, peak_bytes, allocated_bytes} of device memory (None on the CPU) and
        {graphs, graphs_off}: decode graph shapes captured by the last engine's runner, or why none."""
        from .worker import device_stats
        w = self.live()
        try:
            w.groups.command("stats")
            return w.groups.gather(device_stats(w.groups))
        except Exception as e:  # noqa: BLE001
            raise w.failure(e) from None

    def close(self) -> None:
        """Stop the worker ranks."""
        if self.shard is not None:
            self.shard = None
            self.workers.close()


def parallelize(model, tensor_parallel_size: int = 1, enable_expert_parallel: bool = False):
    """`model` as a ParallelModel of tensor_parallel_size ranks (a ParallelModel passes through;
    reused while it still holds its ranks)."""
    if isinstance(model, ParallelModel):
        if tensor_parallel_size not in (1, model.size) or (enable_expert_parallel and not model.expert_parallel):
            raise KernelgateError(f"tensor_parallel_size {tensor_parallel_size} / enable_expert_parallel "
                                  f"{enable_expert_parallel}: the model is already split over {model.size} ranks "
                                  f"(expert parallel {model.expert_parallel})")
        return model
    cached = getattr(model, "_kernelgate_parallel", None)
    if cached is not None and cached.shard is not None and not cached.workers.closed \
            and (cached.size, cached.expert_parallel) == (tensor_parallel_size, enable_expert_parallel):
        return cached
    pm = ParallelModel(model, tensor_parallel_size, enable_expert_parallel)
    if not isinstance(model, (str, Path)):
        model._kernelgate_parallel = pm
    return pm
