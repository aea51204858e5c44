"""``kvforge serve``: the OpenAI-compatible server (FastAPI + uvicorn) on one model."""

from __future__ import annotations

import argparse
import contextlib
import os
from typing import Any

from kvforge.commands._common import (
    add_http_args,
    add_model_args,
    check_api_key,
    check_port_free,
    check_store_url,
    connection_options,
    load,
    positive_int,
    ratio,
)
from kvforge.commands._reuse import add_semantic_args, check_semantic_args
from kvforge.errors import UserError
from kvforge.names import REUSE_NAMES


def register(sub: Any, bench_sub: Any) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (completions, chat, KV reuse, metrics)")
    add_model_args(p)
    add_http_args(p, port=8000)
    p.add_argument("--served-model-name", default=None, help="model id clients send (default: --model)")
    p.add_argument("--store", default=None, help="KV store URL (memory://, file:///dir, redis://host:port/db)")
    p.add_argument("--reuse", choices=[*REUSE_NAMES, "none"], default="none", help="KV reuse strategy")
    p.add_argument("--semantic-mode", choices=["canonical", "context"], default="canonical")
    add_semantic_args(p)
    p.add_argument("--press", default=None, help="default compression method, options as "
                   "name:key=value (see `kvforge presses`; clients name presses only)")  # fmt: skip
    p.add_argument("--compression-ratio", type=ratio, default=0.5, help="fraction of KV entries removed")
    p.add_argument("--max-queue", type=positive_int, default=16, help="waiting requests before 429s")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per request (queueing included)")
    p.add_argument(
        "--grace-period",
        type=float,
        default=30.0,
        help="seconds SIGTERM gives the running generation; waiting requests get a 503 at once",
    )
    p.add_argument("--chunk-size", type=positive_int, default=512, help="prefill chunk size in tokens")
    p.add_argument(
        "--scheduler",
        choices=["batched", "serial"],
        default="batched",
        help="batched: continuous batching (running requests decode together); serial: one request at a time",
    )
    p.add_argument("--max-running", type=positive_int, default=16, help="requests decoding together (batched)")
    p.add_argument(
        "--prefill-budget",
        type=positive_int,
        default=128,
        help="prompt tokens prefilled per scheduler step, between decode steps (batched)",
    )
    p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    p.set_defaults(func=run_serve)


def run_serve(args: argparse.Namespace) -> int:
    check_api_key(args.api_key)
    connections = connection_options(args)  # uvicorn's: read timeouts, connection cap
    check_store_url(args.store)  # cheap checks first: a bad URL or a port in use fails before anything heavy loads
    check_port_free(args.host, args.port)
    check_semantic_args(args)  # before any heavy import
    press = None
    if args.press:  # a wrong press name fails before the model loads
        from kvforge.presses import build_press

        press = build_press(args.press, compression_ratio=args.compression_ratio)
    try:
        import uvicorn

        from kvforge.serve import create_app
    except ImportError as e:
        raise UserError(f"the server needs the serve extra: pip install 'kvforge[serve]' ({e})") from e
    from kvforge.engine import Engine

    if args.timeout <= 0:
        raise UserError(f"--timeout must be > 0, got {args.timeout}")
    if not 0 <= args.grace_period < float("inf"):
        raise UserError(f"--grace-period must be >= 0 seconds, got {args.grace_period}")
    model, tokenizer = load(args)
    engine = Engine(model, tokenizer, chunk_size=args.chunk_size)
    if press is not None:
        from kvforge.kvzap_train import ensure_trained

        ensure_trained(press, model, tokenizer)  # the server's press (a learned scorer) is ready before it listens
    app = create_app(
        engine,
        model_name=args.served_model_name or args.model,
        store_url=args.store,
        reuse=args.reuse,
        semantic_mode=args.semantic_mode,
        semantic={"threshold": args.threshold, "max_error": args.max_error, "verify_ratio": args.verify_ratio},
        press=args.press,
        compression_ratio=args.compression_ratio,
        max_queue=args.max_queue,
        request_timeout_s=args.timeout,
        api_key=args.api_key,
        max_body_bytes=args.max_body_bytes,
        scheduler=args.scheduler,
        max_running=args.max_running,
        prefill_budget=args.prefill_budget,
    )
    print(f"kvforge: serving {args.served_model_name or args.model} on http://{args.host}:{args.port}/v1", flush=True)
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        timeout_graceful_shutdown=args.grace_period + 1,  # bounds the drain even for a stuck connection
        **connections,
    )
    server = _draining_server_class()(config)
    server.grace_period = args.grace_period
    server.run()
    if server.drain_deadline is not None:  # stopped by a signal, drained: exit now, with status 0
        _exit_after_drain(app)
    return 0


def _exit_after_drain(app: Any) -> None:
    """Close the store (a tiered store finishes its background copies), flush the logs and exit 0 at once: the
    interpreter's own teardown of torch and transformers takes seconds on a busy machine (4-5 s measured on 2 loaded
    cores), which a supervisor waiting for the process after SIGTERM should not wait for; nothing is left to save."""
    import logging
    import sys

    features = getattr(app.state, "features", None)
    if features is not None and features.has_store:
        with contextlib.suppress(Exception):
            features.store.close()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _draining_server_class() -> type:
    import signal
    import time

    import uvicorn

    class DrainingServer(uvicorn.Server):  # type: ignore[misc]
        """SIGTERM/SIGINT drain the server before it stops: new requests are answered 503 ``shutting_down`` (the
        socket stays open: a client is told, not refused), waiting ones get their 503 at once, the running ones get
        ``grace_period`` seconds; then uvicorn shuts down and the process exits 0 (the signal is not re-raised).
        A second signal stops at once (uvicorn's graceful shutdown, bounded by its timeout)."""

        grace_period = 30.0
        drain_deadline: float | None = None

        def handle_exit(self, sig: int, frame: object) -> None:
            state = getattr(self.config.app, "state", None)
            if self.drain_deadline is None and state is not None and not self.should_exit:
                state.draining = True  # GuardMiddleware: 503 to every new request from now on
                drain = getattr(state, "drain", None)
                if drain is not None:
                    drain(self.grace_period)
                self.drain_deadline = time.monotonic() + self.grace_period
                return
            if self.should_exit and sig == signal.SIGINT:
                self.force_exit = True
            self.should_exit = True

        async def on_tick(self, counter: int) -> bool:
            if self.drain_deadline is not None and not self.should_exit:
                worker = getattr(self.config.app.state, "worker", None)
                idle = worker is None or (not worker.busy and worker.depth == 0)
                if idle or time.monotonic() > self.drain_deadline + 1.0:  # the running job stops at the deadline
                    self.should_exit = True
            return bool(await super().on_tick(counter))

    return DrainingServer
