"""``create_app(load, model_name=...)``: the app of ``python -m gemma_nb serve`` over a ``Runtime``:
``Gate`` refuses what costs the most first (README: "Serving the model"), ``Engine`` queues requests
FIFO for the one device thread."""

import asyncio
import contextlib
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from starlette.exceptions import HTTPException
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.requests import ClientDisconnect

from gemma_nb.cli import (
    API_KEY_ENV,
    DEFAULT_BODY_TIMEOUT_S,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_TOKENS,
    DEFAULT_MAX_TOKENS_CAP,
    DEFAULT_QUEUE_SIZE,
    DEFAULT_SLOT_WATCHDOG_S,
)
from gemma_nb.serving import schema
from gemma_nb.serving.backends import (
    Generation,
    Runtime,
    SamplingParams,
    Step,
    chat_prompt_ids,
    generate,
    message_texts,
)
from gemma_nb.serving.schema import APIError

MAX_HEAD_BYTES = 16 * 1024
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "[::1]")
GENERATION_PATHS = ("/v1/chat/completions", "/v1/completions", "/generate")
ENDPOINTS = (*GENERATION_PATHS, "/v1/models", "/health", "/metrics")
RETRY_AFTER_S, CPU_WORKERS, WAIT_POLL_S = 1, 2, 0.1
CLOSE = {"Connection": "close"}
STARLETTE_CODES = {
    404: "not_found",
    405: "method_not_allowed",
    408: "request_timeout",
    413: "body_too_large",
}
SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
ERRORS = {
    status: {"model": schema.ErrorBody, "description": why}
    for status, why in (
        (400, "invalid (error.param names the field)"),
        (401, "no or wrong API key"),
        (404, "model not served here"),
        (408, "body too slow"),
        (413, "body too large"),
        (415, "body not JSON"),
        (429, "queue full; see Retry-After"),
        (503, "model loading, or it failed to load, or the server is stopping"),
    )
}
STREAMED = {
    200: {
        "content": {
            "text/event-stream": {
                "schema": {
                    "type": "object",
                    "required": ["data"],
                    "properties": {
                        "data": {"type": "string", "description": "a chunk as JSON, or [DONE]"}
                    },
                }
            }
        },
        "description": "JSON, or with stream: true server-sent events of chunks ending in data: "
        "[DONE]",
    }
}

log = logging.getLogger("gemma_nb.serve")


class ServerMetrics:
    """The server's Prometheus metrics, ``gemma_nb_*``, in a registry of its own."""

    def __init__(self):
        r = self.registry = CollectorRegistry()

        def counter(name: str, doc: str, *labels: str) -> Counter:
            return Counter(f"gemma_nb_{name}", doc, labels, registry=r)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"gemma_nb_{name}", doc, registry=r)

        def seconds(name: str, doc: str) -> Histogram:
            return Histogram(f"gemma_nb_{name}_seconds", doc, buckets=SECONDS, registry=r)

        self.requests = counter(
            "requests", "HTTP responses by endpoint and status", "endpoint", "status"
        )
        self.refused = counter(
            "http_refused",
            "refused by uvicorn: malformed (400), over --limit-concurrency (503)",
            "reason",
        )
        self.prompt_tokens = counter("prompt_tokens", "prompt tokens prefilled")
        self.generated_tokens = counter("generated_tokens", "tokens generated (sampled)")
        self.disconnects = counter(
            "client_disconnects", "requests given up because the client left"
        )
        self.ttft = seconds("time_to_first_token", "request arrival to first token")
        self.itl = seconds("time_per_output_token", "time between consecutive tokens")
        self.queue_depth = gauge(
            "queue_depth", "requests admitted and not finished (the generating one included)"
        )
        self.queue_capacity = gauge(
            "queue_capacity", "most requests admitted at once (--queue-size)"
        )
        self.slots_overdue = gauge(
            "slots_overdue", "queue slots held longer than --slot-watchdog-s: a hung request"
        )
        self.oldest_slot = gauge(
            "oldest_slot_seconds", "age of the oldest held queue slot (0 if none)"
        )
        self.ready = gauge("model_ready", "1 once the model is loaded and warmed up")


