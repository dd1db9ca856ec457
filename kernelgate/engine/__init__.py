"""The request core: what runs when. `Engine` (requests in, outputs out), the scheduler
(admission, chunked prefill, preemption), the block manager (who owns which cache block and
state slot), request checks and sampling parameters. It runs steps through the executor
(kernelgate.executor) and is driven by the serving layer (kernelgate.serving)."""
from .block_manager import BlockManager  # noqa: F401
from .engine import Engine  # noqa: F401
from .outputs import RequestOutput, StepStats  # noqa: F401
from .params import SamplingParams  # noqa: F401
from .scheduler import Request, Scheduler  # noqa: F401
