"""`blockdraft serve`: the OpenAI-compatible server."""

from __future__ import annotations

import os
import sys

from .common import add_model_args, load_engine, spec_from


def cmd_serve(args) -> int:
    import signal
    import threading

    import uvicorn

    from ..serve.app import Server, create_app

    engine = load_engine(args, [args.method])
    name = args.served_model_name or os.path.basename(str(engine.target_name).rstrip("/"))
    api_key = args.api_key or os.environ.get("BLOCKDRAFT_API_KEY") or None
    spec = spec_from(args, adaptive=args.speculation == "adaptive" or None)
    server = Server(
        engine,
        model_name=name,
        method=spec,
        max_batch=args.max_batch,
        max_queue=args.max_queue,
        max_model_len=args.max_model_len,
        max_tokens_limit=args.max_tokens,
        block_size=args.block_size,
        api_key=api_key,
        max_body_bytes=args.max_body_bytes,
        shutdown_grace=args.shutdown_grace,
        metrics_public=args.metrics_public,
        body_timeout=args.body_timeout,
        max_requests=args.max_connections,
    )
    print(
        f"serve: {name} ({engine.weights} weights) with {args.method}"
        + (f" (block {server.scheduler.loop.block_size}, {args.speculation})" if args.method != "ar" else "")
        + f", {args.max_batch} slots, queue {args.max_queue}, on http://{args.host}:{args.port}",
        file=sys.stderr,
    )
    # The decode loop runs on the main thread (measured faster there) and HTTP on a second one.
    # A signal starts the scheduler's drain at once (requests get --shutdown-grace seconds, then end with a
    # finish reason) and asks uvicorn to stop taking connections; uvicorn waits longer than the drain, so
    # that it never cancels a stream the scheduler is still ending. A second signal cuts it short.
    http = uvicorn.Server(
        uvicorn.Config(
            create_app(server, start_scheduler=False),
            host=args.host,
            port=args.port,
            log_level=args.log_level,
            timeout_keep_alive=args.keep_alive,
            # sockets (idle keep-alives too): a backstop above the request cap
            limit_concurrency=2 * args.max_connections,
            timeout_graceful_shutdown=int(args.shutdown_grace) + 15,
        )
    )
    failed: list[BaseException] = []

    def serve_http():
        try:
            http.run()
        except BaseException as exc:  # e.g. SystemExit when the port is taken
            failed.append(exc)
        finally:  # whatever ended HTTP also ends the decode loop
            server.scheduler.shutdown(grace=0)

    def on_signal(_sig, _frame):  # (off the signal handler: the drain waits)
        grace = 0 if http.should_exit else args.shutdown_grace  # a second signal ends in-flight requests now
        threading.Thread(target=server.scheduler.shutdown, kwargs={"grace": grace}, daemon=True).start()
        http.should_exit = True

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    thread = threading.Thread(target=serve_http, name="blockdraft-http", daemon=True)
    thread.start()
    server.scheduler.run()
    thread.join()
    return 1 if failed or not http.started else 0


def register(sub, methods) -> None:
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server with continuous batching")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--method", choices=methods.names(), default="dflash", help=methods.help_text())
    s.add_argument("--block-size", type=int, help="largest verified block (default: the drafter's trained size)")
    s.add_argument(
        "--speculation",
        choices=["adaptive", "fixed"],
        default="adaptive",
        help="adaptive: each step's block size follows the running batch size, by measured speed",
    )
    s.add_argument("--max-batch", type=int, default=8, help="requests decoded together")
    s.add_argument("--max-queue", type=int, default=64, help="waiting requests beyond the batch; more get 429")
    s.add_argument("--max-model-len", type=int, default=2048, help="prompt + generated tokens per request")
    s.add_argument("--max-tokens", type=int, default=1024, help="largest max_tokens a request may ask for")
    s.add_argument("--max-body-bytes", type=int, default=1 << 20)
    s.add_argument("--api-key", help="require 'Authorization: Bearer KEY' (or set BLOCKDRAFT_API_KEY)")
    s.add_argument("--served-model-name", help="model id in the API (default: the target folder's name)")
    s.add_argument(
        "--shutdown-grace",
        type=float,
        default=30.0,
        help="seconds in-flight requests get to finish on shutdown before they are cancelled",
    )
    s.add_argument(
        "--body-timeout",
        type=float,
        default=30.0,
        help="seconds a client may pause while sending its request body (then 408)",
    )
    s.add_argument("--keep-alive", type=int, default=5, help="seconds an idle keep-alive connection is kept open")
    s.add_argument(
        "--max-connections",
        type=int,
        default=1024,
        help="requests handled at once (slow bodies, streams and queued requests count); more get a "
        "JSON 503 with Retry-After; open sockets, idle keep-alives included, are capped at twice this",
    )
    s.add_argument(
        "--metrics-public",
        action="store_true",
        help="with --api-key: serve /metrics without it (default: /metrics needs the key too)",
    )
    s.add_argument("--log-level", default="warning")
    add_model_args(s)
    s.set_defaults(func=cmd_serve)
