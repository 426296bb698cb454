"""The decode model: bytes and FLOPs per step counted by hand and across batch, expected distinct
experts, the largest batch."""

from dataclasses import replace

import pytest
import torch

from gemma_nb import decode_roofline, memory, moe
from gemma_nb.decode_roofline import Deployment, batch_step, expected_distinct_experts, step_costs
from gemma_nb.hardware import GB, INSTANCES, GiB
from gemma_nb.tiny import random_gemma4_config

BATCHES = (1, 2, 4, 8, 16, 32, 64)


@pytest.fixture(scope="module")
def config_26b():
    return memory.load_gemma4_26b_config()


def decode_traffic(
    config, scheme: str = "int8_squeeze", experts: str = "dense", tp: int = 1, context_len: int = 0
) -> dict:
    """Bytes each rank reads and FLOPs it computes to decode one token (batch 1), and the experts'
    share of the bytes."""
    costs = step_costs(config, scheme, tp, context_len)
    step = batch_step(costs, 1, experts)
    return {
        "bytes_per_token": step["bytes"],
        "flops_per_token": step["flops"],
        "experts_bytes": costs.experts_bytes * step["experts_read"] / costs.num_experts,
    }


def _by_hand_bf16_bytes(config):
    """Every bf16 weight a decode step reads, counted from the module tree: all parameters but the
    (host-side) embedding table, plus the tied lm_head's device copy, plus persistent buffers."""
    from transformers import Gemma4ForCausalLM

    with torch.device("meta"):
        model = Gemma4ForCausalLM(config)
    embed = model.get_input_embeddings().weight
    params = sum(p.numel() for p in model.parameters() if p is not embed)
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    buffers = sum(b.numel() for n, b in model.named_buffers() if n.endswith("layer_scalar"))
    return 2 * (params + embed.numel() + buffers), 2 * experts


def _by_hand_matrix_params(config):
    from transformers import Gemma4ForCausalLM

    with torch.device("meta"):
        model = Gemma4ForCausalLM(config)
    embed = model.get_input_embeddings().weight
    return (
        sum(p.numel() for p in model.parameters() if p.dim() >= 2 and p is not embed)
        + embed.numel()
    )


def test_decode_traffic_on_a_tiny_config_matches_a_count_by_hand():
    config = random_gemma4_config()  # 32 experts, top-2
    total_bf16, experts_bf16 = _by_hand_bf16_bytes(config)
    dense = decode_traffic(config, "bf16", "dense", tp=1)
    sparse = decode_traffic(config, "bf16", "sparse", tp=1)
    from gemma_nb.memory import kv_cache_bytes

    # the weights read, and the one KV position the step writes (fp32, the port's cache)
    assert dense["bytes_per_token"] == total_bf16 + kv_cache_bytes(config, 1, 1, dtype="fp32")
    assert dense["bytes_per_token"] - sparse["bytes_per_token"] == experts_bf16 * (1 - 2 / 32)
    assert sparse["experts_bytes"] == experts_bf16 / 16
    # FLOPs: 2 per matrix weight used (vectors excluded), no context.
    assert dense["flops_per_token"] == 2 * _by_hand_matrix_params(config)
    assert dense["flops_per_token"] - sparse["flops_per_token"] == experts_bf16 * (1 - 2 / 32)
    with_kv = decode_traffic(config, "bf16", "dense", tp=1, context_len=100)
    assert with_kv["bytes_per_token"] - dense["bytes_per_token"] == kv_cache_bytes(
        config, 1, 100, dtype="fp32"
    )


