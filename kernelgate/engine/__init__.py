"""Inference engine: state pool, continuous-batching scheduler, sampling, generate()."""
from .batch import StepBatch  # noqa: F401
from .generate import Result, Timing, generate  # noqa: F401
from .sampling import SamplingParams  # noqa: F401
from .scheduler import Request, Scheduler  # noqa: F401
from .state import StatePool  # noqa: F401
