"""Models built from registry ops: Kimi Linear (KDA + MLA + MoE), its config, the streaming
checkpoint loader, and the batch / cache types the layers read (the engine fills them)."""
from .batch import StepBatch  # noqa: F401
from .cache import KVCache  # noqa: F401
from .config import KimiLinearConfig, real_width, tiny  # noqa: F401
from .kimi_linear import KimiLinearForCausalLM, build  # noqa: F401
from .loader import load_model  # noqa: F401