def test_a_step_reads_the_kv_cache_and_writes_one_position_in_the_scheme_s_kv_dtype(config_26b):
    inf2 = decode_roofline.DEPLOYMENTS[0]
    bf16_kv = replace(memory.SCHEMES["int8_squeeze"], kv_dtype="bf16")
    fp32, bf16 = (step_costs(config_26b, scheme, 2, 512) for scheme in ("int8_squeeze", bf16_kv))
    # K and V of one token on every layer, per rank at TP=2: 112,640 bytes in bf16
    assert (fp32.kv_write_bytes_per_stream, bf16.kv_write_bytes_per_stream) == (225_280, 112_640)
    assert fp32.kv_bytes_per_stream == 512 * 225_280 == 2 * bf16.kv_bytes_per_stream
    assert fp32._replace(kv_bytes_per_stream=0, kv_write_bytes_per_stream=0) == bf16._replace(
        kv_bytes_per_stream=0, kv_write_bytes_per_stream=0
    )
    table = decode_roofline.roofline(config_26b, [inf2, replace(inf2, name="bf16", scheme=bf16_kv)])
    rows = table.set_index(["deployment", "experts"])
    saved_gb = rows.loc[inf2.name, "gb_per_token"] - rows.loc["bf16", "gb_per_token"]
    assert list(saved_gb) == pytest.approx([(512 + 1) * 112_640 / GB] * 2)
    assert list(rows.loc["bf16", "kv_written_mb_per_token"]) == [0.11264] * 2
    assert set(table["scheme"]) == {"int8_squeeze"}


def test_expected_distinct_experts_for_the_26b_layer():
    values = [round(expected_distinct_experts(128, 8, b), 1) for b in BATCHES]
    assert values == [8.0, 15.5, 29.1, 51.6, 82.4, 111.8, 125.9]
    assert expected_distinct_experts(32, 2, 1) == 2.0 and expected_distinct_experts(0, 0, 5) == 0.0
    with pytest.raises(ValueError, match="batch=0.*>= 1"):
        expected_distinct_experts(128, 8, 0)


def test_the_formula_is_the_mean_union_of_uniform_routings():
    for batch in (4, 16, 64):
        unions = [
            moe.random_routing(batch, 128, 8, seed=seed)[0].unique().numel() for seed in range(200)
        ]
        assert sum(unions) / len(unions) == pytest.approx(
            expected_distinct_experts(128, 8, batch), rel=0.02
        )


def test_batch_one_is_the_batch_one_roofline(config_26b):
    costs = step_costs(config_26b, "int8_squeeze", 2, 512)
    for mode in ("dense", "sparse"):
        traffic = decode_traffic(config_26b, "int8_squeeze", mode, 2, 512)
        step = batch_step(costs, 1, mode)
        assert (step["bytes"], step["flops"]) == (
            traffic["bytes_per_token"],
            traffic["flops_per_token"],
        )
    assert batch_step(costs, 1, "nxd_rule")["bytes"] == batch_step(costs, 1, "sparse")["bytes"]


def test_bytes_per_step_by_path(config_26b):
    costs = step_costs(config_26b, "int8_squeeze", 2, 512)
    per_expert = costs.experts_bytes / 128
    for batch in BATCHES:
        dense, sparse, nxd = (
            batch_step(costs, batch, path) for path in decode_roofline.BATCH_PATHS
        )
        kv = (costs.kv_bytes_per_stream + costs.kv_write_bytes_per_stream) * batch
        assert dense["bytes"] == pytest.approx(costs.fixed_bytes + costs.experts_bytes + kv)
        assert sparse["bytes"] == pytest.approx(
            costs.fixed_bytes + per_expert * expected_distinct_experts(128, 8, batch) + kv
        )
        assert dense["flops"] == pytest.approx(
            batch * (costs.fixed_flops_per_token + costs.experts_flops_per_token)
        )
        # NxD: selective loading reads each token's 8 experts (repeats included) while B x 8 / 128 <
        # 1
        assert nxd["experts_read"] == (batch * 8 if batch < 16 else 128)
        assert nxd["bytes"] == pytest.approx(
            dense["bytes"] if batch >= 16 else costs.fixed_bytes + per_expert * 8 * batch + kv
        )
    assert [decode_roofline.selective_loading(128, 8, b) for b in (15, 16)] == [True, False]


def test_dense_model_has_one_path():
    from transformers import LlamaConfig

    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=100,
    )
    costs = step_costs(config, "bf16", 1, 64)
    assert costs.num_experts == 0 and costs.experts_bytes == 0
    assert batch_step(costs, 4, "dense") == {**batch_step(costs, 4, "sparse"), "path": "dense"}


