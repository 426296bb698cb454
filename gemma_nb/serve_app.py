"""The app of ``python -m gemma_nb serve``: the app factory, the engine, and the routers.

``create_app(load, model_name=...)`` builds the FastAPI app over a ``Runtime`` (``gemma_nb.serve``
loads one); ``serve_in_thread(app)`` (``gemma_nb.serve_http``) runs it with uvicorn on a thread.

How a request is kept from hurting the server:

- ``gemma_nb.serve_http.GuardMiddleware`` stands in front (Host, API key, body size and deadline,
  crashes as 500s); ``gemma_nb.serve_schema`` parses bodies strictly.
- JSON parsing, validation and tokenization run on a small CPU pool, never on the event loop, so
  ``/health`` and ``/metrics`` answer while a large request is being read.
- One helper, ``Engine.run``, starts every generation: whatever can fail is built *before* the
  queue slot is taken, and from then on the slot is released on every path (finish, exception,
  disconnect, cancellation). ``gemma_nb_slots_overdue`` counts slots held longer than a request
  can run (``slot_watchdog_s``): it must stay 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
import weakref
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from gemma_nb.generation import Generation, Runtime, SamplingParams, Step, chat_prompt_ids
from gemma_nb.serve_http import DEFAULT_BODY_TIMEOUT_S, DEFAULT_MAX_BODY_BYTES, GuardMiddleware, ServerMetrics
from gemma_nb.serve_schema import (
    APIError,
    ChatRequest,
    CompletionRequest,
    GenerateRequest,
    _Sampling,
    error_response,
    excerpt,
    parse_request,
)

DEFAULT_QUEUE_SIZE = 8
DEFAULT_SLOT_WATCHDOG_S = 900.0
RETRY_AFTER_S = 1
CPU_WORKERS = 2  # parsing and tokenizing; the model runs on its own single device thread

log = logging.getLogger("gemma_nb.serve")


# --------------------------------------------------------------------------------------------
# The engine: loading, admission, one generation at a time


class _Slot:
    """A queue place, released exactly once however the request ends."""

    def __init__(self, engine: Engine):
        self._engine, self.since = engine, time.monotonic()
        engine._slots.add(self)

    def release(self) -> None:
        slots = self._engine._slots
        if self in slots:
            slots.discard(self)
            self._engine.metrics.queue_depth.set(len(slots))


class Engine:
    """Owns the runtime, the device thread, the CPU pool, the lock and the queue slots."""

    def __init__(self, load: Callable[[], Runtime], metrics: ServerMetrics, queue_size: int, step_delay_s: float = 0.0,
                 slot_watchdog_s: float = DEFAULT_SLOT_WATCHDOG_S, on_load_failure: Callable[[str], None] | None = None):
        if queue_size < 1:
            raise ValueError(f"queue_size={queue_size} must be at least 1 (the generating request counts)")
        self._load, self.metrics, self.queue_size, self.step_delay_s = load, metrics, queue_size, step_delay_s
        self.slot_watchdog_s, self._on_load_failure = slot_watchdog_s, on_load_failure
        self.runtime: Runtime | None = None
        self.vocab_size: int | None = None
        self.status, self.error = "loading", None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gemma-nb-device")
        self._cpu = ThreadPoolExecutor(max_workers=CPU_WORKERS, thread_name_prefix="gemma-nb-cpu")
        self._lock = asyncio.Lock()
        self._slots: set[_Slot] = set()
        self.load_seconds: float | None = None
        metrics.slots_overdue.set_function(self._overdue)
        metrics.oldest_slot.set_function(lambda: max((time.monotonic() - s.since for s in list(self._slots)), default=0.0))

    @property
    def queue_depth(self) -> int:
        return len(self._slots)

    def _overdue(self) -> int:
        now = time.monotonic()
        return sum(now - s.since > self.slot_watchdog_s for s in list(self._slots))

    def start(self) -> None:
        """Load and warm up on the device thread; /health says 'loading' until it is done."""
        self._executor.submit(self._load_and_warm_up)

    def _load_and_warm_up(self) -> None:
        started = time.perf_counter()
        try:
            runtime = self._load()
            ids = list(runtime.tokenizer("warm up")["input_ids"])
            self.vocab_size = int(runtime.prefill(ids).numel())  # the ids a prompt may hold
            for _ in Generation(runtime, ids, SamplingParams(max_tokens=2, ignore_eos=True)):
                pass
            self.runtime = runtime
            self.load_seconds = time.perf_counter() - started
            self.status = "ok"
            self.metrics.ready.set(1)
            log.info("model loaded and warmed up in %.1f s", self.load_seconds)
        except Exception as error:  # reported by /health and every generation request
            self.status, self.error = "error", f"{type(error).__name__}: {error}"
            log.exception("model failed to load")
            if self._on_load_failure is not None:
                self._on_load_failure(self.error)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._cpu.shutdown(wait=False, cancel_futures=True)

    async def on_cpu(self, fn: Callable, *args):
        """``fn(*args)`` on the CPU pool: parsing and tokenizing stay off the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self._cpu, fn, *args)

    def require_runtime(self) -> Runtime:
        if self.status == "loading":
            raise APIError(503, "the model is still loading; retry when GET /health says ok",
                           "service_unavailable", code="model_loading", headers={"Retry-After": str(RETRY_AFTER_S)})
        if self.status != "ok":
            raise APIError(503, f"the model failed to load ({self.error}); see the server log",
                           "service_unavailable", code="model_load_failed")
        return self.runtime

    def admit(self) -> _Slot:
        if len(self._slots) >= self.queue_size:
            raise APIError(429, f"the server is busy: {len(self._slots)} requests are queued or running "
                           f"(queue size {self.queue_size}); retry after {RETRY_AFTER_S} s",
                           "rate_limit_error", code="queue_full", headers={"Retry-After": str(RETRY_AFTER_S)})
        slot = _Slot(self)
        self.metrics.queue_depth.set(len(self._slots))
        return slot

    async def run(self, request: Request, generation: Generation, arrival: float,
                  stream: Callable[[AsyncIterator[Step]], AsyncIterator[str]] | None = None) -> Generation | Response:
        """Admit ``generation`` (already built, so nothing before this can leak a slot) and run it.

        Without ``stream``: runs to the end and returns the finished generation. With it: returns
        the streaming response, ``stream(steps)`` giving its server-sent events; the response
        owns the slot from then on. 429 when the queue is full.
        """
        slot = self.admit()
        try:
            if stream is None:
                async with contextlib.aclosing(self.steps(request, generation, arrival)) as steps:
                    async for _ in steps:
                        pass
                return generation
            response = _GenerationStream(stream(self.steps(request, generation, arrival)), slot)
            slot = None
            return response
        finally:
            if slot is not None:
                slot.release()

    async def steps(self, request: Request, generation: Generation, arrival: float) -> AsyncIterator[Step]:
        """Run ``generation`` on the device, one token per step, stopping if the client goes away."""
        loop = asyncio.get_running_loop()
        try:
            async with self._lock:
                self.metrics.prompt_tokens.inc(len(generation.prompt_ids))
                previous = None
                while generation.finish_reason is None:
                    if await request.is_disconnected():
                        self._client_left(generation)
                        return
                    step = await loop.run_in_executor(self._executor, generation.step)
                    now = time.perf_counter()
                    if previous is None:
                        self.metrics.ttft.observe(now - arrival)
                    else:
                        self.metrics.itl.observe(now - previous)
                    previous = now
                    self.metrics.generated_tokens.inc()
                    yield step
        except (asyncio.CancelledError, GeneratorExit):
            # Starlette cancels a streaming response whose client hung up; either way the slot frees.
            if generation.finish_reason is None:
                self._client_left(generation)
            raise

    def _client_left(self, generation: Generation) -> None:
        self.metrics.disconnects.inc()
        log.info("client disconnected after %d tokens; generation stopped", len(generation.token_ids))


