"""Benchmark any OpenAI-compatible endpoint from the client side, with the ``openai`` client (notebook 07).

``benchmark_endpoint(base_url)`` streams greedy chat completions at a few concurrency levels and
times what a user sees: time to first token (TTFT), the gaps between tokens (ITL), tokens per second.
It measures this project's server, the port's container on inf2 (``http://<instance>:8080/v1``) or
vLLM; ``local_server()`` starts ``python -m gemma_nb serve`` on a free loopback port for the cpu run.

A streamed chunk carrying ``content`` is one token (the opening role chunk excepted): this server and
vLLM send one per token. ``usage.completion_tokens`` (``stream_options.include_usage``) replaces the
count when the server reports it. Requests ask for ``ignore_eos`` (vLLM's field, and this server's)
so every answer has ``max_tokens`` tokens; a server without it may stop early. The API key comes from
``GEMMA_NB_API_KEY`` or ``OPENAI_API_KEY`` in the environment, never a parameter.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import numpy as np
import openai
import pandas as pd

from gemma_nb.ranks import free_port
from gemma_nb.tiny import BUNDLED_ID

API_KEY_ENVS = ("GEMMA_NB_API_KEY", "OPENAI_API_KEY")
DEFAULT_PROMPT = "The capital of France is"
DEFAULT_CONCURRENCY = (1, 2, 4)


class EndpointError(RuntimeError):
    """The endpoint answered with an error, could not be reached, or did not stream in OpenAI's format."""


def base_url(url: str) -> str:
    """``url`` as an OpenAI base URL ending in ``/v1`` (a bare ``http://host:8080`` means its ``/v1``)."""
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"endpoint {url!r} is not an http(s) URL; expected an OpenAI-compatible base URL "
                         "such as http://127.0.0.1:8080/v1")
    path = parts.path.rstrip("/")
    return f"{parts.scheme}://{parts.netloc}{path if path.endswith('/v1') else path + '/v1'}"


def _client(url: str, api_key: str | None, timeout_s: float) -> openai.OpenAI:
    key = api_key or next((os.environ[name] for name in API_KEY_ENVS if os.environ.get(name)), None)
    return openai.OpenAI(base_url=base_url(url), api_key=key or "none", max_retries=0, timeout=timeout_s)


def served_model(url: str, api_key: str | None = None, timeout_s: float = 10.0) -> str | None:
    """The first model id ``GET /v1/models`` lists, or None if the server has no such endpoint."""
    try:
        return _client(url, api_key, timeout_s).models.list().data[0].id
    except (openai.APIError, IndexError):
        return None


@dataclass
class RequestTiming:
    """What one streamed request looked like from the client. Times in seconds from sending it."""

    ttft_s: float
    token_times_s: list[float]
    completion_tokens: int
    total_s: float
    text: str
    finish_reason: str | None = None
    itl_s: list[float] = field(init=False)

    def __post_init__(self):
        self.itl_s = list(np.diff(self.token_times_s)) if len(self.token_times_s) > 1 else []

    @property
    def decode_tok_s(self) -> float:
        """Tokens after the first, per second of streaming after the first (the decode rate)."""
        span = self.token_times_s[-1] - self.token_times_s[0] if self.token_times_s else 0.0
        return (self.completion_tokens - 1) / span if span > 0 and self.completion_tokens > 1 else float("nan")


