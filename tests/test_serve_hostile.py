"""The server against hostile input: every reproduction, a bounded fuzz test, the body and head
limits.

One in-process uvicorn server on a loopback port (queue of 2, so that a leaked slot shows after
two requests) over the bundled checkpoint, with faults that a test can inject into the tokenizer
or the model; the body-limit test runs ``python -m gemma_nb serve`` itself and watches its RSS.
"""

import contextlib
import http.client
import json
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import psutil
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gemma_nb.cli import main as cli
from gemma_nb.endpoint import free_port, local_server, wait_until_healthy
from gemma_nb.modelio import load_model
from gemma_nb.serving import app as served
from gemma_nb.serving.backends import TransformersRuntime
from gemma_nb.tiny import BUNDLED_ID

pytestmark = pytest.mark.usefixtures("one_thread")

FRANCE = [{"role": "user", "content": "The capital of France is"}]
VALID = {
    "/v1/chat/completions": {"messages": FRANCE, "temperature": 0, "max_tokens": 2},
    "/v1/completions": {"prompt": "The capital of France is", "temperature": 0, "max_tokens": 2},
    "/generate": {"prompt": "The capital of France is", "max_tokens": 2},
}


class FaultyTokenizer:
    """The real tokenizer, except that encoding raises while ``faults`` holds "tokenize"; counts its
    calls."""

    def __init__(self, tokenizer, faults: set):
        self._tokenizer, self._faults, self.calls = tokenizer, faults, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if "tokenize" in self._faults:
            raise RuntimeError("injected tokenizer fault")
        return self._tokenizer(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)


class FaultyRuntime(TransformersRuntime):
    """The bundled model; ``faults`` may hold "prefill" or "decode" to make that step raise once."""

    def __init__(self, model, tokenizer):
        self.faults: set[str] = set()
        super().__init__(model, FaultyTokenizer(tokenizer, self.faults))

    def prefill(self, prompt_ids):
        if "prefill" in self.faults:
            self.faults.discard("prefill")
            raise RuntimeError("injected prefill fault")
        return super().prefill(prompt_ids)

    def decode(self, token_id):
        if "decode" in self.faults:
            self.faults.discard("decode")
            raise RuntimeError("injected decode fault")
        return super().decode(token_id)


@pytest.fixture(scope="module")
def runtime():
    torch.manual_seed(0)
    return FaultyRuntime(*load_model(BUNDLED_ID))


@pytest.fixture(scope="module")
def server(serve_in_thread, runtime):
    app = served.create_app(
        runtime,
        model_name=BUNDLED_ID,
        queue_size=2,
        body_timeout_s=0.5,
        allowed_hosts=[*served.LOOPBACK_HOSTS, "gemma.internal"],
    )
    with serve_in_thread(app) as root:
        wait_until_healthy(root + "/v1", timeout_s=60)
        yield root


def metric(root: str, name: str, **labels) -> float:
    wanted = ",".join(f'{k}="{v}"' for k, v in labels.items())
    prefix = f"{name}{{{wanted}}} " if wanted else f"{name} "
    for line in httpx.get(root + "/metrics").text.splitlines():
        if line.startswith(prefix):
            return float(line[len(prefix) :])
    return 0.0


def post(root: str, path: str, body, **kwargs) -> httpx.Response:
    content = body if isinstance(body, (str, bytes)) else json.dumps(body)
    headers = kwargs.pop("headers", {"Content-Type": "application/json"})
    return httpx.post(root + path, content=content, headers=headers, timeout=30, **kwargs)


