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
- **Errors** are OpenAI-shaped, ``{"error": {"message", "type", "param", "code"}}``: malformed
  JSON, a missing field or a bad value -> 400; unknown model name -> 404; full queue -> 429;
  model still loading -> 503. The server keeps serving afterwards.
- **Chat formatting.** A tokenizer with a chat template (the real Gemma-4) formats ``messages``
  with it. One without (the bundled tiny checkpoint's word-level tokenizer) uses a documented
  fallback: the messages' contents joined by newlines, so a single user message is the prompt as
  written. The tiny model only completes its fact sentences, so ask it
  ``"The capital of France is"``, not ``"What is the capital of France?"`` (whose words it never saw).
  Chat answers have leading whitespace stripped; completions keep it (" Paris .").
- **Security.** Binds 127.0.0.1 by default. If ``GEMMA_NB_API_KEY`` is set in the environment
  (never a command-line argument; never logged), every endpoint except ``/health`` needs
  ``Authorization: Bearer <key>`` and answers 401 without it; ``/health`` stays open for load
  balancers and container health checks.
- ``usage`` counts prompt tokens and every sampled token (the end-of-sequence token included).
  A stream sends one chunk per sampled token, with empty text where the token shows none (an
  end-of-sequence token under ``ignore_eos``, or text held back for a possible stop string), so a
  client can time every token.

The model sits behind a small protocol, ``Runtime`` (a tokenizer, ``prefill(prompt_ids)`` and
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
import asyncio
import contextlib
import hmac
import ipaddress
import json
import logging
import math
import os
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Iterator, Literal, Protocol, Sequence

import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

API_KEY_ENV = "GEMMA_NB_API_KEY"
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8080
DEFAULT_QUEUE_SIZE = 8
RETRY_AFTER_S = 1
MAX_STOP_SEQUENCES = 4
# Prompt tokens decoded together with the answer so a word keeps its leading space (" Paris").
DETOKENIZE_CONTEXT_TOKENS = 4
OPEN_PATHS = frozenset({"/health"})
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/generate", "/v1/models", "/health", "/metrics")

log = logging.getLogger("gemma_nb.serve")


# --------------------------------------------------------------------------------------------
# The model behind the server


class Runtime(Protocol):
    """What the server needs from a loaded model. One decoding session at a time.

    ``prefill(prompt_ids)`` starts a new sequence (dropping any previous one) and returns the
    logits for the token after the prompt, a float tensor [vocab]. ``decode(token_id)`` appends
    one token and returns the logits for the next one. ``max_context`` is the most positions the
    model holds (prompt + generated tokens).
    """

    tokenizer: Any
    max_context: int
    eos_token_ids: frozenset[int]
    # Optional: a runtime whose prefill has a fixed bucket sets max_prompt_tokens (read with getattr).

    def prefill(self, prompt_ids: Sequence[int]) -> torch.Tensor: ...

    def decode(self, token_id: int) -> torch.Tensor: ...


def _eos_ids(*sources) -> frozenset[int]:
    ids: set[int] = set()
    for source in sources:
        if source is None:
            continue
        ids.update([source] if isinstance(source, int) else source)
    return frozenset(ids)


class TransformersRuntime:
    """A transformers causal LM (``model(input_ids, cache=...)``) with its own KV cache."""

    def __init__(self, model, tokenizer, max_context: int | None = None):
        from transformers import DynamicCache

        self.model, self.tokenizer = model, tokenizer
        model_limit = getattr(model.config, "max_position_embeddings", None) or max_context
        self.max_context = _context_limit(max_context, model_limit)
        generation_config = getattr(model, "generation_config", None)
        self.eos_token_ids = _eos_ids(getattr(generation_config, "eos_token_id", None), tokenizer.eos_token_id)
        self._device = next(model.parameters()).device
        self._new_cache = lambda: DynamicCache(config=model.config)
        self._cache = None

    @torch.inference_mode()
    def _forward(self, ids: list[int]) -> torch.Tensor:
        input_ids = torch.tensor([ids], dtype=torch.long, device=self._device)
        out = self.model(input_ids=input_ids, cache=self._cache, use_cache=True, logits_to_keep=1)
        return out.logits[0, -1].float().cpu()

    def prefill(self, prompt_ids: Sequence[int]) -> torch.Tensor:
        self._cache = self._new_cache()
        return self._forward(list(prompt_ids))

    def decode(self, token_id: int) -> torch.Tensor:
        if self._cache is None:
            raise RuntimeError("decode() before prefill(): start a sequence with prefill(prompt_ids)")
        return self._forward([token_id])


class DeployRuntime:
    """The slim deploy (``gemma_nb.deploy.SlimDeploy``): host embedding -> compiled prefill / decode steps.

    ``runner`` is the deploy's ``gemma_nb.compile.StepRunner`` (its two programs, weights, host
    embedding and KV-cache shapes); this drives it one step at a time, as ``StepRunner.generate``
    does in one loop, so the server can sample, stream and stop between tokens. The prefill runs
    on a fixed bucket of ``max_prompt_tokens`` positions; the cache holds ``max_cache_len``.
    """

    def __init__(self, runner, tokenizer, max_context: int | None = None, eos_token_ids=None):
        from gemma_nb.compile import new_kv_cache

        self.runner, self.tokenizer = runner, tokenizer
        self.max_context = _context_limit(max_context, runner.shapes.max_cache_len)
        self.max_prompt_tokens = min(runner.shapes.prefill_len, self.max_context - 1)
        self.eos_token_ids = _eos_ids(eos_token_ids, tokenizer.eos_token_id)
        self._new_cache = lambda: new_kv_cache(runner.kv_shapes, runner.dtype)
        self._kv, self._position = None, 0

    @torch.inference_mode()
    def prefill(self, prompt_ids: Sequence[int]) -> torch.Tensor:
        runner, count = self.runner, len(prompt_ids)
        if not 0 < count <= self.max_prompt_tokens:
            raise ValueError(f"a prompt of {count} tokens; the compiled prefill takes 1 to {self.max_prompt_tokens}")
        self._kv = self._new_cache()
        padded = torch.full((1, runner.shapes.prefill_len), runner.pad_token_id, dtype=torch.long)
        padded[0, :count] = torch.tensor(list(prompt_ids))
        logits = runner.prefill(runner.weights, self._kv, runner.embed(padded), torch.tensor([0]), torch.tensor([count - 1]))
        self._position = count  # where the first generated token goes
        return logits.float().reshape(-1)

    @torch.inference_mode()
    def decode(self, token_id: int) -> torch.Tensor:
        if self._kv is None:
            raise RuntimeError("decode() before prefill(): start a sequence with prefill(prompt_ids)")
        if self._position >= self.runner.shapes.max_cache_len:
            raise ValueError(f"the KV cache of {self.runner.shapes.max_cache_len} positions is full")
        runner = self.runner
        logits = runner.decode(runner.weights, self._kv, runner.embed(torch.tensor([[int(token_id)]])),
                               torch.tensor([self._position]), torch.tensor([0]))
        self._position += 1
        return logits.float().reshape(-1)


class NeuronDeployRuntime:
    """The port's deploy on Inferentia2 (``gemma_nb.neuron.deploy.slim_deploy``), one step at a time.

    ``runner`` is the ``NeuronStepRunner`` (compiled graph, host embedding, config, KV length
    ``max_len`` and prefill ``bucket``); its KV cache is device state that each step updates in
    place, so a new prefill simply overwrites it. NOT RUN HERE on an inf2: the tests drive it over
    the cpu variant of the traced module (``gemma_nb.neuron.deploy.CpuStateGraph``).
    """

    def __init__(self, runner, tokenizer, max_context: int | None = None, eos_token_ids=None):
        self.runner, self.tokenizer = runner, tokenizer
        self.max_context = _context_limit(max_context, runner.max_len)
        self.max_prompt_tokens = min(runner.bucket, self.max_context - 1)
        self.eos_token_ids = _eos_ids(eos_token_ids, tokenizer.eos_token_id)
        self._position = None

    @torch.inference_mode()
    def _step(self, ids: torch.Tensor, positions: list[int], last_index: int) -> torch.Tensor:
        from gemma_nb.neuron.build import host_logits, step_inputs

        runner = self.runner
        inputs = step_inputs(runner.embed(ids), positions, runner.max_len, runner.config.sliding_window, last_index)
        return host_logits(runner.graph(*inputs), runner.config).reshape(-1)

    def prefill(self, prompt_ids: Sequence[int]) -> torch.Tensor:
        bucket, count = self.runner.bucket, len(prompt_ids)
        if not 0 < count <= self.max_prompt_tokens:
            raise ValueError(f"a prompt of {count} tokens; the compiled prefill takes 1 to {self.max_prompt_tokens}")
        padded = torch.full((1, bucket), self.runner.pad_token_id, dtype=torch.long)
        padded[0, :count] = torch.tensor(list(prompt_ids))
        # Padding slots are rewritten by later decode steps before any query can see them.
        logits = self._step(padded, list(range(bucket)), count - 1)
        self._position = count
        return logits

    def decode(self, token_id: int) -> torch.Tensor:
        if self._position is None:
            raise RuntimeError("decode() before prefill(): start a sequence with prefill(prompt_ids)")
        logits = self._step(torch.tensor([[int(token_id)]]), [self._position], 0)
        self._position += 1
        return logits


def _context_limit(requested: int | None, model_limit: int | None) -> int:
    if model_limit is None and requested is None:
        raise ValueError("the model does not say how long its context is: pass max_context (--max-context N)")
    if requested is None:
        return int(model_limit)
    if requested < 2:
        raise ValueError(f"max_context={requested} is too small: a prompt and one new token need at least 2")
    if model_limit is not None and requested > model_limit:
        raise ValueError(
            f"max_context={requested} exceeds the model's {model_limit} positions; "
            f"pass --max-context {model_limit} or less"
        )
    return int(requested)


RUNTIMES = ("auto", "deploy", "transformers")
DEFAULT_PREFILL_LEN = 128  # the port's shipped build: prefill bucket 128, KV cache 512


def load_runtime(target: str = "cpu", model_id: str | None = None, *, max_context: int | None = None,
                 runtime: str = "auto", artifact: str | None = None, prefill_len: int = DEFAULT_PREFILL_LEN,
                 dtype: torch.dtype = torch.float32) -> Runtime:
    """Load ``model_id`` for ``target`` behind the ``Runtime`` protocol.

    ``runtime="deploy"`` is the slim deploy of notebook 05 (``gemma_nb.deploy.SlimDeploy``): the
    compiled ``artifact`` folder if given, else ``model_id`` int8-squeezed and compiled into a
    temporary folder first (removed at exit). ``"transformers"`` loads the model with
    ``gemma_nb.modelio.load_model`` onto the target's torch device, unquantized, and starts in
    seconds. ``"auto"`` is deploy on cpu, transformers on cuda. Compiling at start-up takes ~30 s
    for the tiny checkpoint on a busy 2-core box (notebook 04 measures how it grows).
    """
    from gemma_nb.targets import check_target, torch_device
    from gemma_nb.tiny import BUNDLED_ID

    check_target(target)
    model_id = model_id or BUNDLED_ID
    if runtime not in RUNTIMES:
        raise ValueError(f"runtime {runtime!r} is not one of {', '.join(RUNTIMES)}")
    if target == "neuron":
        if runtime == "transformers" or artifact is None:
            raise ValueError(
                "the neuron target serves the compiled NxD artifact: pass --artifact <folder> written by "
                "gemma_nb.neuron.build.compile_neuron (notebook 04), and --model-id for its tokenizer"
            )
        return load_neuron_runtime(model_id, artifact, max_context=max_context)
    if runtime == "auto":
        runtime = "deploy" if target == "cpu" else "transformers"
    if runtime == "deploy":
        if target != "cpu":
            raise ValueError(f"runtime 'deploy' runs the cpu artifact of gemma_nb.compile; on {target} use --runtime transformers")
        return load_deploy_runtime(model_id, artifact=artifact, max_context=max_context, prefill_len=prefill_len)
    from gemma_nb.modelio import load_model

    model, tokenizer = load_model(model_id, dtype=dtype, device=torch_device(target))
    return TransformersRuntime(model, tokenizer, max_context)


def compile_for_serving(model_id: str, folder: str, max_cache_len: int, prefill_len: int) -> None:
    """The deploy's artifact for ``model_id``: full model on the host, int8 squeeze, export (notebooks 04/05)."""
    from gemma_nb import compile as compile_mod
    from gemma_nb import deploy

    model = deploy.load_full_model(model_id)
    deploy.int8_squeeze(model)
    shapes = compile_mod.StepShapes(max_cache_len=max_cache_len, prefill_len=min(prefill_len, max_cache_len))
    compile_mod.compile_model(model, folder, shapes, scheme=deploy.SQUEEZE)


def _tokenizer_and_eos(model_id: str):
    from transformers import AutoTokenizer, GenerationConfig

    from gemma_nb.modelio import hf_token, resolve_model_id

    source = resolve_model_id(model_id)
    token = None if os.path.isdir(source) else hf_token()
    tokenizer = AutoTokenizer.from_pretrained(source, token=token, trust_remote_code=False)
    try:  # Gemma's chat models also end a turn with <end_of_turn>, listed in generation_config.json
        eos = GenerationConfig.from_pretrained(source, token=token).eos_token_id
    except OSError:
        eos = None
    return source, tokenizer, eos


def load_neuron_runtime(model_id: str, artifact: str, *, max_context: int | None = None) -> NeuronDeployRuntime:
    """The port's slim deploy on Inferentia2 (NOT RUN HERE): the NxD artifact, ``model_id``'s tokenizer."""
    from gemma_nb.neuron.deploy import slim_deploy

    _, tokenizer, eos = _tokenizer_and_eos(model_id)
    runner, figures = slim_deploy(artifact)
    log.info("NEFF loaded in %.1f s; host embedding in %.1f s", figures["neff_load_s"], figures["embedding_load_s"])
    return NeuronDeployRuntime(runner, tokenizer, max_context, eos_token_ids=eos)


def load_deploy_runtime(model_id: str, *, artifact: str | None = None, max_context: int | None = None,
                        prefill_len: int = DEFAULT_PREFILL_LEN) -> DeployRuntime:
    """The slim deploy of ``artifact`` (or of ``model_id``, compiled now), with ``model_id``'s tokenizer."""
    import atexit
    import shutil
    import tempfile

    from transformers import AutoConfig

    from gemma_nb import deploy

    source, tokenizer, eos = _tokenizer_and_eos(model_id)
    if artifact is None:
        limit = getattr(AutoConfig.from_pretrained(source, trust_remote_code=False), "max_position_embeddings", None)
        cache_len = _context_limit(max_context, limit)
        artifact = tempfile.mkdtemp(prefix="gemma-nb-serve-")
        atexit.register(shutil.rmtree, artifact, ignore_errors=True)
        started = time.perf_counter()
        compile_for_serving(model_id, artifact, cache_len, prefill_len)
        log.info("compiled %s for the slim deploy in %.1f s", model_id, time.perf_counter() - started)
    slim = deploy.SlimDeploy(artifact)
    return DeployRuntime(slim.runner, tokenizer, max_context, eos_token_ids=eos)


# --------------------------------------------------------------------------------------------
# Prompts, sampling, and one generation


def chat_prompt_ids(tokenizer, messages: Sequence[dict]) -> list[int]:
    """Token ids of a chat: the tokenizer's chat template if it has one, else the fallback.

    Fallback (tokenizers without a template, like the bundled word-level one): the messages'
    text contents joined with newlines, tokenized as a plain prompt (with BOS).
    """
    texts = [_message_text(m) for m in messages]
    if getattr(tokenizer, "chat_template", None):
        conversation = [{"role": m["role"], "content": t} for m, t in zip(messages, texts)]
        text = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    return list(tokenizer("\n".join(t for t in texts if t))["input_ids"])


def _message_text(message: dict) -> str:
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    # OpenAI content parts: [{"type": "text", "text": ...}, ...]; only text is understood here.
    parts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") != "text":
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ValueError(f"message content part of type {kind!r} is not supported; send text parts only")
        parts.append(str(part.get("text", "")))
    return "".join(parts)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each token. ``temperature == 0`` is greedy; ``top_k <= 0`` means no top-k."""

    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    ignore_eos: bool = False

    def __post_init__(self):
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens!r} must be a positive integer")
        if not (0.0 <= self.temperature <= 2.0):
            raise ValueError(f"temperature={self.temperature} must be in [0, 2]; 0 is greedy")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")


def sample_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None) -> int:
    """One token id from next-token ``logits`` [vocab] under ``params``."""
    if params.temperature == 0.0:
        return int(torch.argmax(logits))
    scores = logits.float() / params.temperature
    if 0 < params.top_k < scores.numel():
        kth = torch.topk(scores, params.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, -math.inf)
    if params.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=True)
        cumulative = torch.softmax(sorted_scores, dim=-1).cumsum(-1)
        # Drop a token once the ones before it already cover top_p; the first always stays.
        drop = (cumulative - torch.softmax(sorted_scores, dim=-1)) >= params.top_p
        scores = scores.scatter(0, order, sorted_scores.masked_fill(drop, -math.inf))
    probs = torch.softmax(scores, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


@dataclass
class Step:
    """One generated token: its id, the new text it made visible, and why generation ended (if it did)."""

    token_id: int
    text: str
    finish_reason: Literal["stop", "length"] | None = None


@dataclass
class Generation:
    """One request's decoding session over a ``Runtime``; ``step()`` produces one token.

    Holds back text that might be the start of a stop string (so a stop string is never streamed)
    and text ending in a half-decoded character. Not thread-safe: one caller at a time.
    """

    runtime: Runtime
    prompt_ids: list[int]
    params: SamplingParams
    strip_leading_space: bool = False
    step_delay_s: float = 0.0
    token_ids: list[int] = field(default_factory=list, init=False)
    finish_reason: str | None = field(default=None, init=False)
    _emitted: int = field(default=0, init=False, repr=False)

    def __post_init__(self):
        tokenizer = self.runtime.tokenizer
        self._context = self.prompt_ids[-DETOKENIZE_CONTEXT_TOKENS:]
        self._context_text = tokenizer.decode(self._context, skip_special_tokens=True)
        self._generator = torch.Generator()
        if self.params.seed is None:
            self._generator.seed()
        else:
            self._generator.manual_seed(self.params.seed)

    @property
    def text(self) -> str:
        """The answer so far as the client sees it (stop strings and after removed)."""
        return self._visible(self._decoded())[0]

    def _decoded(self) -> str:
        full = self.runtime.tokenizer.decode(self._context + self.token_ids, skip_special_tokens=True)
        if full.startswith(self._context_text):
            text = full[len(self._context_text):]
        else:  # a tokenizer that merges across the boundary: keep the common prefix's tail
            text = full[len(os.path.commonprefix([full, self._context_text])):]
        return text.lstrip() if self.strip_leading_space else text

    def _visible(self, text: str) -> tuple[str, bool]:
        cut = min((i for i in (text.find(s) for s in self.params.stop) if i >= 0), default=-1)
        return (text[:cut], True) if cut >= 0 else (text, False)

    def step(self) -> Step:
        if self.finish_reason is not None:
            raise RuntimeError(f"generation already finished ({self.finish_reason})")
        if self.token_ids:
            logits = self.runtime.decode(self.token_ids[-1])
        else:
            logits = self.runtime.prefill(self.prompt_ids)
        if self.step_delay_s:
            time.sleep(self.step_delay_s)  # tests and demos: emulate a slower device
        token = sample_token(logits, self.params, self._generator)
        self.token_ids.append(token)
        text, stopped = self._visible(self._decoded())
        if stopped or (token in self.runtime.eos_token_ids and not self.params.ignore_eos):
            self.finish_reason = "stop"
        elif len(self.token_ids) >= self.params.max_tokens:
            self.finish_reason = "length"
        if self.finish_reason is None:
            text = text[: len(text) - _held_back(text, self.params.stop)]
        delta = text[self._emitted:]
        self._emitted = max(self._emitted, len(text))
        return Step(token, delta, self.finish_reason)

    def __iter__(self) -> Iterator[Step]:
        while self.finish_reason is None:
            yield self.step()


def _held_back(text: str, stops: Sequence[str]) -> int:
    """How many trailing characters to keep unsent: a possible stop-string start or a partial character."""
    hold = 1 if text.endswith("\ufffd") else 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), 0, -1):
            if text.endswith(stop[:n]):
                hold = max(hold, n)
                break
    return hold


def generate(runtime: Runtime, prompt: str | Sequence[int], max_tokens: int = 32, **sampling) -> Generation:
    """Run one generation to the end without a server; returns the finished ``Generation``.

    ``generate(runtime, "The capital of France is", 4).text`` -> ``" Paris ."`` on the bundled checkpoint.
    """
    ids = list(runtime.tokenizer(prompt)["input_ids"]) if isinstance(prompt, str) else list(prompt)
    generation = Generation(runtime, ids, SamplingParams(max_tokens=max_tokens, **sampling))
    for _ in generation:
        pass
    return generation


# --------------------------------------------------------------------------------------------
# Request bodies (pydantic) and OpenAI-shaped errors

class APIError(Exception):
    """An error answered as ``{"error": {...}}`` with ``status``."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, self.type, self.param, self.code, self.headers)


def error_response(status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                   code: str | None = None, headers: dict | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": type_, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")  # clients send fields we do not use (user, penalties, ...)

    model: str | None = None
    max_tokens: int | None = Field(None, gt=0)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = 0
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int = Field(1, ge=1, le=1, description="only one choice per request")
    stream: bool = False
    stream_options: dict | None = None
    ignore_eos: bool = False


class ChatRequest(_Sampling):
    messages: list[dict] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, gt=0)


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str]


