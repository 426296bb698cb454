"""An OpenAI-compatible endpoint's base URL and health, and this project's server on a loopback port
(for notebook 07, the rehearsal and the serving tests)."""

import contextlib
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from urllib.parse import urlsplit

import httpx

from gemma_nb.ranks import free_port
from gemma_nb.tiny import BUNDLED_ID


class EndpointError(RuntimeError):
    """The endpoint answered with an error, could not be reached, or did not stream in OpenAI's
    format."""


def base_url(url: str) -> str:
    """``url`` as an OpenAI base URL ending in ``/v1`` (a bare ``http://host:8080`` means its
    ``/v1``)."""
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(
            f"endpoint {url!r} is not an http(s) URL; expected an OpenAI-compatible base URL "
            "such as http://127.0.0.1:8080/v1"
        )
    path = parts.path.rstrip("/")
    return f"{parts.scheme}://{parts.netloc}{path if path.endswith('/v1') else path + '/v1'}"


def wait_until_healthy(
    url: str,
    timeout_s: float = 180.0,
    process: subprocess.Popen | None = None,
    log_path: Path | None = None,
) -> float:
    """Seconds until ``GET /health`` answers 200; TimeoutError after ``timeout_s``; EndpointError if
    ``process`` exits."""
    health, started = base_url(url).removesuffix("/v1") + "/health", time.perf_counter()
    while True:
        if process is not None and process.poll() is not None:
            tail = (
                log_path.read_text(errors="replace")[-2000:]
                if log_path and log_path.exists()
                else ""
            )
            raise EndpointError(
                f"the server exited with status {process.returncode} before it was healthy:\n{tail}"
            )
        with contextlib.suppress(httpx.HTTPError, ValueError):  # not listening yet, or not JSON
            if (response := httpx.get(health, timeout=2.0)).status_code == 200:
                return time.perf_counter() - started
            if response.json().get("status") == "error":  # the model failed to load: no use waiting
                raise EndpointError(
                    f"{health} reports that the model failed to load: "
                    f"{response.json().get('error')}"
                )
        if time.perf_counter() - started > timeout_s:
            raise TimeoutError(f"{health} did not answer 200 within {timeout_s:.0f} s")
        time.sleep(0.1)


@contextlib.contextmanager
def local_server(
    target: str = "cpu",
    model_id: str | None = None,
    *,
    runtime: str = "auto",
    extra_args: Sequence[str] = (),
    env: dict | None = None,
):
    """``python -m gemma_nb serve`` on a free loopback port, yielding its ``.../v1`` URL; its log is
    shown if it fails to start, ``env`` adds variables (the API key, never a flag), the process is
    stopped at the end."""
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "gemma_nb",
        "serve",
        "--target",
        target,
        "--model-id",
        model_id or BUNDLED_ID,
        "--runtime",
        runtime,
        "--port",
        str(port),
        "--log-level",
        "warning",
        *extra_args,
    ]
    with tempfile.TemporaryDirectory(prefix="gemma-nb-serve-") as folder:
        log_path = Path(folder) / "server.log"
        with open(log_path, "wb") as log:
            process = subprocess.Popen(
                command,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})},
            )
        url = f"http://127.0.0.1:{port}/v1"
        try:
            wait_until_healthy(url, 300.0, process, log_path)
            yield url
        finally:
            process.terminate()
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=5)