def error_of(response: httpx.Response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert len(error["message"]) < 400, "an error must not echo the request back"
    if param is not None:
        assert error["param"] == param, error
    return error


def assert_still_serving(root: str) -> None:
    assert metric(root, "gemma_nb_queue_depth") == 0
    reply = post(
        root, "/v1/chat/completions", {"messages": FRANCE, "temperature": 0, "max_tokens": 4}
    )
    assert (
        reply.status_code == 200 and reply.json()["choices"][0]["message"]["content"] == "Paris ."
    )
    assert metric(root, "gemma_nb_queue_depth") == 0


# ---------------------------------------------------------------- 1. no leaked queue slots


def test_1_refusals_after_admission_do_not_leak_queue_slots(server):
    for _ in range(9):  # the queue holds 2: a leak would turn the valid request below into a 429
        error = error_of(post(server, "/v1/completions", {"prompt": [2, 10**6]}), 400, "prompt.1")
        assert "1000000" in error["message"]
    for prompt in ([-1], [2**70]):
        error_of(post(server, "/v1/completions", {"prompt": prompt}), 400, "prompt.0")
    assert_still_serving(server)
    # Any integer seeds the sampler (modulo 2**64): 2**70 and 2**70 + 2**64 draw alike.
    hot = {"messages": FRANCE, "max_tokens": 6, "temperature": 2.0, "ignore_eos": True}
    texts = [
        post(server, "/v1/chat/completions", {**hot, "seed": seed}).json()["choices"][0]["message"][
            "content"
        ]
        for seed in (2**70, 2**70 + 2**64, -(2**63))
    ]
    assert texts[0] == texts[1]


def test_every_failure_path_releases_the_slot(server, runtime):
    """Validation error, full queue, a fault before admission, in the model, mid-stream, a client
    that leaves."""
    ask = {"messages": FRANCE, "temperature": 0, "max_tokens": 4}
    error_of(post(server, "/v1/chat/completions", {**ask, "top_p": 0}), 400, "top_p")
    runtime.faults.add("tokenize")
    try:
        error = error_of(post(server, "/v1/chat/completions", ask), 500)
    finally:
        runtime.faults.discard("tokenize")
    assert error["type"] == "server_error" and "RuntimeError" in error["message"]
    runtime.faults.add("prefill")
    error_of(post(server, "/generate", {"prompt": "The capital of France is"}), 500)
    runtime.faults.add("decode")
    streamed = post(
        server, "/v1/completions", {**VALID["/v1/completions"], "stream": True, "max_tokens": 4}
    )
    # in-band: headers were sent
    assert streamed.status_code == 200 and '"type":"server_error"' in streamed.text
    with httpx.stream(
        "POST",
        server + "/v1/chat/completions",
        json={**ask, "max_tokens": 300, "ignore_eos": True, "stream": True},
        timeout=30,
    ) as response:
        next(response.iter_lines())  # hang up after the first event
    deadline = time.perf_counter() + 10
    while metric(server, "gemma_nb_queue_depth") != 0:
        assert time.perf_counter() < deadline, "the disconnected stream still holds its slot"
        time.sleep(0.05)
    assert_still_serving(server)


# ---------------------------------------------------------------- 2. bad input is a 4xx


def test_2_bad_values_get_400_not_500(server):
    # A tiny positive temperature is (all but) greedy, streamed or not: no NaN, no in-band error.
    tiny_t = {"messages": FRANCE, "temperature": 5e-324, "max_tokens": 8}
    assert (
        post(server, "/v1/chat/completions", tiny_t).json()["choices"][0]["message"]["content"]
        == "Paris ."
    )
    streamed = post(server, "/v1/chat/completions", {**tiny_t, "stream": True})
    assert (
        streamed.status_code == 200
        and streamed.text.endswith("data: [DONE]\n\n")
        and '"error"' not in streamed.text
    )
    error_of(
        post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}),
        400,
        "messages.0.content",
    )
    surrogate = '{"messages": [{"role": "user", "content": "\\ud800"}]}'
    assert (
        "lone surrogate"
        in error_of(post(server, "/v1/chat/completions", surrogate), 400, "messages.0.content")[
            "message"
        ]
    )
    assert (
        "lone surrogate"
        in error_of(post(server, "/v1/completions", '{"prompt": "a\\udfff"}'), 400, "prompt")[
            "message"
        ]
    )
    error = error_of(post(server, "/v1/completions", {"prompt": [2, 10**9]}), 400, "prompt.1")
    assert "1000000000" in error["message"]
    assert_still_serving(server)


