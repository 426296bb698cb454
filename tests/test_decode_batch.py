"""Notebook 07's batch sweep: real routing captured, mapped to the 26B layer's ids, timed,
tabulated."""

import pandas as pd
import pytest
import torch

from gemma_nb import experts, moe
from gemma_nb.decode_roofline import expected_distinct_experts
from gemma_nb.experiments import decode_batch
from gemma_nb.memory import tensor_bytes
from gemma_nb.modelio import load_model
from gemma_nb.tiny import BUNDLED_ID, fact_prompts, random_gemma4_config


@pytest.fixture(scope="module")
def real():
    model, tokenizer = load_model(BUNDLED_ID)
    return decode_batch.capture_real_routing(model, tokenizer, fact_prompts()[:40], new_tokens=3)


def test_capture_records_every_fed_back_token_of_every_layer(real):
    assert real.index.shape == (40 * 3, 4, 2) and real.weights.shape == real.index.shape
    assert real.num_experts == 32 and sorted(set(real.prompt.tolist())) == list(range(40))
    assert (real.prompt.bincount() == 3).all()
    assert int(real.index.min()) >= 0 and int(real.index.max()) < 32
    # top-2: two different experts per layer
    assert (real.index[..., 0] != real.index[..., 1]).all()


def test_a_prompt_routes_the_same_alone_or_in_a_batch(real):
    model, tokenizer = load_model(BUNDLED_ID)
    prompt = fact_prompts()[5]
    alone = decode_batch.capture_real_routing(model, tokenizer, [prompt], new_tokens=3)
    in_batch = real.index[real.prompt == fact_prompts()[:40].index(prompt)]
    # prompts are batched by length, so the row order differs; the routes must not
    assert torch.equal(alone.index.sort(dim=-1).values, in_batch.sort(dim=-1).values)


def test_full_size_routes_number_layer_times_32_plus_expert(real):
    rows = torch.tensor([0, 7, 11])
    index, weights = decode_batch.full_size_routes(real, rows, 128, 8)
    assert index.shape == weights.shape == (3, 8)
    expected = (real.index[rows] + torch.tensor([0, 32, 64, 96])[None, :, None]).reshape(3, 8)
    assert torch.equal(index, expected) and all(len(set(row.tolist())) == 8 for row in index)
    assert torch.allclose(weights.sum(-1), real.weights[rows].sum(-1).mean(-1))


def test_sampled_streams_come_from_different_prompts(real):
    generator = torch.Generator().manual_seed(0)
    rows = real.sample(16, generator)
    assert len(set(real.prompt[rows].tolist())) == 16
    with pytest.raises(ValueError, match="batch 41.*holds 40"):
        real.sample(41, generator)


def test_distinct_table(real):
    table = decode_batch.distinct_table(real, (1, 2, 8, 16), draws=50)
    assert (table.loc[1, ["formula", "uniform", "real"]] == 2.0).all()
    for batch in table.index:
        assert table.loc[batch, "formula"] == pytest.approx(expected_distinct_experts(32, 2, batch))
        assert table.loc[batch, "uniform"] == pytest.approx(table.loc[batch, "formula"], rel=0.05)
        assert table.loc[batch, "formula_full_size"] == pytest.approx(
            expected_distinct_experts(128, 8, batch)
        )
    assert (table["real"] <= 32).all() and table["real"].is_monotonic_increasing


def test_sparse_experts_say_what_they_read():
    # 32 experts, top-2
    layer = experts.FloatExperts.from_experts(moe.random_experts(random_gemma4_config(), seed=0))
    repeated = torch.tensor([[3, 4], [3, 5]])
    assert layer.experts_read(repeated) == 4  # decode path: expert 3 read twice
    grouped = torch.arange(32).reshape(16, 2).repeat(2, 1)
    assert layer.experts_read(grouped) == 32  # grouped path: each distinct expert once


@pytest.fixture(scope="module")
def sweep():
    config = random_gemma4_config(
        hidden_size=64, moe_intermediate_size=16, num_experts=16, top_k_experts=4
    )
    source = moe.random_experts(config, seed=0)
    sparse_int8 = experts.Int8Experts.from_experts(source)
    layers = {
        "dense bf16": experts.FloatExperts.from_experts(source, "dense"),
        "sparse bf16": experts.FloatExperts.from_experts(source),
        "dense int8": sparse_int8.sharing(kernel="dense"),
        "sparse int8": sparse_int8,
    }
    routes = {
        "uniform": lambda b, n: decode_batch.uniform_routes(b, n, 16, 4),
        "other": lambda b, n: decode_batch.uniform_routes(b, n, 16, 4, seed=1),
    }
    table = decode_batch.time_batch_sweep(layers, routes, 64, batches=(1, 2, 8), steps_at_batch_1=4)
    return config, table


