"""``python -m gemma_nb serve``: the command (exit 2 for bad arguments, 1 if the model fails to
load, 0 after Ctrl-C or SIGTERM), and uvicorn with its own limits for the connections."""

import argparse
import contextlib
import functools
import ipaddress
import logging
import os
import sys

import torch
import uvicorn

from gemma_nb.neuron.sdk import check_target_with_sdk
from gemma_nb.serving import app as served
from gemma_nb.serving.backends import RUNTIMES, load_runtime
from gemma_nb.targets import TargetError
from gemma_nb.tiny import BUNDLED_ID

DEFAULT_HOST, DEFAULT_PORT, DEFAULT_KEEP_ALIVE_TIMEOUT_S, DEFAULT_LIMIT_CONCURRENCY = (
    "127.0.0.1",
    8080,
    5,
    64,
)
# uvicorn answers these itself (plain text; the app never sees them) and has no hook but its log.
UVICORN_REFUSALS = {
    "Invalid HTTP request received.": "invalid_http",
    "Exceeded concurrency limit.": "concurrency_limit",
}

log = logging.getLogger("gemma_nb.serve")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m gemma_nb serve",
        description=f"OpenAI-compatible server ({served.API_KEY_ENV}: the API key)",
    )
    add = p.add_argument
    add("--target", default="cpu", help="cpu (default), neuron or cuda")
    add("--model-id", default=BUNDLED_ID, help="local folder or hub id (default: %(default)s)")
    add("--served-model-name", default=None, help="the name /v1/models lists (default: --model-id)")
    add(
        "--host",
        default=DEFAULT_HOST,
        help="interface to bind (default %(default)s: loopback; see the README's proxy)",
    )
    add(
        "--port",
        type=int,
        default=DEFAULT_PORT,
        help="default %(default)s, as the port's container",
    )
    add(
        "--runtime",
        choices=RUNTIMES,
        default="auto",
        help="deploy (the slim deploy of --artifact) or transformers (auto: deploy with "
        "--artifact on cpu)",
    )
    add(
        "--artifact",
        default=None,
        help="the compiled folder: notebook 04's (outputs/cpu/artifacts/04_tiny), or on neuron "
        "its NxD one (required)",
    )
    add(
        "--dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="weights dtype for --runtime transformers",
    )
    add(
        "--max-context",
        type=int,
        default=None,
        help="context in tokens, prompt + answer (default: the model's)",
    )
    _add_limits(add)
    add("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    return p


def _add_limits(add) -> None:
    """The server's bounds: queue, answer lengths, bodies, connections, hosts, keys, watchdog."""
    add(
        "--queue-size",
        type=int,
        default=served.DEFAULT_QUEUE_SIZE,
        help="requests admitted at once, the running one included (%(default)s)",
    )
    add(
        "--max-tokens",
        type=int,
        default=served.DEFAULT_MAX_TOKENS,
        help="answer length if a request sets none (%(default)s)",
    )
    add(
        "--max-tokens-cap",
        type=int,
        default=served.DEFAULT_MAX_TOKENS_CAP,
        help="most a request may ask (%(default)s)",
    )
    add(
        "--max-body-bytes",
        type=int,
        default=served.DEFAULT_MAX_BODY_BYTES,
        help="largest request body (%(default)s)",
    )
    add(
        "--body-timeout-s",
        type=float,
        default=served.DEFAULT_BODY_TIMEOUT_S,
        help="time for a body to arrive (%(default)s)",
    )
    add(
        "--keep-alive-timeout-s",
        type=int,
        default=DEFAULT_KEEP_ALIVE_TIMEOUT_S,
        help="idle connections close (%(default)s)",
    )
    add(
        "--limit-concurrency",
        type=int,
        default=DEFAULT_LIMIT_CONCURRENCY,
        help="uvicorn's: connections at once, more get 503 (%(default)s)",
    )
    add(
        "--allowed-host",
        action="append",
        default=[],
        metavar="NAME",
        help="on loopback, answer this Host too (repeatable)",
    )
    add(
        "--metrics-require-key",
        action="store_true",
        help="/metrics needs the API key too (always beyond loopback)",
    )
    add(
        "--slot-watchdog-s",
        type=float,
        default=served.DEFAULT_SLOT_WATCHDOG_S,
        help="gemma_nb_slots_overdue: slots held longer (%(default)s)",
    )


def _check_arguments(args) -> None:
    """Raise ValueError for what would only fail later: bad numbers, a model or artifact that is not
    there."""
    check_target_with_sdk(args.target)
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port {args.port} is not a TCP port (0-65535)")
    for name in (
        "queue_size",
        "max_tokens",
        "max_tokens_cap",
        "max_body_bytes",
        "body_timeout_s",
        "keep_alive_timeout_s",
        "limit_concurrency",
        "slot_watchdog_s",
        "max_context",
    ):
        if getattr(args, name) is not None and not getattr(args, name) >= 1:
            raise ValueError(f"--{name.replace('_', '-')} {getattr(args, name)} must be at least 1")
    if args.max_tokens > args.max_tokens_cap:
        raise ValueError(
            f"--max-tokens {args.max_tokens} is over --max-tokens-cap {args.max_tokens_cap}"
        )
    if args.artifact is not None and not os.path.isdir(args.artifact):
        raise ValueError(
            f"--artifact {args.artifact}: no such folder; pass the folder the compile step wrote"
        )
    if args.model_id.startswith((".", "/", "~")) and not os.path.exists(
        os.path.expanduser(args.model_id)
    ):
        raise ValueError(
            f"--model-id {args.model_id}: no such folder; pass a local model folder or a hub id"
        )


def uvicorn_config(
    app,
    *,
    keep_alive_timeout_s: int = DEFAULT_KEEP_ALIVE_TIMEOUT_S,
    limit_concurrency: int = DEFAULT_LIMIT_CONCURRENCY,
    **kwargs,
) -> uvicorn.Config:
    """uvicorn's own limits: idle keep-alive, connections at once, and h11's cap on a head arriving
    in pieces."""
    return uvicorn.Config(
        app,
        http="h11",
        timeout_keep_alive=keep_alive_timeout_s,
        limit_concurrency=limit_concurrency,
        h11_max_incomplete_event_size=served.MAX_HEAD_BYTES,
        **kwargs,
    )


@contextlib.contextmanager
def counting_refusals(metrics: served.ServerMetrics):
    """Count uvicorn's refusals (``UVICORN_REFUSALS``, read from its log) in
    ``gemma_nb_http_refused``."""
    logger = logging.getLogger("uvicorn.error")
    level, shown = logger.level, logger.getEffectiveLevel()

    # uvicorn logs each at warning; shown only at the chosen level
    def count(record: logging.LogRecord) -> bool:
        if (reason := UVICORN_REFUSALS.get(record.getMessage())) is not None:
            metrics.refused.labels(reason).inc()
        return record.levelno >= shown

    logger.addFilter(count)
    logger.setLevel(min(shown, logging.WARNING))
    try:
        yield
    finally:
        logger.removeFilter(count)
        logger.setLevel(level)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        _check_arguments(args)
    except (TargetError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    api_key, server, failure, loopback = (
        os.environ.get(served.API_KEY_ENV) or None,
        None,
        [],
        args.host == "localhost",
    )
    with contextlib.suppress(ValueError):  # a host name other than localhost is not loopback
        loopback = loopback or ipaddress.ip_address(args.host).is_loopback
    if not loopback and api_key is None:
        log.warning(
            "binding %s without an API key: anyone who can reach it can use the model (set %s)",
            args.host,
            served.API_KEY_ENV,
        )

    def stop_on_failure(error: str) -> None:
        failure.append(error)
        if server is not None:
            server.should_exit = True  # uvicorn checks it every 0.1 s

    load = functools.partial(
        load_runtime,
        args.target,
        args.model_id,
        max_context=args.max_context,
        runtime=args.runtime,
        artifact=args.artifact,
        dtype=getattr(torch, args.dtype),
    )
    app = served.create_app(
        load,
        model_name=args.served_model_name or args.model_id,
        queue_size=args.queue_size,
        api_key=api_key,
        aliases=sorted({args.model_id, os.path.basename(os.path.normpath(args.model_id))}),
        max_tokens=args.max_tokens,
        max_tokens_cap=args.max_tokens_cap,
        metrics_need_key=args.metrics_require_key or not loopback,
        max_body_bytes=args.max_body_bytes,
        body_timeout_s=args.body_timeout_s,
        slot_watchdog_s=args.slot_watchdog_s,
        allowed_hosts=[*served.LOOPBACK_HOSTS, *args.allowed_host] if loopback else None,
        on_load_failure=stop_on_failure,
    )
    log.info(
        "serving %s on http://%s:%d/v1 ; API key %s",
        args.model_id,
        args.host,
        args.port,
        "required" if api_key else "not required",
    )
    server = uvicorn.Server(
        uvicorn_config(
            app,
            keep_alive_timeout_s=args.keep_alive_timeout_s,
            host=args.host,
            port=args.port,
            limit_concurrency=args.limit_concurrency,
            log_level=args.log_level,
            access_log=args.log_level == "debug",
            timeout_graceful_shutdown=5,
        )
    )
    server.should_exit = bool(failure)  # failed before the server object existed
    with counting_refusals(app.state.metrics):
        server.run()
    if failure:
        print(f"error: the model failed to load: {failure[0]}", file=sys.stderr)
        return 1
    return 0