class Engine:
    def __init__(
        self,
        load: Callable[[], Runtime],
        model_name: str,
        aliases: Sequence[str],
        queue_size: int,
        max_tokens: int,
        slot_watchdog_s: float,
        on_load_failure: Callable[[str], None] | None,
    ):
        assert queue_size >= 1, "queue_size counts the generating request"
        self._load, self._on_load_failure = load, on_load_failure
        self.metrics = metrics = ServerMetrics()
        self.queue_size, self.max_tokens = queue_size, max_tokens
        self.model_name, self.names = model_name, {model_name, *aliases}
        self.created = int(time.time())
        self.status = "loading"
        self.runtime = self.vocab_size = self.error = None
        self.max_prompt_tokens = self.max_prompt_chars = None  # known once the model is
        self.stopping = False  # SIGINT or SIGTERM: end what runs, answer what waits
        self.device = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gemma-nb-device")
        self.cpu = ThreadPoolExecutor(max_workers=CPU_WORKERS, thread_name_prefix="gemma-nb-cpu")
        self._turn, self.slots = asyncio.Lock(), {}  # slots: admitted request -> since when
        ages = lambda: [time.monotonic() - since for since in list(self.slots.values())]  # noqa: E731
        metrics.queue_depth.set_function(lambda: len(self.slots))
        metrics.queue_capacity.set(queue_size)
        metrics.slots_overdue.set_function(lambda: sum(age > slot_watchdog_s for age in ages()))
        metrics.oldest_slot.set_function(lambda: max(ages(), default=0.0))

    def load_and_warm_up(self) -> None:
        started = time.perf_counter()
        try:
            runtime = self._load()
            ids = list(runtime.tokenizer("warm up")["input_ids"])
            self.vocab_size = int(runtime.prefill(ids).numel())  # the ids a prompt may hold
            longest = getattr(runtime, "max_prompt_tokens", None) or runtime.max_context
            self.max_prompt_tokens = min(runtime.max_context - 1, longest)
            # no token spells more characters than the longest piece of the vocabulary
            piece = max(map(len, runtime.tokenizer.get_vocab()))
            self.max_prompt_chars = self.max_prompt_tokens * piece
            generate(runtime, ids, max_tokens=2, ignore_eos=True)
            self.runtime, self.status = runtime, "ok"
            self.metrics.ready.set(1)
            log.info("model loaded and warmed up in %.1f s", time.perf_counter() - started)
        except Exception as error:  # reported by /health and every generation request
            self.status, self.error = "error", f"{type(error).__name__}: {error}"
            log.exception("model failed to load")
            if self._on_load_failure is not None:
                self._on_load_failure(self.error)

    async def on_cpu(self, fn: Callable, *args):  # tokenizing stays off the event loop
        return await asyncio.get_running_loop().run_in_executor(self.cpu, fn, *args)

    def check_characters(self, chars: int, param: str) -> None:
        """Refuse, before tokenizing it, text that no tokenization fits into a prompt."""
        if chars > self.max_prompt_chars:
            raise APIError(
                400,
                f"the prompt has {chars:,} characters; {self.max_prompt_tokens} tokens of this "
                f"model spell at most {self.max_prompt_chars:,}: shorten it",
                param=param,
                code="context_length_exceeded",
            )

    async def _wait_turn(self, request: Request) -> bool:
        """Wait in line for the device; False, with the place given up, if the client leaves
        first."""
        acquire, got = asyncio.ensure_future(self._turn.acquire()), False
        try:
            while not got:
                got = bool((await asyncio.wait([acquire], timeout=WAIT_POLL_S))[0])
                if not got and (self.stopping or await request.is_disconnected()):
                    return False
            return True
        finally:
            if not got:  # gave up, or cancelled: the turn must never stay taken
                acquire.cancel()
                acquire.add_done_callback(lambda done: done.cancelled() or self._turn.release())

    async def steps(
        self, request: Request, generation: Generation, arrival: float
    ) -> AsyncIterator[Step]:
        turn, previous, failed = False, arrival, False
        try:
            turn = await self._wait_turn(request)
            self.metrics.prompt_tokens.inc(len(generation.prompt_ids) if turn else 0)
            while (
                turn
                and generation.finish_reason is None
                and not self.stopping
                and not await request.is_disconnected()
            ):
                step = await asyncio.get_running_loop().run_in_executor(
                    self.device, generation.step
                )
                now = time.perf_counter()
                (self.metrics.itl if generation.token_ids[1:] else self.metrics.ttft).observe(
                    now - previous
                )
                previous = now
                self.metrics.generated_tokens.inc()
                yield step
            if generation.finish_reason is None:  # the server stops, or the client left
                raise shutting_down() if self.stopping else ClientDisconnect()
        except Exception as error:
            failed = not isinstance(error, ClientDisconnect)
            raise
        finally:
            # unfinished and not failed: the client left while waiting or between tokens
            # (Starlette cancels its stream)
            if generation.finish_reason is None and not failed:
                self.metrics.disconnects.inc()
                log.info(
                    "client left after %d tokens; its request was given up",
                    len(generation.token_ids),
                )
            if turn:
                self._turn.release()

    def ready(self, model: str | None) -> Runtime:
        loading = self.status == "loading"
        if model is not None and model not in self.names:
            raise APIError(
                404,
                f"model {schema.excerpt(model)} is not served here; it serves "
                f"{self.model_name!r} (GET /v1/models)",
                param="model",
                code="model_not_found",
            )
        if self.status != "ok":
            raise APIError(
                503,
                "the model is still loading; retry when GET /health says ok"
                if loading
                else f"the model failed to load ({self.error}); see the server log",
                "service_unavailable",
                code="model_loading" if loading else "model_load_failed",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        return self.runtime

    def generation(
        self, body, runtime: Runtime, ids: list[int], max_tokens: int | None, param: str, **options
    ) -> Generation:
        context, count = runtime.max_context, len(ids)
        if count == 0:
            raise APIError(
                400,
                f"{param} is empty once tokenized; send some text",
                param=param,
                code="empty_prompt",
            )
        if count > self.max_prompt_tokens:  # the context, or the deployed prefill, holds no more
            raise APIError(
                400,
                f"the prompt has {count} tokens; at most {self.max_prompt_tokens} fit (the context "
                f"holds {context}): shorten it",
                param=param,
                code="context_length_exceeded",
            )
        if max_tokens is not None and count + max_tokens > context:
            raise APIError(
                400,
                f"the prompt has {count} tokens and max_tokens={max_tokens}: together "
                f"{count + max_tokens} exceed the context of {context}; lower max_tokens",
                param="max_tokens",
                code="context_length_exceeded",
            )
        params = SamplingParams(
            max_tokens=max_tokens or min(self.max_tokens, context - count),
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
            stop=(body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ()),
            seed=None if body.seed is None else body.seed % 2**64,
            ignore_eos=body.ignore_eos,
        )
        return Generation(runtime, ids, params, **options)

    async def reply(
        self, request: Request, body, generation: Generation, arrival: float, chat: bool
    ):
        """OpenAI's answer: one JSON object, or with ``stream`` server-sent chunks, one per
        token."""
        usage = body.stream_options or schema.StreamOptions()
        base = {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
            "created": int(time.time()),
            "model": self.model_name,
        }
        if not body.stream:
            async for _ in self.steps(request, generation, arrival):  # run out, it closes itself
                pass
            key, value = (
                ("message", {"role": "assistant", "content": generation.text})
                if chat
                else ("text", generation.text)
            )
            return {
                **base,
                "object": "chat.completion" if chat else "text_completion",
                "usage": generation.usage(),
                "choices": [
                    {
                        "index": 0,
                        key: value,
                        "logprobs": None,
                        "finish_reason": generation.finish_reason,
                    }
                ],
            }
        base["object"] = "chat.completion.chunk" if chat else "text_completion"
        return self._stream(request, generation, arrival, chat, base, usage)

    def _stream(
        self, request: Request, generation: Generation, arrival: float, chat: bool, base, usage
    ) -> StreamingResponse:
        """Server-sent chunks, one per token, then usage (if asked) and ``[DONE]``."""

        def chunk(text: str, reason: str | None, role: bool = False) -> str:
            content = (
                {"delta": {"role": "assistant", "content": text} if role else {"content": text}}
                if chat
                else {"text": text}
            )
            payload = {
                **base,
                "choices": [{"index": 0, **content, "logprobs": None, "finish_reason": reason}],
            }
            return _sse(
                {**payload, "usage": generation.usage() if usage.continuous_usage_stats else None}
                if usage.include_usage
                else payload
            )

        async def events():
            try:
                if chat:
                    yield chunk("", None, role=True)
                async with contextlib.aclosing(self.steps(request, generation, arrival)) as steps:
                    async for step in steps:
                        # one chunk per token, even without text
                        yield chunk(step.text, step.finish_reason)
                if usage.include_usage:
                    yield _sse({**base, "choices": [], "usage": generation.usage()})
                yield "data: [DONE]\n\n"
            except ClientDisconnect:
                return  # nobody to tell
            except Exception as error:  # the stream has started: report in-band, then end it
                if not isinstance(error, APIError):  # an APIError here: the server stops
                    log.exception("generation failed")
                    message = f"generation failed ({type(error).__name__}); see the server log"
                    error = APIError(500, message, "server_error")
                yield f"data: {error.response().body.decode()}\n\n"

        return StreamingResponse(
            events(),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )


class Gate:
    """The one middleware, before the body is read: a head over 16 KiB (431), Content-Length with
    Transfer-Encoding (400), a declared body over the limit (413), no API key (401, before a queue
    place: keyless clients hold none), a full queue (429); then the body bounded in size (413) and
    time (408)."""

    def __init__(self, app, engine: Engine, max_body_bytes: int, body_timeout_s: float, key_check):
        self.app, self.engine, self.key_check = app, engine, key_check
        self.max_body_bytes, self.body_timeout_s = max_body_bytes, body_timeout_s

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        endpoint, started = scope["path"] if scope["path"] in ENDPOINTS else "other", False

        async def counted(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                self.engine.metrics.requests.labels(endpoint, str(message["status"])).inc()
            await send(message)

        queued = scope["method"] == "POST" and scope["path"] in GENERATION_PATHS
        if (refusal := await self._refusal(scope, queued)) is not None:
            return await refusal(scope, receive, counted)
        slot, slots = object(), self.engine.slots
        if queued:
            slots[slot] = time.monotonic()  # held until the response has ended, however it ends
        try:
            await self.app(scope, self._bounded(receive), counted)
        except Exception as error:
            log.exception("request %s %s failed", scope["method"], scope["path"])
            if started:
                raise  # mid-stream: nothing to do but close the connection
            await APIError(
                500,
                f"the server failed on this request ({type(error).__name__}); see its log",
                "server_error",
            ).response()(scope, receive, counted)
        finally:
            slots.pop(slot, None)

    async def _refusal(self, scope, queued: bool) -> Response | None:
        headers = dict(scope["headers"])
        head = (
            len(scope["raw_path"])
            + len(scope["query_string"])
            + sum(len(k) + len(v) + 4 for k, v in scope["headers"])
        )
        declared, engine = headers.get(b"content-length", b""), self.engine
        if head > MAX_HEAD_BYTES:  # h11 caps only a head that arrives in pieces
            return APIError(
                431,
                f"the request head is {head:,} bytes; at most {MAX_HEAD_BYTES:,}",
                code="head_too_large",
                headers=CLOSE,
            ).response()
        if declared and b"transfer-encoding" in headers:
            return APIError(
                400,
                "both Content-Length and Transfer-Encoding: the body's length is ambiguous; send "
                "one",
                code="ambiguous_length",
                headers=CLOSE,
            ).response()
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            return APIError(
                413,
                f"the request body is {int(declared):,} bytes; at most {self.max_body_bytes:,} "
                "(--max-body-bytes)",
                code="body_too_large",
                headers=CLOSE,
            ).response()
        if queued and self.key_check is not None:
            require_key, bearer = self.key_check
            try:
                await require_key(await bearer(Request(scope)))
            except APIError as error:
                return error.response()
        if queued and len(engine.slots) >= engine.queue_size:
            return APIError(
                429,
                f"the server is busy: {len(engine.slots)} requests queued or running "
                f"(--queue-size {engine.queue_size}); retry after {RETRY_AFTER_S} s",
                "rate_limit_error",
                code="queue_full",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            ).response()

    def _bounded(self, receive):
        """``receive`` with the body bounded: 413 past ``max_body_bytes`` (a chunked body too), 408
        past the deadline."""
        deadline, size, done = time.monotonic() + self.body_timeout_s, 0, False

        async def bounded():
            nonlocal size, done
            if done:
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(deadline - time.monotonic(), 0.0))
            except TimeoutError:
                raise HTTPException(
                    408, f"the request body did not arrive within {self.body_timeout_s:g} s"
                ) from None
            size += len(message.get("body", b""))
            if size > self.max_body_bytes:
                raise HTTPException(
                    413,
                    f"the request body is over {self.max_body_bytes:,} bytes (--max-body-bytes)",
                )
            done = message["type"] != "http.request" or not message.get("more_body", False)
            return message

        return bounded


def shutting_down() -> APIError:
    return APIError(
        503,
        "the server is shutting down (SIGINT or SIGTERM); send the request again once it is back",
        "service_unavailable",
        code="shutting_down",
    )


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


def _key_check(api_key: str):
    """FastAPI's ``HTTPBearer`` and the check of what it reads: a route dependency (documented in
    /openapi.json), which ``Gate`` also runs before a generation request takes a queue place."""
    key, described = api_key.encode(), f"the key the server was started with ({API_KEY_ENV})"
    bearer = HTTPBearer(auto_error=False, description=described)

    async def require_key(credentials: HTTPAuthorizationCredentials | None = Depends(bearer)):
        if credentials is None or not hmac.compare_digest(credentials.credentials.encode(), key):
            raise APIError(
                401,
                "missing or wrong API key: send 'Authorization: Bearer <key>' with the key the "
                f"server was started with ({API_KEY_ENV})",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )

    return require_key, bearer


def create_app(
    load: Callable[[], Runtime] | Runtime,
    *,
    model_name: str,
    aliases: Sequence[str] = (),
    queue_size: int = DEFAULT_QUEUE_SIZE,
    api_key: str | None = None,
    metrics_need_key: bool = False,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    max_tokens_cap: int = DEFAULT_MAX_TOKENS_CAP,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S,
    allowed_hosts: Sequence[str] | None = None,
    slot_watchdog_s: float = DEFAULT_SLOT_WATCHDOG_S,
    on_load_failure: Callable[[str], None] | None = None,
) -> FastAPI:
    """The app serving the runtime ``load()`` returns (or a loaded one) as ``model_name`` (or
    ``aliases``); ``api_key`` (None: open) guards all but ``/health`` (and ``/metrics`` without
    ``metrics_need_key``); ``allowed_hosts``: None, any Host; ``on_load_failure(error)`` if the load
    fails."""
    assert 1 <= max_tokens <= max_tokens_cap, "max_tokens must be between 1 and max_tokens_cap"
    engine = Engine(
        load if callable(load) and not hasattr(load, "prefill") else (lambda: load),
        model_name,
        aliases,
        queue_size,
        max_tokens,
        slot_watchdog_s,
        on_load_failure,
    )

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        engine.device.submit(engine.load_and_warm_up)  # /health says 'loading' until it is done
        yield
        for pool in (engine.device, engine.cpu):
            pool.shutdown(wait=False, cancel_futures=True)

    # a body without Content-Type is read as JSON
    app = FastAPI(
        title="gemma-nb",
        summary="OpenAI-compatible API over the deployed model",
        lifespan=lifespan,
        strict_content_type=False,
    )
    app.state.metrics, app.state.engine = engine.metrics, engine
    key_check = _key_check(api_key) if api_key else None
    if allowed_hosts is not None:
        app.add_middleware(
            TrustedHostMiddleware, allowed_hosts=list(allowed_hosts), www_redirect=False
        )
    app.add_middleware(
        Gate,
        engine=engine,
        max_body_bytes=max_body_bytes,
        body_timeout_s=body_timeout_s,
        key_check=key_check,
    )
    models = [
        schema.served(m, max_tokens_cap, engine)
        for m in (schema.ChatRequest, schema.CompletionRequest, schema.GenerateRequest)
    ]
    fields = {
        path: sorted(set(m.model_fields) - set(schema.UNSUPPORTED))
        for path, m in zip(GENERATION_PATHS, models)
    }

    _error_handlers(app, fields)

    # FastAPI keeps the first document it makes: made afresh until the vocabulary is known
    def openapi():
        if engine.status != "ok":
            app.openapi_schema = None
        return FastAPI.openapi(app)

    app.openapi = openapi
    keyed = [Depends(key_check[0])] if key_check else []
    _info_routes(app, engine, keyed, keyed if metrics_need_key else [])
    _generation_routes(app, engine, *models, keyed)
    return app


def _error_handlers(app: FastAPI, fields: dict) -> None:
    """Every error as OpenAI's body, naming the field where the request models name one."""

    # APIError's, Starlette's own (404, 405)
    @app.exception_handler(HTTPException)
    async def http_error(_request, error: HTTPException):
        status = error.status_code
        return APIError(
            status,
            str(error.detail),
            getattr(error, "type", "not_found_error" if status == 404 else "invalid_request_error"),
            getattr(error, "param", None),
            getattr(error, "code", STARLETTE_CODES.get(status)),
            headers={**(error.headers or {}), **(CLOSE if status in (408, 413) else {})},
        ).response()

    @app.exception_handler(ClientDisconnect)  # nobody to answer; counted as nginx logs it
    async def client_left(_request, _error):
        return Response(status_code=499)

    @app.exception_handler(RequestValidationError)  # the request models' errors, naming the field
    async def invalid(request: Request, error: RequestValidationError):
        return await http_error(
            request,
            schema.validation_error(
                error, request.headers.get("content-type"), fields.get(request.url.path)
            ),
        )


def _info_routes(app: FastAPI, engine: Engine, keyed: list, metrics_keyed: list) -> None:
    @app.get(
        "/health",
        response_model=schema.Health,
        response_model_exclude_none=True,
        responses={503: {"model": schema.Health, "description": "not ready"}},
    )
    async def health():
        body = {"status": engine.status, **({"error": engine.error} if engine.error else {})}
        return body if engine.status == "ok" else JSONResponse(body, status_code=503)

    @app.get(
        "/metrics",
        response_class=PlainTextResponse,
        dependencies=metrics_keyed,
        responses={401: ERRORS[401]},
    )
    async def prometheus_metrics():
        return Response(generate_latest(engine.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get(
        "/v1/models",
        response_model=schema.ModelList,
        dependencies=keyed,
        responses={401: ERRORS[401]},
    )
    async def list_models():
        return {
            "object": "list",
            "data": [
                {
                    "id": engine.model_name,
                    "object": "model",
                    "created": engine.created,
                    "owned_by": "gemma-nb",
                }
            ],
        }


async def _prompt_ids(engine: Engine, runtime: Runtime, prompt) -> list[int]:
    """A completion's prompt as token ids: a string (or a one-string list) tokenized, ids checked
    against the vocabulary."""
    if isinstance(prompt, list) and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        engine.check_characters(len(prompt), "prompt")
        return list((await engine.on_cpu(runtime.tokenizer, prompt))["input_ids"])
    # as long as the context at most (the request model checked): still, not on the event loop
    bad = await engine.on_cpu(
        lambda: next((i for i, t in enumerate(prompt) if t >= engine.vocab_size), None)
    )
    if bad is not None:
        raise APIError(
            400,
            f"prompt[{bad}] = {prompt[bad]} is not a token id of this model (0 to "
            f"{engine.vocab_size - 1})",
            param=f"prompt.{bad}",
            code="invalid_value",
        )
    return prompt


def _generation_routes(
    app: FastAPI, engine: Engine, Chat, Completions, Generate, keyed: list
) -> None:  # noqa: N803

    @app.post(
        "/v1/chat/completions",
        response_model=schema.ChatCompletion,
        responses={**STREAMED, **ERRORS},
        dependencies=keyed,
    )
    async def chat_completions(body: Chat, request: Request):
        arrival, runtime = time.perf_counter(), engine.ready(body.model)
        messages = [
            {
                "role": "system" if m.role == "developer" else m.role,
                "content": m.model_dump()["content"],
            }
            for m in body.messages
        ]
        engine.check_characters(sum(map(len, message_texts(messages))), "messages")
        try:
            ids = await engine.on_cpu(chat_prompt_ids, runtime.tokenizer, messages)
        except ValueError as error:
            raise APIError(400, str(error)[:200], param="messages", code="invalid_value") from None
        generation = engine.generation(
            body,
            runtime,
            ids,
            body.max_completion_tokens or body.max_tokens,
            "messages",
            strip_leading_space=True,
        )
        return await engine.reply(request, body, generation, arrival, chat=True)

    @app.post(
        "/v1/completions",
        response_model=schema.Completion,
        responses={**STREAMED, **ERRORS},
        dependencies=keyed,
    )
    async def completions(body: Completions, request: Request):
        arrival, runtime = time.perf_counter(), engine.ready(body.model)
        ids = await _prompt_ids(engine, runtime, body.prompt)
        generation = engine.generation(body, runtime, ids, body.max_tokens, "prompt")
        return await engine.reply(request, body, generation, arrival, chat=False)

    @app.post("/generate", response_model=schema.Generated, responses=ERRORS, dependencies=keyed)
    async def generate(body: Generate, request: Request):
        runtime = engine.ready(body.model)
        engine.check_characters(len(body.prompt), "prompt")
        ids = list((await engine.on_cpu(runtime.tokenizer, body.prompt))["input_ids"])
        generation = engine.generation(body, runtime, ids, body.max_tokens, "prompt")
        started = time.perf_counter()
        async for _ in engine.steps(request, generation, started):
            pass
        seconds = time.perf_counter() - started
        return {
            "text": generation.text,
            "tokens": len(generation.token_ids),
            "token_ids": generation.token_ids,
            "prompt_tokens": len(generation.prompt_ids),
            "finish_reason": generation.finish_reason,
            "seconds": round(seconds, 4),
            "tok_s": round(len(generation.token_ids) / seconds, 2) if seconds else None,
        }