def test_the_sweep_times_dense_once_per_batch(sweep):
    _, table = sweep
    # per batch: four layers under uniform, the two sparse ones under "other"
    assert len(table) == 3 * (4 + 2)
    assert set(table[table["source"] == "other"]["path"]) == {"sparse"}
    assert (
        table.set_index(["batch", "layer", "source"]).loc[(1, "dense bf16", "uniform"), "steps"]
        == 4
    )
    assert (table[table["batch"] == 8]["steps"] == 1).all()
    assert (table[table["path"] == "dense"]["experts_read"] == 16).all()
    sparse = table[(table["path"] == "sparse") & (table["batch"] == 2)]
    assert (sparse["experts_read"] == 8).all() and (sparse["distinct_experts"] <= 8).all()
    assert (table["p50_ms"] > 0).all()


def test_batch_table_bytes_floors_and_the_reused_dense_timing(sweep):
    config, timed = sweep
    per_expert = {
        d: tensor_bytes((32, 64), d) + tensor_bytes((64, 16), d) for d in ("bf16", "int8")
    }
    table = decode_batch.batch_table(timed, per_expert, 1e10)
    row = table[
        (table["source"] == "other") & (table["dtype"] == "int8") & (table["batch"] == 8)
    ].iloc[0]
    dense = timed[
        (timed["source"] == "uniform") & (timed["layer"] == "dense int8") & (timed["batch"] == 8)
    ].iloc[0]
    assert row["dense_p50_ms"] == dense["p50_ms"]
    assert row["dense_gb"] == 16 * per_expert["int8"] / 1e9
    assert row["sparse_floor_ms"] == pytest.approx(
        1000 * row["sparse_experts_read"] * per_expert["int8"] / 1e10
    )
    assert row["sparse_tok_s"] == pytest.approx(8000 / row["sparse_p50_ms"])
    assert row["sparse_vs_dense_x"] == pytest.approx(row["dense_p50_ms"] / row["sparse_p50_ms"])


def _table(dense_ms, sparse_ms, batches=(1, 2, 4, 8, 16, 32, 64)):
    rows = [
        {
            "source": "uniform",
            "dtype": "int8",
            "batch": b,
            "dense_p50_ms": d,
            "sparse_p50_ms": s,
            "dense_experts_read": 128.0,
            "sparse_experts_read": min(b * 8.0, expected_distinct_experts(128, 8, b))
            if b * 8 >= 128
            else b * 8.0,
            "sparse_vs_dense_x": d / s,
        }
        for b, d, s in zip(batches, dense_ms, sparse_ms)
    ]
    return pd.DataFrame(rows)


def test_crossovers_measured_and_predicted():
    table = _table([10, 10, 10, 10, 10, 10, 10], [1, 2, 4, 8, 11, 12, 13])
    cross = decode_batch.crossovers(table, 128, 8)
    assert cross["measured"] == {"int8": {"uniform": 16}}
    assert (cross["bytes_this_sparse"], cross["bytes_selective_loading"], cross["nxd_rule"]) == (
        None,
        16,
        16,
    )
    never = decode_batch.crossovers(_table([10] * 7, [1] * 7), 128, 8)
    assert never["measured"]["int8"]["uniform"] is None
    distinct = pd.DataFrame({"real_vs_uniform": [0.7]}, index=[16])
    verdicts = decode_batch.verdict_table(table, cross, distinct).set_index("finding")["value"]
    assert verdicts["dense no slower than sparse (int8, uniform routing), measured"] == "B = 16"
    assert verdicts["the same, predicted from bytes for this sparse path"] == "none up to B = 64"
    assert verdicts["NxD's rule switches to all experts at"] == "B = 16"
    assert verdicts["sparse's lead over dense (int8), B = 1 -> 64"] == "10.0x -> 0.8x"
    assert verdicts["distinct experts at B = 16, real router vs uniform"] == "0.70x"


def test_metrics_sections():
    from gemma_nb import decode_roofline
    from gemma_nb.memory import load_gemma4_26b_config

    summary = decode_roofline.batch_summary(
        load_gemma4_26b_config(), decode_roofline.DEPLOYMENTS[:2]
    )
    section = decode_batch.roofline_metrics(summary)
    squeeze, bf16 = section["inf2.xlarge, int8 squeeze, TP=2"], section["inf2.xlarge, bf16, TP=2"]
    assert (squeeze["largest_batch"], squeeze["largest_batch_if_low"]) == (1, 12)
    assert set(squeeze["paths"]) == {"dense", "sparse", "nxd_rule"}
    assert bf16["largest_batch"] == 0 and bf16["paths"]["sparse"]["usd_per_m_if_low"] is None
    cost = decode_batch.cost_table(summary, "inf2.xlarge, int8 squeeze, TP=2")
    assert cost[("", "streams")].tolist() == [1, 1, 12]
    assert (
        cost.loc["one stream", ("sparse", "usd_per_m")]
        == squeeze["paths"]["sparse"]["usd_per_m_b1"]
    )
