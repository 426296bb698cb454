"""Benchmark harness structure, bandwidth probe, and the story's roofline figures."""

import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pandas as pd
import pytest
import torch

from gemma_nb import bench, decode_roofline, experts
from gemma_nb.hardware import DEVICES, GB, INSTANCES
from gemma_nb.targets import one_thread
from gemma_nb.tiny import random_gemma4_config


def test_smoke_timing_runs_every_loop_once(monkeypatch):
    calls = []
    monkeypatch.setenv(bench.TIMING_ENV, "smoke")
    timings = bench.time_steps({"a": calls.append, "b": calls.append}, steps=3, repeats=4, warmup=2)
    assert calls == [0, 0] and len(timings.steps) == 2
    assert bench.measure_bandwidth(2**20, repeats=5)["nbytes"] == 2**20
    monkeypatch.setenv(bench.TIMING_ENV, "quick")
    with pytest.raises(ValueError, match="GEMMA_NB_TIMING='quick'.*full, smoke"):
        bench.time_steps({"a": calls.append}, steps=1, repeats=1)


def test_time_steps_interleaves_and_summarises():
    calls = []

    def fast(i):
        calls.append(("fast", i))
        time.sleep(0.001)

    def slow(i):
        calls.append(("slow", i))
        time.sleep(0.003)

    timings = bench.time_steps({"fast": fast, "slow": slow}, steps=3, repeats=4, warmup=1)
    assert len(calls) == 2 * (1 + 3 * 4)
    # Warm-up first, then one step of each candidate per round, the order rotating every round.
    assert [name for name, _ in calls[:2]] == ["fast", "slow"]
    assert [name for name, _ in calls[2:8]] == ["fast", "slow", "slow", "fast", "fast", "slow"]
    assert [i for name, i in calls if name == "fast"] == list(range(13))
    summary = timings.summary()
    assert list(summary.index) == ["fast", "slow"]
    assert {"p50_ms", "p90_ms", "tok_s", "repeats", "steps_per_repeat"} <= set(summary.columns)
    assert summary.loc["fast", "repeats"] == 4 and summary.loc["fast", "steps_per_repeat"] == 3
    assert 1.0 <= summary.loc["fast", "p50_ms"] < summary.loc["slow", "p50_ms"]
    assert summary.loc["fast", "p50_ms"] <= summary.loc["fast", "p90_ms"]
    assert summary.loc["slow", "tok_s"] < 1000 / 3
    assert 1.5 < timings.ratio("slow", "fast") < 4.0


def test_time_generation_reports_first_token_and_equal_tokens():
    from gemma_nb.tiny import random_gemma4_model

    model = random_gemma4_model(
        random_gemma4_config(num_hidden_layers=2, vocab_size=256), dtype=torch.float32
    )
    before_threads = torch.get_num_threads()
    prompt = torch.tensor([[5, 6, 7, 8]])
    with one_thread():
        timings = bench.time_generation(
            {"a": model, "b": lambda: model}, prompt, new_tokens=5, repeats=2, warmup=0
        )
    assert torch.get_num_threads() == before_threads
    summary = timings.summary()
    assert list(summary.index) == ["a", "b"] and summary["ttft_ms"].gt(0).all()
    assert summary.loc["a", "steps_per_repeat"] == 4
    assert timings.tokens["a"].shape == (1, 9) and torch.equal(
        timings.tokens["a"], timings.tokens["b"]
    )
    from gemma_nb.evaluate import greedy_generate

    assert torch.equal(timings.tokens["a"], greedy_generate(model, prompt, 5))
    with pytest.raises(ValueError, match="new_tokens=1.*>= 2"):
        bench.time_generation({"a": model}, prompt, new_tokens=1)


def test_time_runners_uses_only_generate():
    class Runner:
        def __init__(self, delay_s):
            self.delay_s, self.calls = delay_s, []

        def generate(self, input_ids, max_new_tokens):
            self.calls.append(max_new_tokens)
            time.sleep(self.delay_s * max_new_tokens)
            return torch.arange(max_new_tokens)[None]

    fast, slow = Runner(0.001), Runner(0.003)
    table = bench.time_runners(
        {"fast": fast, "slow": slow}, torch.tensor([[1, 2]]), new_tokens=4, repeats=2
    )
    assert fast.calls == [1, 4, 1, 4] and list(table.index) == ["fast", "slow"]
    assert table.loc["fast", "decode_tok_s"] > table.loc["slow", "decode_tok_s"]
    assert table.loc["fast", "tokens"] == [0, 1, 2, 3]


def test_bandwidth_probe_and_floor():
    result = bench.measure_bandwidth(nbytes=8 * 2**20, repeats=2)
    assert result["nbytes"] == 8 * 2**20
    assert result["read_gb_s"] > 0 and result["copy_gb_s"] > 0
    assert result["read_gb_s"] >= result["read_gb_s_median"]
    assert bench.floor_ms(24e9, 24e9) == 1000.0
    with pytest.raises(ValueError, match="nbytes=1000.*>= 1 MiB"):
        bench.measure_bandwidth(nbytes=1000)
    with pytest.raises(ValueError, match="steps=0.*>= 1"):
        bench.time_steps({"a": lambda i: None}, steps=0)


