"""Prometheus metrics for `GET /metrics`, fed by the async engine's observer hooks.

Names follow vLLM's (`vllm:num_requests_running` -> `kernelgate:num_requests_running`), so
dashboards carry over. Each server owns its registry (tests run several apps in one process).
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from ..serving.async_engine import Observer

_LATENCY = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
            10.0, 20.0, 40.0, 80.0)
_TTFT = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
         20.0, 40.0, 80.0, 160.0, 640.0)
_STEP = (0.0005, 0.001, 0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.03, 0.05, 0.1, 0.25, 0.5,
         1.0, 2.5, 5.0, 10.0)
_E2E = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
        240.0, 480.0, 960.0, 1920.0)


class Metrics(Observer):
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, model_name: str):
        self.registry = r = CollectorRegistry()
        labels = {"model_name": model_name}
        lbl = list(labels)

        def gauge(name, doc):
            return Gauge(f"kernelgate:{name}", doc, lbl, registry=r).labels(**labels)

        def hist(name, doc, buckets):
            return Histogram(f"kernelgate:{name}", doc, lbl, buckets=buckets, registry=r).labels(**labels)

        self.running = gauge("num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("num_requests_waiting", "Requests waiting for a slot.")
        self.cache = gauge("cache_usage_perc", "Share of the state / latent cache in use (1 = full).")
        self.ttft = hist("time_to_first_token_seconds", "Arrival to first token.", _TTFT)
        self.itl = hist("inter_token_latency_seconds", "Time between a request's tokens.", _LATENCY)
        self.e2e = hist("e2e_request_latency_seconds", "Arrival to the last token.", _E2E)
        self.prompt_tokens = Counter("kernelgate:prompt_tokens", "Prompt tokens prefilled.", lbl,
                                     registry=r).labels(**labels)
        self.generation_tokens = Counter("kernelgate:generation_tokens", "Tokens generated.", lbl,
                                         registry=r).labels(**labels)
        self.prefix_queries = Counter("kernelgate:prefix_cache_queries", "Prompt tokens looked up in the prefix "
                                      "cache.", lbl, registry=r).labels(**labels)
        self.prefix_hits = Counter("kernelgate:prefix_cache_hits", "Prompt tokens served from the prefix cache "
                                   "(not recomputed).", lbl, registry=r).labels(**labels)
        self.finished = Counter("kernelgate:request_success", "Finished requests by finish reason.",
                                [*lbl, "finished_reason"], registry=r)
        self.step_seconds = Histogram("kernelgate:engine_step_seconds", "Engine steps by kind "
                                      "(prefill, decode, mixed: prefill chunks and decodes together).",
                                      [*lbl, "kind"], buckets=_STEP, registry=r)
        self.step_tokens = Counter("kernelgate:engine_step_tokens", "Tokens fed to the model, by step kind.",
                                   [*lbl, "kind"], registry=r)
        self._labels = labels

    # Observer hooks (engine thread)
    def on_step(self, running: int, waiting: int, cache_usage: float, step=None) -> None:
        self.running.set(running)
        self.waiting.set(waiting)
        self.cache.set(cache_usage)
        if step is not None:
            kind, tokens, secs = step
            self.step_seconds.labels(**self._labels, kind=kind).observe(secs)
            self.step_tokens.labels(**self._labels, kind=kind).inc(tokens)

    def on_first_token(self, seconds: float, prompt_tokens: int, cached_tokens: int = 0) -> None:
        self.ttft.observe(seconds)
        self.prompt_tokens.inc(prompt_tokens)
        self.prefix_queries.inc(prompt_tokens)
        self.prefix_hits.inc(cached_tokens)
        self.generation_tokens.inc()

    def on_tokens(self, n: int, seconds_per_token: float) -> None:
        for _ in range(n):
            self.itl.observe(seconds_per_token)
        self.generation_tokens.inc(n)

    def on_finish(self, e2e_seconds: float, reason: str) -> None:
        self.e2e.observe(e2e_seconds)
        self.finished.labels(**self._labels, finished_reason=reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
