"""``python -m gemma_nb serve``: the command (exit 2 for bad arguments, 1 if the model fails to
load, 0 after Ctrl-C or SIGTERM), and uvicorn with its own limits for the connections."""

import contextlib
import functools
import ipaddress
import logging
import os
import sys

import torch
import uvicorn

from gemma_nb.cli import DEFAULT_KEEP_ALIVE_TIMEOUT_S, DEFAULT_LIMIT_CONCURRENCY
from gemma_nb.neuron.sdk import check_target_with_sdk
from gemma_nb.serving import app as served
from gemma_nb.serving.backends import load_runtime
from gemma_nb.targets import TargetError
from gemma_nb.tiny import BUNDLED_ID

# uvicorn answers these itself (plain text; the app never sees them) and has no hook but its log.
UVICORN_REFUSALS = {
    "Invalid HTTP request received.": "invalid_http",
    "Exceeded concurrency limit.": "concurrency_limit",
}

log = logging.getLogger("gemma_nb.serve")


def _check_arguments(args) -> None:
    """Raise ValueError for what would only fail later (argparse checked each number alone)."""
    check_target_with_sdk(args.target)
    if args.max_tokens > args.max_tokens_cap:
        raise ValueError(
            f"--max-tokens {args.max_tokens} is over --max-tokens-cap {args.max_tokens_cap}"
        )
    if args.artifact is not None and not os.path.isdir(args.artifact):
        raise ValueError(
            f"--artifact {args.artifact}: no such folder; pass the folder the compile step wrote "
            "(outputs/cpu/artifacts/04_tiny is made by make run, or python -m gemma_nb run "
            "--target cpu --only 04)"
        )
    if args.model_id.startswith((".", "/", "~")) and not os.path.exists(
        os.path.expanduser(args.model_id)
    ):
        raise ValueError(
            f"--model-id {args.model_id}: no such folder; pass a local model folder or a hub id"
        )


class StoppingServer(uvicorn.Server):
    """uvicorn's server that tells the app's engine first on SIGINT or SIGTERM (it ends streams and
    queued requests at once), then exits 0 where uvicorn would raise the signal again."""

    def handle_exit(self, sig, frame) -> None:
        self.config.app.state.engine.stopping = True
        super().handle_exit(sig, frame)
        self._captured_signals.clear()


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


def main(args) -> int:
    """``args`` as ``cli`` parsed them."""
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    args.model_id = args.model_id or BUNDLED_ID
    try:
        _check_arguments(args)
    except (TargetError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    api_key, loopback = os.environ.get(served.API_KEY_ENV) or None, args.host == "localhost"
    server, failure = None, []
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
    server = StoppingServer(
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