# ---------------------------------------------------------------- 3. a 500 is counted and keeps the
# connection


def test_3_a_500_is_counted_and_the_connection_stays_usable(server, runtime):
    before = metric(server, "gemma_nb_requests_total", endpoint="/generate", status="500")
    host, port = server.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    body = json.dumps({"prompt": "The capital of France is", "max_tokens": 4})
    runtime.faults.add("prefill")
    conn.request("POST", "/generate", body, {"Content-Type": "application/json"})
    failed = conn.getresponse()
    payload = json.loads(failed.read())
    assert failed.status == 500 and payload["error"]["type"] == "server_error"
    assert failed.getheader("connection") != "close"
    sock = conn.sock
    # same pooled connection
    conn.request("POST", "/generate", body, {"Content-Type": "application/json"})
    ok = conn.getresponse()
    assert ok.status == 200 and json.loads(ok.read())["text"] == " Paris ." and conn.sock is sock
    conn.close()
    assert (
        metric(server, "gemma_nb_requests_total", endpoint="/generate", status="500") == before + 1
    )
    assert metric(server, "gemma_nb_queue_depth") == 0


# ---------------------------------------------------------------- 4. bodies: type, size, speed


def test_4_wrong_content_type_is_415_without_echo(server):
    body = json.dumps({"messages": FRANCE, "padding": "secret " * 1000})
    error = error_of(
        post(server, "/v1/chat/completions", body, headers={"Content-Type": "text/plain"}), 415
    )
    assert "secret" not in error["message"] and "application/json" in error["message"]
    # No Content-Type at all is read as JSON (as curl --json or a bare client sends it).
    reply = httpx.post(
        server + "/generate",
        content=json.dumps({"prompt": "The capital of France is", "max_tokens": 4}),
    )
    assert reply.status_code == 200 and reply.json()["text"] == " Paris ."


def _server_process(port: int) -> psutil.Process:
    for child in psutil.Process().children(recursive=True):
        if str(port) in child.cmdline():
            return child
    raise AssertionError(f"no child process serves port {port}")


