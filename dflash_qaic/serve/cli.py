"""`dflash-serve`: serve an artifacts directory over vLLM's OpenAI-compatible HTTP API.

    dflash-serve artifacts/default
    dflash-serve ARTIFACTS [--host 127.0.0.1] [--port 8000] [--backend ort|qaic|auto|qaic-standin]
                 [--threads N] [--device-ids 4,5] [--max-queue N] [--served-model-name NAME]
                 [--chat-template FILE] [--api-key KEY] [--max-model-len N] [--max-num-seqs N]
                 [--seed N] [--shutdown-timeout S] [--max-request-bytes N] [--log-level LEVEL]
                 [--uvicorn-log-level LEVEL] [--disable-log-requests]
                 [--enable-auto-tool-choice] [--tool-call-parser hermes|llama3_json]
                 [--max-grammar-compile-s S] [--max-grammar-alternatives N]
                 [--structured-output-lenient]

vLLM's flags mean what they mean there: --api-key (or $VLLM_API_KEY) makes every endpoint but
/health answer 401 without `Authorization: Bearer KEY`; --max-model-len caps prompt + output
(at most the positions the artifacts were exported for, ctx_len - 1); --max-num-seqs caps the
sequences generating at once (at most the artifacts' cache rows, --full-batch-size at export);
--seed seeds the sampling requests that bring no seed of their own (the same requests in the
same order give the same outputs; default: fresh entropy); --uvicorn-log-level sets uvicorn's
logging (default: --log-level's); --disable-log-requests drops the one info line per request;
--enable-auto-tool-choice with --tool-call-parser serves tool_choice "auto" (artifacts exported
with --structured-output also enforce "required", a named function and response_format).
A constraint's grammar compiles on its own thread: one holding more than
--max-grammar-alternatives enum values, choices or branches, or not compiled within
--max-grammar-compile-s, is a 400 naming the limit; a JSON schema with a keyword xgrammar does
not enforce (not, uniqueItems, allOf of several, ...) is a 400 naming it, unless
--structured-output-lenient (then accepted, unenforced, with an X-Structured-Output-Warning
header).
--device-ids places this replica's programs on chosen AI100 devices (ONNX Runtime records them in
/metrics, dflash:device_info); dflash-serve-replicas runs one server per device group behind
vllm-router.

Binds 127.0.0.1 unless told otherwise (--host 0.0.0.0 exposes the server to the network: give it
an --api-key; without one a warning is logged). --port 0 takes a free port; the line
"dflash-serve: serving ... on URL" on stdout says which. One worker thread drives the
continuous-batching engine: artifacts exported with `dflash-export --full-batch-size N` generate
up to N requests at once (a newcomer joins at the next step), others one at a time; up to
--max-queue more requests wait for a slot (beyond, 503). A request body above
--max-request-bytes is refused (413) as it is read. On SIGTERM or Ctrl-C the server stops
accepting connections, lets the requests in flight finish for up to --shutdown-timeout seconds,
then cuts what is left at its next step (a 503 JSON error, or a stream's last chunk with
finish_reason "abort" and [DONE]), and exits 0.
"""

from __future__ import annotations

import argparse
import copy
import ipaddress
import logging
import os
import signal
import socket
import sys
from pathlib import Path

from dflash_qaic.commands import doc_parser


def parser() -> argparse.ArgumentParser:
    from dflash_qaic.runtime import options

    p = doc_parser("dflash-serve", __doc__)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0: any free one)")
    options.add_arguments(p, "backend", "threads", "device_ids", "check_files")
    options.add_engine_arguments(p)
    p.add_argument(
        "--verify-lengths",
        default=None,
        help="verify lengths steps may pick from, e.g. 16 (default: every one the artifacts "
        "have; the block size alone verifies the whole block every step)",
    )
    _add_server_arguments(p)
    _add_request_arguments(p)
    _add_logging_arguments(p)
    p.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    return p


def _add_server_arguments(p: argparse.ArgumentParser) -> None:
    """The server's own: its queue, names, template, shutdown, body limit and API key."""
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
        "--max-request-bytes",
        type=int,
        default=None,
        help="largest request body accepted, in bytes (default: 64 per token of context, at "
        "least 1 MiB); larger ones get 413",
    )
    p.add_argument(
        "--api-key",
        default=None,
        help="require `Authorization: Bearer KEY` on every endpoint but /health "
        "(default: $VLLM_API_KEY; neither: no authentication)",
    )
    p.add_argument(
        "--role",
        choices=("both", "prefill", "decode"),
        default="both",
        help="prefill/decode disaggregation over vLLM's kv_transfer_params (serve/pd.py): "
        "prefill hands prompts off, decode pulls them (default: both, no hand-off)",
    )
    p.add_argument(
        "--fallback-local-prefill",
        action="store_true",
        help="--role decode: prefill a prompt here when its hand-off cannot be had (prefill "
        "server gone, lease ended) or the request brings none (default: refuse it)",
    )
    p.add_argument(
        "--kv-max-bytes",
        type=int,
        default=1 << 30,
        help="largest hand-off payload a prefill server exports or a decode server pulls "
        "(default 1 GiB)",
    )
    p.add_argument(
        "--kv-transport",
        choices=("http", "shm"),
        default="http",
        help="--role prefill: shm also offers each payload in shared memory (/dev/shm), read "
        "there by a decode server on the same host (others pull it over HTTP); default http",
    )