class _GenerationStream(StreamingResponse):
    """Server-sent events that release their queue slot when the response ends, however it ends."""

    def __init__(self, events: AsyncIterator[str], slot: _Slot):
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._slot = slot
        weakref.finalize(self, slot.release)  # a response dropped without being sent

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            with contextlib.suppress(RuntimeError):  # "already running": its own task ends it
                await self.body_iterator.aclose()
            self._slot.release()


# --------------------------------------------------------------------------------------------
# The app


def create_app(load: Callable[[], Runtime] | Runtime, *, model_name: str, aliases: Sequence[str] = (),
               queue_size: int = DEFAULT_QUEUE_SIZE, api_key: str | None = None, step_delay_s: float = 0.0,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S,
               allowed_hosts: Sequence[str] | None = None, slot_watchdog_s: float = DEFAULT_SLOT_WATCHDOG_S,
               on_load_failure: Callable[[str], None] | None = None) -> FastAPI:
    """The FastAPI app serving the runtime that ``load()`` returns (or an already loaded one).

    ``model_name`` is what ``/v1/models`` lists; requests may name it or one of ``aliases``.
    ``allowed_hosts``: the Host names answered (None: any; ``LOOPBACK_HOSTS`` for a loopback bind).
    ``on_load_failure(error)`` is called on the loading thread if the model fails to load.
    ``step_delay_s`` sleeps after every token on the device thread (tests and demos only).
    The routes come from four routers: ``status_router`` (health, metrics, models), ``chat_router``,
    ``completions_router`` and ``generate_router``; each generation route starts through ``Served``.
    """
    load_fn = load if callable(load) and not hasattr(load, "prefill") else (lambda: load)
    metrics = ServerMetrics(queue_size)
    engine = Engine(load_fn, metrics, queue_size, step_delay_s, slot_watchdog_s, on_load_failure)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        yield
        engine.shutdown()

    app = FastAPI(title="gemma-nb", summary="OpenAI-compatible API over the deployed model", lifespan=lifespan)
    app.state.engine, app.state.metrics = engine, metrics
    app.add_middleware(GuardMiddleware, metrics=metrics, api_key=api_key, max_body_bytes=max_body_bytes,
                       body_timeout_s=body_timeout_s, allowed_hosts=allowed_hosts)
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    served = Served(engine, model_name, aliases)
    for router in (status_router(served, metrics), chat_router(served), completions_router(served),
                   generate_router(served)):
        app.include_router(router)
    return app


