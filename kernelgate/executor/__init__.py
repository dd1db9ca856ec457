"""The executor: runs a scheduled step on one rank or N.

model_runner.py  the cache, the step, sampling (one process)
graphs.py        captured decode steps
memory.py        how many cache blocks and state slots fit (the capacity report)
sampling.py      next-token sampling and logprobs
plan.py          the step's messages: StepPlan, Launched, StepResult
parallel/        tensor / expert parallel: the driver's ParallelModel and its runner, the ranks'
                 runner and command loop (process groups and launch: kernelgate/distributed)

`make_runner(model, config)` is the one entry the engine uses: a plain model gets a
ModelRunner; tensor_parallel_size > 1 (or a ParallelModel) gets the driver's runner, which
drives every rank.
"""
from __future__ import annotations

from ..config import EngineConfig
from .model_runner import ModelRunner


def make_runner(model, config: EngineConfig):
    if config.tensor_parallel_size != 1 or config.enable_expert_parallel or hasattr(model, "make_runner"):
        from .parallel import parallelize
        model = parallelize(model, config.tensor_parallel_size, config.enable_expert_parallel)
        return model.make_runner(config)
    return ModelRunner(model, config)
