"""Process groups and worker launch for tensor / expert parallel (backend: the platform layer's
declaration).

group.py   process groups (model collectives on nccl / xccl / hccl / gloo; commands on gloo) and
           the command channel (int words for a step, pickled objects otherwise)
launch.py  worker ranks: spawned here or from torchrun's environment; fault monitor
What runs on the ranks (the driver's model and runner, the workers' command loop) is the
executor's: kernelgate/executor/parallel.
"""
from ..platform import collective_backend, collective_line  # noqa: F401
from .group import backend  # noqa: F401
