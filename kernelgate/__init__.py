"""kernelgate: one registry of kernel declarations for hybrid linear-attention LLMs, with a
parity suite and a small runtime on top. `kernelgate.ops.<name>(...)` dispatches an op."""
from . import platform, registry  # noqa: F401
from .platform import KernelgateError  # noqa: F401
from .registry import force, forcing  # noqa: F401

__version__ = "0.1.0"


def load_model(path, device=None, dtype=None):
    """Load a Kimi Linear checkpoint folder (safetensors + config.json) -> model."""
    from .models.loader import load_model as _load
    return _load(path, device=device, dtype=dtype)


def generate(model, prompts, **kwargs):
    """Generate for prompts with continuous batching; see kernelgate.engine.generate."""
    from .engine.generate import generate as _generate
    return _generate(model, prompts, **kwargs)
