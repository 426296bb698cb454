"""Benchmark any OpenAI-compatible endpoint from the client side (notebook 07).

``benchmark_endpoint(base_url)`` streams chat completions and times what a user sees: time to
first token (TTFT), the gaps between streamed tokens (inter-token latency, ITL) and tokens per
second, at a few concurrency levels (1, 2, 4 by default; a handful of requests each). It works
against the project's own server (``python -m gemma_nb serve``), the port's container on inf2
(``http://<instance>:8080/v1``) or vLLM, and needs nothing beyond the standard library: on an
inf2 instance the Neuron environment may not have the ``openai`` package.

``local_server()`` starts the project's server on a free loopback port in a subprocess, waits for
``/health``, yields its base URL and stops it afterwards: the cpu reference run measures a real
server, not a mock.

How tokens are counted: one streamed chunk carrying a ``content`` field is one token (the
opening chunk that only announces the assistant's role excepted). This project's server sends a
chunk for every token, with empty text for tokens that show none (the tiny checkpoint's
end-of-sequence tokens under ``ignore_eos``); vLLM sends a chunk per token with text. The
request's ``usage.completion_tokens``, when the server reports it (``stream_options.include_usage``),
replaces the chunk count for tok/s.
Requests ask for ``ignore_eos`` (vLLM's field; this server's too) so every answer has
``max_tokens`` tokens and levels compare like for like; servers that do not know the field
ignore it and may stop early. The API key, if the endpoint needs one, comes from the
``GEMMA_NB_API_KEY`` or ``OPENAI_API_KEY`` environment variable, never a notebook parameter.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Sequence
from urllib.parse import urlsplit

import numpy as np
import pandas as pd

API_KEY_ENVS = ("GEMMA_NB_API_KEY", "OPENAI_API_KEY")
DEFAULT_PROMPT = "The capital of France is"
DEFAULT_CONCURRENCY = (1, 2, 4)


class EndpointError(RuntimeError):
    """The endpoint answered with an error status, or not in the OpenAI streaming format."""


@dataclass(frozen=True)
class Endpoint:
    """An OpenAI-compatible base URL split into what ``http.client`` needs."""

    scheme: str
    host: str
    port: int
    prefix: str  # the path in front of /chat/completions, e.g. "/v1"

    @classmethod
    def parse(cls, base_url: str) -> "Endpoint":
        parts = urlsplit(base_url.strip())
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(
                f"endpoint {base_url!r} is not an http(s) URL; expected an OpenAI-compatible base URL "
                "such as http://127.0.0.1:8080/v1"
            )
        prefix = parts.path.rstrip("/")
        if not prefix.endswith("/v1"):
            prefix += "/v1"  # "http://host:8080" means the usual /v1 API
        port = parts.port or (443 if parts.scheme == "https" else 80)
        return cls(parts.scheme, parts.hostname, port, prefix)

    @property
    def base_url(self) -> str:
        return f"{self.scheme}://{self.host}:{self.port}{self.prefix}"

    @property
    def root(self) -> str:
        """Where /health lives: the base URL without its /v1."""
        return f"{self.scheme}://{self.host}:{self.port}{self.prefix[: -len('/v1')]}"

    def connection(self, timeout_s: float) -> http.client.HTTPConnection:
        kind = http.client.HTTPSConnection if self.scheme == "https" else http.client.HTTPConnection
        return kind(self.host, self.port, timeout=timeout_s)


def _api_key() -> str | None:
    for name in API_KEY_ENVS:
        if os.environ.get(name):
            return os.environ[name]
    return None


def _headers(api_key: str | None) -> dict[str, str]:
    headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    return headers


def _get_json(url: str, timeout_s: float = 5.0, api_key: str | None = None) -> tuple[int, dict | None]:
    parts = urlsplit(url)
    endpoint = Endpoint(parts.scheme, parts.hostname, parts.port or 80, "")
    conn = endpoint.connection(timeout_s)
    try:
        conn.request("GET", parts.path or "/", headers=_headers(api_key))
        response = conn.getresponse()
        body = response.read()
        try:
            return response.status, json.loads(body)
        except ValueError:
            return response.status, None
    finally:
        conn.close()


def served_model(base_url: str, api_key: str | None = None, timeout_s: float = 10.0) -> str | None:
    """The first model id ``GET /v1/models`` lists, or None if the server has no such endpoint."""
    endpoint = Endpoint.parse(base_url)
    try:
        status, body = _get_json(f"{endpoint.base_url}/models", timeout_s, api_key or _api_key())
    except OSError:
        return None
    if status != 200 or not body or not body.get("data"):
        return None
    return body["data"][0]["id"]


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


def _sse_payloads(response) -> Iterator[str]:
    """The ``data:`` payloads of a server-sent-event stream, as they arrive."""
    while True:
        line = response.readline()
        if not line:
            return
        line = line.strip()
        if line.startswith(b"data:"):
            yield line[len(b"data:"):].strip().decode()


def stream_chat(base_url: str, messages: Sequence[dict], *, model: str | None = None, max_tokens: int = 32,
                temperature: float = 0.0, ignore_eos: bool = True, api_key: str | None = None,
                timeout_s: float = 300.0) -> RequestTiming:
    """One streamed ``POST /v1/chat/completions``, timed chunk by chunk."""
    endpoint = Endpoint.parse(base_url)
    body = {"messages": list(messages), "max_tokens": max_tokens, "temperature": temperature, "stream": True,
            "stream_options": {"include_usage": True}}
    if model is not None:
        body["model"] = model
    if ignore_eos:
        body["ignore_eos"] = True
    conn = endpoint.connection(timeout_s)
    try:
        started = time.perf_counter()
        conn.request("POST", f"{endpoint.prefix}/chat/completions", body=json.dumps(body),
                     headers=_headers(api_key or _api_key()))
        response = conn.getresponse()
        if response.status != 200:
            detail = response.read().decode(errors="replace")[:500]
            raise EndpointError(f"POST {endpoint.base_url}/chat/completions answered {response.status}: {detail}")
        token_times, pieces, usage_tokens, finish = [], [], None, None
        for payload in _sse_payloads(response):
            if payload == "[DONE]":
                break
            chunk = json.loads(payload)
            if "error" in chunk:
                raise EndpointError(f"the stream reported an error: {chunk['error']}")
            if chunk.get("usage"):
                usage_tokens = chunk["usage"].get("completion_tokens")
            for choice in chunk.get("choices") or []:
                delta = choice.get("delta") or {}
                if delta.get("content") is not None and "role" not in delta:
                    token_times.append(time.perf_counter() - started)
                    pieces.append(delta["content"])
                finish = choice.get("finish_reason") or finish
        total = time.perf_counter() - started
    finally:
        conn.close()
    if not token_times:
        raise EndpointError(f"{endpoint.base_url}/chat/completions streamed no text; is it an OpenAI-compatible server?")
    return RequestTiming(ttft_s=token_times[0], token_times_s=token_times,
                         completion_tokens=usage_tokens or len(token_times), total_s=total,
                         text="".join(pieces), finish_reason=finish)


def benchmark_endpoint(base_url: str, *, model: str | None = None, prompt: str = DEFAULT_PROMPT,
                       concurrency: Sequence[int] = DEFAULT_CONCURRENCY, requests_per_level: int = 4,
                       max_tokens: int = 32, ignore_eos: bool = True, warmup: bool = True,
                       api_key: str | None = None, timeout_s: float = 300.0) -> pd.DataFrame:
    """Stream ``requests_per_level`` chat completions at each concurrency level; one row per request.

    Columns: concurrency, request, ttft_ms, itl_ms (the list of gaps between tokens),
    itl_ms_p50, itl_ms_p90, completion_tokens, e2e_s, decode_tok_s, level_wall_s (the level's
    wall time, for aggregate throughput: see ``summarize``), text. ``model`` defaults to the first
    id of ``/v1/models`` (omitted from requests if the server has none). Greedy (temperature 0).
    """
    levels = [int(c) for c in concurrency]
    if not levels or any(c < 1 for c in levels):
        raise ValueError(f"concurrency={list(concurrency)!r}; expected positive integers such as (1, 2, 4)")
    if requests_per_level < 1:
        raise ValueError(f"requests_per_level={requests_per_level} must be at least 1")
    endpoint = Endpoint.parse(base_url)
    model = model or served_model(endpoint.base_url, api_key)
    messages = [{"role": "user", "content": prompt}]

    def one(_index: int) -> RequestTiming:
        return stream_chat(endpoint.base_url, messages, model=model, max_tokens=max_tokens,
                           ignore_eos=ignore_eos, api_key=api_key, timeout_s=timeout_s)

    if warmup:
        one(-1)
    rows = []
    for level in levels:
        count = max(requests_per_level, level)
        started = time.perf_counter()
        with ThreadPoolExecutor(max_workers=level) as pool:
            timings = list(pool.map(one, range(count)))
        wall = time.perf_counter() - started
        for index, timing in enumerate(timings):
            itl_ms = [1e3 * gap for gap in timing.itl_s]
            rows.append({
                "concurrency": level, "request": index, "ttft_ms": 1e3 * timing.ttft_s, "itl_ms": itl_ms,
                "itl_ms_p50": float(np.percentile(itl_ms, 50)) if itl_ms else float("nan"),
                "itl_ms_p90": float(np.percentile(itl_ms, 90)) if itl_ms else float("nan"),
                "completion_tokens": timing.completion_tokens, "e2e_s": timing.total_s,
                "decode_tok_s": timing.decode_tok_s, "level_wall_s": wall, "text": timing.text,
            })
    return pd.DataFrame(rows)


def summarize(requests: pd.DataFrame) -> pd.DataFrame:
    """One row per concurrency level: TTFT and ITL percentiles, per-request and aggregate tok/s.

    ``tok_s_per_request`` is the median decode rate one client sees; ``tok_s_total`` is every
    token of the level over its wall time (what the server delivers to all clients together).
    With one generation at a time, ``tok_s_total`` stays flat as concurrency grows and TTFT grows
    with the queue; a batching server raises ``tok_s_total`` instead.
    """
    rows = []
    for level, group in requests.groupby("concurrency", sort=True):
        gaps = [g for gaps in group["itl_ms"] for g in gaps]
        rows.append({
            "concurrency": int(level), "requests": len(group),
            "ttft_ms_p50": float(np.percentile(group["ttft_ms"], 50)),
            "ttft_ms_p90": float(np.percentile(group["ttft_ms"], 90)),
            "itl_ms_p50": float(np.percentile(gaps, 50)) if gaps else float("nan"),
            "itl_ms_p90": float(np.percentile(gaps, 90)) if gaps else float("nan"),
            "tok_s_per_request": float(group["decode_tok_s"].median()),
            "tok_s_total": float(group["completion_tokens"].sum() / group["level_wall_s"].iloc[0]),
        })
    return pd.DataFrame(rows)


def measure_endpoint(endpoint: str = "", target: str = "cpu", model_id: str | None = None, runtime: str = "auto",
                     **benchmark_kwargs) -> pd.DataFrame | None:
    """Notebook 07's endpoint run: ``endpoint`` if given, else the project's own server on loopback.

    With ``endpoint`` empty, the cpu and cuda targets start ``python -m gemma_nb serve`` for
    ``model_id`` (``local_server``; on cpu the slim deploy by default), benchmark it and stop it;
    the neuron target has no local server (serve the port's container and pass its URL), so it
    returns None. ``benchmark_kwargs`` go to ``benchmark_endpoint``.
    """
    if endpoint:
        return benchmark_endpoint(endpoint, **benchmark_kwargs)
    if target == "neuron":
        return None
    with local_server(target, model_id, runtime=runtime) as base_url:
        return benchmark_endpoint(base_url, **benchmark_kwargs)


def endpoint_metrics(requests: pd.DataFrame | None, endpoint: str = "") -> tuple[dict, list[dict]]:
    """(metrics, headline rows) for ``save_metrics`` from a ``benchmark_endpoint`` table.

    The story's decode speed (``decode_tok_s``, 6 tok/s) is attached as the claim only when an
    external ``endpoint`` was measured (the port's container is the same deploy); the local
    server runs the tiny checkpoint, which answers a different question.
    """
    from gemma_nb.metrics import headline

    if requests is None:
        return {"measured": False, "endpoint": endpoint or None}, []
    summary = summarize(requests).set_index("concurrency")
    lowest, highest = summary.index.min(), summary.index.max()
    metrics = {
        "measured": True, "endpoint": "external" if endpoint else "local gemma_nb serve",
        "requests_per_level": int(summary["requests"].iloc[0]),
        "max_tokens": int(requests["completion_tokens"].max()),
        "by_concurrency": {int(c): {k: float(v) for k, v in row.drop("requests").items()} for c, row in summary.iterrows()},
        "ttft_growth_x": float(summary.loc[highest, "ttft_ms_p50"] / summary.loc[lowest, "ttft_ms_p50"]),
        "tok_s_total_growth_x": float(summary.loc[highest, "tok_s_total"] / summary.loc[lowest, "tok_s_total"]),
    }
    rows = [
        headline("endpoint TTFT p50, 1 client", round(summary.loc[lowest, "ttft_ms_p50"], 1), "ms"),
        headline("endpoint ITL p50, 1 client", round(summary.loc[lowest, "itl_ms_p50"], 2), "ms"),
        headline("endpoint decode speed, 1 client", round(summary.loc[lowest, "tok_s_per_request"], 1), "tok/s",
                 claim="decode_tok_s" if endpoint else None),
        headline(f"endpoint tok/s, {highest} clients together", round(summary.loc[highest, "tok_s_total"], 1), "tok/s"),
    ]
    return metrics, rows


def inter_token_latencies(requests: pd.DataFrame) -> pd.DataFrame:
    """Every gap between streamed tokens, long format: columns concurrency, itl_ms."""
    rows = [(level, gap) for level, gaps in zip(requests["concurrency"], requests["itl_ms"]) for gap in gaps]
    return pd.DataFrame(rows, columns=["concurrency", "itl_ms"])


def plot_benchmark(requests: pd.DataFrame, title: str = ""):
    """Three panels: TTFT and ITL distributions per concurrency level, tok/s against concurrency."""
    from gemma_nb import plots

    fig, (ax_ttft, ax_itl, ax_tok) = plots.subplots(1, 3, figsize=(10, 3.6))
    levels = sorted(requests["concurrency"].unique())
    gaps = inter_token_latencies(requests)
    ttft = [requests.loc[requests["concurrency"] == c, "ttft_ms"].to_numpy() for c in levels]
    itl = [gaps.loc[gaps["concurrency"] == c, "itl_ms"].to_numpy() for c in levels]
    _ = ax_ttft.boxplot(ttft, tick_labels=[str(c) for c in levels])
    _ = ax_ttft.set(xlabel="concurrent requests", ylabel="time to first token (ms)", title="TTFT")
    _ = ax_itl.boxplot(itl, tick_labels=[str(c) for c in levels], showfliers=False)
    _ = ax_itl.set(xlabel="concurrent requests", ylabel="inter-token latency (ms)", title="ITL (outliers hidden)")
    summary = summarize(requests)
    _ = ax_tok.plot(summary["concurrency"], summary["tok_s_total"], marker="o", label="all clients together")
    _ = ax_tok.plot(summary["concurrency"], summary["tok_s_per_request"], marker="s", label="one client")
    _ = ax_tok.set(xlabel="concurrent requests", ylabel="tokens / s", title="throughput", xticks=levels, ylim=(0, None))
    _ = ax_tok.legend()
    if title:
        _ = fig.suptitle(title)
    return fig


# --------------------------------------------------------------------------------------------
# The project's own server, for the cpu reference run


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def wait_until_healthy(base_url: str, timeout_s: float = 180.0, process: subprocess.Popen | None = None,
                       log_path: Path | None = None) -> float:
    """Poll ``GET /health`` until it answers 200; returns the seconds waited.

    Raises ``TimeoutError`` after ``timeout_s``, or ``EndpointError`` at once if ``process`` exits
    (with the tail of its log).
    """
    endpoint = Endpoint.parse(base_url)
    started = time.perf_counter()
    while True:
        if process is not None and process.poll() is not None:
            tail = log_path.read_text(errors="replace")[-2000:] if log_path and log_path.exists() else ""
            raise EndpointError(f"the server exited with status {process.returncode} before it was healthy:\n{tail}")
        try:
            status, body = _get_json(f"{endpoint.root}/health", timeout_s=2.0)
        except OSError:
            status, body = None, None  # not listening yet
        if status == 200:
            return time.perf_counter() - started
        if isinstance(body, dict) and body.get("status") == "error":
            raise EndpointError(f"{endpoint.root}/health reports that the model failed to load: {body.get('error')}")
        if time.perf_counter() - started > timeout_s:
            raise TimeoutError(f"{endpoint.root}/health did not answer 200 within {timeout_s:.0f} s")
        time.sleep(0.1)


@contextlib.contextmanager
def local_server(target: str = "cpu", model_id: str | None = None, *, runtime: str = "auto", queue_size: int = 8,
                 extra_args: Sequence[str] = (), env: dict | None = None, ready_timeout_s: float = 300.0):
    """Run ``python -m gemma_nb serve`` on a free loopback port; yields its base URL (``.../v1``).

    ``runtime``: the server's ``--runtime`` (auto: the slim deploy on cpu, compiled at start-up;
    "transformers" starts in seconds). The server's log goes to a temporary file (shown if it
    fails to start); the process is terminated (then killed) when the block ends. ``env`` adds
    environment variables (e.g. the API key, which is never passed on the command line).
    """
    from gemma_nb.tiny import BUNDLED_ID

    port = free_port()
    command = [sys.executable, "-m", "gemma_nb", "serve", "--target", target, "--model-id", model_id or BUNDLED_ID,
               "--runtime", runtime, "--host", "127.0.0.1", "--port", str(port), "--queue-size", str(queue_size),
               "--log-level", "warning", *extra_args]
    with tempfile.TemporaryDirectory(prefix="gemma-nb-serve-") as folder:
        log_path = Path(folder) / "server.log"
        with open(log_path, "wb") as log:
            process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                       env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})})
        base_url = f"http://127.0.0.1:{port}/v1"
        try:
            wait_until_healthy(base_url, ready_timeout_s, process, log_path)
            yield base_url
        finally:
            process.terminate()
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=5)