def stream_chat(url: str, messages: Sequence[dict], *, model: str | None = None, max_tokens: int = 32,
                temperature: float = 0.0, ignore_eos: bool = True, api_key: str | None = None,
                timeout_s: float = 300.0) -> RequestTiming:
    """One streamed chat completion, timed chunk by chunk."""
    token_times, pieces, usage_tokens, finish = [], [], None, None
    started = time.perf_counter()
    try:
        stream = _client(url, api_key, timeout_s).chat.completions.create(
            model=model or openai.omit, messages=list(messages), max_tokens=max_tokens, temperature=temperature, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True} if ignore_eos else None)
        for chunk in stream:
            usage_tokens = chunk.usage.completion_tokens if chunk.usage else usage_tokens
            for choice in chunk.choices:
                if choice.delta.content is not None and choice.delta.role is None:
                    token_times.append(time.perf_counter() - started)
                    pieces.append(choice.delta.content)
                finish = choice.finish_reason or finish
    except openai.APIStatusError as error:
        raise EndpointError(f"{base_url(url)}/chat/completions answered {error.status_code}: {error.message}") from None
    except openai.APIError as error:
        raise EndpointError(f"{base_url(url)}/chat/completions failed: {error}") from None
    if not token_times:
        raise EndpointError(f"{base_url(url)}/chat/completions streamed no text; is it an OpenAI-compatible server?")
    return RequestTiming(ttft_s=token_times[0], token_times_s=token_times, completion_tokens=usage_tokens or len(token_times),
                         total_s=time.perf_counter() - started, text="".join(pieces), finish_reason=finish)


def benchmark_endpoint(url: str, *, model: str | None = None, prompt: str = DEFAULT_PROMPT,
                       concurrency: Sequence[int] = DEFAULT_CONCURRENCY, requests_per_level: int = 4,
                       max_tokens: int = 32, ignore_eos: bool = True, warmup: bool = True,
                       api_key: str | None = None, timeout_s: float = 300.0) -> pd.DataFrame:
    """Stream ``requests_per_level`` chat completions (at least one per client) at each concurrency level.

    One row per request: concurrency, request, ttft_ms, itl_ms (the gaps), itl_ms_p50, itl_ms_p90,
    completion_tokens, e2e_s, decode_tok_s, level_wall_s (for aggregate throughput, ``summarize``),
    text. ``model`` defaults to the first id of ``/v1/models``. Greedy (temperature 0).
    """
    levels = [int(c) for c in concurrency]
    if not levels or any(c < 1 for c in levels):
        raise ValueError(f"concurrency={list(concurrency)!r}; expected positive integers such as (1, 2, 4)")
    if requests_per_level < 1:
        raise ValueError(f"requests_per_level={requests_per_level} must be at least 1")
    model = model or served_model(url, api_key)

    def one(_index: int) -> RequestTiming:
        return stream_chat(url, [{"role": "user", "content": prompt}], model=model, max_tokens=max_tokens,
                           ignore_eos=ignore_eos, api_key=api_key, timeout_s=timeout_s)

    if warmup:
        one(-1)
    rows = []
    for level in levels:
        started = time.perf_counter()
        with ThreadPoolExecutor(max_workers=level) as pool:
            timings = list(pool.map(one, range(max(requests_per_level, level))))
        wall = time.perf_counter() - started
        for index, timing in enumerate(timings):
            itl_ms = [1e3 * gap for gap in timing.itl_s]
            rows.append({"concurrency": level, "request": index, "ttft_ms": 1e3 * timing.ttft_s, "itl_ms": itl_ms,
                         "itl_ms_p50": float(np.percentile(itl_ms, 50)) if itl_ms else float("nan"),
                         "itl_ms_p90": float(np.percentile(itl_ms, 90)) if itl_ms else float("nan"),
                         "completion_tokens": timing.completion_tokens, "e2e_s": timing.total_s,
                         "decode_tok_s": timing.decode_tok_s, "level_wall_s": wall, "text": timing.text})
    return pd.DataFrame(rows)


