"""The HTTP guard of ``python -m gemma_nb serve``: what stands between a client and the app.

``GuardMiddleware`` sits outermost: the Host allow-list (loopback binds; DNS rebinding), the API
key, the body limit (413 from ``Content-Length`` before reading anything, or as soon as a
streamed body passes the limit), the body deadline (408), and any unexpected exception turned
into a 500 JSON body that leaves the connection usable. Every response is counted in
``/metrics`` by endpoint and status, 5xx included. ``uvicorn_config`` adds the transport limits:
a deadline and a 16 KiB cap for each request head, and the keep-alive timeout.
``serve_in_thread(app)`` runs an app with them on a background thread (tests, notebook 07).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import threading
import time
from collections.abc import Sequence

from fastapi import FastAPI
from fastapi.responses import Response

from gemma_nb.serve_schema import error_response, excerpt

API_KEY_ENV = "GEMMA_NB_API_KEY"
DEFAULT_HOST = "127.0.0.1"
DEFAULT_MAX_BODY_BYTES = 4_000_000  # 4 MB: a 128k-token prompt as text is well under 1 MB
DEFAULT_BODY_TIMEOUT_S = 30.0
DEFAULT_HEAD_TIMEOUT_S = 10.0
DEFAULT_KEEP_ALIVE_TIMEOUT_S = 5
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "[::1]")
OPEN_PATHS = frozenset({"/health"})
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/generate", "/v1/models", "/health", "/metrics")

log = logging.getLogger("gemma_nb.serve")


# --------------------------------------------------------------------------------------------
# Metrics and the guard in front of every request


class ServerMetrics:
    """The server's Prometheus metrics, in a registry of their own (one per app)."""

    def __init__(self, queue_size: int):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("gemma_nb_requests", "HTTP requests by endpoint and status", ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("gemma_nb_prompt_tokens", "prompt tokens prefilled", registry=r)
        self.generated_tokens = Counter("gemma_nb_generated_tokens", "tokens generated (sampled)", registry=r)
        self.disconnects = Counter("gemma_nb_client_disconnects", "generations stopped because the client left", registry=r)
        self.ttft = Histogram("gemma_nb_time_to_first_token_seconds", "request arrival to first token",
                              buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120), registry=r)
        self.itl = Histogram("gemma_nb_time_per_output_token_seconds", "time between consecutive tokens",
                             buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5), registry=r)
        self.queue_depth = Gauge("gemma_nb_queue_depth", "requests admitted and not finished (the generating one included)", registry=r)
        self.queue_capacity = Gauge("gemma_nb_queue_capacity", "most requests admitted at once (--queue-size)", registry=r)
        self.slots_overdue = Gauge("gemma_nb_slots_overdue", "queue slots held longer than a request can run "
                                   "(--slot-watchdog-s); anything but 0 is a leak", registry=r)
        self.oldest_slot = Gauge("gemma_nb_oldest_slot_seconds", "age of the oldest held queue slot (0 if none)", registry=r)
        self.ready = Gauge("gemma_nb_model_ready", "1 once the model is loaded and warmed up", registry=r)
        self.queue_capacity.set(queue_size)


def _endpoint_label(path: str) -> str:
    return path if path in ENDPOINTS else "other"


def _host_name(host_header: bytes) -> str:
    """``b"LocalHost:8080"`` -> ``"localhost"``; ``b"[::1]:80"`` -> ``"[::1]"``."""
    host = host_header.decode("latin-1").strip().lower()
    if host.startswith("["):
        return host[: host.find("]") + 1] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


async def _nobody_to_answer(scope, receive, send) -> None:
    """The client left while sending its body: no response to send."""