def test_4_large_bodies_get_413_at_once_and_leave_no_memory_behind():
    """The issue's check on a real ``python -m gemma_nb serve``: 10 and 50 MB bodies, then RSS;
    under the limit, three 3.9 MB prompts and 1.9 million token ids are refused untokenized."""
    with local_server(runtime="transformers", extra_args=("--queue-size", "4")) as base_url:
        root = base_url.removesuffix("/v1")
        process = _server_process(int(root.rsplit(":", 1)[1]))
        httpx.get(root + "/health")
        rss_before_mb = process.memory_info().rss / 1e6
        health_ms: list[float] = []
        stop = threading.Event()

        def poll_health():
            while not stop.is_set():
                started = time.perf_counter()
                assert httpx.get(root + "/health", timeout=5).status_code == 200
                health_ms.append(1e3 * (time.perf_counter() - started))
                time.sleep(0.05)

        poller = threading.Thread(target=poll_health, daemon=True)
        poller.start()
        figures = []
        try:
            for size_mb in (10, 50):
                body = b'{"prompt": "' + b"x" * (size_mb * 1_000_000) + b'"}'
                started = time.perf_counter()
                response = httpx.post(
                    base_url + "/completions",
                    content=body,
                    headers={"Content-Type": "application/json"},
                    timeout=30,
                )
                seconds = time.perf_counter() - started
                error_of(response, 413)
                figures.append((f"{size_mb} MB with Content-Length", seconds))

            def chunks():  # no Content-Length: the server counts what arrives
                for _ in range(10):
                    yield b"x" * 1_000_000

            started = time.perf_counter()
            response = httpx.post(base_url + "/completions", content=chunks(), timeout=30)
            error_of(response, 413)
            figures.append(("10 MB chunked", time.perf_counter() - started))
            rss_after_mb = process.memory_info().rss / 1e6
            # Under the limit: bounded against the context before they are tokenized or checked.
            prompts = [
                ("/completions", {"prompt": "France " * 557_000}, "prompt"),
                (
                    "/chat/completions",
                    {"messages": [{"role": "user", "content": "Paris " * 650_000}]},
                    "messages",
                ),
                ("/generate", {"prompt": "Lyon " * 780_000}, "prompt"),
                ("/completions", {"prompt": [1] * 1_900_000}, "prompt"),
            ]

            def refused(case) -> float:
                path, body, param = case
                content = json.dumps(body, separators=(",", ":")).encode()
                assert 3_800_000 < len(content) < served.DEFAULT_MAX_BODY_BYTES
                started = time.perf_counter()
                url = root + path if path == "/generate" else base_url + path
                response = httpx.post(url, content=content, timeout=60)
                assert error_of(response, 400, param)["code"] == "context_length_exceeded"
                return time.perf_counter() - started

            with ThreadPoolExecutor(4) as pool:
                bounded_s = list(pool.map(refused, prompts))
        finally:
            stop.set()
            poller.join(timeout=10)
        rss_bounded_mb = process.memory_info().rss / 1e6
        for name, seconds in figures:
            print(f"{name}: 413 in {seconds:.3f} s")
        print(f"3.9 MB prompts and token ids refused (context) in {max(bounded_s):.2f} s at most")
        print(f"/health during all that: {len(health_ms)} polls, slowest {max(health_ms):.1f} ms")
        print(
            f"server RSS: {rss_before_mb:.0f} MB before, {rss_after_mb:.0f} MB after the 413s, "
            f"{rss_bounded_mb:.0f} MB after the four 3.9 MB prompts"
        )
        assert all(seconds < 1.0 for _, seconds in figures), figures
        assert max(bounded_s) < 5.0, bounded_s
        assert health_ms and max(health_ms) < 1000
        assert rss_after_mb - rss_before_mb < 100
        assert rss_bounded_mb - rss_before_mb < 150
        reply = httpx.post(
            base_url + "/completions",
            json={"prompt": "The capital of France is", "temperature": 0, "max_tokens": 4},
            timeout=30,
        )
        assert reply.json()["choices"][0]["text"] == " Paris ."


# ---------------------------------------------------------------- 5. nothing accepted silently


@pytest.mark.parametrize(
    "field, value",
    [
        ("logprobs", True),
        ("n", 2),
        ("tools", [{"type": "function"}]),
        ("response_format", {"type": "json_object"}),
        ("frequency_penalty", 0.5),
        ("logit_bias", {"5": 10}),
    ],
)
def test_5_unsupported_openai_options_are_refused_by_name(server, field, value):
    error = error_of(
        post(server, "/v1/chat/completions", {"messages": FRANCE, field: value}), 400, field
    )
    assert error["code"] == "unsupported_parameter" and f"'{field}'" in error["message"]


def test_5_neutral_values_of_unsupported_options_are_accepted(server):
    neutral = {
        "logprobs": False,
        "n": 1,
        "frequency_penalty": 0,
        "tools": [],
        "response_format": {"type": "text"},
    }
    reply = post(
        server,
        "/v1/chat/completions",
        {"messages": FRANCE, "temperature": 0, "max_tokens": 4, **neutral},
    )
    assert (
        reply.status_code == 200 and reply.json()["choices"][0]["message"]["content"] == "Paris ."
    )


