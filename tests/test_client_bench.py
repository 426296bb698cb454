"""The endpoint benchmark on the openai client: URLs, timing a real server's stream, the local
server."""

import math
import socket

import pandas as pd
import pytest

from gemma_nb import endpoint
from gemma_nb.endpoint import EndpointError
from gemma_nb.experiments import endpoint_bench
from gemma_nb.modelio import load_model
from gemma_nb.ranks import free_port
from gemma_nb.serving import app as served
from gemma_nb.serving import client_bench
from gemma_nb.serving.backends import TransformersRuntime
from gemma_nb.tiny import BUNDLED_ID


def test_base_url():
    assert endpoint.base_url("http://10.0.0.5:8000/v1") == "http://10.0.0.5:8000/v1"
    # A bare host means the usual /v1 API, as the port's container serves it on :8080.
    assert endpoint.base_url("http://localhost:8080") == "http://localhost:8080/v1"
    assert endpoint.base_url("https://example.com/proxy/v1/") == "https://example.com/proxy/v1"
    with pytest.raises(ValueError, match="'localhost:8080'.*http\\(s\\)"):
        endpoint.base_url("localhost:8080")


@pytest.fixture(scope="module")
def server(serve_in_thread):
    model, tokenizer = load_model(BUNDLED_ID)
    app = served.create_app(TransformersRuntime(model, tokenizer), model_name=BUNDLED_ID)
    with serve_in_thread(app) as root:
        endpoint.wait_until_healthy(root + "/v1", timeout_s=60)
        yield root + "/v1"


def test_stream_chat_times_every_token(server):
    timing = client_bench.stream_chat(
        server,
        [{"role": "user", "content": "The capital of France is"}],
        max_tokens=8,
        ignore_eos=False,
    )
    assert timing["text"] == "Paris ." and timing["finish_reason"] == "stop"
    # "Paris", ".", <eos>: one chunk each, the last one empty
    assert timing["completion_tokens"] == 3
    assert len(timing["itl_ms"]) == 2 and timing["itl_ms_p50"] <= timing["itl_ms_p90"]
    assert 0 < timing["ttft_ms"] + sum(timing["itl_ms"]) <= 1e3 * timing["e2e_s"]


def test_benchmark_endpoint_rows_and_summary(server):
    requests = client_bench.benchmark_endpoint(
        server, concurrency=(1, 2), requests_per_level=2, max_tokens=6
    )
    assert list(requests["concurrency"]) == [1, 1, 2, 2]
    assert (requests["completion_tokens"] == 6).all()  # ignore_eos: fixed-length answers
    assert requests["itl_ms"].map(len).eq(5).all()
    assert (requests["ttft_ms"] > 0).all() and (
        requests["itl_ms_p90"] >= requests["itl_ms_p50"]
    ).all()
    summary = endpoint_bench.summarize(requests)
    assert list(summary.columns) == [
        "concurrency",
        "requests",
        "ttft_ms_p50",
        "ttft_ms_p90",
        "itl_ms_p50",
        "itl_ms_p90",
        "tok_s_per_request",
        "tok_s_total",
    ]
    assert list(summary["requests"]) == [2, 2] and (summary["tok_s_total"] > 0).all()
    level1 = requests[requests["concurrency"] == 1]
    assert math.isclose(summary["tok_s_total"][0], 12 / level1["level_wall_s"].iloc[0])
    fig = endpoint_bench.plot_benchmark(requests, title="tiny")
    assert len(fig.axes) == 3


def test_measure_endpoint_and_its_metrics(server):
    requests = endpoint_bench.measure_endpoint(
        server, concurrency=(1, 2), requests_per_level=2, max_tokens=4
    )
    metrics, rows = endpoint_bench.endpoint_metrics(requests, endpoint=server)
    summary = endpoint_bench.summarize(requests).set_index("concurrency")
    assert metrics["by_concurrency"][2]["tok_s_total"] == summary.loc[2, "tok_s_total"]
    assert metrics["ttft_growth_x"] == summary.loc[2, "ttft_ms_p50"] / summary.loc[1, "ttft_ms_p50"]
    assert [r.get("claim") for r in rows] == [None, None, "decode_tok_s", None]
    # the local tiny server
    assert endpoint_bench.endpoint_metrics(requests)[1][2].get("claim") is None
    # neuron has no local server: without an endpoint there is nothing to measure.
    assert endpoint_bench.measure_endpoint("", target="neuron") is None
    assert endpoint_bench.endpoint_metrics(None) == ({"measured": False, "endpoint": None}, [])


def test_benchmark_rejects_bad_levels(server):
    with pytest.raises(ValueError, match=r"concurrency=\[0\].*positive"):
        client_bench.benchmark_endpoint(server, concurrency=[0])


def test_errors_are_reported(server):
    with pytest.raises(EndpointError, match="404: .*served"):
        client_bench.stream_chat(server, [{"role": "user", "content": "hi"}], model="no-such-model")
    with pytest.raises(EndpointError, match="failed: Connection error"):
        client_bench.stream_chat(
            f"http://127.0.0.1:{free_port()}/v1", [{"role": "user", "content": "hi"}], timeout_s=2
        )


def test_local_server_starts_serves_and_stops():
    with endpoint.local_server(
        runtime="transformers", extra_args=("--queue-size", "2")
    ) as base_url:
        assert client_bench.served_model(base_url) == BUNDLED_ID
        requests = client_bench.benchmark_endpoint(
            base_url, concurrency=(1,), requests_per_level=1, max_tokens=4, warmup=False
        )
        assert isinstance(requests, pd.DataFrame) and requests["completion_tokens"].tolist() == [4]
        port = int(base_url.rsplit(":", 1)[1].split("/")[0])
    with pytest.raises(OSError), socket.create_connection(("127.0.0.1", port), timeout=2):
        pass  # nobody listens any more


def test_local_server_reports_a_failed_start():
    with pytest.raises(EndpointError, match="no-such-folder"):
        with endpoint.local_server(model_id="./no-such-folder", runtime="transformers"):
            pass
