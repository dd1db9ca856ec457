"""Tensor and expert parallel over torch.distributed (backend: the platform layer's declaration).

    model = kernelgate.load_model(path, tensor_parallel_size=2, enable_expert_parallel=True)
    kernelgate.generate(model, prompts)                 # or generate(model, ..., tensor_parallel_size=2)

driver.py       ParallelModel (the driver's handle of a sharded model) and the runner that sends
                each step to every rank
rank_runner.py  the model runner every rank uses (decode graphs agreed over the ranks, one cache size)
worker.py       a worker rank's command loop (`python -m kernelgate.executor.parallel`)
Process groups, the command channel and launching the ranks: kernelgate/distributed. The model
side (which slice each rank holds, the collectives): kernelgate/models/parallel.py.
"""
from .driver import ParallelModel, parallelize  # noqa: F401