def _add_request_arguments(p: argparse.ArgumentParser) -> None:
    """vLLM's flags that bound or shape the requests: lengths, concurrency, seed, tools."""
    p.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="the most tokens of a request, prompt + output (default and most: the artifacts' "
        "ctx_len - 1)",
    )
    p.add_argument(
        "--max-num-seqs",
        type=int,
        default=None,
        help="the most sequences generating at once (default and most: the artifacts' cache "
        "rows, --full-batch-size at export, 1 without it)",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=None,
        help="seed of the seeds given to sampling requests without one (default: fresh entropy)",
    )
    p.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='tool_choice "auto": parse replies for tool calls with --tool-call-parser (vLLM\'s '
        'flag); "required" and a named function work without it',
    )
    p.add_argument(
        "--tool-call-parser",
        default=None,
        choices=["hermes", "llama3_json"],
        help="how replies are read for tool calls: hermes (Qwen3 <tool_call> JSON), "
        "llama3_json (Llama 3.1 JSON)",
    )
    p.add_argument(
        "--max-grammar-compile-s",
        type=float,
        default=10.0,
        help="the longest a request waits for its grammar to compile, else a 400 (default 10)",
    )
    p.add_argument(
        "--max-grammar-alternatives",
        type=int,
        default=None,
        help="the most enum values, choices and anyOf/oneOf branches one constraint may hold "
        "(default 10000: compile time grows with their square)",
    )
    p.add_argument(
        "--structured-output-lenient",
        action="store_true",
        help="accept JSON-Schema keywords xgrammar does not enforce (with a warning header) "
        "instead of a 400",
    )


def _add_logging_arguments(p: argparse.ArgumentParser) -> None:
    levels = ["critical", "error", "warning", "info", "debug"]
    p.add_argument("--log-level", default="info", choices=levels, help="dflash-serve's logging")
    p.add_argument(
        "--uvicorn-log-level",
        default=None,
        choices=[*levels, "trace"],
        help="uvicorn's logging (default: --log-level)",
    )
    p.add_argument(
        "--disable-log-requests",
        action="store_true",
        help="no info line per request (as vLLM's flag)",
    )


class UsageError(ValueError):
    pass


def _check(args) -> str | None:
    """Refuse bad values before loading anything; returns the chat template's text."""
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        raise UsageError(
            "--enable-auto-tool-choice needs --tool-call-parser (hermes or llama3_json)"
        )
    if not 0 <= args.port <= 65535:
        raise UsageError(f"--port must be in 0 … 65535 (got {args.port})")
    most = (os.cpu_count() or 1) * 4
    if args.threads is not None and not 1 <= args.threads <= most:
        raise UsageError(f"--threads must be in 1 … {most} (got {args.threads})")
    if args.max_queue < 1:
        raise UsageError(f"--max-queue must be ≥ 1 (got {args.max_queue})")
    if args.kv_max_bytes < 1:
        raise UsageError(f"--kv-max-bytes must be ≥ 1 (got {args.kv_max_bytes})")
    if args.fallback_local_prefill and args.role != "decode":
        raise UsageError("--fallback-local-prefill is for --role decode servers")
    if args.kv_transport == "shm" and args.role != "prefill":
        raise UsageError("--kv-transport shm is for --role prefill servers (decode reads either)")
    if args.verify_lengths is not None:
        try:
            args.verify_lengths = [int(x) for x in args.verify_lengths.split(",")]
        except ValueError:
            raise UsageError(
                f"--verify-lengths must be integers separated by commas, e.g. 4,8,16 "
                f"(got {args.verify_lengths!r})"
            ) from None
    if not args.max_grammar_compile_s > 0:
        raise UsageError(f"--max-grammar-compile-s must be > 0 (got {args.max_grammar_compile_s})")
    if args.max_grammar_alternatives is not None and args.max_grammar_alternatives < 1:
        raise UsageError(
            f"--max-grammar-alternatives must be ≥ 1 (got {args.max_grammar_alternatives})"
        )
    if args.max_request_bytes is not None and args.max_request_bytes < 1:
        raise UsageError(f"--max-request-bytes must be ≥ 1 (got {args.max_request_bytes})")
    if args.max_model_len is not None and args.max_model_len < 2:
        raise UsageError(
            f"--max-model-len must be ≥ 2: one prompt token and one output token "
            f"(got {args.max_model_len})"
        )
    if args.max_num_seqs is not None and args.max_num_seqs < 1:
        raise UsageError(f"--max-num-seqs must be ≥ 1 (got {args.max_num_seqs})")
    if args.seed is not None and args.seed < 0:
        raise UsageError(f"--seed must be ≥ 0 (got {args.seed})")
    if args.api_key is None:
        args.api_key = os.environ.get("VLLM_API_KEY") or None
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