@pytest.mark.parametrize(
    "field, value",
    [
        ("max_tokens", True),
        ("max_tokens", "10"),
        ("temperature", "0.5"),
        ("stream", "yes"),
        ("seed", 1.5),
        ("top_k", False),
        ("stop", ["a", "b", "c", "d", "e"]),
        ("stream_options", {"include_usage": 1}),
    ],
)
def test_5_strict_types(server, field, value):
    error_of(post(server, "/v1/chat/completions", {"messages": FRANCE, field: value}), 400)


def test_5_roles_fields_and_routes(server):
    error_of(
        post(server, "/v1/chat/completions", {"messages": [{"role": "hacker", "content": "x"}]}),
        400,
        "messages.0.role",
    )
    error = error_of(
        post(server, "/v1/chat/completions", {"messages": FRANCE, "temprature": 0}),
        400,
        "temprature",
    )
    assert "unknown field 'temprature'" in error["message"] and "temperature" in error["message"]
    # /generate does not stream
    error_of(post(server, "/generate", {"prompt": "x", "stream": True}), 400, "stream")


def test_5_host_allow_list(server):
    port = server.rsplit(":", 1)[1]
    for host in (
        f"localhost:{port}",
        f"LOCALHOST:{port}",
        "127.0.0.1",
        f"[::1]:{port}",
        "gemma.internal:80",
    ):
        assert httpx.get(server + "/health", headers={"Host": host}).status_code == 200, host
    before = metric(server, "gemma_nb_requests_total", endpoint="/v1/models", status="400")
    for host in (
        "attacker.example",
        f"attacker.example:{port}",
        "127.0.0.1.attacker.example",
        "[::2]",
    ):
        # Starlette's TrustedHostMiddleware
        response = httpx.get(server + "/v1/models", headers={"Host": host})
        assert response.status_code == 400 and response.text == "Invalid host header", host
    assert (
        metric(server, "gemma_nb_requests_total", endpoint="/v1/models", status="400") == before + 4
    )


def test_5_bearer_scheme_is_case_insensitive(serve_in_thread, runtime):
    app = served.create_app(runtime, model_name=BUNDLED_ID, api_key="k" * 24)
    with serve_in_thread(app) as root:
        wait_until_healthy(root + "/v1", timeout_s=60)
        for scheme in ("Bearer", "bearer", "BEARER"):
            assert (
                httpx.get(
                    root + "/v1/models", headers={"Authorization": f"{scheme} {'k' * 24}"}
                ).status_code
                == 200
            )
        for header in ("Basic " + "k" * 24, "bearer wrong", "k" * 24):
            assert (
                httpx.get(root + "/v1/models", headers={"Authorization": header}).status_code == 401
            )


def test_5_a_slow_body_gets_408(server):
    host, port = server.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(
            b"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b'Content-Length: 100\r\n\r\n{"prompt":'
        )
        started, answer = time.perf_counter(), b""
        while chunk := sock.recv(65536):  # until the server closes the connection
            answer += chunk
            waited = time.perf_counter() - started
    assert answer.startswith(b"HTTP/1.1 408") and b"within 0.5 s" in answer
    assert 0.4 < waited < 5