def test_full_size_layer_bytes_by_hand():
    with torch.device("meta"):
        gate_up = torch.empty(128, 2 * 704, 2816, dtype=torch.bfloat16)
        down = torch.empty(128, 2816, 704, dtype=torch.bfloat16)
        scales = (torch.empty(128, 2 * 704, 1), torch.empty(128, 2816, 1))
        dense, sparse = (experts.FloatExperts(gate_up, down, None, k) for k in ("dense", "sparse"))
        int8 = experts.Int8Experts(gate_up.to(torch.int8), down.to(torch.int8), None, scales)
    one_token = torch.arange(8)[None]
    per_expert_bf16 = (2 * 704 * 2816 + 2816 * 704) * 2
    assert dense.read_bytes(one_token) == 128 * per_expert_bf16  # 1.52 GB
    assert sparse.read_bytes(one_token) == 8 * per_expert_bf16  # 95.2 MB
    int8_expert = 3 * 704 * 2816 + 4 * (2 * 704 + 2816)  # int8 weights + one fp32 scale per row
    assert int8.read_bytes(one_token) == 8 * int8_expert


@pytest.fixture(scope="module")
def config_26b():
    from gemma_nb.memory import load_gemma4_26b_config

    return load_gemma4_26b_config()


def test_story_decode_reproduces_the_story_roofline_without_kv(config_26b):
    story = decode_roofline.story_decode(config_26b, context_len=0)
    # The roofline without the KV cache: DenseExperts ~26.4 GB/token -> <= ~33 tok/s;
    # top-8 ~4.9 GB -> <= ~178 tok/s; upcast hypothesis ~118 GB -> ~7.5 tok/s; it leaves the KV
    # cache out.
    assert story["kv_gb_per_token"] == 0.0
    assert story["dense_gb_per_token"] == pytest.approx(26.4, abs=0.1)
    assert story["dense_tok_s"] == pytest.approx(33.29, abs=0.01)
    assert story["sparse_gb_per_token"] == pytest.approx(4.97, abs=0.05)
    assert story["sparse_tok_s"] == pytest.approx(177.0, abs=0.1)
    assert story["upcast_gb_per_token"] == pytest.approx(117.8, abs=0.2)
    assert story["upcast_tok_s"] == pytest.approx(7.47, abs=0.02)
    assert story["expert_flops_waste_x"] == 16.0
    assert story["measured_usd_per_m_tokens"] == pytest.approx(0.7582 / (6 * 3600) * 1e6)
    bandwidth = DEVICES["neuroncore_v2"].bandwidth_bytes_s
    assert story["dense_tok_s"] == pytest.approx(2 * bandwidth / (story["dense_gb_per_token"] * GB))
    table = decode_roofline.hypotheses_table(story)
    assert table["status"].tolist().count("hypothesis") == 2


def test_story_decode_counts_the_ports_fp32_kv_cache_by_default(config_26b):
    story = decode_roofline.story_decode(config_26b)
    assert story["context_len"] == 512
    # 30 layers' fp32 K and V for 512 tokens, split by KV head over 2 ranks: 115.3 MB per rank
    assert story["kv_gb_per_token"] * GB / 2 == pytest.approx(115.34e6, rel=1e-4)
    assert story["dense_tok_s"] == pytest.approx(33.01, abs=0.01)
    assert story["sparse_tok_s"] == pytest.approx(169.17, abs=0.01)
    without = decode_roofline.story_decode(config_26b, context_len=0)
    assert story["dense_gb_per_token"] - without["dense_gb_per_token"] == pytest.approx(
        story["kv_gb_per_token"]
    )


def test_context_sensitivity_falls_with_the_cache(config_26b):
    table = decode_roofline.context_sensitivity(config_26b, [0, 512, 4096])
    assert table["context_len"].tolist() == [0, 512, 4096]
    assert (
        table["dense_tok_s"].is_monotonic_decreasing
        and table["sparse_tok_s"].is_monotonic_decreasing
    )
    # the cache takes a bigger share of sparse steps
    assert table["sparse_vs_dense_x"].is_monotonic_decreasing
    assert table.loc[1, "sparse_tok_s"] == pytest.approx(
        decode_roofline.story_decode(config_26b)["sparse_tok_s"]
    )


def test_roofline_table_prices_and_fit(config_26b):
    table = decode_roofline.roofline(config_26b).set_index(["deployment", "experts"])
    story_row = table.loc[("inf2.xlarge, int8 squeeze, TP=2", "dense")]
    assert story_row["fits"] and story_row["bound"] == "memory"
    assert story_row["usd_per_hour"] == INSTANCES["inf2.xlarge"].usd_per_hour
    assert story_row["usd_per_m_tokens"] == pytest.approx(
        0.7582 / (story_row["tok_s"] * 3600) * 1e6
    )
    assert not table.loc[("inf2.xlarge, bf16, TP=2", "dense"), "fits"]  # 26 GB per rank > 16 GiB
    assert table.loc[("TPU v6e x2, bf16, TP=2", "sparse"), "usd_per_hour"] == pytest.approx(5.40)
    # no H200 price in the hardware table
    assert pd.isna(table.loc[("H200 x1, bf16", "sparse"), "usd_per_m_tokens"])
    sparse_over_dense = (
        table.xs("sparse", level="experts")["tok_s"] / table.xs("dense", level="experts")["tok_s"]
    )
    assert sparse_over_dense.between(4.0, 8.0).all()
    assert decode_roofline.usd_per_million_tokens(None, 10.0) is None