def build_app(args, template: str | None):
    """The app, engine and pipeline dflash-serve serves for these parsed and checked flags
    (`parser().parse_args`, then `_check`); also what the Ray Serve deployment serves
    (serve/ray_serve.py)."""
    import prometheus_client

    import dflash_qaic
    from dflash_qaic.runtime.options import engine_values, from_args
    from dflash_qaic.serve.app import GrammarLimits, create_app
    from dflash_qaic.serve.engine import AsyncEngine
    from dflash_qaic.serve.metrics import Metrics
    from dflash_qaic.serve.pd import Config

    prometheus_client.disable_created_metrics()  # as vLLM: no *_created series
    from dflash_qaic.logs import show

    show(stream="stderr")
    pipe = dflash_qaic.load(args.artifacts, **from_args(args))
    try:
        pipe.configure(**engine_values(args))
    except ValueError as e:
        raise UsageError(str(e)) from None
    if args.verify_lengths is not None:
        try:
            pipe.configure(verify_lengths=args.verify_lengths)  # checked against the artifacts
        except ValueError as e:
            raise UsageError(f"--verify-lengths: {e}") from None
    _limits(args, pipe)
    name = args.served_model_name or args.artifacts
    metrics = Metrics(name, pipe.B)
    metrics.device_info(pipe.backend, pipe.device_ids)
    engine = AsyncEngine(pipe, max_queue=args.max_queue, metrics=metrics)
    # the HTTP side encodes prompts with its own tokenizer: never one shared across threads
    tok = copy.deepcopy(pipe.tokenizer) if pipe.tokenizer is not None else None
    app = create_app(
        engine,
        name,
        tok,
        template,
        api_key=args.api_key,
        max_model_len=args.max_model_len,
        seed=args.seed,
        log_requests=not args.disable_log_requests,
        max_request_bytes=args.max_request_bytes,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        tool_call_parser=args.tool_call_parser,
        grammar_limits=GrammarLimits(
            args.max_grammar_compile_s,
            args.max_grammar_alternatives or GrammarLimits.alternatives,
            args.structured_output_lenient,
        ),
        role=args.role,
        pd_config=Config(
            args.role, args.fallback_local_prefill, args.kv_max_bytes, transport=args.kv_transport
        ),
    )
    return app, engine, pipe


def _serve(args, template: str | None, sock: socket.socket) -> None:
    import uvicorn

    from dflash_qaic.serve.app import Server

    app, engine, pipe = build_app(args, template)
    name = args.served_model_name or args.artifacts
    config = uvicorn.Config(app, log_level=args.uvicorn_log_level or args.log_level, lifespan="on")
    server = Server(config, engine, args.shutdown_timeout)  # cuts at --shutdown-timeout
    ours = logging.getLogger("dflash_qaic.serve")  # log as uvicorn does (it configured its own)
    ours.handlers, ours.propagate = logging.getLogger("uvicorn").handlers, False
    ours.setLevel(args.log_level.upper())
    host, port = sock.getsockname()[:2]
    if not args.api_key and not ipaddress.ip_address(host.split("%")[0]).is_loopback:
        ours.warning(
            "serving on %s without an API key: anyone who can reach this address can use the "
            "server; give it --api-key KEY (or set VLLM_API_KEY), or bind 127.0.0.1",
            host,
        )
    slots = pipe.full_batch_size if pipe.max_running is None else pipe.max_running
    url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
    slots = f"{slots} request{'s' if slots > 1 else ''} at once"
    where = pipe.backend
    if pipe.device_ids is not None:
        where += f", devices {','.join(map(str, pipe.device_ids.devices))}"
    print(f"dflash-serve: serving {name} on {url} (backend {where}, {slots})", flush=True)
    # uvicorn handles SIGINT/SIGTERM while it runs, then re-raises the signal to the handler that
    # was installed before it; a no-op there lets a graceful shutdown exit 0
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    server.run(sockets=[sock])


def _limits(args, pipe) -> None:
    """--max-model-len and --max-num-seqs against what the artifacts hold."""
    from dflash_qaic import contract

    positions = contract.max_positions(pipe.ctx_len)
    if args.max_model_len is not None and args.max_model_len > positions:
        raise UsageError(
            f"--max-model-len {args.max_model_len} is more than these artifacts hold: they were "
            f"exported with ctx_len {pipe.ctx_len}, {positions} positions for prompt + output; "
            f"use --max-model-len ≤ {positions}, or re-export with a larger --ctx-len"
        )
    if args.max_num_seqs is not None:
        if args.max_num_seqs > pipe.full_batch_size:
            how = (
                f"cache rows for {pipe.full_batch_size} sequences (--full-batch-size "
                f"{pipe.full_batch_size} at export)"
                if pipe.full_batch_size > 1
                else "one cache row (exported without --full-batch-size)"
            )
            raise UsageError(
                f"--max-num-seqs {args.max_num_seqs} is more than these artifacts run at once: "
                f"they have {how}; use --max-num-seqs ≤ {pipe.full_batch_size}, or re-export "
                f"with dflash-export --full-batch-size {args.max_num_seqs}"
            )
        pipe.configure(max_running=args.max_num_seqs)


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