class GenerateRequest(_Sampling):
    prompt: str
    temperature: float = Field(0.0, ge=0.0, le=2.0)


def _validation_error(error: RequestValidationError) -> JSONResponse:
    first = error.errors()[0] if error.errors() else {}
    if first.get("type") == "json_invalid":
        return error_response(400, f"request body is not valid JSON: {first.get('msg', '')}".rstrip(": "),
                              param=None, code="invalid_json")
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = ".".join(loc) or None
    if first.get("type") == "missing":
        message = f"'{param}' is required"
    else:
        message = f"{param or 'body'}: {first.get('msg', 'invalid value')} (got {first.get('input')!r})"
    return error_response(400, message, param=param, code="invalid_value" if param else "invalid_body")


# --------------------------------------------------------------------------------------------
# Metrics, authentication and request counting


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
        self.ready = Gauge("gemma_nb_model_ready", "1 once the model is loaded and warmed up", registry=r)
        self.queue_capacity.set(queue_size)


def _endpoint_label(path: str) -> str:
    return path if path in ENDPOINTS else "other"


class GuardMiddleware:
    """Counts every response by endpoint and status, and enforces the API key when one is set."""

    def __init__(self, app, metrics: ServerMetrics, api_key: str | None):
        self.app, self.metrics = app, metrics
        self._expected = f"Bearer {api_key}".encode() if api_key else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        endpoint = _endpoint_label(scope["path"])

        async def counting_send(message):
            if message["type"] == "http.response.start":
                self.metrics.requests.labels(endpoint, str(message["status"])).inc()
            await send(message)

        if self._expected is not None and scope["path"] not in OPEN_PATHS:
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self._expected):
                response = error_response(
                    401, "missing or wrong API key: send 'Authorization: Bearer <key>' with the key the server "
                    f"was started with ({API_KEY_ENV})", code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"})
                return await response(scope, receive, counting_send)
        await self.app(scope, receive, counting_send)


# --------------------------------------------------------------------------------------------
# The engine: loading, admission, one generation at a time


class _Slot:
    """A queue place, released exactly once however the request ends."""

    def __init__(self, engine: "Engine"):
        self._engine, self._held = engine, True

    def release(self) -> None:
        if self._held:
            self._held = False
            self._engine._admitted -= 1
            self._engine.metrics.queue_depth.set(self._engine._admitted)


class Engine:
    """Owns the runtime, the device thread, the lock and the admission count."""

    def __init__(self, load: Callable[[], Runtime], metrics: ServerMetrics, queue_size: int, step_delay_s: float = 0.0):
        if queue_size < 1:
            raise ValueError(f"queue_size={queue_size} must be at least 1 (the generating request counts)")
        self._load, self.metrics, self.queue_size, self.step_delay_s = load, metrics, queue_size, step_delay_s
        self.runtime: Runtime | None = None
        self.status, self.error = "loading", None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gemma-nb-device")
        self._lock = asyncio.Lock()
        self._admitted = 0
        self.load_seconds: float | None = None

    def start(self) -> None:
        """Load and warm up on the device thread; /health says 'loading' until it is done."""
        self._executor.submit(self._load_and_warm_up)

    def _load_and_warm_up(self) -> None:
        started = time.perf_counter()
        try:
            runtime = self._load()
            warm = Generation(runtime, list(runtime.tokenizer("warm up")["input_ids"]),
                              SamplingParams(max_tokens=2, ignore_eos=True))
            for _ in warm:
                pass
            self.runtime = runtime
            self.load_seconds = time.perf_counter() - started
            self.status = "ok"
            self.metrics.ready.set(1)
            log.info("model loaded and warmed up in %.1f s", self.load_seconds)
        except Exception as error:  # reported by /health and every generation request
            self.status, self.error = "error", f"{type(error).__name__}: {error}"
            log.exception("model failed to load")

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    def require_runtime(self) -> Runtime:
        if self.status == "loading":
            raise APIError(503, "the model is still loading; retry when GET /health says ok",
                           "service_unavailable", code="model_loading", headers={"Retry-After": str(RETRY_AFTER_S)})
        if self.status != "ok":
            raise APIError(503, f"the model failed to load ({self.error}); see the server log",
                           "service_unavailable", code="model_load_failed")
        return self.runtime

    def admit(self) -> _Slot:
        if self._admitted >= self.queue_size:
            raise APIError(429, f"the server is busy: {self._admitted} requests are queued or running "
                           f"(queue size {self.queue_size}); retry after {RETRY_AFTER_S} s",
                           "rate_limit_error", code="queue_full", headers={"Retry-After": str(RETRY_AFTER_S)})
        self._admitted += 1
        self.metrics.queue_depth.set(self._admitted)
        return _Slot(self)

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


# --------------------------------------------------------------------------------------------
# The app


def create_app(load: Callable[[], Runtime] | Runtime, *, model_name: str, aliases: Sequence[str] = (),
               queue_size: int = DEFAULT_QUEUE_SIZE, api_key: str | None = None, step_delay_s: float = 0.0) -> FastAPI:
    """The FastAPI app serving the runtime that ``load()`` returns (or an already loaded one).

    ``model_name`` is what ``/v1/models`` lists; requests may name it or one of ``aliases``.
    ``step_delay_s`` sleeps after every token on the device thread (tests and demos only).
    """
    load_fn = load if callable(load) and not hasattr(load, "prefill") else (lambda: load)
    metrics = ServerMetrics(queue_size)
    engine = Engine(load_fn, metrics, queue_size, step_delay_s)
    names = {model_name, *aliases}
    created = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        yield
        engine.shutdown()

    app = FastAPI(title="gemma-nb", summary="OpenAI-compatible API over the deployed model", lifespan=lifespan)
    app.state.engine, app.state.metrics = engine, metrics
    app.add_middleware(GuardMiddleware, metrics=metrics, api_key=api_key)

    @app.exception_handler(APIError)
    async def _api_error(_request, error: APIError):
        return error.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_request, error: RequestValidationError):
        return _validation_error(error)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request, error: StarletteHTTPException):
        kind = "not_found_error" if error.status_code == 404 else "invalid_request_error"
        return error_response(error.status_code, str(error.detail), kind, headers=getattr(error, "headers", None))

    @app.exception_handler(Exception)
    async def _server_error(_request, error: Exception):
        log.error("request failed: %s: %s", type(error).__name__, error)
        return error_response(500, f"the server failed on this request ({type(error).__name__}); see its log",
                              "server_error")

    def check_model(name: str | None) -> None:
        if name is not None and name not in names:
            raise APIError(404, f"model {name!r} is not served here; this server serves {model_name!r} "
                           "(GET /v1/models)", param="model", code="model_not_found")

    def sampling(body: _Sampling, runtime: Runtime, prompt_len: int, max_tokens: int | None, prompt_param: str) -> SamplingParams:
        context = runtime.max_context
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
        if len(stop) > MAX_STOP_SEQUENCES or any(not s for s in stop):
            raise APIError(400, f"stop has {len(stop)} entries; give up to {MAX_STOP_SEQUENCES} non-empty strings",
                           param="stop", code="invalid_value")
        return SamplingParams(max_tokens=max_tokens or context - prompt_len, temperature=body.temperature,
                              top_p=body.top_p, top_k=body.top_k, stop=stop, seed=body.seed, ignore_eos=body.ignore_eos)

    async def run_to_end(request: Request, generation: Generation, arrival: float, slot: _Slot) -> Generation:
        try:
            async with contextlib.aclosing(engine.steps(request, generation, arrival)) as steps:
                async for _ in steps:
                    pass
        finally:
            slot.release()
        return generation

    def streaming(request: Request, generation: Generation, arrival: float, slot: _Slot,
                  chunk: Callable[[Step | None, dict | None], dict | None], include_usage: bool) -> StreamingResponse:
        async def events():
            try:
                first = chunk(None, None)
                if first is not None:
                    yield _sse(first)
                async with contextlib.aclosing(engine.steps(request, generation, arrival)) as steps:
                    async for step in steps:
                        yield _sse(chunk(step, None))  # one chunk per token, even if it adds no text
                if generation.finish_reason is not None:
                    if include_usage:
                        yield _sse(chunk(None, _usage(generation)))
                    yield "data: [DONE]\n\n"
            except Exception as error:  # the stream has started: report in-band, then end it
                log.exception("generation failed")
                yield _sse({"error": {"message": f"generation failed: {error}", "type": "server_error",
                                      "param": None, "code": None}})
            finally:
                slot.release()

        return StreamingResponse(events(), media_type="text/event-stream", background=BackgroundTask(slot.release),
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @app.get("/health")
    async def health():
        if engine.status == "ok":
            return {"status": "ok"}
        body = {"status": engine.status}
        if engine.error:
            body["error"] = engine.error
        return JSONResponse(body, status_code=503)

    @app.get("/metrics")
    async def prometheus_metrics():
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created, "owned_by": "gemma-nb"}]}

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request):
        arrival = time.perf_counter()
        check_model(body.model)
        runtime = engine.require_runtime()
        for i, message in enumerate(body.messages):
            if not isinstance(message.get("role"), str) or "content" not in message:
                raise APIError(400, f"messages[{i}] needs a 'role' string and a 'content'", param=f"messages.{i}",
                               code="invalid_value")
        try:
            prompt_ids = chat_prompt_ids(runtime.tokenizer, body.messages)
        except ValueError as error:
            raise APIError(400, str(error), param="messages", code="invalid_value") from None
        params = sampling(body, runtime, len(prompt_ids), body.max_completion_tokens or body.max_tokens, "messages")
        slot = engine.admit()
        generation = Generation(runtime, prompt_ids, params, strip_leading_space=True, step_delay_s=engine.step_delay_s)
        ident, stamp = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        base = {"id": ident, "object": "chat.completion.chunk", "created": stamp, "model": model_name}
        if body.stream:
            include_usage = bool((body.stream_options or {}).get("include_usage"))

            def chunk(step: Step | None, usage: dict | None) -> dict:
                if usage is not None:
                    return {**base, "choices": [], "usage": usage}
                if step is None:
                    delta, reason = {"role": "assistant", "content": ""}, None
                else:
                    delta, reason = {"content": step.text}, step.finish_reason
                payload = {**base, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}]}
                if include_usage:
                    payload["usage"] = None
                return payload

            return streaming(request, generation, arrival, slot, chunk, include_usage)
        await run_to_end(request, generation, arrival, slot)
        return {**base, "object": "chat.completion",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": generation.text},
                             "logprobs": None, "finish_reason": generation.finish_reason}],
                "usage": _usage(generation)}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        arrival = time.perf_counter()
        check_model(body.model)
        runtime = engine.require_runtime()
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise APIError(400, f"prompt is a list of {len(prompt)} strings; send one prompt per request",
                               param="prompt", code="invalid_value")
            prompt = prompt[0]
        if isinstance(prompt, str):
            prompt_ids = list(runtime.tokenizer(prompt)["input_ids"])
        else:
            prompt_ids = list(prompt)
        if not prompt_ids:
            raise APIError(400, "prompt is empty; send text or at least one token id", param="prompt", code="invalid_value")
        params = sampling(body, runtime, len(prompt_ids), body.max_tokens, "prompt")
        slot = engine.admit()
        generation = Generation(runtime, prompt_ids, params, step_delay_s=engine.step_delay_s)
        base = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()), "model": model_name}
        if body.stream:
            include_usage = bool((body.stream_options or {}).get("include_usage"))

            def chunk(step: Step | None, usage: dict | None) -> dict | None:
                if usage is not None:
                    return {**base, "choices": [], "usage": usage}
                if step is None:
                    return None
                return {**base, "choices": [{"index": 0, "text": step.text, "logprobs": None,
                                             "finish_reason": step.finish_reason}]}

            return streaming(request, generation, arrival, slot, chunk, include_usage)
        await run_to_end(request, generation, arrival, slot)
        return {**base, "choices": [{"index": 0, "text": generation.text, "logprobs": None,
                                     "finish_reason": generation.finish_reason}], "usage": _usage(generation)}

    @app.post("/generate")
    async def generate_endpoint(body: GenerateRequest, request: Request):
        arrival = time.perf_counter()
        check_model(body.model)
        runtime = engine.require_runtime()
        prompt_ids = list(runtime.tokenizer(body.prompt)["input_ids"])
        params = sampling(body, runtime, len(prompt_ids), body.max_tokens, "prompt")
        slot = engine.admit()
        generation = Generation(runtime, prompt_ids, params, step_delay_s=engine.step_delay_s)
        started = time.perf_counter()
        await run_to_end(request, generation, arrival, slot)
        seconds = time.perf_counter() - started
        return {"text": generation.text, "tokens": len(generation.token_ids), "token_ids": generation.token_ids,
                "prompt_tokens": len(prompt_ids), "finish_reason": generation.finish_reason,
                "seconds": round(seconds, 4), "tok_s": round(len(generation.token_ids) / seconds, 2) if seconds else None}

    return app


