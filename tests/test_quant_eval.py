"""gemma_nb.experiments.quantization: scoring a quantization scheme against the float model
(notebook 02)."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from gemma_nb import memory
from gemma_nb.experiments import quantization  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def corpus_model():
    """A random model with the corpus tokenizer's vocabulary, and the tokenizer."""
    from gemma_nb.tiny import random_gemma4_config, random_gemma4_model
    from gemma_nb.tiny.corpus import build_tokenizer

    tokenizer = build_tokenizer()
    config = random_gemma4_config(
        vocab_size=len(tokenizer),
        num_hidden_layers=2,
        num_experts=8,
        top_k_experts=2,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
    )
    return random_gemma4_model(config, seed=1, dtype=torch.float32), tokenizer


def test_evaluate_scheme_scores_against_the_reference(corpus_model):
    from gemma_nb.tiny import FACTS

    reference, tokenizer = corpus_model
    facts = FACTS[:12]
    prompts = [f.prompt for f in facts]
    reference_greedy = quantization.greedy_tokens(reference, tokenizer, prompts, 3)
    assert [len(t) for t in reference_greedy] == [3] * 12
    same, summary, report, greedy = quantization.evaluate_scheme(
        reference,
        tokenizer,
        "bf16",
        dtype=torch.float32,
        facts=facts,
        reference_greedy=reference_greedy,
        steps=3,
    )
    assert (
        summary["top1_agreement"] == 1.0
        and summary["kl_mean"] == 0.0
        and summary["greedy_match"] == 1.0
    )
    assert report.empty and greedy["first_divergent_step"].isna().all()
    _, summary, report, greedy = quantization.evaluate_scheme(
        reference,
        tokenizer,
        "mxfp4_experts",
        facts=facts,
        reference_greedy=reference_greedy,
        steps=3,
    )
    assert 0.0 < summary["top1_agreement"] < 1.0 and summary["kl_mean"] > 0
    assert (
        summary["quantized_bytes"] == report["stored_bytes"].sum() < summary["quantized_bf16_bytes"]
    )
    # the reference is untouched
    assert reference.lm_head.weight is reference.model.embed_tokens.weight
    diverged = greedy[~greedy["match"]]
    if len(diverged):
        row = diverged.iloc[0]
        step = int(row["first_divergent_step"])
        index = prompts.index(row["prompt"])
        detail = quantization.divergence_detail(
            reference, same, tokenizer, row["prompt"], reference_greedy[index], step
        )
        assert detail["model"].tolist() == ["reference"] * 3 + ["candidate"] * 3
        assert detail.loc[0, "token"] == tokenizer.decode([reference_greedy[index][step]])


def test_lm_head_isolation_and_formats_table(corpus_model):
    reference, tokenizer = corpus_model
    result = quantization.lm_head_isolation(
        reference, tokenizer, "int8", texts=["The capital of France is Paris ."]
    )
    assert result["positions"] == len(tokenizer("The capital of France is Paris .").input_ids)
    assert 0 < result["max_abs_logit_error"] < 0.05 and result["margin_min"] >= 0
    table = quantization.formats_table().set_index("format")
    assert table.loc["mxfp4", "bytes_per_weight"] == memory.tensor_bytes((1408, 2816), "mxfp4") / (
        1408 * 2816
    )
    assert table.loc["bf16", "bytes_per_weight"] == 2.0


def test_score_findings_reads_the_tables():
    import pandas as pd

    results = pd.DataFrame(
        {
            "top1_agreement": [0.99, 0.99, 0.98, 0.995, 0.97, 0.99],
            "kl_mean_float32": [0.0, 0.1, 0.3, 0.6, 2.0, 1.0],
            "fact_recall": [1.0, 1.0, 1.0, 1.0, 0.9, 1.0],
            "greedy_match": [1.0, 1.0, 1.0, 1.0, 1.0, 0.5],
        },
        index=[
            "bf16",
            "int8_experts",
            "int8_experts_shared_mlp",
            "int8_squeeze",
            "mxfp4_experts",
            "fp8_experts",
        ],
    )
    errors = pd.DataFrame(
        {
            "scheme": ["int8_experts", "mxfp4_experts", "fp8_experts", "int8_squeeze"],
            "group": ["experts", "experts", "experts", "lm_head"],
            "rel_error": [0.01, 0.1, 0.03, 0.5],
        }
    )
    found = quantization.score_findings(results, errors, reference_recall=1.0)
    assert found["kept"] == ["bf16", "int8_experts", "int8_experts_shared_mlp", "int8_squeeze"]
    assert found["changed"] == ["mxfp4_experts", "fp8_experts"]
    assert found["bf16_disagreement"] == pytest.approx(0.01)
    assert found["top1_spread"] == pytest.approx(0.02) and found["top1_both_sides"]
    assert found["kl_order"] == [
        "int8_experts",
        "int8_experts_shared_mlp",
        "int8_squeeze",
        "fp8_experts",
        "mxfp4_experts",
    ]
    assert found["experts_by_weight_error"] == ["int8_experts", "fp8_experts", "mxfp4_experts"]
    assert (
        found["experts_by_kl"] == ["int8_experts", "fp8_experts", "mxfp4_experts"]
        and found["follows_weight_error"]
    )
    assert found["shared_mlp_kl_added"] == pytest.approx(0.2) and found[
        "lm_head_kl_added"
    ] == pytest.approx(0.3)
    found = quantization.score_findings(
        results.drop(index="int8_squeeze"), errors, reference_recall=1.0
    )
    assert found["lm_head_kl_added"] is None and not found["top1_both_sides"]