def test_5_slot_watchdog_counts_overdue_slots(serve_in_thread, slowed, runtime):
    app = served.create_app(slowed(runtime), model_name=BUNDLED_ID, slot_watchdog_s=0.2)
    with serve_in_thread(app) as root:
        wait_until_healthy(root + "/v1", timeout_s=60)
        assert metric(root, "gemma_nb_slots_overdue") == 0
        ask = {"messages": FRANCE, "max_tokens": 40, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", root + "/v1/chat/completions", json=ask, timeout=30):
            time.sleep(0.5)
            assert (
                metric(root, "gemma_nb_slots_overdue") == 1
                and metric(root, "gemma_nb_oldest_slot_seconds") > 0.2
            )
        deadline = time.perf_counter() + 10
        while metric(root, "gemma_nb_slots_overdue") != 0:
            assert time.perf_counter() < deadline
            time.sleep(0.05)


def test_5_startup_fails_fast(tmp_path, capsys):
    assert cli(["serve", "--model-id", "/nonexistent", "--runtime", "transformers"]) == 2
    assert "--model-id /nonexistent" in capsys.readouterr().err
    assert cli(["serve", "--artifact", str(tmp_path / "missing")]) == 2
    assert "missing" in capsys.readouterr().err
    # A folder that exists but holds no model: the server starts, the load fails, the process ends.
    started = time.perf_counter()
    assert (
        cli(
            [
                "serve",
                "--model-id",
                str(tmp_path),
                "--runtime",
                "transformers",
                "--port",
                "0",
                "--log-level",
                "critical",
            ]
        )
        == 1
    )
    assert "failed to load" in capsys.readouterr().err and time.perf_counter() - started < 60


# ---------------------------------------------------------------- the fuzz test


def json_values():
    scalars = (
        st.none()
        | st.booleans()
        | st.integers()
        | st.integers(min_value=-(2**80), max_value=2**80)
        | st.floats(allow_nan=False, allow_infinity=False)
        | st.text(max_size=12)
        | st.text(st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF), min_size=1, max_size=2)
    )
    return st.recursive(
        scalars,
        lambda inner: (
            st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
        ),
        max_leaves=6,
    )


FIELDS = [
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "stop",
    "seed",
    "ignore_eos",
    "stream",
    "stream_options",
    "n",
    "logprobs",
    "tools",
    "user",
    "prompt",
    "messages",
    "max_completion_tokens",
    "extra",
]
MESSAGES = st.lists(
    st.fixed_dictionaries(
        {
            "role": st.sampled_from(["system", "user", "assistant", "tool"]) | json_values(),
            "content": json_values() | st.just("The capital of France is"),
        }
    ),
    max_size=3,
)

# Values near the valid ones, so that some requests get through to the model.
PLAUSIBLE = (
    st.integers(-2, 600)
    | st.floats(0, 2.5)
    | st.booleans()
    | st.sampled_from(["Paris", " .", BUNDLED_ID])
    | st.lists(st.integers(0, 300), min_size=1, max_size=4)
)


@st.composite
def hostile_requests(draw):
    route = draw(st.sampled_from(sorted(VALID)))
    if draw(st.integers(0, 9)) == 0:
        return route, draw(json_values())  # the whole body
    field = draw(st.sampled_from(FIELDS))
    value = draw(
        MESSAGES if field == "messages" and draw(st.booleans()) else PLAUSIBLE | json_values()
    )
    return route, {**VALID[route], field: value}


