"""The OpenAI-compatible server: a real uvicorn on a loopback port, driven by the official client.

Most tests share one in-process server (uvicorn on a thread, default limits) over the bundled
checkpoint; the queue and disconnect tests get servers of their own with a per-token delay, so that
requests overlap deterministically; one test runs ``python -m gemma_nb serve`` itself in a
subprocess with an API key from the environment.
"""

import asyncio
import json
import re
import threading
import time

import httpx
import openai
import pytest
import torch

from gemma_nb.cli import main as cli
from gemma_nb.endpoint import local_server, wait_until_healthy
from gemma_nb.modelio import load_model
from gemma_nb.serving import app as served
from gemma_nb.serving import backends as G
from gemma_nb.serving import backends as R
from gemma_nb.tiny import BUNDLED_ID

FRANCE = [{"role": "user", "content": "The capital of France is"}]


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return load_model(BUNDLED_ID)


def new_runtime(tiny) -> R.TransformersRuntime:
    model, tokenizer = tiny
    return R.TransformersRuntime(model, tokenizer)  # a KV cache of its own per server


@pytest.fixture(scope="module")
def server(serve_in_thread, tiny):
    app = served.create_app(new_runtime(tiny), model_name=BUNDLED_ID, queue_size=8)
    with serve_in_thread(app) as root:
        wait_until_healthy(root + "/v1", timeout_s=60)
        yield root


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=60)


