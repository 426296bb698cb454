"""The endpoint benchmark: URL parsing, timing a real server's stream, the local server's lifecycle."""

import math
import socket

import pandas as pd
import pytest

from gemma_nb import client_bench, serve
from gemma_nb.client_bench import Endpoint, EndpointError
from gemma_nb.modelio import load_model
from gemma_nb.tiny import BUNDLED_ID


def test_endpoint_parse():
    vllm = Endpoint.parse("http://10.0.0.5:8000/v1")
    assert (vllm.host, vllm.port, vllm.prefix, vllm.root) == ("10.0.0.5", 8000, "/v1", "http://10.0.0.5:8000")
    # A bare host means the usual /v1 API, as the port's container serves it on :8080.
    assert Endpoint.parse("http://localhost:8080").base_url == "http://localhost:8080/v1"
    assert Endpoint.parse("https://example.com/proxy/v1/").base_url == "https://example.com:443/proxy/v1"
    with pytest.raises(ValueError, match="'localhost:8080' is not an http\\(s\\) URL"):
        Endpoint.parse("localhost:8080")


@pytest.fixture(scope="module")
def server():
    model, tokenizer = load_model(BUNDLED_ID)
    app = serve.create_app(serve.TransformersRuntime(model, tokenizer), model_name=BUNDLED_ID)
    with serve.serve_in_thread(app) as root:
        client_bench.wait_until_healthy(root + "/v1", timeout_s=60)
        yield root + "/v1"


def test_stream_chat_times_every_token(server):
    timing = client_bench.stream_chat(server, [{"role": "user", "content": "The capital of France is"}],
                                      max_tokens=8, ignore_eos=False)
    assert timing.text == "Paris ." and timing.finish_reason == "stop"
    assert timing.completion_tokens == 3  # "Paris", ".", <eos>: one chunk each, the last one empty
    assert len(timing.token_times_s) == 3 and len(timing.itl_s) == 2
    assert 0 < timing.ttft_s <= timing.token_times_s[-1] <= timing.total_s


def test_benchmark_endpoint_rows_and_summary(server):
    requests = client_bench.benchmark_endpoint(server, concurrency=(1, 2), requests_per_level=2, max_tokens=6)
    assert list(requests["concurrency"]) == [1, 1, 2, 2]
    assert (requests["completion_tokens"] == 6).all()  # ignore_eos: fixed-length answers
    assert requests["itl_ms"].map(len).eq(5).all()
    assert (requests["ttft_ms"] > 0).all() and (requests["itl_ms_p90"] >= requests["itl_ms_p50"]).all()
    summary = client_bench.summarize(requests)
    assert list(summary.columns) == ["concurrency", "requests", "ttft_ms_p50", "ttft_ms_p90", "itl_ms_p50",
                                     "itl_ms_p90", "tok_s_per_request", "tok_s_total"]
    assert list(summary["requests"]) == [2, 2] and (summary["tok_s_total"] > 0).all()
    level1 = requests[requests["concurrency"] == 1]
    assert math.isclose(summary["tok_s_total"][0], 12 / level1["level_wall_s"].iloc[0])
    gaps = client_bench.inter_token_latencies(requests)
    assert len(gaps) == 20 and list(gaps.columns) == ["concurrency", "itl_ms"]
    fig = client_bench.plot_benchmark(requests, title="tiny")
    assert len(fig.axes) == 3


def test_measure_endpoint_and_its_metrics(server):
    requests = client_bench.measure_endpoint(server, concurrency=(1, 2), requests_per_level=2, max_tokens=4)
    metrics, rows = client_bench.endpoint_metrics(requests, endpoint=server)
    summary = client_bench.summarize(requests).set_index("concurrency")
    assert metrics["by_concurrency"][2]["tok_s_total"] == summary.loc[2, "tok_s_total"]
    assert metrics["ttft_growth_x"] == summary.loc[2, "ttft_ms_p50"] / summary.loc[1, "ttft_ms_p50"]
    assert [r.get("claim") for r in rows] == [None, None, "decode_tok_s", None]
    assert client_bench.endpoint_metrics(requests)[1][2].get("claim") is None  # the local tiny server
    # neuron has no local server: without an endpoint there is nothing to measure.
    assert client_bench.measure_endpoint("", target="neuron") is None
    assert client_bench.endpoint_metrics(None) == ({"measured": False, "endpoint": None}, [])


def test_benchmark_rejects_bad_levels(server):
    with pytest.raises(ValueError, match=r"concurrency=\[0\]; expected positive integers"):
        client_bench.benchmark_endpoint(server, concurrency=[0])


def test_errors_are_reported(server):
    with pytest.raises(EndpointError, match="answered 404"):
        client_bench.stream_chat(server, [{"role": "user", "content": "hi"}], model="no-such-model")
    port = client_bench.free_port()
    with pytest.raises(OSError):
        client_bench.stream_chat(f"http://127.0.0.1:{port}/v1", [{"role": "user", "content": "hi"}], timeout_s=2)


def test_local_server_starts_serves_and_stops():
    with client_bench.local_server(runtime="transformers", queue_size=2) as base_url:
        assert client_bench.served_model(base_url) == BUNDLED_ID
        requests = client_bench.benchmark_endpoint(base_url, concurrency=(1,), requests_per_level=1,
                                                   max_tokens=4, warmup=False)
        assert isinstance(requests, pd.DataFrame) and requests["completion_tokens"].tolist() == [4]
        port = client_bench.Endpoint.parse(base_url).port
    with pytest.raises(OSError), socket.create_connection(("127.0.0.1", port), timeout=2):
        pass  # nobody listens any more


def test_local_server_reports_a_failed_start():
    with pytest.raises(EndpointError, match="no-such-folder"):
        with client_bench.local_server(model_id="./no-such-folder", runtime="transformers", ready_timeout_s=60):
            pass
