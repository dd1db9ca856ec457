"""Models built from registry ops: Kimi Linear (KDA + MLA + MoE)."""
from .config import KimiLinearConfig, real_width, tiny  # noqa: F401
from .kimi_linear import KimiLinearForCausalLM, build  # noqa: F401
from .loader import load_model  # noqa: F401
