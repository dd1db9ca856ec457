"""A stand-in for engine.Engine with the same interface and no model: each step gives every
running request the token (its last token + 1) % vocab. Knobs make faults on purpose:
`gate` (a threading.Event) holds steps until set; a prompt holding `poison` makes the step
that runs it raise, one holding `die` ends the process (exit code 7); `slots` bounds how many
requests run at once (the rest wait). `build` makes one in an engine process."""
from __future__ import annotations

import os
import threading
import time

from kernelgate.engine.outputs import RequestOutput
from kernelgate.errors import KernelgateError


class FakeEngine:
    def __init__(self, vocab: int = 512, slots: int = 4, poison: int | None = None, die: int | None = None,
                 step_s: float = 0.0):
        self.vocab, self.slots, self.poison, self.die, self.step_s = vocab, slots, poison, die, step_s
        self.gate = threading.Event()
        self.gate.set()
        self.waiting: list = []
        self.running: dict = {}        # id -> [prompt, params, output]
        self.steps = 0
        self.thread_ids: set = set()

    def add_request(self, request_id, prompt_ids, params):
        self.thread_ids.add(threading.get_ident())
        if not prompt_ids or max(prompt_ids) >= self.vocab:
            raise KernelgateError(f"engine: request {request_id}: token ids outside [0, {self.vocab})")
        self.waiting.append((request_id, [list(prompt_ids), params, []]))

    def abort(self, request_id):
        self.running.pop(request_id, None)
        self.waiting = [w for w in self.waiting if w[0] != request_id]

    def has_unfinished(self):
        return bool(self.waiting or self.running)

    @property
    def num_running(self):
        return len(self.running)

    @property
    def num_waiting(self):
        return len(self.waiting)

    @property
    def cache_usage(self):
        return len(self.running) / self.slots

    def step(self):
        self.thread_ids.add(threading.get_ident())
        self.gate.wait()
        while self.waiting and len(self.running) < self.slots:
            rid, st = self.waiting.pop(0)
            self.running[rid] = st
        self.steps += 1
        if self.step_s:
            time.sleep(self.step_s)   # a device step with nothing to compute (bench/e2e/serve_http_path.py)
        if self.poison is not None and any(self.poison in st[0] for st in self.running.values()):
            raise RuntimeError("poisoned batch")
        if self.die is not None and any(self.die in st[0] for st in self.running.values()):
            os._exit(7)
        outs = []
        for rid, (prompt, params, output) in list(self.running.items()):
            tok = ((output or prompt)[-1] + 1) % self.vocab
            output.append(tok)
            reason = ("stop" if tok in params.stop_token_ids else
                      "length" if len(output) >= params.max_new_tokens else None)
            outs.append(RequestOutput(rid, [tok], reason is not None, reason, len(prompt), len(output)))
            if reason:
                del self.running[rid]
        return outs


def build(fail: str | None, kw: dict):
    """An engine process's builder (core_process.EngineProcess): FakeEngine(**kw), or `fail` raised."""
    if fail:
        raise KernelgateError(fail)
    return FakeEngine(**kw), {"pid": os.getpid()}
