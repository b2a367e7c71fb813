"""`dflash-serve`: serve an artifacts directory over vLLM's OpenAI-compatible HTTP API.

    dflash-serve artifacts/default
    dflash-serve ARTIFACTS [--host 127.0.0.1] [--port 8000] [--backend ort|qaic|auto|qaic-standin]
                 [--threads N] [--max-queue N] [--served-model-name NAME] [--chat-template FILE]
                 [--shutdown-timeout S] [--log-level LEVEL]

Binds 127.0.0.1 unless told otherwise (--host 0.0.0.0 exposes the server to the network; it has
no authentication). --port 0 takes a free port; the line "dflash-serve: serving ... on URL" on
stdout says which. One worker thread drives the continuous-batching engine: artifacts exported
with `dflash-export --full-batch-size N` generate up to N requests at once (a newcomer joins at
the next step), others one at a time; up to --max-queue more requests wait for a slot (a full
queue answers 503). On SIGTERM or Ctrl-C the server stops accepting
connections, lets the requests in flight finish for up to --shutdown-timeout seconds, cancels
what is left at its next step, and exits 0.
"""

from __future__ import annotations

import argparse
import copy
import logging
import os
import signal
import socket
import sys
from pathlib import Path


def parser() -> argparse.ArgumentParser:
    from dflash_qaic.manifest import add_verify_argument

    p = argparse.ArgumentParser(
        prog="dflash-serve",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    p.add_argument("artifacts", help="artifacts directory written by dflash-export")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0: any free one)")
    p.add_argument("--backend", default="ort", choices=["ort", "qaic", "auto", "qaic-standin"])
    p.add_argument("--threads", type=int, default=None, help="ONNX Runtime intra-op threads")
    add_verify_argument(p)
    p.add_argument(
        "--verify-lengths",
        default=None,
        help="verify lengths steps may pick from, e.g. 16 (default: every one the artifacts "
        "have; the block size alone verifies the whole block every step)",
    )
    p.add_argument(
        "--max-queue", type=int, default=256, help="requests that may wait (default 256)"
    )
    p.add_argument(
        "--served-model-name",
        default=None,
        help="the model name clients send and /v1/models lists (default: ARTIFACTS as given)",
    )
    p.add_argument(
        "--chat-template",
        default=None,
        help="a Jinja chat template file for /v1/chat/completions (default: the tokenizer's)",
    )
    p.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="seconds in-flight requests may take to finish after SIGTERM (default 30)",
    )
    p.add_argument(
        "--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"]
    )
    p.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    return p


class UsageError(ValueError):
    pass


def _check(args) -> str | None:
    """Refuse bad values before loading anything; returns the chat template's text."""
    if not 0 <= args.port <= 65535:
        raise UsageError(f"--port must be in 0 … 65535 (got {args.port})")
    most = (os.cpu_count() or 1) * 4
    if args.threads is not None and not 1 <= args.threads <= most:
        raise UsageError(f"--threads must be in 1 … {most} (got {args.threads})")
    if args.max_queue < 1:
        raise UsageError(f"--max-queue must be ≥ 1 (got {args.max_queue})")
    if args.verify_lengths is not None:
        try:
            args.verify_lengths = [int(x) for x in args.verify_lengths.split(",")]
        except ValueError:
            raise UsageError(
                f"--verify-lengths must be integers separated by commas, e.g. 4,8,16 "
                f"(got {args.verify_lengths!r})"
            ) from None
    if not args.shutdown_timeout >= 0:
        raise UsageError(f"--shutdown-timeout must be ≥ 0 (got {args.shutdown_timeout})")
    if args.chat_template is None:
        return None
    try:
        return Path(args.chat_template).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"--chat-template: cannot read {args.chat_template}: {e}") from None


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)  # connections made while the model loads wait instead of failing
    except OSError as e:
        sock.close()
        raise UsageError(
            f"cannot listen on {host}:{port}: {e.strerror or e}: use another --port"
        ) from None
    return sock


def _serve(args, template: str | None, sock: socket.socket) -> None:
    import prometheus_client
    import uvicorn

    import dflash_qaic
    from dflash_qaic.serve.app import create_app
    from dflash_qaic.serve.engine import Engine
    from dflash_qaic.serve.metrics import Metrics

    prometheus_client.disable_created_metrics()  # as vLLM: no *_created series
    from dflash_qaic.logs import show

    show(stream="stderr")
    pipe = dflash_qaic.load(
        args.artifacts, backend=args.backend, threads=args.threads, verify=args.verify
    )
    if args.verify_lengths is not None:
        pipe.verify_lengths = args.verify_lengths
        try:
            pipe.engine()  # checks them against the artifacts' lengths before serving
        except ValueError as e:
            raise UsageError(f"--verify-lengths: {e}") from None
    name = args.served_model_name or args.artifacts
    engine = Engine(pipe, max_queue=args.max_queue, metrics=Metrics(name, pipe.B))
    # the HTTP side encodes prompts with its own tokenizer: never one shared across threads
    tok = copy.deepcopy(pipe.tokenizer) if pipe.tokenizer is not None else None
    app = create_app(engine, name, tok, template)
    config = uvicorn.Config(
        app,
        log_level=args.log_level,
        timeout_graceful_shutdown=args.shutdown_timeout,
        lifespan="on",
    )
    server = uvicorn.Server(config)
    ours = logging.getLogger("dflash_qaic.serve")  # log as uvicorn does (it configured its own)
    ours.handlers, ours.propagate = logging.getLogger("uvicorn").handlers, False
    ours.setLevel(args.log_level.upper())
    host, port = sock.getsockname()[:2]
    url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
    slots = f"{pipe.full_batch_size} request{'s' if pipe.full_batch_size > 1 else ''} at once"
    print(f"dflash-serve: serving {name} on {url} (backend {pipe.backend}, {slots})", flush=True)
    # uvicorn handles SIGINT/SIGTERM while it runs, then re-raises the signal to the handler that
    # was installed before it; a no-op there lets a graceful shutdown exit 0
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    server.run(sockets=[sock])


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        template = _check(args)
        sock = _listen(args.host, args.port)
    except UsageError as e:
        print(f"dflash-serve: error: {e}", file=sys.stderr)
        return 2
    from dflash_qaic.runtime import ArtifactsError, BackendError

    try:
        _serve(args, template, sock)
    except (ArtifactsError, BackendError, UsageError) as e:
        if args.debug:
            raise
        print(f"dflash-serve: error: {e}", file=sys.stderr)
        return 2
    except ImportError as e:
        if args.debug:
            raise
        print(f"dflash-serve: error: {e}: pip install 'dflash-qaic[serve]'", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    finally:
        sock.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