@settings(
    max_examples=100,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(case=hostile_requests())
def test_fuzz_no_5xx(server, case):
    route, body = case
    response = post(server, route, json.dumps(body))
    assert response.status_code < 500, (route, body, response.text[:300])
    if response.status_code >= 400:
        error_of(response, response.status_code)


def test_fuzz_leaves_the_server_serving(server):
    """Runs after the fuzz test (file order): no slot held, a valid request answered."""
    assert metric(server, "gemma_nb_requests_total", endpoint="/v1/completions", status="500") == 0
    assert_still_serving(server)


# ---------------------------------------------------------------- the HTTP layer: heads, framing,
# uvicorn's refusals


def raw(root: str, data: bytes, timeout_s: float = 10.0) -> bytes:
    """Send ``data`` on a fresh connection in one write; everything the server answers until it
    closes."""
    host, port = root.removeprefix("http://").split(":")
    answer = b""
    with socket.create_connection((host, int(port)), timeout=timeout_s) as sock:
        sock.sendall(data)
        with contextlib.suppress(TimeoutError):
            while chunk := sock.recv(65536):
                answer += chunk
    return answer


def test_a_head_over_16_kib_in_one_packet_is_refused(server):
    head = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Padding: " + b"x" * 60_000 + b"\r\n\r\n"
    answer = raw(server, head)
    assert answer.startswith(b"HTTP/1.1 431") and b'"code":"head_too_large"' in answer, answer[:200]


def test_content_length_with_transfer_encoding_is_refused(server):
    body = json.dumps({"prompt": "The capital of France is", "max_tokens": 2}).encode()
    request = (
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Content-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n"
        + b"%x\r\n%s\r\n0\r\n\r\n"
        % (len(body), body)
    )
    answer = raw(server, request)  # read to the end: the server closes the connection
    assert answer.startswith(b"HTTP/1.1 400") and b'"code":"ambiguous_length"' in answer, answer[
        :200
    ]
    assert answer.count(b"HTTP/1.1") == 1


def test_uvicorn_refusals_are_counted(serve_in_thread, runtime):
    app = served.create_app(runtime, model_name=BUNDLED_ID)
    with serve_in_thread(app, limit_concurrency=3) as root:
        wait_until_healthy(root + "/v1", timeout_s=60)
        # uvicorn's own, plain text
        assert raw(root, b"NOT HTTP AT ALL\r\n\r\n").startswith(b"HTTP/1.1 400")
        host, port = root.removeprefix("http://").split(":")
        idle = [socket.create_connection((host, int(port))) for _ in range(3)]
        try:
            assert httpx.get(root + "/health").status_code == 503  # over --limit-concurrency
        finally:
            for sock in idle:
                sock.close()
        time.sleep(0.2)  # the server notices the closed connections
        assert metric(root, "gemma_nb_http_refused_total", reason="invalid_http") == 1
        assert metric(root, "gemma_nb_http_refused_total", reason="concurrency_limit") == 1


def test_a_pipelined_long_request_keeps_its_response(serve_in_thread, slowed, runtime):
    """No timer of the server's (keep-alive here, 1 s) cuts a request that has arrived and is
    running."""
    app = served.create_app(slowed(runtime), model_name=BUNDLED_ID)
    with serve_in_thread(app, keep_alive_timeout_s=1) as root:
        wait_until_healthy(root + "/v1", timeout_s=60)
        body = json.dumps(
            {"prompt": "The capital of France is", "max_tokens": 40, "ignore_eos": True}
        ).encode()
        two = (
            b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
            + b"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Content-Type: application/json\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%s"
            % (len(body), body)
        )
        answer = raw(root, two, timeout_s=30)  # the second takes >= 2 s
    assert answer.count(b"HTTP/1.1 200") == 2 and b'"tokens":40' in answer, answer[-300:]


def test_admission_comes_before_the_body_is_parsed_or_tokenized(serve_in_thread, slowed, runtime):
    """With the queue full, 3.9 MB bodies under the limit get 429 without being parsed or
    tokenized."""
    app = served.create_app(slowed(runtime), model_name=BUNDLED_ID, queue_size=1)
    with serve_in_thread(app) as root:
        wait_until_healthy(root + "/v1", timeout_s=60)
        long = {"prompt": "The capital of France is", "max_tokens": 60, "ignore_eos": True}
        holder = threading.Thread(target=lambda: post(root, "/v1/completions", long), daemon=True)
        holder.start()
        while metric(root, "gemma_nb_generated_tokens_total") < 1:
            time.sleep(0.02)
        calls, big = runtime.tokenizer.calls, json.dumps({"prompt": "France " * 557_000})
        assert 3_800_000 < len(big) < served.DEFAULT_MAX_BODY_BYTES
        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda _: post(root, "/v1/completions", big), range(12)))
        assert [a.status_code for a in answers] == [429] * 12 and answers[0].json()["error"][
            "code"
        ] == "queue_full"
        assert runtime.tokenizer.calls == calls  # nothing was tokenized
        holder.join(timeout=30)


# ---------------------------------------------------------------- the key before a queue place,
# bounds before tokenizing, short errors, OpenAI's nulls