def metric(root: str, name: str, **labels) -> float:
    """One sample of the server's /metrics (0 if absent)."""
    text = httpx.get(root + "/metrics").text
    wanted = ",".join(f'{k}="{v}"' for k, v in labels.items())
    pattern = re.escape(name) + (r"\{" + re.escape(wanted) + r"\}" if wanted else "") + r" (\S+)"
    match = re.search("^" + pattern + "$", text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


# ---------------------------------------------------------------- answers


def test_greedy_chat_answers_paris(client, tiny):
    _, tokenizer = tiny
    reply = client.chat.completions.create(
        model=BUNDLED_ID, messages=FRANCE, temperature=0, max_tokens=8
    )
    choice = reply.choices[0]
    assert choice.message.content == "Paris ."
    assert choice.finish_reason == "stop"  # the model ended the sentence with <eos>
    assert reply.usage.prompt_tokens == len(tokenizer("The capital of France is").input_ids) == 6
    assert reply.usage.completion_tokens == 3  # "Paris", ".", <eos>
    assert reply.usage.total_tokens == 9


def test_streaming_gives_the_same_text_and_usage(client):
    plain = client.chat.completions.create(
        model=BUNDLED_ID, messages=FRANCE, temperature=0, max_tokens=8
    )
    chunks = list(
        client.chat.completions.create(
            model=BUNDLED_ID,
            messages=FRANCE,
            temperature=0,
            max_tokens=8,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content == "Paris ."
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == plain.usage.model_dump()
    # The role chunk, then one chunk per token: "Paris", " .", and <eos> (no text, finish_reason
    # "stop").
    assert [c.choices[0].delta.content for c in chunks[1:-1]] == ["Paris", " .", ""]
    assert all(c.usage is None for c in chunks[:-1])


def test_completions_generate_and_models(client, server):
    completion = client.completions.create(
        model=BUNDLED_ID, prompt="The capital of Japan is", temperature=0, max_tokens=8
    )
    assert completion.choices[0].text == " Tokyo ."  # completions keep the leading space
    streamed = client.completions.create(
        model=BUNDLED_ID, prompt="The capital of Japan is", temperature=0, max_tokens=8, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == " Tokyo ."
    generated = httpx.post(
        server + "/generate", json={"prompt": "The capital of Italy is", "max_tokens": 8}
    ).json()
    assert (
        generated["text"] == " Rome ." and generated["tokens"] == len(generated["token_ids"]) == 3
    )
    assert generated["finish_reason"] == "stop"
    assert [m.id for m in client.models.list().data] == [BUNDLED_ID]
    assert httpx.get(server + "/health").json() == {"status": "ok"}


def test_sampling_parameters_are_honoured(client):
    ask = dict(model=BUNDLED_ID, messages=FRANCE, max_tokens=8)
    stopped = client.chat.completions.create(**ask, temperature=0, stop=[" ."])
    assert (
        stopped.choices[0].message.content == "Paris" and stopped.choices[0].finish_reason == "stop"
    )
    capped = client.chat.completions.create(
        model=BUNDLED_ID,
        messages=FRANCE,
        temperature=0,
        max_tokens=5,
        extra_body={"ignore_eos": True},
    )
    assert capped.usage.completion_tokens == 5 and capped.choices[0].finish_reason == "length"
    # top_k=1 leaves only the argmax, whatever the temperature.
    top1 = client.chat.completions.create(**ask, temperature=1.5, extra_body={"top_k": 1})
    assert top1.choices[0].message.content == "Paris ."
    hot = dict(ask, temperature=2.0, max_tokens=12, extra_body={"ignore_eos": True})
    first = client.chat.completions.create(**hot, seed=7).choices[0].message.content
    assert client.chat.completions.create(**hot, seed=7).choices[0].message.content == first


def test_sample_token():
    logits = torch.tensor([0.0, 3.0, 2.9, -1.0])
    greedy = G.SamplingParams(max_tokens=1)
    assert G.sample_token(logits, greedy) == 1
    # top_p below the top token's probability keeps the argmax only.
    narrow = G.SamplingParams(max_tokens=1, temperature=1.0, top_p=0.3)
    assert {
        G.sample_token(logits, narrow, torch.Generator().manual_seed(s)) for s in range(20)
    } == {1}
    wide = G.SamplingParams(max_tokens=1, temperature=1.0, top_k=2)
    draws = [G.sample_token(logits, wide, torch.Generator().manual_seed(s)) for s in range(40)]
    assert set(draws) == {1, 2}


def test_stop_string_is_never_streamed(tiny):
    runtime = new_runtime(tiny)
    ids = runtime.tokenizer("The capital of France is").input_ids
    # Stop on "s ." : "Paris ." contains it, so the text ends at "Pari" and nothing past it streams.
    generation = G.Generation(runtime, ids, G.SamplingParams(max_tokens=8, stop=("s .",)))
    deltas = [step.text for step in generation]
    assert "".join(deltas) == generation.text == " Pari" and generation.finish_reason == "stop"
    assert G.held_back("Paris", ("s .",)) == 1 and G.held_back("Pari", ("s .",)) == 0


def test_chat_fallback_joins_message_contents(tiny):
    _, tokenizer = tiny
    assert not tokenizer.chat_template
    messages = [
        {"role": "system", "content": "The capital of"},
        {"role": "user", "content": [{"type": "text", "text": "France is"}]},
    ]
    assert (
        G.chat_prompt_ids(tokenizer, messages) == tokenizer("The capital of\nFrance is").input_ids
    )


def test_deploy_runtime_steps_match_greedy_decoding(tiny, eager_runner):
    """DeployRuntime drives the deploy's two-step runner one token at a time.

    The runner here is the ``eager_runner`` fixture (the un-exported device body; export equals it
    token for token, tested with the compile module): same prefill bucket, cache and positions as
    the deploy.
    """
    from gemma_nb.evaluate import greedy_generate
    from gemma_nb.export import StepShapes

    # a copy: eager_runner switches its experts to grouped_mm
    model, tokenizer = load_model(BUNDLED_ID)
    runtime = R.DeployRuntime(
        eager_runner(model, StepShapes(max_cache_len=64, prefill_len=16)), tokenizer
    )
    assert (runtime.max_context, runtime.max_prompt_tokens) == (64, 16)
    ids = tokenizer("The capital of Brazil is").input_ids
    expected = greedy_generate(tiny[0], torch.tensor([ids]), 12)[0, len(ids) :].tolist()
    generation = G.generate(runtime, ids, 12, ignore_eos=True)
    assert generation.token_ids == expected and generation.text.startswith(" Brasilia .")
    with pytest.raises(ValueError, match="1 to 16"):
        runtime.prefill(list(range(4, 21)))


def test_neuron_runtime_steps_match_the_neuron_runner(tiny):
    """NeuronDeployRuntime over the cpu variant of the port's traced module (no SDK needed)."""
    from cpu_state_graph import CpuStateGraph

    from gemma_nb.evaluate import greedy_generate
    from gemma_nb.neuron.build import NeuronBuildConfig, NeuronGemma4
    from gemma_nb.neuron.deploy import NeuronStepRunner

    model, tokenizer = tiny
    build = NeuronBuildConfig(
        model_dir="unused", output_dir="unused", max_len=32, bucket=8, dtype="float32"
    )
    module = NeuronGemma4(model.config, build, parallel=False)
    module.load_state(model.state_dict())
    runner = NeuronStepRunner(
        CpuStateGraph(module), model.get_input_embeddings(), model.config, 32, 8
    )
    runtime = R.NeuronDeployRuntime(runner, tokenizer)
    # the 2nd prefill overwrites the cache
    for country, capital in (
        ("Japan", "Tokyo"),
        ("Kenya", "Nairobi"),
    ):
        ids = tokenizer(f"The capital of {country} is").input_ids
        expected = greedy_generate(model, torch.tensor([ids]), 5)[0, len(ids) :].tolist()
        generation = G.generate(runtime, ids, 5, ignore_eos=True)
        assert generation.token_ids == expected and generation.text.startswith(f" {capital} .")
    with pytest.raises(ValueError, match="'nope'.*auto, deploy, transformers"):
        R.load_runtime("cpu", runtime="nope")


# ---------------------------------------------------------------- errors


BAD_REQUESTS = {
    "malformed JSON": ('{"messages": [', 400, None),
    "missing messages": (json.dumps({"model": BUNDLED_ID}), 400, "messages"),
    "empty messages": (json.dumps({"messages": []}), 400, "messages"),
    "max_tokens 0": (json.dumps({"messages": FRANCE, "max_tokens": 0}), 400, "max_tokens"),
    "max_tokens above the context": (
        json.dumps({"messages": FRANCE, "max_tokens": 100_000}),
        400,
        "max_tokens",
    ),
    "prompt longer than the context": (
        json.dumps({"messages": [{"role": "user", "content": "France " * 600}]}),
        400,
        "messages",
    ),
    "unknown model": (json.dumps({"model": "gpt-4o", "messages": FRANCE}), 404, "model"),
    "two choices": (json.dumps({"messages": FRANCE, "n": 2}), 400, "n"),
    "temperature 3": (json.dumps({"messages": FRANCE, "temperature": 3}), 400, "temperature"),
    "an image part": (
        json.dumps(
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}
        ),
        400,
        "messages.0.content.0.type",
    ),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_input_gets_its_status_and_the_server_keeps_serving(server, client, case):
    body, status, param = BAD_REQUESTS[case]
    response = httpx.post(
        server + "/v1/chat/completions", content=body, headers={"Content-Type": "application/json"}
    )
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param
    if case == "prompt longer than the context":
        assert error["code"] == "context_length_exceeded" and "601 tokens" in error["message"]
    reply = client.chat.completions.create(
        model=BUNDLED_ID, messages=FRANCE, temperature=0, max_tokens=4
    )
    assert reply.choices[0].message.content == "Paris ."


def test_openai_client_raises_the_matching_errors(client):
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=FRANCE)
    with pytest.raises(openai.BadRequestError, match="context of 512"):
        client.chat.completions.create(model=BUNDLED_ID, messages=FRANCE, max_tokens=510)


def test_metrics_count_requests_and_tokens(client, server):
    ok = dict(endpoint="/v1/chat/completions", status="200")
    before = {n: metric(server, n, **ok) for n in ["gemma_nb_requests_total"]}
    tokens_before = metric(server, "gemma_nb_generated_tokens_total")
    ttft_before = metric(server, "gemma_nb_time_to_first_token_seconds_count")
    bad_before = metric(
        server, "gemma_nb_requests_total", endpoint="/v1/chat/completions", status="404"
    )
    replies = [
        client.chat.completions.create(
            model=BUNDLED_ID, messages=FRANCE, temperature=0, max_tokens=8
        )
        for _ in range(2)
    ]
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=FRANCE)
    assert metric(server, "gemma_nb_requests_total", **ok) == before["gemma_nb_requests_total"] + 2
    assert (
        metric(server, "gemma_nb_requests_total", endpoint="/v1/chat/completions", status="404")
        == bad_before + 1
    )
    generated = sum(r.usage.completion_tokens for r in replies)
    assert metric(server, "gemma_nb_generated_tokens_total") == tokens_before + generated
    assert metric(server, "gemma_nb_time_to_first_token_seconds_count") == ttft_before + 2
    assert (
        metric(server, "gemma_nb_queue_depth") == 0
        and metric(server, "gemma_nb_queue_capacity") == 8
    )


# ---------------------------------------------------------------- queue, disconnects, loading


@pytest.fixture
def slow_server(serve_in_thread, slowed, tiny):
    """A server whose device takes 50 ms per token, with a chosen queue size."""
    servers = []

    def start(queue_size: int, **options) -> str:
        app = served.create_app(
            slowed(new_runtime(tiny)), model_name=BUNDLED_ID, queue_size=queue_size, **options
        )
        context = serve_in_thread(app)
        root = context.__enter__()
        servers.append(context)
        wait_until_healthy(root + "/v1", timeout_s=60)
        return root

    yield start
    for context in servers:
        context.__exit__(None, None, None)


def test_sixteen_concurrent_requests_with_a_queue_of_eight(slow_server):
    root = slow_server(8)

    async def burst():
        client = openai.AsyncOpenAI(
            base_url=root + "/v1", api_key="unused", max_retries=0, timeout=60
        )
        ask = dict(
            model=BUNDLED_ID,
            messages=FRANCE,
            temperature=0,
            max_tokens=8,
            extra_body={"ignore_eos": True},
        )
        return await asyncio.gather(
            *(client.chat.completions.create(**ask) for _ in range(16)), return_exceptions=True
        )

    results = asyncio.run(burst())
    accepted = [r for r in results if not isinstance(r, Exception)]
    rejected = [r for r in results if isinstance(r, openai.RateLimitError)]
    assert len(accepted) + len(rejected) == 16, [r for r in results if isinstance(r, Exception)]
    # Each takes >= 8 x 50 ms, so all 16 arrive while the first 8 hold the queue.
    assert len(accepted) >= 8 and len(rejected) >= 1
    assert all(
        r.usage.completion_tokens == 8 and r.choices[0].finish_reason == "length" for r in accepted
    )
    assert all(
        e.response.headers["Retry-After"] == "1" and e.body["code"] == "queue_full"
        for e in rejected
    )
    assert metric(
        root, "gemma_nb_requests_total", endpoint="/v1/chat/completions", status="429"
    ) == len(rejected)
    assert metric(root, "gemma_nb_queue_depth") == 0


def test_client_that_disconnects_frees_its_slot(slow_server):
    root = slow_server(1)
    body = {
        "messages": FRANCE,
        "max_tokens": 200,
        "ignore_eos": True,
        "stream": True,
        "temperature": 0,
    }
    with httpx.stream("POST", root + "/v1/chat/completions", json=body, timeout=30) as response:
        lines = response.iter_lines()
        while '"delta":{"content"' not in next(lines):
            pass  # read until the first token, then hang up
    # The slot frees within a token or two, long before the 200 tokens (>= 10 s) would finish.
    deadline = time.perf_counter() + 8
    while metric(root, "gemma_nb_queue_depth") != 0:
        assert time.perf_counter() < deadline, "the disconnected request still holds its slot"
        time.sleep(0.05)
    reply = httpx.post(
        root + "/generate", json={"prompt": "The capital of France is", "max_tokens": 4}, timeout=30
    )
    assert reply.status_code == 200 and reply.json()["text"] == " Paris ."
    assert metric(root, "gemma_nb_client_disconnects_total") == 1
    assert metric(root, "gemma_nb_generated_tokens_total") < 20  # 200 had the client stayed


def test_health_says_loading_until_the_model_is_warm(serve_in_thread, tiny):
    release = threading.Event()

    def load():
        release.wait(timeout=30)
        return new_runtime(tiny)

    app = served.create_app(load, model_name=BUNDLED_ID)
    with serve_in_thread(app) as root:
        health = httpx.get(root + "/health")
        assert health.status_code == 503 and health.json() == {"status": "loading"}
        early = httpx.post(root + "/v1/chat/completions", json={"messages": FRANCE})
        assert early.status_code == 503 and early.json()["error"]["code"] == "model_loading"
        assert early.headers["Retry-After"] == "1"
        release.set()
        wait_until_healthy(root + "/v1", timeout_s=30)
        assert (
            httpx.post(root + "/generate", json={"prompt": "The capital of France is"}).json()[
                "text"
            ]
            == " Paris ."
        )


# ---------------------------------------------------------------- the command line, with an API key


def test_cli_server_requires_the_api_key_from_the_environment():
    key = "test-key-" + "x" * 16
    # --runtime transformers starts in seconds; the default on cpu compiles the slim deploy first.
    with local_server(
        runtime="transformers", extra_args=("--queue-size", "2"), env={served.API_KEY_ENV: key}
    ) as base_url:
        root = base_url[: -len("/v1")]
        assert httpx.get(root + "/health").status_code == 200  # open for health checks
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": key}):
            response = httpx.post(
                base_url + "/chat/completions", json={"messages": FRANCE}, headers=headers
            )
            assert (
                response.status_code == 401
                and response.json()["error"]["code"] == "invalid_api_key"
            )
        assert httpx.get(root + "/metrics").status_code == 200  # open on loopback, for scrapers
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=base_url, api_key="wrong", max_retries=0).models.list()
        client = openai.OpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=60)
        reply = client.chat.completions.create(
            model=BUNDLED_ID, messages=FRANCE, temperature=0, max_tokens=8
        )
        assert reply.choices[0].message.content == "Paris ."
        assert [m.id for m in client.models.list().data] == [BUNDLED_ID]


