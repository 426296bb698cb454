"""Fixtures shared by the test files."""

import contextlib
import socket
import threading
import time

import pytest


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models are op-overhead bound: one torch thread is fastest, and a second one only waits
    at a barrier per op (30-100x slower on a busy 2-core box). Opt in with
    ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    from gemma_nb import targets

    with targets.one_thread():
        yield


@pytest.fixture
def eager_runner():
    """``export``'s two-step loop over the un-exported ``DeviceBody``: what the exported programs
    must equal."""
    from gemma_nb import export

    def build(model, shapes):
        export.set_traceable_experts(model)
        body = export.DeviceBody(model, shapes.max_cache_len)
        return export._runner(model, body, body, shapes)

    return build


# tests/xla lower the neuron graphs with torch-xla: collected only in the xla environment
# (`make test-xla`, .venv-xla), never in the main one, which has no torch_xla.
def _has_torch_xla() -> bool:
    import importlib.util

    return importlib.util.find_spec("torch_xla") is not None


collect_ignore = [] if _has_torch_xla() else ["xla"]


# The server's tests run its app in-process: uvicorn on a thread, with the CLI's limits.
@contextlib.contextmanager
def serve_app(app, host: str = "127.0.0.1", port: int = 0, **config):
    """Serve ``app`` on a thread; yields ``http://host:port`` once uvicorn listens (poll ``/health``
    for the model). ``port=0`` picks a free port; ``config``: ``uvicorn_config``'s limits."""
    import uvicorn  # here: the xla environment runs tests/xla without the server's dependencies

    from gemma_nb.serving import serve

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    # A test ends with requests still running (a long answer holding the queue): half a second of
    # grace, then uvicorn cancels them, instead of idling out the serve command's 5 s.
    server = uvicorn.Server(
        serve.uvicorn_config(
            app, log_level="warning", access_log=False, timeout_graceful_shutdown=0.5, **config
        )
    )
    thread = threading.Thread(
        target=server.run, kwargs={"sockets": [sock]}, daemon=True, name="gemma-nb-uvicorn"
    )
    with serve.counting_refusals(app.state.metrics):
        thread.start()
        while not server.started:
            if not thread.is_alive():
                raise RuntimeError(f"uvicorn did not start on {host}:{sock.getsockname()[1]}")
            time.sleep(0.02)
        try:
            yield f"http://{host}:{sock.getsockname()[1]}"
        finally:
            server.should_exit = True
            thread.join(timeout=10)
            sock.close()


@pytest.fixture(scope="session")
def serve_in_thread():
    """``serve_in_thread(app, **limits)``: a context manager yielding the base URL of ``app`` served
    on a thread."""
    return serve_app


class Slowed:
    """``runtime`` on a slower device: every prefill and decode step ``delay_s`` longer, so that
    requests queue."""

    def __init__(self, runtime, delay_s: float = 0.05):
        self.runtime, self.delay_s = runtime, delay_s

    def __getattr__(self, name):
        return getattr(self.runtime, name)

    def prefill(self, prompt_ids):
        time.sleep(self.delay_s)
        return self.runtime.prefill(prompt_ids)

    def decode(self, token_id):
        time.sleep(self.delay_s)
        return self.runtime.decode(token_id)


@pytest.fixture(scope="session")
def slowed():
    """``slowed(runtime)``: ``runtime`` with every token 50 ms slower (``Slowed``)."""
    return Slowed