class GuardMiddleware:
    """In front of the app: counts responses, checks Host and API key, bounds the body, catches crashes.

    ``allowed_hosts`` (None: any) is the Host allow-list, ports ignored. The body is read here,
    at most ``max_body_bytes`` of it within ``body_timeout_s``, and handed on whole; the app reads
    the client's disconnect through the same channel afterwards.
    """

    def __init__(self, app, metrics: ServerMetrics, api_key: str | None, max_body_bytes: int,
                 body_timeout_s: float, allowed_hosts: Sequence[str] | None):
        self.app, self.metrics = app, metrics
        self._key = api_key.encode() if api_key else None
        self.max_body_bytes, self.body_timeout_s = max_body_bytes, body_timeout_s
        self.allowed_hosts = None if allowed_hosts is None else frozenset(_host_name(h.encode()) for h in allowed_hosts)

    def _authorized(self, header: bytes) -> bool:
        scheme, _, token = header.strip().partition(b" ")
        # The scheme is case-insensitive (RFC 9110, section 11.1); the key is compared in constant time.
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self._key)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        endpoint = _endpoint_label(scope["path"])
        started = False

        async def counting_send(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                self.metrics.requests.labels(endpoint, str(message["status"])).inc()
            await send(message)

        headers = dict(scope["headers"])
        problem = self._refusal(scope, headers)
        if problem is None and scope["method"] in ("POST", "PUT", "PATCH"):
            receive, problem = await self._read_body(headers, receive)
        if problem is not None:
            return await problem(scope, receive, counting_send)
        try:
            await self.app(scope, receive, counting_send)
        except Exception as error:
            log.exception("request %s %s failed", scope["method"], scope["path"])
            if started:
                raise  # mid-stream: nothing to do but close the connection
            response = error_response(500, f"the server failed on this request ({type(error).__name__}); "
                                      "see its log", "server_error")
            await response(scope, receive, counting_send)

    def _refusal(self, scope, headers: dict) -> Response | None:
        if self.allowed_hosts is not None and _host_name(headers.get(b"host", b"")) not in self.allowed_hosts:
            return error_response(
                400, f"Host {excerpt(headers.get(b'host', b'').decode('latin-1'))} is not allowed: this server "
                f"answers to {', '.join(sorted(self.allowed_hosts))} (add a name with --allowed-host)",
                param="Host", code="invalid_host")
        if self._key is not None and scope["path"] not in OPEN_PATHS and not self._authorized(headers.get(b"authorization", b"")):
            return error_response(
                401, "missing or wrong API key: send 'Authorization: Bearer <key>' with the key the server "
                f"was started with ({API_KEY_ENV})", code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        return None

    def _too_large(self, size: str) -> Response:
        return error_response(413, f"the request body is {size}; this server takes at most {self.max_body_bytes:,} "
                              "bytes (--max-body-bytes)", code="body_too_large", headers={"Connection": "close"})

    async def _read_body(self, headers: dict, receive):
        """(a receive that replays the body, None) or (receive, the error response)."""
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            return receive, self._too_large(f"{int(declared):,} bytes")
        body, deadline = bytearray(), time.monotonic() + self.body_timeout_s
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(deadline - time.monotonic(), 0.0))
            except TimeoutError:
                return receive, error_response(408, f"the request body did not arrive within {self.body_timeout_s:g} s",
                                               code="request_timeout", headers={"Connection": "close"})
            if message["type"] == "http.disconnect":
                return receive, _nobody_to_answer
            body += message.get("body", b"")
            if len(body) > self.max_body_bytes:
                return receive, self._too_large(f"over {self.max_body_bytes:,} bytes")
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()

        return replay, None



# --------------------------------------------------------------------------------------------
# Running it


def _h11_with_head_deadline(head_timeout_s: float):
    """uvicorn's h11 protocol, plus a deadline for every request head.

    uvicorn closes a keep-alive connection only when it is silent; a client that sends a header
    line every few seconds (slowloris) would hold its connection for ever. Here the head of each
    request (the first on a connection, or the next after a response) must be complete within
    ``head_timeout_s``, or the connection is closed.
    """
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class H11WithHeadDeadline(H11Protocol):
        _head_timer = None

        def _arm_head_deadline(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
            waiting_after = self.cycle  # a new request head replaces self.cycle
            self._head_timer = self.loop.call_later(head_timeout_s, self._head_deadline_passed, waiting_after)

        def _head_deadline_passed(self, waiting_after) -> None:
            if self.cycle is waiting_after and not self.transport.is_closing():
                self.transport.close()

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm_head_deadline()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm_head_deadline()

        def connection_lost(self, exc) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
            super().connection_lost(exc)

    return H11WithHeadDeadline


def uvicorn_config(app, *, keep_alive_timeout_s: float = DEFAULT_KEEP_ALIVE_TIMEOUT_S,
                   head_timeout_s: float = DEFAULT_HEAD_TIMEOUT_S, **kwargs):
    """uvicorn settings shared by the CLI and ``serve_in_thread``: a request head must arrive within
    ``head_timeout_s`` and be under 16 KiB; idle keep-alive connections close after ``keep_alive_timeout_s``."""
    import uvicorn

    return uvicorn.Config(app, http=_h11_with_head_deadline(head_timeout_s), timeout_keep_alive=keep_alive_timeout_s,
                          h11_max_incomplete_event_size=16 * 1024, **kwargs)


@contextlib.contextmanager
def serve_in_thread(app: FastAPI, host: str = DEFAULT_HOST, port: int = 0, ready_timeout_s: float = 120.0,
                    **config):
    """Serve ``app`` with uvicorn on a background thread; yields the base URL (``http://host:port``).

    ``port=0`` picks a free port. Waits until uvicorn listens (not until the model is loaded:
    poll ``/health`` for that). Stops the server on exit. ``config``: ``uvicorn_config``'s timeouts.
    """
    import socket

    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    server = uvicorn.Server(uvicorn_config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=2, **config))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True, name="gemma-nb-uvicorn")
    thread.start()
    deadline = time.monotonic() + ready_timeout_s
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"uvicorn did not start on {host}:{sock.getsockname()[1]}")
        time.sleep(0.02)
    try:
        yield f"http://{host}:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()
