"""Cache sizing (executor/memory.py) on a stand-in accelerator: after the weights and the
measured activation peak of one step at the token budget, what gpu_memory_utilization leaves
goes to state slots and MLA blocks; too little is one clear error. Hand-computed numbers."""
import pytest

from kernelgate import KernelgateError
from kernelgate.config import EngineConfig
from kernelgate.executor import memory
from kernelgate.models import build, tiny
from kernelgate.models.cache import block_bytes, slot_bytes

MiB = 1 << 20


class FakeDevice:
    """torch.cuda-like memory API: `allocated` bytes live, the profile step peaks `act` above."""

    def __init__(self, total, allocated, act, outside=0):
        self.total, self.allocated, self.act, self.outside = total, allocated, act, outside
        self.peak = allocated

    def synchronize(self):
        pass

    def empty_cache(self):
        pass

    def reset_peak_memory_stats(self):
        self.peak = self.allocated

    def memory_allocated(self):
        return self.allocated

    def memory_reserved(self):
        return self.allocated

    def max_memory_allocated(self):
        return self.peak

    def mem_get_info(self):
        return self.total - self.allocated - self.outside, self.total


@pytest.fixture(scope="module")
def model():
    return build(tiny(vocab_size=64), seed=0)


def test_blocks_from_what_utilisation_leaves(model, monkeypatch):
    dev = FakeDevice(total=4000 * MiB, allocated=100 * MiB, act=50 * MiB, outside=30 * MiB)

    def profile():                 # the budget step: a 2 MiB temporary cache, peak 50 MiB above it
        dev.peak = dev.allocated + 2 * MiB + dev.act
        return 2 * MiB
    monkeypatch.setattr(memory, "_accel", lambda device: dev)
    cfg = EngineConfig(max_num_seqs=4, max_model_len=256, max_num_batched_tokens=512, gpu_memory_utilization=0.5,
                       block_size=16)
    cap = memory.plan(model, cfg, profile=profile, graphs=True)
    bb, sb = block_bytes(model.config, 16, model.dtype), slot_bytes(model.config, model.dtype)
    left = int(4000 * MiB * 0.5) - 30 * MiB - 100 * MiB - 50 * MiB - memory.GRAPH_RESERVE \
        - (5 + cfg.num_snapshots) * sb - bb      # scratch slot and the prefix cache's snapshots included
    assert cfg.num_snapshots == 2 * 4 + 4 and cap.num_snapshots == cfg.num_snapshots
    assert cap.activation_bytes == 50 * MiB and cap.num_slots == 4
    assert cap.num_blocks == left // bb and cap.cache_tokens == cap.num_blocks * 16
    assert "gpu_memory_utilization 0.5" in cap.report()
    pinned = memory.plan(model, cfg.replace(num_cache_blocks=7), profile, True)
    assert pinned.num_blocks == 7 and pinned.source == "num_cache_blocks"


def test_too_little_memory_is_one_clear_error(model, monkeypatch):
    dev = FakeDevice(total=1000 * MiB, allocated=900 * MiB, act=0)
    monkeypatch.setattr(memory, "_accel", lambda device: dev)
    with pytest.raises(KernelgateError, match="gpu_memory_utilization 0.9 leaves room for 0 cache blocks.*"
                                              "one max_model_len 256 sequence needs 16") as e:
        memory.plan(model, EngineConfig(max_num_seqs=4, max_model_len=256, max_num_batched_tokens=512,
                                        block_size=16), lambda: 0, True)
    assert "\n" not in str(e.value)


def test_cpu_default_holds_every_sequence_at_full_length(model):
    cap = memory.plan(model, EngineConfig(max_num_seqs=3, max_model_len=100, max_num_batched_tokens=512,
                                          block_size=16), lambda: 0, False)
    assert cap.num_blocks == 3 * 7 and cap.activation_bytes is None and cap.max_concurrent_full_length == 3.36
