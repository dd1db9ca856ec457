"""Models built from registry ops: Kimi Linear (KDA + MLA + MoE) and the Gated DeltaNet hybrids
(Qwen3-Next, Qwen3.5-MoE text: GDN + gated attention + MoE), their configs, the streaming
checkpoint loader, and the batch / cache types the layers read (the engine fills them)."""
from .batch import StepBatch  # noqa: F401
from .cache import KVCache, LayerCache  # noqa: F401
from .config import KimiLinearConfig, real_width, tiny  # noqa: F401
from .kimi_linear import KimiLinearForCausalLM, build  # noqa: F401
from .loader import load_model  # noqa: F401
from .qwen3_next import Qwen3NextForCausalLM  # noqa: F401
from .qwen3_next_config import Qwen3NextConfig  # noqa: F401