def test_keyless_clients_trickling_bodies_hold_no_queue_place(serve_in_thread, runtime):
    """4 clients without the key send `{` and trickle, at --queue-size 2: each gets 401 before its
    body, so the authorized request is served."""
    key = "k" * 24
    app = served.create_app(
        runtime, model_name=BUNDLED_ID, queue_size=2, api_key=key, body_timeout_s=10
    )
    with serve_in_thread(app) as root:
        wait_until_healthy(root + "/v1", timeout_s=60)
        host, port = root.removeprefix("http://").split(":")
        trickling = [socket.create_connection((host, int(port)), timeout=10) for _ in range(4)]
        try:
            for sock in trickling:
                sock.sendall(
                    b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                    b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{"
                )
            for sock in trickling:
                assert sock.recv(65536).startswith(b"HTTP/1.1 401")
            authorized = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
            reply = post(root, "/v1/completions", VALID["/v1/completions"], headers=authorized)
            assert reply.status_code == 200 and reply.json()["choices"][0]["text"] == " Paris ."
        finally:
            for sock in trickling:
                sock.close()


def test_a_megabyte_unknown_field_gets_a_short_error(server):
    name = "x" * 1_000_000
    response = post(server, "/v1/completions", {**VALID["/v1/completions"], name: 1})
    assert len(response.content) < 1_000
    error = error_of(response, 400)
    assert error["code"] == "unknown_parameter" and error["message"].startswith("unknown field 'xx")
    assert error["param"] == "x" * 40 + "..."


def test_null_sampling_fields_are_their_defaults(server):
    nulls = dict.fromkeys(("temperature", "top_p", "top_k", "stream", "ignore_eos"))
    for path, body in VALID.items():
        response = post(server, path, {**body, **{k: None for k in nulls if k != "stream"}})
        assert response.status_code == 200, response.text
    chat = post(server, "/v1/chat/completions", {**VALID["/v1/chat/completions"], **nulls})
    assert chat.status_code == 200 and chat.json()["object"] == "chat.completion"
    generated = post(server, "/generate", {**VALID["/generate"], "temperature": None})
    assert generated.json()["text"] == " Paris ."  # /generate's default: greedy


# ---------------------------------------------------------------- a clean stop


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_ends_streams_with_an_error_event_and_queued_requests_with_a_503(stop):
    port = free_port()
    command = [sys.executable, "-m", "gemma_nb", "serve", "--runtime", "transformers"]
    command += ["--port", str(port), "--log-level", "warning"]
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    root, answers = f"http://127.0.0.1:{port}", {}
    try:
        wait_until_healthy(root + "/v1", 120, process)
        long = {"prompt": "The capital of France is", "max_tokens": 500, "ignore_eos": True}

        def stream():
            with httpx.stream(
                "POST", root + "/v1/completions", json={**long, "stream": True}, timeout=60
            ) as response:
                answers["stream"] = [line for line in response.iter_lines() if line]

        streaming = threading.Thread(target=stream)
        streaming.start()
        while metric(root, "gemma_nb_generated_tokens_total") < 1:
            time.sleep(0.02)
        queued = threading.Thread(
            target=lambda: answers.update(queued=post(root, "/generate", long))
        )
        queued.start()
        while metric(root, "gemma_nb_queue_depth") < 2:
            time.sleep(0.02)
        process.send_signal(stop)
        streaming.join(timeout=30)
        queued.join(timeout=30)
        _, stderr = process.communicate(timeout=30)
    finally:
        process.kill()
    assert process.returncode == 0 and "Traceback" not in stderr, stderr[-2000:]
    last = json.loads(answers["stream"][-1].removeprefix("data: "))
    assert last["error"]["code"] == "shutting_down" and "data: [DONE]" not in answers["stream"]
    assert error_of(answers["queued"], 503)["code"] == "shutting_down"
