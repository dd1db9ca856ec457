"""Inference engine: scheduler (admission, chunked prefill, preemption), block manager, model
runner (cache, graphs, step, sampling), the Engine core and generate(). The batch and cache
types the model reads live in kernelgate.models (re-exported here)."""
from ..models.batch import StepBatch  # noqa: F401
from ..models.cache import KVCache  # noqa: F401
from .block_manager import BlockManager  # noqa: F401
from .engine import Engine, RequestOutput, StepStats  # noqa: F401
from .generate import Result, Timing, generate  # noqa: F401
from .memory import Capacity  # noqa: F401
from .model_runner import ModelRunner  # noqa: F401
from .sampling import SamplingParams  # noqa: F401
from .scheduler import Request, Scheduler  # noqa: F401