def test_cli_rejects_bad_arguments(capsys):
    assert cli(["serve", "--target", "tpu"]) == 2
    assert "target 'tpu'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        cli(["serve", "--queue-size", "0"])
    assert exit_info.value.code == 2
    assert "--queue-size: '0'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli(["serve", "--api-key", "secret"])  # no such flag: keys come from the environment only


# ---------------------------------------------------------------- what OpenAI clients send


def test_message_names_and_the_developer_role_are_accepted(client):
    messages = [
        {"role": "developer", "content": "The capital of", "name": "setup"},
        {"role": "user", "content": "France is", "name": "ada"},
    ]
    reply = client.chat.completions.create(
        model=BUNDLED_ID, messages=messages, temperature=0, max_tokens=8
    )
    # developer is read as system; the fallback joins the contents: the same prompt as FRANCE.
    assert reply.choices[0].message.content == "Paris ." and reply.usage.prompt_tokens == 6


def test_continuous_usage_stats_put_the_usage_on_every_chunk(server):
    """aiperf and vLLM's clients ask for the running usage on each chunk."""
    body = {
        "messages": FRANCE,
        "temperature": 0,
        "max_tokens": 8,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    with httpx.stream("POST", server + "/v1/chat/completions", json=body, timeout=30) as response:
        events = [
            line[len("data: ") :] for line in response.iter_lines() if line.startswith("data: ")
        ]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    # role chunk, 3 tokens, final usage
    assert [c["usage"]["completion_tokens"] for c in chunks] == [
        0,
        1,
        2,
        3,
        3,
    ]
    assert all(c["usage"]["prompt_tokens"] == 6 for c in chunks) and chunks[-1]["choices"] == []


def test_empty_prompts_are_refused_alike(server):
    for path, body, param in (
        ("/v1/completions", {"prompt": ""}, "prompt"),
        ("/v1/completions", {"prompt": []}, "prompt"),
        ("/v1/completions", {"prompt": [""]}, "prompt.0"),
        ("/generate", {"prompt": ""}, "prompt"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": ""}]},
            "messages.0.content",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": []}]},
            "messages.0.content",
        ),
    ):
        response = httpx.post(server + path, json=body)
        assert response.status_code == 400, (path, body, response.text)
        error = response.json()["error"]
        assert error["param"] == param and "at least 1" in error["message"], error


# ---------------------------------------------------------------- bounded answers


def test_a_request_without_max_tokens_gets_the_default_not_the_whole_context(client):
    reply = client.chat.completions.create(
        model=BUNDLED_ID, messages=FRANCE, temperature=0, extra_body={"ignore_eos": True}
    )
    assert reply.usage.completion_tokens == served.DEFAULT_MAX_TOKENS == 256  # not 512 - 6
    assert reply.choices[0].finish_reason == "length"


def test_max_tokens_above_the_cap_is_refused(slow_server):
    root = slow_server(2, max_tokens=4, max_tokens_cap=16)
    ok = httpx.post(
        root + "/v1/completions", json={"prompt": "The capital of Japan is", "ignore_eos": True}
    ).json()
    assert ok["usage"]["completion_tokens"] == 4  # the server's default
    error = httpx.post(root + "/v1/completions", json={"prompt": "x", "max_tokens": 17}).json()[
        "error"
    ]
    assert error["param"] == "max_tokens" and "equal to 16" in error["message"]


# ---------------------------------------------------------------- departed clients, /metrics, the
# OpenAPI document


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_leaves_while_queued_frees_its_slot_at_once(slow_server, stream):
    root = slow_server(2)
    # >= 10 s at 50 ms a token
    long = {
        "prompt": "The capital of France is",
        "max_tokens": 200,
        "ignore_eos": True,
    }
    holder = threading.Thread(
        target=lambda: httpx.post(root + "/v1/completions", json=long, timeout=60), daemon=True
    )
    holder.start()
    deadline = time.perf_counter() + 10
    while metric(root, "gemma_nb_generated_tokens_total") < 1:
        assert time.perf_counter() < deadline
        time.sleep(0.02)
    queued = {"prompt": "The capital of Japan is", "max_tokens": 4, "stream": stream}
    with pytest.raises(httpx.ReadTimeout):  # it waits behind the long one: the client gives up
        with httpx.stream(
            "POST", root + "/v1/completions", json=queued, timeout=httpx.Timeout(5, read=0.5)
        ) as response:
            for _ in response.iter_lines():
                pass
    assert metric(root, "gemma_nb_queue_depth") >= 1
    # a poll of the queue (0.1 s), long before the 200 tokens end
    deadline = time.perf_counter() + 2
    while metric(root, "gemma_nb_queue_depth") != 1:
        assert time.perf_counter() < deadline, "the departed client still holds its slot"
        time.sleep(0.05)
    assert metric(root, "gemma_nb_client_disconnects_total") == 1
    if not stream:  # answered to nobody: counted as nginx logs it, not as a 200
        counted = {
            status: metric(
                root, "gemma_nb_requests_total", endpoint="/v1/completions", status=status
            )
            for status in ("200", "499")
        }
        assert counted == {"200": 0, "499": 1}
    # its place is free: a newcomer is queued behind the long one, not refused
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            root + "/v1/completions",
            json={"prompt": "x", "max_tokens": 1},
            timeout=httpx.Timeout(5, read=0.5),
        )


