"""kernelgate: one registry of kernel declarations for hybrid linear-attention LLMs, with a
parity suite and a small runtime on top. `kernelgate.ops.<name>(...)` dispatches an op.

Nothing heavy is imported here (`kernelgate --version` answers without torch): the names
below load their modules on first use.
"""
from .errors import KernelgateError  # noqa: F401
from .version import __version__  # noqa: F401

_LAZY = {
    "force": ("registry", "force"), "forcing": ("registry", "forcing"),
    "EngineConfig": ("config", "EngineConfig"), "Engine": ("engine.engine", "Engine"),
    "SamplingParams": ("engine.params", "SamplingParams"),
    "release": ("serving.generate", "release"),
}
_SUBMODULES = ("platform", "registry", "ops", "models", "engine", "executor", "serving", "server", "distributed",
               "config", "envs", "tools", "text")


def __getattr__(name: str):
    import importlib
    if name in _LAZY:
        module, attr = _LAZY[name]
        value = getattr(importlib.import_module(f"{__name__}.{module}"), attr)
    elif name in _SUBMODULES:
        value = importlib.import_module(f"{__name__}.{name}")
    else:
        raise AttributeError(f"module 'kernelgate' has no attribute {name!r}")
    globals()[name] = value
    return value


def load_model(path, device=None, dtype=None, tensor_parallel_size: int = 1, enable_expert_parallel: bool = False,
               quantization=None):
    """Load a checkpoint folder (safetensors + config.json) -> model; the family from config.json's
    model_type (kimi_linear, qwen3_next, qwen3_5_moe, qwen3_5_moe_text). Parameters are
    allocated once in their final dtype on `device`; tensors stream from the files into them.
    With tensor_parallel_size N > 1: N processes (this one is rank 0) each read only their shard
    -> a ParallelModel, which generate() / Engine run sharded. quantization="fp8": projections and
    experts quantized to 128 x 128 block FP8 as they stream; an FP8 checkpoint loads as published
    (kernelgate/models/quant.py)."""
    if tensor_parallel_size != 1 or enable_expert_parallel:
        if device is not None:
            raise KernelgateError("load_model: device is chosen per rank with tensor_parallel_size (one device each)")
        from .executor.parallel import ParallelModel
        return ParallelModel(path, tensor_parallel_size, enable_expert_parallel, dtype=dtype, quantization=quantization)
    from .models.loader import load_model as _load
    return _load(path, device=device, dtype=dtype, quantization=quantization)


def generate(model, prompts, **kwargs):
    """Generate for prompts with continuous batching, chunked prefill and a paged cache, on an
    engine the model keeps between calls; see kernelgate.serving.generate."""
    from .serving.generate import generate as _generate
    return _generate(model, prompts, **kwargs)
