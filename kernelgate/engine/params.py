"""What a request asks of sampling: `SamplingParams`, checked when made (one line naming the
field). Sampling itself runs in the executor (kernelgate/executor/sampling.py)."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..checks import is_int, require_int, require_number
from ..errors import KernelgateError

MAX_LOGPROBS = 20                    # alternatives per token, as vLLM's default max_logprobs


@dataclass
class SamplingParams:
    max_new_tokens: int = 32
    temperature: float = 0.0
    top_k: int = 0                   # 0 = off
    top_p: float = 1.0               # 1.0 = off
    seed: int | None = None
    stop_token_ids: tuple = field(default_factory=tuple)
    logprobs: int | None = None      # None = off; k >= 0: the sampled token's logprob + the top k

    def __post_init__(self):
        w = "generate"
        require_int(w, "max_new_tokens", self.max_new_tokens, lo=1)
        require_number(w, "temperature", self.temperature, lo=0.0)
        require_int(w, "top_k", self.top_k, lo=0)
        if not (isinstance(self.top_p, (int, float)) and not isinstance(self.top_p, bool) and 0.0 < self.top_p <= 1.0):
            raise KernelgateError(f"generate: top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None:
            require_int(w, "seed", self.seed, lo=0, hi=2**64 - 1)
        stops = self.stop_token_ids
        if not isinstance(stops, (list, tuple, set, frozenset)) or not all(is_int(t) for t in stops):
            raise KernelgateError(f"generate: stop_token_ids must be a list of int token ids, got {stops!r}")
        self.stop_token_ids = tuple(int(t) for t in stops)
        if self.logprobs is not None:
            require_int(w, "logprobs", self.logprobs, lo=0, hi=MAX_LOGPROBS)

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0 or self.top_k == 1
