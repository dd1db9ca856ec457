"""kernelgate: one registry of kernel declarations for hybrid linear-attention LLMs, with a
parity suite and a small runtime on top. `kernelgate.ops.<name>(...)` dispatches an op."""
from . import platform, registry  # noqa: F401
from .platform import KernelgateError  # noqa: F401
from .registry import force, forcing  # noqa: F401

__version__ = "0.1.0"
