"""`kernelgate serve`: the OpenAI-compatible HTTP server (kernelgate.server) on uvicorn.

    kernelgate serve                               # the built-in model on 127.0.0.1:8000
    kernelgate serve --model DIR --dtype bfloat16 --max-num-seqs 64 --api-key KEY

The engine runs in a process of its own (engine/core_process.py; --no-engine-process: on a
thread of the server). SIGINT / SIGTERM: stop accepting connections, let running requests finish for up to
--shutdown-timeout seconds, abort the rest, exit with rc 0.

The listening socket is bound first, before the model loads: a port in use or a host that
does not resolve is one line and rc 2 at once, as is any other failure to start.
"""
from __future__ import annotations

import argparse
import logging
import signal
import sys

from .. import envs
from ..errors import KernelgateError
from . import args as flags


def add_parser(sub, common) -> None:
    p = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    common(p)
    flags.add_model_args(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=flags.int_in(1, 65535), default=8000)
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1/* "
                                     "(default: $KERNELGATE_API_KEY, else none)")
    p.add_argument("--served-model-name", help="the model name clients send (default: the folder name, "
                                               "or kernelgate-builtin)")
    p.add_argument("--max-queued-requests", type=flags.int_at_least(1), default=1024,
                   help="engine requests allowed to wait for a slot (each prompt x n choice of an HTTP request "
                        "counts); a request that would pass it answers 429 (default 1024)")
    p.add_argument("--shutdown-timeout", type=flags.float_in(0.0, 3600.0), default=10.0,
                   help="seconds running requests get to finish on SIGINT / SIGTERM (default 10)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True,
                   help="run the engine in a process of its own, apart from the HTTP server's Python work "
                        "(default; --no-engine-process: on a thread of the server)")
    flags.add_engine_args(p)
    p.set_defaults(fn=main)


def _server(config, aengine, timeout: float):
    """uvicorn's server whose first SIGINT / SIGTERM also starts the engine's drain: running
    requests get --shutdown-timeout seconds to finish, the rest are aborted (their streams end
    with finish_reason "abort" and [DONE]); uvicorn meanwhile stops accepting connections and
    waits for the open ones to end. (uvicorn alone would cancel the open streams mid-message at
    its timeout, and the engine would hear of the shutdown only after that.)"""
    import asyncio

    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            if not self.should_exit:
                loop = asyncio.get_running_loop()
                loop.call_soon_threadsafe(lambda: loop.create_task(aengine.shutdown(timeout)))
            super().handle_exit(sig, frame)
    return Server(config)


def build_engine(args):
    """The engine `serve` runs, built and warmed up (in the engine process unless
    --no-engine-process); -> (engine, what the server needs to know of the model)."""
    import torch

    from ..engine.engine import Engine
    from ..platform import default_device
    from ..serving import host_threads
    from ..serving.warmup import warm_up
    from .model import load
    flags.apply_env()
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")

    def say(m):
        print(f"kernelgate serve: {m}", file=sys.stderr, flush=True)
    host_threads.apply(torch.device(args.device) if args.device else default_device(), log=say)
    model, source = load(args)
    engine = Engine(model, flags.engine_config(args))
    # every shape a step may meet, where kernels are compiled and autotuned per shape (not on a CPU)
    warm_up(engine, log=say, every_shape=model.device.type != "cpu")
    return engine, {"source": source, "vocab_size": model.config.vocab_size,
                    "eos_token_ids": list(model.config.eos_token_ids)}


def _listen(host: str, port: int):
    """The server's socket, bound now (uvicorn serves on it)."""
    import socket
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                          flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
    except OSError as e:
        raise KernelgateError(f"serve: cannot listen on {host}:{port}: {e.strerror or e}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(2048)
    except OSError as e:
        sock.close()
        raise KernelgateError(f"serve: cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def main(args) -> int:
    sock = _listen(args.host, args.port)
    try:
        return _main(args, sock)
    finally:
        sock.close()


def _main(args, sock) -> int:
    from pathlib import Path

    import uvicorn

    from ..engine.engine import freeze_heap
    from ..serving.async_engine import AsyncEngine
    from ..serving.core_process import EngineProcess
    from ..server.app import create_app
    from ..server.jobs import ModelInfo
    from ..server.metrics import Metrics
    from .model import BUILTIN, load_tokenizer
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    if args.engine_process:
        core = EngineProcess(build_engine, args).spawn()
        tokenizer = load_tokenizer(args)          # while the engine process loads the model
        got = core.ready()
    else:
        core, got = build_engine(args)
        tokenizer = core.model.tokenizer
    engine_config = flags.engine_config(args)
    name = args.served_model_name or (Path(args.model).resolve().name if args.model else BUILTIN)
    metrics = Metrics(name)
    aengine = AsyncEngine(core, max_queued=args.max_queued_requests, observer=metrics).start()
    info = ModelInfo(name, tokenizer, engine_config.max_model_len, got["vocab_size"], got["eos_token_ids"])
    api_key = args.api_key or envs.get("KERNELGATE_API_KEY") or None
    app = create_app(aengine, info, metrics, api_key=api_key, shutdown_timeout=1.0)
    # uvicorn's own drain outlasts the engine's, so aborted streams still send their last chunk
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=args.shutdown_timeout + 5.0, lifespan="on")
    server = _server(config, aengine, args.shutdown_timeout)
    # uvicorn re-raises the signal that stopped it once it is done; a handled signal is a clean exit
    got_signal = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda s, f: got_signal.append(s))
    where = "its own process" if args.engine_process else "a thread of the server"
    print(f"kernelgate serve: {got['source']} as {name!r} on http://{args.host}:{args.port}/v1 "
          f"(max_model_len {engine_config.max_model_len}, engine in {where})", file=sys.stderr, flush=True)
    freeze_heap()    # this process holds torch and the tokenizer too: no long collection mid-burst
    try:
        server.run(sockets=[sock])
    except SystemExit as e:          # uvicorn's way out of a failed start-up (its log says why)
        if got_signal:
            return 0
        raise KernelgateError(f"serve: the HTTP server failed to start on {args.host}:{args.port} "
                              f"(uvicorn exit {e.code})") from None
    if not server.started and not got_signal:
        raise KernelgateError(f"serve: could not start on {args.host}:{args.port} (see the log above)")
    return 0
