"""Process groups for tensor / expert parallel: the backend is the platform layer's declaration.

Two groups per job, as in vLLM: the model's collectives (all-reduce, all-gather) on the
platform's backend (nccl / xccl / hccl; gloo on the CPU), and the driver's commands on a Gloo
group over host memory (no device round trip). Rendezvous through a TCPStore that the driver
(rank 0) hosts.

Timeouts: a model collective waits at most KERNELGATE_DIST_TIMEOUT seconds (default 300) for
its peers -- a rank stuck or out of step ends the job instead of hanging it (Gloo raises; NCCL's
watchdog aborts the communicator). Idle workers wait for the driver's next command without
limit (the command group), so a server may sit idle for days.

Commands: a decode or prefill step (the hot path) goes as int32 words in one fixed-size
tensor broadcast (a second one only for a step that does not fit); anything else as a
pickled object after a header that says so. What the words mean is the executor's business
(StepPlan.to_words / from_words).
"""
from __future__ import annotations

import array
import os
from datetime import timedelta

import torch
import torch.distributed as dist

from .. import envs, platform
from ..models.parallel import Parallel
from ..errors import KernelgateError

# idle workers wait for the driver's next command as long as it likes: no timeout that bites
COMMAND_TIMEOUT = timedelta(days=7)
HEAD = 4096                  # int32 words per command broadcast: [kind, payload length, payload...]
OBJECT, STEP = 0, 1


def collective_timeout() -> timedelta:
    """KERNELGATE_DIST_TIMEOUT: seconds a model collective may wait for its peers."""
    return timedelta(seconds=envs.get("KERNELGATE_DIST_TIMEOUT"))


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


def nccl_env() -> None:
    """NCCL settings every rank starts with (a user's own values win)."""
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")     # NVLink multicast stays off
    # NCCL's cuMem buffers cost 1-2 GiB per device with all-reduce inside CUDA graphs (NCCL issue
    # 1234; vLLM sets the same); they only matter for multi-node NVLink
    os.environ.setdefault("NCCL_CUMEM_ENABLE", "0")


def frame(op: str, arg) -> list:
    """The words a command is broadcast as: [kind, payload length, payload...]; a "step"'s
    argument is its int words (the executor's StepPlan.to_words)."""
    words = [STEP, 0, *arg] if op == "step" else [OBJECT, 0]
    words[1] = len(words) - 2
    return words


def remainder(head: list) -> int:
    """Words still to come after the first HEAD."""
    return max(0, head[1] + 2 - HEAD)


def unframe(words: list) -> list:
    return words[2:2 + words[1]]


class Groups:
    """This process's membership: `model` (the platform backend) and `cpu` (gloo commands)."""

    def __init__(self, rank: int, size: int, store, local_rank: int):
        name, _ = backend()
        nccl_env()
        timeout = collective_timeout()
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
        dist.init_process_group(name, rank=rank, world_size=size, timeout=timeout, **kw)
        self.timeout_s = timeout.total_seconds()
        self.model = dist.group.WORLD
        # a group of its own even on the CPU: idle waits must not run into the model's timeout
        self.cpu = dist.new_group(backend="gloo", timeout=COMMAND_TIMEOUT)
        self._head = torch.zeros(HEAD, dtype=torch.int32)
        self.graph_state = (0, "no runner yet")   # (decode graph shapes captured, why none / off)

    def parallel(self, expert_parallel: bool) -> Parallel:
        return Parallel(self.rank, self.size, expert_parallel, self.model)

    # ---- commands (driver: command; workers: next_command)
    def command(self, op: str, arg=None) -> None:
        """Rank 0: every rank's next_command() returns (op, arg)."""
        words = frame(op, arg)
        # (via array: torch.tensor(list) is 4x slower, ~270 us for a B=64 step at 2k context)
        packed = torch.frombuffer(array.array("i", words), dtype=torch.int32)
        head = self._head
        n = min(len(words), HEAD)
        head[:n] = packed[:n]
        dist.broadcast(head, 0, group=self.cpu)
        if len(words) > HEAD:
            dist.broadcast(packed[HEAD:].clone(), 0, group=self.cpu)
        if op != "step":
            self.broadcast((op, arg))

    def next_command(self) -> tuple:
        head = self._head
        dist.broadcast(head, 0, group=self.cpu)
        n = int(head[1]) + 2
        words = head[:min(n, HEAD)].tolist()
        rest = remainder(words)
        if rest:
            tail = torch.empty(rest, dtype=torch.int32)
            dist.broadcast(tail, 0, group=self.cpu)
            words += tail.tolist()
        return self.broadcast() if words[0] == OBJECT else ("step", unframe(words))

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

    def abort(self) -> None:
        """Tear the groups down after a fault: a device backend's pending collectives are
        aborted rather than waited for (their peers are gone)."""
        torch.set_num_threads(self._threads)
        if not dist.is_initialized():
            return
        abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
        if self.backend == "nccl" and abort is not None:
            abort()
        else:
            dist.destroy_process_group()
