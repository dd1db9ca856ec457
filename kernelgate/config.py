"""`EngineConfig`: every engine knob, its default, its check and its flag, written once.

The names and meanings are vLLM's. `Engine`, `generate()`, the CLI (`run`, `serve`, `warmup`
build their flags from the fields) and the tensor-parallel ranks all take this one object.

    cfg = EngineConfig(max_num_seqs=64, max_model_len=32768)
    cfg = cfg.replace(gpu_memory_utilization=0.8)      # checked again
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from .checks import require_bool, require_int, require_number
from .errors import KernelgateError


def _knob(default, help: str, *, flag: bool = True, lo=None, hi=None, lo_open: bool = False):
    """A field with its CLI help and bounds (checked by EngineConfig.__post_init__)."""
    return field(default=default, metadata={"help": help, "flag": flag, "lo": lo, "hi": hi, "lo_open": lo_open})


@dataclass(frozen=True)
class EngineConfig:
    max_num_seqs: int = _knob(16, "sequences in flight at once (state slots)", lo=1)
    max_model_len: int = _knob(4096, "longest prompt + output, in tokens", lo=2)
    max_num_batched_tokens: int = _knob(8192, "tokens per engine step (a long prompt prefills in chunks of this)", lo=1)
    decode_tokens_in_budget: bool = _knob(False, "decodes count against max_num_batched_tokens (vLLM's policy: a "
                                                 "prompt's chunks take what the decodes leave); off (default): "
                                                 "the chunks get the whole budget and a step's decodes ride on top "
                                                 "(SGLang's mixed chunks): chunks keep the budget's length beside "
                                                 "running streams, steps grow by up to max_num_seqs tokens")
    gpu_memory_utilization: float = _knob(0.9, "share of device memory the engine may use (weights, activations, "
                                               "caches), in (0, 1]", lo=0.0, hi=1.0, lo_open=True)
    block_size: int = _knob(64, "paged attention cache block size, in tokens", lo=1)
    num_cache_blocks: int | None = _knob(None, "pin the number of attention cache blocks (instead of sizing them "
                                               "from gpu_memory_utilization)", lo=1)
    graphs: bool = _knob(True, "decode through captured device graphs where the device has them "
                               "(KERNELGATE_GRAPHS=0 also turns them off)", flag=False)
    async_scheduling: bool = _knob(True, "queue each step before reading the previous step's tokens "
                                         "(outputs arrive one step later; the tokens are the same)", flag=False)
    scheduler_delay_factor: float = _knob(0.0, "while requests run, admit waiting prompts once the oldest has "
                                               "waited this many times the last admitting step (0: at once)",
                                          lo=0.0, hi=1000.0)
    enable_prefix_caching: bool = _knob(True, "reuse cached prompt prefixes across requests (exact: attention "
                                              "blocks shared, linear-attention states restored from snapshots)")
    prefix_snapshots: int | None = _knob(None, "state snapshots the prefix cache may hold (each one sequence's "
                                               "recurrent + conv states; default 2 x max_num_seqs + 4)", lo=1)
    tensor_parallel_size: int = _knob(1, "run the model sharded over N processes, one device each", lo=1)
    enable_expert_parallel: bool = _knob(False, "with tensor_parallel_size N: each rank holds E/N routed experts "
                                                "instead of a slice of every expert")

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v, m = getattr(self, f.name), f.metadata
            if f.type == "bool":
                require_bool("engine", f.name, v)
            elif v is None and f.default is None:
                continue
            elif f.type.startswith("int"):
                require_int("engine", f.name, v, lo=m["lo"], hi=m["hi"])
            else:
                require_number("engine", f.name, v, lo=m["lo"], hi=m["hi"], lo_open=m["lo_open"])

    @property
    def num_snapshots(self) -> int:
        """Rows of the snapshot pool (0 without prefix caching)."""
        if not self.enable_prefix_caching:
            return 0
        return self.prefix_snapshots if self.prefix_snapshots is not None else 2 * self.max_num_seqs + 4

    @property
    def max_step_tokens(self) -> int:
        """The most tokens one step can hold: the budget, plus a decode per sequence where the
        decodes ride on top of it (the memory profile's step and the largest padded step)."""
        return self.max_num_batched_tokens + (0 if self.decode_tokens_in_budget else self.max_num_seqs)

    def replace(self, **changes) -> EngineConfig:
        unknown = sorted(set(changes) - set(names()))
        if unknown:
            raise KernelgateError(f"engine: unknown setting(s) {', '.join(unknown)} (known: {', '.join(names())})")
        return dataclasses.replace(self, **changes)

    @classmethod
    def of(cls, config: EngineConfig | None = None, **changes) -> EngineConfig:
        """`config` (default: the defaults) with `changes` applied; None values leave a field as it is."""
        return (config or cls()).replace(**{k: v for k, v in changes.items() if v is not None})


def names() -> list[str]:
    return [f.name for f in dataclasses.fields(EngineConfig)]


def knobs():
    """The fields with their metadata (the CLI builds its engine flags from them)."""
    return dataclasses.fields(EngineConfig)