async def _api_error(_request, error: APIError):
    return error.response()


async def _http_error(_request, error: StarletteHTTPException):
    kind = "not_found_error" if error.status_code == 404 else "invalid_request_error"
    return error_response(error.status_code, str(error.detail), kind, headers=getattr(error, "headers", None))


class Served:
    """The served model as the generation routes see it: what every route checks before it starts.

    ``body`` parses a request on the CPU pool and checks the model name and that the runtime is
    loaded; ``sampling`` checks the prompt and ``max_tokens`` against the context;
    ``generation`` builds the ``Generation`` that ``Engine.run`` starts.
    """

    def __init__(self, engine: Engine, model_name: str, aliases: Sequence[str] = ()):
        self.engine, self.model_name = engine, model_name
        self.names = {model_name, *aliases}
        self.created = int(time.time())

    async def body(self, request: Request, model):
        raw = await request.body()  # already read (and bounded) by GuardMiddleware
        body = await self.engine.on_cpu(parse_request, raw, request.headers.get("content-type"), model)
        if body.model is not None and body.model not in self.names:
            raise APIError(404, f"model {excerpt(body.model)} is not served here; this server serves "
                           f"{self.model_name!r} (GET /v1/models)", param="model", code="model_not_found")
        return body, self.engine.require_runtime()

    def check_token_ids(self, ids: Sequence[int], param: str) -> None:
        vocab = self.engine.vocab_size
        bad = next((i for i, t in enumerate(ids) if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(400, f"{param}[{bad}] = {ids[bad]} is not a token id of this model (0 to {vocab - 1})",
                           param=f"{param}.{bad}", code="invalid_value")

    def generation(self, body: _Sampling, runtime: Runtime, prompt_ids: list[int], max_tokens: int | None,
                   prompt_param: str, **options) -> Generation:
        params = sampling_params(body, runtime, len(prompt_ids), max_tokens, prompt_param)
        return Generation(runtime, prompt_ids, params, step_delay_s=self.engine.step_delay_s, **options)


def sampling_params(body: _Sampling, runtime: Runtime, prompt_len: int, max_tokens: int | None,
                    prompt_param: str) -> SamplingParams:
    """The request's sampling, after checking the prompt and ``max_tokens`` against the runtime's context."""
    context = runtime.max_context
    if prompt_len == 0:
        raise APIError(400, "prompt is empty; send text or at least one token id", param=prompt_param,
                       code="invalid_value")
    if max_tokens is not None and max_tokens > context:
        raise APIError(400, f"max_tokens={max_tokens} exceeds the model's context of {context} tokens",
                       param="max_tokens", code="invalid_value")
    if prompt_len >= context:
        raise APIError(400, f"the prompt has {prompt_len} tokens; the context holds {context} "
                       "(prompt + answer): shorten the prompt", param=prompt_param, code="context_length_exceeded")
    longest = getattr(runtime, "max_prompt_tokens", None)
    if longest is not None and prompt_len > longest:
        raise APIError(400, f"the prompt has {prompt_len} tokens; the deployed prefill takes at most {longest}: "
                       "shorten the prompt (or compile a larger prefill bucket)", param=prompt_param,
                       code="context_length_exceeded")
    if max_tokens is not None and prompt_len + max_tokens > context:
        raise APIError(400, f"the prompt has {prompt_len} tokens and max_tokens={max_tokens}: together "
                       f"{prompt_len + max_tokens} exceed the context of {context}; lower max_tokens",
                       param="max_tokens", code="context_length_exceeded")
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    return SamplingParams(max_tokens=max_tokens or context - prompt_len, temperature=body.temperature,
                          top_p=body.top_p, top_k=body.top_k, stop=stop, seed=body.seed, ignore_eos=body.ignore_eos)


def sse_events(first: dict | None, chunk: Callable[[Step], dict], usage: Callable[[], dict | None],
               generation: Generation) -> Callable[[AsyncIterator[Step]], AsyncIterator[str]]:
    """How ``Engine.run`` turns a generation's steps into server-sent events: ``first`` (if any), one
    ``chunk(step)`` per token, ``usage()`` (if not None) and ``[DONE]`` once it finished; an error
    after the stream started is reported in-band."""
    def stream(steps: AsyncIterator[Step]) -> AsyncIterator[str]:
        async def events():
            try:
                if first is not None:
                    yield _sse(first)
                async with contextlib.aclosing(steps):
                    async for step in steps:
                        yield _sse(chunk(step))  # one chunk per token, even if it adds no text
                if generation.finish_reason is not None:
                    final = usage()
                    if final is not None:
                        yield _sse(final)
                    yield "data: [DONE]\n\n"
            except Exception as error:  # the stream has started: report in-band, then end it
                log.exception("generation failed")
                yield _sse({"error": {"message": f"generation failed ({type(error).__name__}); see the server log",
                                      "type": "server_error", "param": None, "code": None}})
        return events()
    return stream


# --------------------------------------------------------------------------------------------
# The routers


def status_router(served: Served, metrics: ServerMetrics) -> APIRouter:
    """``/health``, ``/metrics`` (Prometheus) and ``/v1/models``: they answer while a generation runs."""
    router = APIRouter()
    engine = served.engine

    @router.get("/health")
    async def health():
        if engine.status == "ok":
            return {"status": "ok"}
        body = {"status": engine.status}
        if engine.error:
            body["error"] = engine.error
        return JSONResponse(body, status_code=503)

    @router.get("/metrics")
    async def prometheus_metrics():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @router.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": served.model_name, "object": "model", "created": served.created,
                                            "owned_by": "gemma-nb"}]}

    return router


