"""gemma_nb.experiments.quantization: each scheme scored by the KL divergence of its next-token
distribution on held-out text, and the 26B evaluation's host bytes and time (notebook 02)."""

from __future__ import annotations

import math
import os

import pandas as pd
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from gemma_nb import memory  # noqa: E402
from gemma_nb.experiments import quantization  # noqa: E402
from gemma_nb.hardware import INSTANCES, GiB  # noqa: E402
from gemma_nb.tiny import BUNDLED_ID  # noqa: E402
from gemma_nb.tiny.corpus import HELD_OUT, build_tokenizer  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
HEADS = {scheme.name: scheme for scheme in quantization.HEAD_ALONE}


def schemes(*names):
    return {name: memory.get_scheme(name) for name in names} | HEADS


def test_eval_batches_hold_the_held_out_split_or_a_text_file(tmp_path):
    tokenizer = build_tokenizer()
    batches = quantization.eval_batches(tokenizer, "held-out", 4096, 512)
    assert sum(batch.shape[0] for batch in batches) == len(HELD_OUT)
    assert all(bool((batch[:, 0] == tokenizer.bos_token_id).all()) for batch in batches)
    text = tmp_path / "text.txt"
    text.write_text(" ".join(fact.sentence for fact in HELD_OUT))
    batches = quantization.eval_batches(tokenizer, str(text), 40, 16)
    assert [tuple(batch.shape) for batch in batches] == [(1, 16), (1, 16)]
    with pytest.raises(ValueError, match="eval_text 'missing.txt' is not a file"):
        quantization.eval_batches(tokenizer, "missing.txt", 40, 16)
    with pytest.raises(ValueError, match="chunk_tokens=1 must be >= 2"):
        quantization.eval_batches(tokenizer, "held-out", 40, 1)
    with pytest.raises(ValueError, match="chunk_tokens=64 must be >= 2 and <= eval_tokens=40"):
        quantization.eval_batches(tokenizer, str(text), 40, 64)
    with pytest.raises(ValueError, match="eval_tokens=0 must be an integer >= 1"):
        quantization.eval_batches(tokenizer, "held-out", 0, 16)
    with pytest.raises(ValueError, match="fewer than one sequence of chunk_tokens=4096"):
        quantization.eval_batches(tokenizer, str(text), 4096, 4096)


@pytest.fixture(scope="module")
def evaluation():
    return quantization.evaluate_held_out(
        BUNDLED_ID,
        schemes("bf16", "int8_experts"),
        lambda tokenizer: quantization.eval_batches(tokenizer, "held-out", 4096, 512),
        tp=2,
    )


def test_every_scheme_is_scored_against_bf16_and_fp32(evaluation):
    tokenizer = build_tokenizer()
    assert evaluation.positions == sum(len(tokenizer(f.sentence).input_ids) - 1 for f in HELD_OUT)
    assert set(evaluation.scores) == {"bf16", "fp32"}  # the bundled checkpoint stores fp32
    bf16, fp32 = (evaluation.scores[c].astype(float) for c in ("bf16", "fp32"))
    assert list(bf16.index) == ["bf16", "int8_experts", "int8_lm_head", "int8_lm_head_sharded"]
    assert set(bf16.columns) == {"perplexity"} | {
        f"{score}_vs_{ref}"
        for score in ("kld_mean", "kld_p99", "top1_agreement")
        for ref in ("bf16", "fp32")
    }
    # the unquantized model against itself: nothing moves
    assert (bf16.loc["bf16", "kld_mean_vs_bf16"], bf16.loc["bf16", "top1_agreement_vs_bf16"]) == (
        0.0,
        1.0,
    )
    assert (fp32.loc["bf16", "kld_mean_vs_fp32"], fp32.loc["bf16", "kld_p99_vs_fp32"]) == (0.0, 0.0)
    # bf16's own rounding, and int8's, in fp32 compute, are not zero
    assert bf16.loc["bf16", "kld_mean_vs_fp32"] > 0 and fp32.loc["int8_experts"].min() >= 0
    assert (
        0
        < fp32.loc["int8_experts", "kld_mean_vs_fp32"]
        <= fp32.loc["int8_experts", "kld_p99_vs_fp32"]
    )
    # sharding the head by rows computes the same logits
    for table in (bf16, fp32):
        pd.testing.assert_series_equal(
            table.loc["int8_lm_head"],
            table.loc["int8_lm_head_sharded"],
            rtol=1e-4,
            check_names=False,
        )
    assert evaluation.host["peak_bytes"] >= evaluation.host["baseline_bytes"] > 0


