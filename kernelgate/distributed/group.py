"""Process groups for tensor / expert parallel: the backend is the platform layer's declaration.

Two groups per job, as in vLLM: the model's collectives (all-reduce, all-gather) on the
platform's backend (nccl / xccl / hccl; gloo on the CPU), and the driver's step metadata on a
Gloo group over host memory (python objects, no device round trip). Rendezvous through a
TCPStore that the driver (rank 0) hosts.
"""
from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from .. import platform
from ..models.parallel import Parallel
from ..platform import KernelgateError

# idle workers wait for the driver's next command as long as it likes: no timeout that bites
COMMAND_TIMEOUT = timedelta(days=7)


def backend() -> tuple[str, str]:
    """(backend runs use, reason). A simulated platform shows its declaration in doctor, but the
    tensors live on the real device, so runs take the real device's backend."""
    p = platform.current()
    if p.simulated:
        real = platform.COLLECTIVE_BACKENDS[p.real]
        if real[0] != platform.collective_backend(p)[0]:
            return real[0], f"{real[1]} (KERNELGATE_PLATFORM={p.name} is simulated on {p.real})"
    return platform.collective_backend(p)


def device_count() -> int | None:
    """Devices of the real platform's type; None on the CPU (any number of processes)."""
    dev = platform.default_device()
    if dev.type == "cpu":
        return None
    return torch.accelerator.device_count()


def check_world_size(size: int) -> None:
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise KernelgateError(f"tensor_parallel_size must be an int >= 1, got {size!r}")
    n = device_count()
    if n is not None and size > n:
        raise KernelgateError(f"tensor_parallel_size {size} > the {n} {platform.default_device().type} "
                              f"device(s) available (one device per rank)")


def rank_device(local_rank: int) -> torch.device:
    dev = platform.default_device()
    if dev.type == "cpu":
        return dev
    torch.accelerator.set_device_index(local_rank)
    return torch.device(dev.type, local_rank)


class Groups:
    """This process's membership: `model` (the platform backend) and `cpu` (gloo metadata)."""

    def __init__(self, rank: int, size: int, store, local_rank: int):
        name, _ = backend()
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")   # NVLink multicast stays off
        self.rank, self.size, self.backend = rank, size, name
        self.device = rank_device(local_rank)
        self._threads = torch.get_num_threads()
        if self.device.type == "cpu":    # ranks share the host's cores: oversubscribed ranks stall in collectives
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
        kw = {"device_id": self.device} if self.device.type != "cpu" else {}
        if store is None:                # torchrun: its rendezvous (MASTER_ADDR / MASTER_PORT)
            kw["init_method"] = "env://"
        else:
            kw["store"] = store
        dist.init_process_group(name, rank=rank, world_size=size, timeout=COMMAND_TIMEOUT, **kw)
        self.model = dist.group.WORLD
        self.cpu = self.model if name == "gloo" else dist.new_group(backend="gloo", timeout=COMMAND_TIMEOUT)

    def parallel(self, expert_parallel: bool) -> Parallel:
        return Parallel(self.rank, self.size, expert_parallel, self.model)

    def broadcast(self, obj=None):
        """Rank 0 sends obj; every rank returns it."""
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.cpu)
        return box[0]

    def gather(self, obj) -> list:
        out = [None] * self.size
        dist.all_gather_object(out, obj, group=self.cpu)
        return out

    def close(self) -> None:
        torch.set_num_threads(self._threads)
        if dist.is_initialized():
            dist.destroy_process_group()