def chat_router(served: Served) -> APIRouter:
    """``POST /v1/chat/completions`` (OpenAI chat; streamed as server-sent events with ``stream``)."""
    router = APIRouter()
    engine = served.engine

    @router.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        arrival = time.perf_counter()
        body, runtime = await served.body(request, ChatRequest)
        messages = [m.model_dump() for m in body.messages]
        try:
            prompt_ids = await engine.on_cpu(chat_prompt_ids, runtime.tokenizer, messages)
        except ValueError as error:
            raise APIError(400, str(error)[:200], param="messages", code="invalid_value") from None
        generation = served.generation(body, runtime, prompt_ids, body.max_completion_tokens or body.max_tokens,
                                       "messages", strip_leading_space=True)
        ident, stamp = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        base = {"id": ident, "object": "chat.completion.chunk", "created": stamp, "model": served.model_name}
        if not body.stream:
            await engine.run(request, generation, arrival)
            return {**base, "object": "chat.completion",
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": generation.text},
                                 "logprobs": None, "finish_reason": generation.finish_reason}],
                    "usage": _usage(generation)}
        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        def choice(delta: dict, reason: str | None) -> dict:
            payload = {**base, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}]}
            return {**payload, "usage": None} if include_usage else payload

        stream = sse_events(choice({"role": "assistant", "content": ""}, None),
                            lambda step: choice({"content": step.text}, step.finish_reason),
                            lambda: {**base, "choices": [], "usage": _usage(generation)} if include_usage else None,
                            generation)
        return await engine.run(request, generation, arrival, stream)

    return router


