"""What the engine gives back: a request's new tokens per step, and what each step ran."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list            # tokens this request gained in this step (may be empty)
    finished: bool
    finish_reason: str | None      # "stop" | "length" | "abort" | "error" once finished
    prompt_len: int
    num_output_tokens: int
    error: str | None = None       # why, when finish_reason == "error"
    logprobs: list | None = None   # TokenLogprobs per new token, when the request asked for them
    num_cached_tokens: int = 0     # prompt tokens served from the prefix cache (none recomputed)


@dataclass
class StepStats:
    kind: str                      # "prefill" | "decode" | "mixed" (prefill chunks and decodes)
    tokens: int                    # tokens fed to the model
    seqs: int
    prefill_tokens: int = 0
    decode_tokens: int = 0
    preempted: int = 0             # requests sent back to the queue in this step
