"""`kernelgate serve`: the OpenAI-compatible HTTP server (kernelgate.server) on uvicorn.

    kernelgate serve                               # the built-in model on 127.0.0.1:8000
    kernelgate serve --model DIR --dtype bfloat16 --max-num-seqs 64 --api-key KEY

SIGINT / SIGTERM: stop accepting connections, let running requests finish for up to
--shutdown-timeout seconds, abort the rest, exit with rc 0.
"""
from __future__ import annotations

import logging
import signal
import sys

from ..platform import KernelgateError
from . import args as flags


def add_parser(sub, common) -> None:
    p = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    common(p)
    flags.add_model_args(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=flags.int_at_least(0), default=8000)
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1/* "
                                     "(default: $KERNELGATE_API_KEY, else none)")
    p.add_argument("--served-model-name", help="the model name clients send (default: the folder name, "
                                               "or kernelgate-builtin)")
    p.add_argument("--max-queued-requests", type=flags.int_at_least(0), default=1024,
                   help="requests allowed to wait for a slot; more answer 503 (default 1024)")
    p.add_argument("--shutdown-timeout", type=flags.float_in(0.0, 3600.0), default=10.0,
                   help="seconds running requests get to finish on SIGINT / SIGTERM (default 10)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    flags.add_engine_args(p, max_num_seqs_default=16)
    p.set_defaults(fn=main)


def main(args) -> int:
    import os
    from pathlib import Path

    import uvicorn

    from ..engine.async_engine import AsyncEngine
    from ..engine.engine import Engine
    from ..engine.warmup import warm_up
    from ..server.app import create_app
    from ..server.jobs import ModelInfo
    from ..server.metrics import Metrics
    from .model import BUILTIN, load
    flags.check_env()
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    model, source = load(args)
    kw = flags.engine_kwargs(args)
    engine = Engine(model, **kw)
    warm_up(engine, log=lambda m: print(f"kernelgate serve: {m}", file=sys.stderr, flush=True))
    name = args.served_model_name or (Path(args.model).resolve().name if args.model else BUILTIN)
    metrics = Metrics(name)
    aengine = AsyncEngine(engine, max_queued=args.max_queued_requests, observer=metrics).start()
    info = ModelInfo(name, model.tokenizer, args.max_model_len, model.config.vocab_size,
                     list(model.config.eos_token_ids))
    api_key = args.api_key or os.environ.get("KERNELGATE_API_KEY") or None
    app = create_app(aengine, info, metrics, api_key=api_key, shutdown_timeout=1.0)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=args.shutdown_timeout, lifespan="on")
    server = uvicorn.Server(config)
    # uvicorn re-raises the signal that stopped it once it is done; a handled signal is a clean exit
    got = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda s, f: got.append(s))
    print(f"kernelgate serve: {source} as {name!r} on http://{args.host}:{args.port}/v1 "
          f"(max_model_len {args.max_model_len}, engine {kw})", file=sys.stderr, flush=True)
    server.run()
    if not server.started and not got:
        raise KernelgateError(f"serve: could not start on {args.host}:{args.port} (see the log above)")
    return 0