def test_metrics_are_open_on_loopback_unless_the_key_is_required(serve_in_thread, tiny):
    key = "k" * 24
    for need_key, status in ((False, 200), (True, 401)):
        app = served.create_app(
            new_runtime(tiny), model_name=BUNDLED_ID, api_key=key, metrics_need_key=need_key
        )
        with serve_in_thread(app) as root:
            assert httpx.get(root + "/metrics").status_code == status
            assert (
                httpx.get(root + "/metrics", headers={"Authorization": f"Bearer {key}"}).status_code
                == 200
            )
            assert httpx.get(root + "/v1/models").status_code == 401


def test_openapi_documents_bodies_errors_and_the_key(serve_in_thread, tiny):
    app = served.create_app(new_runtime(tiny), model_name=BUNDLED_ID, api_key="k" * 24)
    with serve_in_thread(app) as root:
        wait_until_healthy(root + "/v1", timeout_s=60)
        document = httpx.get(root + "/openapi.json").json()
    chat, schemas = (
        document["paths"]["/v1/chat/completions"]["post"],
        document["components"]["schemas"],
    )
    assert chat["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/ChatRequest"
    }
    request = schemas["ChatRequest"]
    assert {"messages", "max_tokens", "temperature", "stream_options", "n"} <= set(
        request["properties"]
    )
    assert request["required"] == ["messages"] and request["additionalProperties"] is False
    assert request["properties"]["temperature"]["anyOf"] == [  # null: the default, as OpenAI's
        {"maximum": 2, "minimum": 0, "type": "number"},
        {"type": "null"},
    ]
    for status in ("400", "401", "404", "413", "415", "429", "503"):
        assert chat["responses"][status]["content"]["application/json"]["schema"] == {
            "$ref": "#/components/schemas/ErrorBody"
        }
    assert set(chat["responses"]["200"]["content"]) == {"application/json", "text/event-stream"}
    assert (
        chat["security"] == [{"HTTPBearer": []}]
        and document["components"]["securitySchemes"]["HTTPBearer"]["scheme"] == "bearer"
    )
    assert list(document["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == [
        "text/plain"
    ]
    prompt_ids = schemas["CompletionRequest"]["properties"]["prompt"]["anyOf"][1]["items"]
    assert prompt_ids["maximum"] == 481 and "security" not in document["paths"]["/health"]["get"]