def _usage(generation: Generation) -> dict:
    prompt, completion = len(generation.prompt_ids), len(generation.token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


# --------------------------------------------------------------------------------------------
# Running it


@contextlib.contextmanager
def serve_in_thread(app: FastAPI, host: str = DEFAULT_HOST, port: int = 0, ready_timeout_s: float = 120.0):
    """Serve ``app`` with uvicorn on a background thread; yields the base URL (``http://host:port``).

    ``port=0`` picks a free port. Waits until uvicorn listens (not until the model is loaded:
    poll ``/health`` for that). Stops the server on exit.
    """
    import socket

    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    config = uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=2)
    server = uvicorn.Server(config)
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


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def build_parser() -> argparse.ArgumentParser:
    from gemma_nb.tiny import BUNDLED_ID

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
                        help="a compiled artifact folder: gemma_nb.compile's for the cpu slim deploy (without it the "
                             "model is compiled into a temporary folder at start-up), gemma_nb.neuron.build's on neuron "
                             "(required there; --model-id then names the tokenizer)")
    parser.add_argument("--prefill-len", type=int, default=DEFAULT_PREFILL_LEN,
                        help=f"prefill bucket when compiling at start-up: the longest prompt (default {DEFAULT_PREFILL_LEN})")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="weights dtype for --runtime transformers (default float32)")
    parser.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m gemma_nb serve``; returns the exit status."""
    import uvicorn

    from gemma_nb.targets import TargetError, check_target

    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        check_target(args.target)
        if args.queue_size < 1:
            raise ValueError(f"--queue-size {args.queue_size} must be at least 1")
        if not 0 <= args.port <= 65535:
            raise ValueError(f"--port {args.port} is not a TCP port (0-65535)")
    except (TargetError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    api_key = os.environ.get(API_KEY_ENV) or None
    if not _is_loopback(args.host) and api_key is None:
        log.warning("binding %s without an API key: anyone who can reach this port can use the model "
                    "(set %s)", args.host, API_KEY_ENV)
    dtype = getattr(torch, args.dtype)

    def load() -> Runtime:
        return load_runtime(args.target, args.model_id, max_context=args.max_context, runtime=args.runtime,
                            artifact=args.artifact, prefill_len=args.prefill_len, dtype=dtype)

    name = args.served_model_name or args.model_id
    aliases = {args.model_id, os.path.basename(os.path.normpath(args.model_id))}
    app = create_app(load, model_name=name, aliases=sorted(aliases), queue_size=args.queue_size, api_key=api_key)
    log.info("serving %s (target %s) on http://%s:%d/v1 ; API key %s", name, args.target, args.host, args.port,
             f"required ({API_KEY_ENV} is set)" if api_key else "not required")
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, access_log=args.log_level == "debug",
                timeout_graceful_shutdown=5)
    return 0
