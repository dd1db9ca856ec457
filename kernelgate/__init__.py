"""kernelgate: one registry of kernel declarations for hybrid linear-attention LLMs, with a
parity suite and a small runtime on top. `kernelgate.ops.<name>(...)` dispatches an op."""
from . import kernel_cache

kernel_cache.configure()   # before anything compiles: kernels persist between runs

from . import platform, registry  # noqa: F401,E402
from .platform import KernelgateError  # noqa: F401,E402
from .registry import force, forcing  # noqa: F401,E402

__version__ = "0.1.0"


def load_model(path, device=None, dtype=None, tensor_parallel_size: int = 1, enable_expert_parallel: bool = False):
    """Load a Kimi Linear checkpoint folder (safetensors + config.json) -> model. Parameters are
    allocated once in their final dtype on `device`; tensors stream from the files into them.
    With tensor_parallel_size N > 1: N processes (this one is rank 0) each read only their shard
    -> a kernelgate.distributed.ParallelModel, which generate() / Engine run sharded."""
    if tensor_parallel_size != 1 or enable_expert_parallel:
        if device is not None:
            raise KernelgateError("load_model: device is chosen per rank with tensor_parallel_size (one device each)")
        from .distributed import ParallelModel
        return ParallelModel(path, tensor_parallel_size, enable_expert_parallel, dtype=dtype)
    from .models.loader import load_model as _load
    return _load(path, device=device, dtype=dtype)


def generate(model, prompts, **kwargs):
    """Generate for prompts with continuous batching, chunked prefill and a paged cache; the
    engine knobs (max_num_seqs, max_model_len, max_num_batched_tokens, gpu_memory_utilization,
    block_size, num_cache_blocks) are keyword arguments; see kernelgate.engine.generate."""
    from .engine.generate import generate as _generate
    return _generate(model, prompts, **kwargs)
