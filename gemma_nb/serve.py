"""``python -m gemma_nb serve``: the deployed model behind an OpenAI-compatible HTTP API.

The port served its slim-deployed model on :8080 with an OpenAI-compatible API; this is the same
for any target, built with FastAPI + uvicorn (the stack vLLM's and TGI's OpenAI front ends use)::

    python -m gemma_nb serve --target cpu --model-id gemma-nb/tiny-gemma4-moe --port 8080

Endpoints: ``POST /v1/chat/completions`` and ``POST /v1/completions`` (``stream: true`` gives
server-sent events in OpenAI's chunk format, ending with ``data: [DONE]``), ``POST /generate``
(``{"prompt": ..., "max_tokens": ...}`` -> ``{"text", "tokens", ...}``), ``GET /v1/models``,
``GET /health`` (503 ``{"status": "loading"}`` while the model loads and warms up in a
background thread, then 200 ``{"status": "ok"}``) and ``GET /metrics`` (Prometheus).

Behaviour worth knowing:

- **One generation at a time.** The model has one KV cache and the device is busy per token, so
  requests take turns (an ``asyncio.Lock``; every model call runs on one worker thread).
- **A bounded queue.** At most ``queue_size`` requests (default 8) are admitted at once, *the one
  generating included*; one more gets 429 with ``Retry-After``. A client that disconnects frees
  its slot: the server checks ``request.is_disconnected()`` between tokens and stops generating.
- **Sampling.** ``temperature: 0`` is greedy (argmax). Otherwise ``temperature``, ``top_k`` and
  ``top_p`` filter the distribution and ``seed`` makes the draw reproducible. The OpenAI endpoints
  default to temperature 1.0 like OpenAI's API; ``/generate`` is greedy unless told otherwise.
  ``stop`` (a string or up to 4) ends the text before the first match; ``ignore_eos: true`` (as in
  vLLM) keeps generating past the end-of-sequence token, for fixed-length benchmarks.
- **Context.** ``max_tokens`` defaults to what is left of the context after the prompt. A prompt
  with no room left, or ``prompt + max_tokens`` over the context, is a 400 with code
  ``context_length_exceeded`` (OpenAI's choice; 413 would suggest the HTTP body was too big).
- **Errors** are OpenAI-shaped, ``{"error": {"message", "type", "param", "code"}}``, quoting at
  most a short excerpt of the input: malformed JSON, a missing or unknown field, a wrong type
  (strict: ``true`` is not an integer, ``"10"`` not a number) or a value out of range -> 400; an
  OpenAI option not implemented here (``logprobs``, ``n > 1``, ``tools``, ...) -> 400 naming it;
  body not JSON -> 415; body too large -> 413; body too slow -> 408; unknown model name -> 404;
  full queue -> 429; model still loading -> 503; a bug -> 500 (counted in ``/metrics``, the
  connection stays usable). The server keeps serving afterwards (``gemma_nb.serve_schema``).
- **Limits** (``gemma_nb.serve_app``): request bodies up to ``--max-body-bytes`` (4 MB), refused
  from ``Content-Length`` before they are read; a body must arrive within ``--body-timeout-s``
  (30 s) and a request head within ``--head-timeout-s`` (10 s), or the connection closes; idle
  keep-alive connections close after 5 s; request heads over 16 KiB are refused.
  Parsing and tokenizing run on a worker pool, so ``/health`` answers during a large request.
- **Chat formatting.** A tokenizer with a chat template (the real Gemma-4) formats ``messages``
  with it. One without (the bundled tiny checkpoint's word-level tokenizer) uses a documented
  fallback: the messages' contents joined by newlines, so a single user message is the prompt as
  written. The tiny model only completes its fact sentences, so ask it
  ``"The capital of France is"``, not ``"What is the capital of France?"`` (whose words it never saw).
  Chat answers have leading whitespace stripped; completions keep it (" Paris .").
- **Security.** Binds 127.0.0.1 by default, and then answers only requests whose ``Host`` is
  localhost, 127.0.0.1 or [::1] (plus each ``--allowed-host``), so a web page cannot reach it by
  DNS rebinding. If ``GEMMA_NB_API_KEY`` is set in the environment (never a command-line
  argument; never logged), every endpoint except ``/health`` needs ``Authorization: Bearer <key>``
  (scheme in any case) and answers 401 without it; ``/health`` stays open for load balancers and
  container health checks.
- **Fails fast.** A model or artifact that cannot be loaded ends the process with status 1 and
  the error: ``/health`` says "loading", then "ok", or the process is gone.
- ``usage`` counts prompt tokens and every sampled token (the end-of-sequence token included).
  A stream sends one chunk per sampled token, with empty text where the token shows none (an
  end-of-sequence token under ``ignore_eos``, or text held back for a possible stop string), so a
  client can time every token.

The model sits behind a small protocol, ``gemma_nb.generation.Runtime``, implemented in ``gemma_nb.runtimes`` (a tokenizer, ``prefill(prompt_ids)`` and
``decode(token_id)`` returning next-token logits). ``DeployRuntime`` drives the slim deploy of
notebook 05 (``gemma_nb.deploy``: host embedding, int8-squeezed compiled steps; its one-token
decode step reads only the routed experts, ``Int8Experts``, unlike the port's DenseExperts) one
token at a time. It is the default on the cpu target:
``--artifact <folder>`` serves a compiled folder, and without one the checkpoint is compiled into
a temporary folder while ``/health`` says "loading" (~30 s for the tiny checkpoint).
``TransformersRuntime`` (``--runtime transformers``; the default on cuda) wraps any transformers
causal LM and starts in seconds; on the bundled checkpoint both give the same greedy answers.
``NeuronDeployRuntime`` steps the port's NxD deploy on an inf2 (``--target neuron --artifact
<folder>``, from ``gemma_nb.neuron``): written against its cpu-tested graph interface, NOT RUN
here on Inferentia2.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import sys

import torch

# The HTTP side (serve_http, serve_schema, serve_app) and the generation loop live in their own modules; their names are re-exported
# here, so ``serve.create_app``, ``serve.Generation`` and ``serve.SamplingParams`` keep working.
from gemma_nb.generation import (  # noqa: F401
    DETOKENIZE_CONTEXT_TOKENS,
    Generation,
    Runtime,
    SamplingParams,
    Step,
    _held_back,
    chat_prompt_ids,
    generate,
    sample_token,
)

# The model runtimes live in gemma_nb.runtimes; re-exported for ``serve.DeployRuntime`` and friends.
from gemma_nb.runtimes import (  # noqa: F401
    DEFAULT_PREFILL_LEN,
    RUNTIMES,
    DeployRuntime,
    NeuronDeployRuntime,
    TransformersRuntime,
    compile_for_serving,
    load_deploy_runtime,
    load_neuron_runtime,
    load_runtime,
)
from gemma_nb.serve_app import DEFAULT_QUEUE_SIZE, DEFAULT_SLOT_WATCHDOG_S, Engine, create_app  # noqa: F401
from gemma_nb.serve_http import (  # noqa: F401
    API_KEY_ENV,
    DEFAULT_BODY_TIMEOUT_S,
    DEFAULT_HEAD_TIMEOUT_S,
    DEFAULT_HOST,
    DEFAULT_KEEP_ALIVE_TIMEOUT_S,
    DEFAULT_MAX_BODY_BYTES,
    LOOPBACK_HOSTS,
    serve_in_thread,
    uvicorn_config,
)
from gemma_nb.serve_schema import APIError, ChatRequest, CompletionRequest, GenerateRequest, error_response  # noqa: F401
from gemma_nb.targets import TargetError, check_target
from gemma_nb.tiny import BUNDLED_ID

DEFAULT_PORT = 8080

log = logging.getLogger("gemma_nb.serve")


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m gemma_nb serve",
        description="OpenAI-compatible server for the deployed model. The API key, if any, comes from the "
                    f"{API_KEY_ENV} environment variable (never a flag).")
    parser.add_argument("--target", default="cpu", help="cpu (default), neuron or cuda")
    parser.add_argument("--model-id", default=BUNDLED_ID, help=f"local folder or hub id (default: {BUNDLED_ID})")
    parser.add_argument("--served-model-name", default=None, help="the name /v1/models lists (default: --model-id)")
    parser.add_argument("--host", default=DEFAULT_HOST, help="interface to bind (default 127.0.0.1, loopback only)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="default 8080, as the port's container")
    parser.add_argument("--queue-size", type=int, default=DEFAULT_QUEUE_SIZE,
                        help="most requests admitted at once, the generating one included; more get 429 (default 8)")
    parser.add_argument("--max-context", type=int, default=None,
                        help="context length in tokens, prompt + answer (default: the model's own)")
    parser.add_argument("--runtime", choices=RUNTIMES, default="auto",
                        help="deploy: the slim deploy of notebook 05 (int8 squeeze, compiled steps); transformers: "
                             "the model as transformers loads it (default auto: deploy on cpu, transformers on cuda)")
    parser.add_argument("--artifact", default=None,
                        help="a compiled artifact folder: gemma_nb.export's for the cpu slim deploy (without it the "
                             "model is compiled into a temporary folder at start-up), gemma_nb.neuron.build's on neuron "
                             "(required there: it holds the tokenizer too, --model-id is then only the served name)")
    parser.add_argument("--prefill-len", type=int, default=DEFAULT_PREFILL_LEN,
                        help=f"prefill bucket when compiling at start-up: the longest prompt (default {DEFAULT_PREFILL_LEN})")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="weights dtype for --runtime transformers (default float32)")
    parser.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                        help=f"largest request body; bigger ones get 413 unread (default {DEFAULT_MAX_BODY_BYTES:,})")
    parser.add_argument("--body-timeout-s", type=float, default=DEFAULT_BODY_TIMEOUT_S,
                        help=f"a request body must arrive within this; slower ones get 408 (default {DEFAULT_BODY_TIMEOUT_S:g})")
    parser.add_argument("--head-timeout-s", type=float, default=DEFAULT_HEAD_TIMEOUT_S,
                        help=f"a request's head (line and headers) must arrive within this, or the connection is "
                             f"closed (default {DEFAULT_HEAD_TIMEOUT_S:g})")
    parser.add_argument("--keep-alive-timeout-s", type=float, default=DEFAULT_KEEP_ALIVE_TIMEOUT_S,
                        help=f"idle keep-alive connections close after this (default {DEFAULT_KEEP_ALIVE_TIMEOUT_S})")
    parser.add_argument("--allowed-host", action="append", default=[], metavar="NAME",
                        help="on a loopback bind, answer this Host name too (repeatable; localhost, 127.0.0.1 and "
                             "[::1] always)")
    parser.add_argument("--slot-watchdog-s", type=float, default=DEFAULT_SLOT_WATCHDOG_S,
                        help="gemma_nb_slots_overdue counts queue slots held longer than this "
                             f"(default {DEFAULT_SLOT_WATCHDOG_S:g})")
    parser.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    return parser


def _check_arguments(args) -> None:
    """Raise ValueError for what would only fail later: bad numbers, a model or artifact that is not there."""
    check_target(args.target)
    if args.queue_size < 1:
        raise ValueError(f"--queue-size {args.queue_size} must be at least 1")
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port {args.port} is not a TCP port (0-65535)")
    for flag, value in (("--max-body-bytes", args.max_body_bytes), ("--body-timeout-s", args.body_timeout_s),
                        ("--keep-alive-timeout-s", args.keep_alive_timeout_s),
                        ("--head-timeout-s", args.head_timeout_s), ("--slot-watchdog-s", args.slot_watchdog_s)):
        if not value > 0:
            raise ValueError(f"{flag} {value} must be positive")
    if args.max_context is not None and args.max_context < 1:
        raise ValueError(f"--max-context {args.max_context} must be at least 1 (tokens of KV cache per request)")
    if args.prefill_len < 1:
        raise ValueError(f"--prefill-len {args.prefill_len} must be at least 1 (tokens per compiled prefill)")
    if args.artifact is not None and not os.path.isdir(args.artifact):
        raise ValueError(f"--artifact {args.artifact}: no such folder; pass the folder the compile step wrote")
    if args.model_id.startswith((".", "/", "~")) and not os.path.exists(os.path.expanduser(args.model_id)):
        raise ValueError(f"--model-id {args.model_id}: no such folder; pass a local model folder or a hub id")


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m gemma_nb serve``; returns the exit status.

    2 for bad arguments, 1 if the model fails to load (the server stops at once), 0 after a
    normal shutdown (Ctrl-C or SIGTERM).
    """
    import uvicorn

    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        _check_arguments(args)
    except (TargetError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    api_key = os.environ.get(API_KEY_ENV) or None
    loopback = _is_loopback(args.host)
    if not loopback and api_key is None:
        log.warning("binding %s without an API key: anyone who can reach this port can use the model "
                    "(set %s)", args.host, API_KEY_ENV)
    dtype = getattr(torch, args.dtype)

    def load() -> Runtime:
        return load_runtime(args.target, args.model_id, max_context=args.max_context, runtime=args.runtime,
                            artifact=args.artifact, prefill_len=args.prefill_len, dtype=dtype)

    server: uvicorn.Server | None = None
    failure: list[str] = []

    def stop_on_failure(error: str) -> None:
        failure.append(error)
        if server is not None:
            server.should_exit = True  # uvicorn checks it every 0.1 s

    name = args.served_model_name or args.model_id
    aliases = {args.model_id, os.path.basename(os.path.normpath(args.model_id))}
    allowed_hosts = [*LOOPBACK_HOSTS, *args.allowed_host] if loopback else None
    app = create_app(load, model_name=name, aliases=sorted(aliases), queue_size=args.queue_size, api_key=api_key,
                     max_body_bytes=args.max_body_bytes, body_timeout_s=args.body_timeout_s,
                     allowed_hosts=allowed_hosts, slot_watchdog_s=args.slot_watchdog_s, on_load_failure=stop_on_failure)
    log.info("serving %s (target %s) on http://%s:%d/v1 ; API key %s", name, args.target, args.host, args.port,
             f"required ({API_KEY_ENV} is set)" if api_key else "not required")
    server = uvicorn.Server(uvicorn_config(app, keep_alive_timeout_s=args.keep_alive_timeout_s,
                                           head_timeout_s=args.head_timeout_s, host=args.host,
                                           port=args.port, log_level=args.log_level,
                                           access_log=args.log_level == "debug", timeout_graceful_shutdown=5))
    if failure:  # failed before the server object existed
        server.should_exit = True
    server.run()
    if failure:
        print(f"error: the model failed to load: {failure[0]}", file=sys.stderr)
        return 1
    return 0