def completions_router(served: Served) -> APIRouter:
    """``POST /v1/completions`` (OpenAI completions: one prompt, text or token ids)."""
    router = APIRouter()
    engine = served.engine

    @router.post("/v1/completions")
    async def completions(request: Request):
        arrival = time.perf_counter()
        body, runtime = await served.body(request, CompletionRequest)
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise APIError(400, f"prompt is a list of {len(prompt)} strings; send one prompt per request",
                               param="prompt", code="invalid_value")
            prompt = prompt[0]
        if isinstance(prompt, str):
            prompt_ids = list((await engine.on_cpu(runtime.tokenizer, prompt))["input_ids"])
        else:
            prompt_ids = list(prompt)
            served.check_token_ids(prompt_ids, "prompt")
        generation = served.generation(body, runtime, prompt_ids, body.max_tokens, "prompt")
        base = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": served.model_name}
        if not body.stream:
            await engine.run(request, generation, arrival)
            return {**base, "choices": [{"index": 0, "text": generation.text, "logprobs": None,
                                         "finish_reason": generation.finish_reason}], "usage": _usage(generation)}
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        stream = sse_events(None,
                            lambda step: {**base, "choices": [{"index": 0, "text": step.text, "logprobs": None,
                                                               "finish_reason": step.finish_reason}]},
                            lambda: {**base, "choices": [], "usage": _usage(generation)} if include_usage else None,
                            generation)
        return await engine.run(request, generation, arrival, stream)

    return router


def generate_router(served: Served) -> APIRouter:
    """``POST /generate``: the plain route (text in, text, token ids and tok/s out)."""
    router = APIRouter()

    @router.post("/generate")
    async def generate_endpoint(request: Request):
        arrival = time.perf_counter()
        body, runtime = await served.body(request, GenerateRequest)
        prompt_ids = list((await served.engine.on_cpu(runtime.tokenizer, body.prompt))["input_ids"])
        generation = served.generation(body, runtime, prompt_ids, body.max_tokens, "prompt")
        started = time.perf_counter()
        await served.engine.run(request, generation, arrival)
        seconds = time.perf_counter() - started
        return {"text": generation.text, "tokens": len(generation.token_ids), "token_ids": generation.token_ids,
                "prompt_tokens": len(prompt_ids), "finish_reason": generation.finish_reason,
                "seconds": round(seconds, 4), "tok_s": round(len(generation.token_ids) / seconds, 2) if seconds else None}

    return router


def _usage(generation: Generation) -> dict:
    prompt, completion = len(generation.prompt_ids), len(generation.token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"
