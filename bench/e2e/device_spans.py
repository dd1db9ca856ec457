"""Device time of each engine step, from CUDA events around the runner's model step: what a step
costs the GPU, unlike the host interval between two reads (Timing.steps), which under async
scheduling holds whatever the host waited for -- several queued steps, or none.

    spans = DeviceSpans(engine)      # before the steps to measure
    ...                              # generate(..., engine=engine) / engine.step()
    spans.table()                    # [(kind, tokens, ms)], kind prefill | mixed | decode
"""
from __future__ import annotations

import torch


class DeviceSpans:
    def __init__(self, engine):
        runner = engine.runner
        self.steps = []
        run = runner.run

        def timed(plan, tokens=None):
            decodes = sum(n == 1 and s > 0 for n, s in zip(plan.lengths, plan.starts))
            kind = "decode" if decodes == len(plan.lengths) else "mixed" if decodes else "prefill"
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            out = run(plan, tokens)
            b.record()
            self.steps.append((kind, sum(plan.lengths), a, b))
            return out
        runner.run = timed

    def table(self) -> list:
        torch.cuda.synchronize()
        return [(kind, n, a.elapsed_time(b)) for kind, n, a, b in self.steps]
