"""Inference engine: scheduler, model runner, sampling, the Engine core and generate().
The batch and cache types the model reads live in kernelgate.models (re-exported here)."""
from ..models.batch import StepBatch  # noqa: F401
from ..models.cache import StatePool  # noqa: F401
from .generate import Result, Timing, generate  # noqa: F401
from .model_runner import ModelRunner  # noqa: F401
from .sampling import SamplingParams  # noqa: F401
from .scheduler import Request, Scheduler  # noqa: F401
