"""TTFT, inter-token latency and tok/s of any OpenAI-compatible endpoint, from the client side with
the ``openai`` client (notebook 07): greedy streamed chats at a few concurrency levels; the key from
``API_KEY_ENVS``."""

import os
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import openai
import pandas as pd

from gemma_nb.endpoint import EndpointError, base_url

API_KEY_ENVS = ("GEMMA_NB_API_KEY", "OPENAI_API_KEY")


def _client(url: str, api_key: str | None, timeout_s: float) -> openai.OpenAI:
    key = api_key or next((os.environ[name] for name in API_KEY_ENVS if os.environ.get(name)), None)
    return openai.OpenAI(
        base_url=base_url(url), api_key=key or "none", max_retries=0, timeout=timeout_s
    )


def served_model(url: str, api_key: str | None = None, timeout_s: float = 10.0) -> str | None:
    """The first model id ``GET /v1/models`` lists, or None if the server has no such endpoint."""
    try:
        return _client(url, api_key, timeout_s).models.list().data[0].id
    except (openai.APIError, IndexError):
        return None


def percentile(values: Sequence[float], q: float) -> float:
    return float(np.percentile(values, q)) if len(values) else float("nan")


def stream_chat(
    url: str,
    messages: Sequence[dict],
    *,
    model: str | None = None,
    max_tokens: int = 32,
    ignore_eos: bool = True,
    api_key: str | None = None,
    timeout_s: float = 300.0,
) -> dict:
    """One greedy streamed chat completion, timed chunk by chunk: ttft_ms, itl_ms (the gaps between
    tokens), itl_ms_p50, itl_ms_p90, completion_tokens, e2e_s, decode_tok_s (after the first token),
    text, finish_reason."""
    times, pieces, usage, finish, started = [], [], None, None, time.perf_counter()
    try:
        stream = _client(url, api_key, timeout_s).chat.completions.create(
            model=model or openai.omit,
            messages=list(messages),
            max_tokens=max_tokens,
            temperature=0.0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True} if ignore_eos else None,
        )
        for chunk in stream:
            usage = chunk.usage.completion_tokens if chunk.usage else usage
            for choice in chunk.choices:
                if choice.delta.content is not None and choice.delta.role is None:
                    times.append(time.perf_counter() - started)
                    pieces.append(choice.delta.content)
                finish = choice.finish_reason or finish
    except openai.APIStatusError as error:
        raise EndpointError(
            f"{base_url(url)}/chat/completions answered {error.status_code}: {error.message}"
        ) from None
    except openai.APIError as error:
        raise EndpointError(f"{base_url(url)}/chat/completions failed: {error}") from None
    if not times:
        raise EndpointError(
            f"{base_url(url)}/chat/completions streamed no text; is it an OpenAI-compatible server?"
        )
    gaps, tokens, span = (
        [1e3 * gap for gap in np.diff(times)],
        usage or len(times),
        times[-1] - times[0],
    )
    return {
        "ttft_ms": 1e3 * times[0],
        "itl_ms": gaps,
        "itl_ms_p50": percentile(gaps, 50),
        "itl_ms_p90": percentile(gaps, 90),
        "completion_tokens": tokens,
        "e2e_s": time.perf_counter() - started,
        "decode_tok_s": (tokens - 1) / span if span > 0 and tokens > 1 else float("nan"),
        "text": "".join(pieces),
        "finish_reason": finish,
    }


def benchmark_endpoint(
    url: str,
    *,
    model: str | None = None,
    prompt: str = "The capital of France is",
    concurrency: Sequence[int] = (1, 2, 4),
    requests_per_level: int = 4,
    max_tokens: int = 32,
    warmup: bool = True,
    api_key: str | None = None,
    timeout_s: float = 300.0,
) -> pd.DataFrame:
    """``requests_per_level`` greedy streamed chats of ``max_tokens`` (ignore_eos; one per client at
    least) at each level, a row each: concurrency, request, ``stream_chat``'s timings, level_wall_s
    (the level's). ``model``: the first of /v1/models."""
    levels = [int(c) for c in concurrency]
    if not levels or any(c < 1 for c in levels):
        raise ValueError(
            f"concurrency={list(concurrency)!r}; expected positive integers such as (1, 2, 4)"
        )
    if requests_per_level < 1:
        raise ValueError(f"requests_per_level={requests_per_level} must be at least 1")
    model = model or served_model(url, api_key)

    def one(_index: int) -> dict:
        return stream_chat(
            url,
            [{"role": "user", "content": prompt}],
            model=model,
            max_tokens=max_tokens,
            api_key=api_key,
            timeout_s=timeout_s,
        )

    if warmup:
        one(-1)
    rows = []
    for level in levels:
        started = time.perf_counter()
        with ThreadPoolExecutor(max_workers=level) as pool:
            timings = list(pool.map(one, range(max(requests_per_level, level))))
        wall = time.perf_counter() - started
        rows += [
            {"concurrency": level, "request": index, **timing, "level_wall_s": wall}
            for index, timing in enumerate(timings)
        ]
    return pd.DataFrame(rows)
