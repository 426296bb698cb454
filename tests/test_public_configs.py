"""``plan`` on eight public models, as a new user would run it: counts, and what it cannot model, by
name.

The configs in ``tests/configs/`` are the models' published ``config.json`` files (Phi-3.5-MoE's
without its long-rope factor lists, which change no count); no weights are read. The published
totals come from each model's card or paper (docs/sources.md: public-model-configs).
"""

import json
from pathlib import Path

import pytest

from gemma_nb import memory
from gemma_nb.cli import main as cli
from gemma_nb.tools import plan as planner
from gemma_nb.tools.plan import read_config

CONFIGS = Path(__file__).resolve().parent / "configs"
# Billions of parameters, as published (towers included where the model has them).
PUBLISHED_TOTAL_B = {
    "qwen3_30b_a3b": 30.5,
    "olmoe_1b_7b": 6.9,
    "mixtral_8x22b": 141.0,
    "gpt_oss_20b": 20.91,
    "deepseek_v2_lite": 15.7,
    "gemma3_27b": 27.433,
    "llama31_8b": 8.03,
    "phi35_moe": 41.9,
}
# What the planner cannot model exactly, and the config field each note must name.
FLAGGED = {
    "deepseek_v2_lite": "kv_lora_rank",
    "gpt_oss_20b": "quantization_config",
    "gemma3_27b": "vision_config",
}


def plan_json(capsys, *args):
    code = cli(["plan", *map(str, args), "--json"])
    return code, json.loads(capsys.readouterr().out)


def test_the_fixtures_are_the_eight():
    assert {path.stem for path in CONFIGS.glob("*.json")} == set(PUBLISHED_TOTAL_B)


@pytest.mark.parametrize("name", sorted(PUBLISHED_TOTAL_B))
def test_totals_are_within_half_a_percent_of_the_published(name):
    source = read_config(CONFIGS / f"{name}.json")
    params = planner.param_counts(source.config, source.towers_params)
    assert params["total_with_towers"] / 1e9 == pytest.approx(PUBLISHED_TOTAL_B[name], rel=0.005)


@pytest.mark.parametrize("name", sorted(PUBLISHED_TOTAL_B))
def test_what_cannot_be_modelled_is_named(name):
    notes = read_config(CONFIGS / f"{name}.json").notes
    if name in FLAGGED:
        assert len(notes) == 1 and notes[0].startswith(FLAGGED[name]), notes
    else:
        assert notes == (), notes


def test_mla_kv_cache_is_the_latent_and_the_heads_are_the_configs(capsys):
    """DeepSeek-V2-Lite: 16 heads of 192 (not 48 of 64), and a 576-value latent per layer per token
    (not 0)."""
    config = read_config(CONFIGS / "deepseek_v2_lite.json").config
    layers = memory.model_facts(config).attention_layers
    assert {(layer.q_heads, layer.head_dim, layer.latent_dim) for layer in layers} == {
        (16, 192, 576)
    }
    assert memory.kv_cache_bytes(config, 2, 1, dtype="bf16") == 27 * 576 * 2  # whole on every rank
    assert memory.valid_tp_degrees(config, 24) == [1, 2, 4, 8, 16]
    # MLA's down-projection to the latent is replicated, not split by TP
    records = {rec.name: rec for rec in memory.model_facts(config).records}
    assert records["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"].split == "none"
    _, report = plan_json(capsys, CONFIGS / "deepseek_v2_lite.json")
    assert report["kv_cache_gb_per_rank"] * 1e9 == 512 * 27 * 576 * 4  # the port's fp32 cache
    assert "kv_lora_rank=512" in report["notes"][0]


def test_a_checkpoints_own_quantization_is_named(capsys):
    _, report = plan_json(capsys, CONFIGS / "gpt_oss_20b.json")
    assert report["notes"][0].startswith(
        "quantization_config: the checkpoint ships 'mxfp4' weights"
    )
    assert "--scheme mxfp4_experts" in report["notes"][0]
    # the card's active
    assert report["params"]["active_excl_input_embedding"] / 1e9 == pytest.approx(3.61, rel=0.005)


def test_multimodal_towers_are_counted_apart(capsys):
    code, report = plan_json(capsys, CONFIGS / "gemma3_27b.json")
    params = report["params"]
    # SigLIP encoder and projector
    assert params["towers"] / 1e9 == pytest.approx(0.4235, abs=0.001)
    assert params["total_with_towers"] == params["total"] + params["towers"]
    assert report["notes"][0].startswith("vision_config: a multimodal config (Gemma3Config)")
    assert code == 1 and report["advice"].startswith("Try --tp 4")


def test_mixtral_8x22b_gets_no_circular_advice(capsys):
    """Its 8 experts cap TP at 8 on any inf2: the advice says no inf2 holds it, and why; it never
    suggests a TP the model refuses or the scheme already asked for."""
    code, report = plan_json(capsys, CONFIGS / "mixtral_8x22b.json")
    assert code == 1 and report["cheapest_fit"] is None
    assert report["advice"].startswith("No inf2 holds it: TP is at most 8")
    assert "int8_squeeze, needs" in report["advice"]
    assert cli(["plan", str(CONFIGS / "mixtral_8x22b.json"), "--tp", "16"]) == 2
    assert "1, 2, 4, 8" in capsys.readouterr().err