def test_the_26b_evaluation_host_bytes_come_from_the_planner(evaluation):
    config = memory.load_gemma4_26b_config()
    scored = schemes("int8_squeeze")
    needs = quantization.host_needs(config, scored, positions=4088, sequence=511)
    plan = memory.plan(config, 1, "int8_squeeze")
    assert needs == {
        "checkpoint_mmapped": 2 * 25_233_141_760,  # the hub's bf16, mapped, never copied
        "bf16_copy": 0,
        "quantized_copy": sum(plan.bytes(g) for g in ("experts", "shared_mlp", "lm_head")),
        "reference_logprobs": 4 * 4088 * 262_144,  # 8 sequences of 512
        "sequence_logits": quantization.TRANSIENT_BYTES_PER_LOGIT * 511 * 262_144,
    }
    table = quantization.host_peak_table(evaluation, config, scored, 4096, 512)
    host = evaluation.host
    here = quantization.host_needs(
        evaluation.config, scored, evaluation.positions, host["longest_sequence"]
    )
    assert here["bf16_copy"] == here["checkpoint_mmapped"] // 2  # fp32 on disk, bf16 in memory
    rest = max(0, host["peak_bytes"] - host["baseline_bytes"] - sum(here.values()))
    assert table.loc["beyond_the_components", "model_26b_gb"] == rest / 1e9
    assert table.loc["total", "model_26b_gb"] == pytest.approx(
        (sum(needs.values()) + rest + host["baseline_bytes"]) / 1e9
    )
    assert table.loc["total", "model_26b_gb"] * 1e9 < 128 * GiB


def test_the_time_estimate_adds_passes_quantization_and_dequantization():
    config = memory.load_gemma4_26b_config()
    seconds = pd.DataFrame({"quantize_s": {"int8": 10.0}, "dequantize_s": {"int8": 1.0}})
    box = INSTANCES["inf2.8xlarge"]
    table = quantization.time_estimate(
        config, schemes("int8_experts"), seconds, 1e10, 1024, 512, box
    )
    summary = memory.param_summary(config)
    per_token = 2 * (summary["active_params_excl_embeddings"] + 262_144 * 2816)
    forward = 4 * 1024 * per_token / 1e10  # the reference, int8_experts and the two heads
    head = 262_144 * 2816 / (summary["experts_params"] / 30)  # the head in layers' worth
    quantize = 30 * 10.0 + 2 * head * 10.0
    dequantize = (30 * 1.0 + 2 * head * 1.0) * 2  # two sequences
    assert table.loc["one thread", "hours"] == pytest.approx(
        (forward + quantize + dequantize) / 3600
    )
    assert table.loc["32 vCPUs", "hours"] == pytest.approx(
        (quantize + (forward + dequantize) / 32) / 3600
    )
    assert list(table["usd"]) == pytest.approx(list(table["hours"] * box.usd_per_hour))


def test_formats_table_and_the_pareto_figure():
    table = quantization.formats_table().set_index("format")
    assert table.loc["mxfp4", "bytes_per_weight"] == memory.tensor_bytes((1408, 2816), "mxfp4") / (
        1408 * 2816
    )
    assert table.loc["bf16", "bytes_per_weight"] == 2.0 and table.columns[-1] == "description"
    scores = {
        "bf16": pd.DataFrame(
            {"kld_mean_vs_bf16": [0.0, 1e-3, 2e-3, 5e-4], "kld_mean_vs_fp32": [1e-3] * 4},
            index=["bf16", "a", "b", "c"],
        )
    }
    gb = pd.Series({"bf16": 26.0, "a": 15.0, "b": 10.0, "c": 20.0})
    fig = quantization.pareto_figure(scores, gb, tp=2)
    ax = fig.axes[0]
    front = ax.lines[0]
    assert list(front.get_xdata()) == [10.0, 15.0] and list(front.get_ydata()) == [2e-3, 1e-3]
    labels = fig.legends[0].get_texts()
    assert [t.get_text() for t in labels] == [
        "Pareto front of what fits",
        "a",
        "b",
        "c",
        "16 GiB per core",
        "bf16 model against fp32",
    ]
    assert math.isclose(ax.lines[-1].get_ydata()[0], 1e-3)