def test_largest_batch_on_an_inf2_xlarge_spans_the_runtime_window(config_26b):
    deployment = decode_roofline.DEPLOYMENTS[0]
    costs = step_costs(config_26b, deployment.scheme, deployment.ranks, 512)
    allowance = memory.inferred_runtime_allowance()
    limits = decode_roofline.batch_limits(costs, deployment)
    free = lambda allowance_bytes: 16 * GiB - int(costs.weights_bytes) - allowance_bytes  # noqa: E731
    kv = int(costs.kv_bytes_per_stream)
    assert kv == memory.kv_cache_bytes(config_26b, 2, 512, dtype="fp32")
    # the squeeze fits with nothing to spare
    assert limits["largest_batch"] == free(allowance.high_bytes) // kv == 1
    assert limits["largest_batch_if_low"] == free(allowance.low_bytes) // kv == 12
    bf16 = decode_roofline.DEPLOYMENTS[1]
    assert (
        decode_roofline.batch_limits(step_costs(config_26b, "bf16", 2, 512), bf16)["largest_batch"]
        == 0
    )
    h200 = step_costs(config_26b, "bf16", 1, 512)
    no_allowance = decode_roofline.batch_limits(h200, decode_roofline.DEPLOYMENTS[4])
    assert no_allowance["largest_batch"] == (141 * GB - int(h200.weights_bytes)) // int(
        h200.kv_bytes_per_stream
    )
    assert decode_roofline.largest_batch(step_costs(config_26b, "bf16", 1, 0), 141 * GB, 0) is None


def test_replicas_multiply_the_box_and_divide_its_price(config_26b):
    costs = step_costs(config_26b, "int8_squeeze", 2, 512)
    one = Deployment("one", "neuroncore_v2", 2, "int8_squeeze", 6.4906)
    six = Deployment("six", "neuroncore_v2", 2, "int8_squeeze", 6.4906, replicas=6)
    a, b = (decode_roofline.step_speed(costs, d, 4, "sparse") for d in (one, six))
    assert (
        b["tok_s"] == pytest.approx(6 * a["tok_s"])
        and b["tok_s_per_stream"] == a["tok_s_per_stream"]
    )
    assert b["usd_per_m_tokens"] == pytest.approx(a["usd_per_m_tokens"] / 6)
    assert a["tok_s"] == pytest.approx(4 * a["tok_s_per_stream"])


def test_batch_summary_starts_from_the_batch_one_roofline(config_26b):
    summary = decode_roofline.batch_summary(config_26b, decode_roofline.DEPLOYMENTS[:1]).set_index(
        "path"
    )
    story = decode_roofline.story_decode(config_26b)
    assert summary.loc["dense", "tok_s_b1"] == pytest.approx(story["dense_tok_s"], rel=1e-12)
    assert summary.loc["sparse", "usd_per_m_b1"] == pytest.approx(
        story["sparse_usd_per_m_tokens"], rel=1e-12
    )
    # The most streams that fit cost less per token than one, on every path
    assert (summary["usd_per_m_if_low"] < summary["usd_per_m_b1"]).all()
    assert summary.loc["dense", "largest_batch_if_low"] == 12
    price = INSTANCES["inf2.xlarge"].usd_per_hour
    assert summary.loc["sparse", "usd_per_m_if_low"] == pytest.approx(
        price / (summary.loc["sparse", "tok_s_if_low"] * 3600) * 1e6
    )


def test_batch_roofline_rows_and_fit_flags(config_26b):
    table = decode_roofline.batch_roofline(
        config_26b, decode_roofline.DEPLOYMENTS[:1], batches=(1, 12, 13, 16)
    )
    assert len(table) == 3 * 4
    sparse = table[table["path"] == "sparse"].set_index("batch")
    assert sparse["fits"].tolist() == [True, False, False, False]
    assert sparse["fits_if_low"].tolist() == [True, True, False, False]
    assert (
        sparse["tok_s"].is_monotonic_increasing
        and sparse["tok_s_per_stream"].is_monotonic_decreasing
    )


def test_non_neuron_devices_get_no_runtime_allowance(config_26b):
    costs = step_costs(config_26b, "bf16", 1, 512)
    neuron, h200 = (
        decode_roofline.batch_limits(costs, decode_roofline.DEPLOYMENTS[i]) for i in (0, 4)
    )
    assert neuron["runtime_allowance_gb"] == memory.inferred_runtime_allowance().high_bytes / GB
    assert h200["runtime_allowance_gb"] == 0
