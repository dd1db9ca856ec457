"""The messages between a front end (AsyncEngine) and the loop that owns the engine
(core_loop.run_loop), on a thread or across a process boundary; each defined once, and packed
for the pipe in one place (`pack` / `unpack`).

    commands  AddRequest | Abort | Exit
    start-up  Ready        the engine process built its engine (info: what the server needs to know)
              StartFailed  it could not (the one-line reason)
    events    Admitted     the engine took (error None) or refused a request
              Outputs      after every step: the outputs, the gauges, the step's (kind, tokens, s)
              Failed       a step raised: those requests were aborted
              Dead         the loop itself died
"""
from __future__ import annotations

from dataclasses import dataclass, fields

from ..engine.outputs import RequestOutput
from ..engine.params import SamplingParams


@dataclass
class AddRequest:
    request_id: str
    prompt_ids: list
    params: SamplingParams


@dataclass
class Abort:
    request_id: str


@dataclass
class Exit:
    pass


@dataclass
class Ready:
    info: dict


@dataclass
class StartFailed:
    message: str


@dataclass
class Admitted:
    request_id: str
    error: str | None


@dataclass
class Outputs:
    outputs: list                  # [RequestOutput]
    running: int
    waiting: int
    cache_usage: float
    step: tuple | None = None      # (kind, tokens, seconds) of the step, or None


@dataclass
class Failed:
    request_ids: list
    message: str


@dataclass
class Dead:
    message: str


_KINDS = {cls.__name__: cls for cls in (AddRequest, Abort, Exit, Ready, StartFailed, Admitted, Outputs, Failed, Dead)}


def _shallow(obj) -> tuple:
    return tuple(getattr(obj, f.name) for f in fields(obj))


def pack(msg) -> tuple:
    """A message as plain tuples (they pickle several times faster than dataclasses)."""
    if isinstance(msg, Outputs):
        return ("Outputs", [_shallow(o) for o in msg.outputs], msg.running, msg.waiting, msg.cache_usage, msg.step)
    return (type(msg).__name__, *_shallow(msg))


def unpack(t: tuple):
    kind, *fields = t
    if kind == "Outputs":
        return Outputs([RequestOutput(*o) for o in fields[0]], *fields[1:])
    return _KINDS[kind](*fields)
