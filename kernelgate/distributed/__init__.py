"""Tensor and expert parallel over torch.distributed (backend: the platform layer's declaration).

    model = kernelgate.load_model(path, tensor_parallel_size=2, enable_expert_parallel=True)
    kernelgate.generate(model, prompts)                 # or generate(model, ..., tensor_parallel_size=2)

group.py   process groups (model collectives on nccl / xccl / hccl / gloo; metadata on gloo)
launch.py  worker ranks: spawned here or from torchrun's environment; fault monitor
worker.py  a worker rank's command loop
runner.py  the model runner every rank uses (decode graphs agreed over the ranks, one cache size)
driver.py  ParallelModel (the driver's handle) and the runner that broadcasts each step
The model side (which slice each rank holds, the collectives) is kernelgate/models/parallel.py.
"""
from ..platform import collective_backend, collective_line  # noqa: F401
from .driver import ParallelModel, parallelize  # noqa: F401
from .group import backend  # noqa: F401