def summarize(requests: pd.DataFrame) -> pd.DataFrame:
    """One row per concurrency level: TTFT and ITL percentiles, per-request and aggregate tok/s.

    ``tok_s_per_request`` is the median decode rate one client sees; ``tok_s_total`` every token of the
    level over its wall time. One generation at a time keeps ``tok_s_total`` flat while TTFT grows with
    the queue; a batching server raises ``tok_s_total`` instead.
    """
    rows = []
    for level, group in requests.groupby("concurrency", sort=True):
        gaps = [g for gaps in group["itl_ms"] for g in gaps]
        rows.append({
            "concurrency": int(level), "requests": len(group),
            "ttft_ms_p50": float(np.percentile(group["ttft_ms"], 50)), "ttft_ms_p90": float(np.percentile(group["ttft_ms"], 90)),
            "itl_ms_p50": float(np.percentile(gaps, 50)) if gaps else float("nan"),
            "itl_ms_p90": float(np.percentile(gaps, 90)) if gaps else float("nan"),
            "tok_s_per_request": float(group["decode_tok_s"].median()),
            "tok_s_total": float(group["completion_tokens"].sum() / group["level_wall_s"].iloc[0]),
        })
    return pd.DataFrame(rows)


def measure_endpoint(endpoint: str = "", target: str = "cpu", model_id: str | None = None, runtime: str = "auto",
                     **benchmark_kwargs) -> pd.DataFrame | None:
    """Notebook 07's run: ``endpoint`` if given, else (cpu, cuda) this project's server on loopback for
    ``model_id``; None on neuron without an endpoint (serve the port's container and pass its URL)."""
    if endpoint:
        return benchmark_endpoint(endpoint, **benchmark_kwargs)
    if target == "neuron":
        return None
    with local_server(target, model_id, runtime=runtime) as url:
        return benchmark_endpoint(url, **benchmark_kwargs)


def wait_until_healthy(url: str, timeout_s: float = 180.0, process: subprocess.Popen | None = None,
                       log_path: Path | None = None) -> float:
    """Poll ``GET /health`` (beside ``/v1``) until it answers 200; returns the seconds waited.

    Raises ``TimeoutError`` after ``timeout_s``, or ``EndpointError`` at once if ``process`` exits (with
    the tail of its log) or the server reports that its model failed to load.
    """
    health, started = base_url(url).removesuffix("/v1") + "/health", time.perf_counter()
    while True:
        if process is not None and process.poll() is not None:
            tail = log_path.read_text(errors="replace")[-2000:] if log_path and log_path.exists() else ""
            raise EndpointError(f"the server exited with status {process.returncode} before it was healthy:\n{tail}")
        with contextlib.suppress(httpx.HTTPError, ValueError):  # not listening yet, or not JSON
            response = httpx.get(health, timeout=2.0)
            if response.status_code == 200:
                return time.perf_counter() - started
            if response.json().get("status") == "error":
                raise EndpointError(f"{health} reports that the model failed to load: {response.json().get('error')}")
        if time.perf_counter() - started > timeout_s:
            raise TimeoutError(f"{health} did not answer 200 within {timeout_s:.0f} s")
        time.sleep(0.1)


@contextlib.contextmanager
def local_server(target: str = "cpu", model_id: str | None = None, *, runtime: str = "auto", queue_size: int = 8,
                 extra_args: Sequence[str] = (), env: dict | None = None, ready_timeout_s: float = 300.0):
    """Run ``python -m gemma_nb serve`` on a free loopback port; yields its base URL (``.../v1``).

    ``runtime``: the server's ``--runtime`` ("transformers" starts in seconds; the cpu default compiles
    the slim deploy first). Its log goes to a temporary file, shown if it fails to start; the process is
    terminated (then killed) when the block ends. ``env`` adds environment variables (e.g. the API key).
    """
    port = free_port()
    command = [sys.executable, "-m", "gemma_nb", "serve", "--target", target, "--model-id", model_id or BUNDLED_ID,
               "--runtime", runtime, "--port", str(port), "--queue-size", str(queue_size), "--log-level", "warning",
               *extra_args]
    with tempfile.TemporaryDirectory(prefix="gemma-nb-serve-") as folder:
        log_path = Path(folder) / "server.log"
        with open(log_path, "wb") as log:
            process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                       env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})})
        url = f"http://127.0.0.1:{port}/v1"
        try:
            wait_until_healthy(url, ready_timeout_s, process, log_path)
            yield url
        finally:
            process.terminate()
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=5)
