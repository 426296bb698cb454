"""``python -m gemma_nb plan``: any causal-LM config.json, exact against memory's inventory and plan."""

import json

import pytest

from gemma_nb import memory, planner
from gemma_nb.__main__ import main as cli
from gemma_nb.hardware import INSTANCES

H, L, E, I, V = 64, 2, 4, 96, 1000  # hidden, layers, experts, expert intermediate, vocab


def write_config(folder, config):
    config.save_pretrained(folder)  # config.json only: no weights anywhere in these tests
    return folder


@pytest.fixture(scope="module")
def configs(tmp_path_factory):
    from transformers import LlamaConfig, MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

    common = dict(hidden_size=H, num_hidden_layers=L, num_attention_heads=8, num_key_value_heads=2, vocab_size=V)
    made = {
        "mixtral": MixtralConfig(**common, intermediate_size=I, num_local_experts=E, num_experts_per_tok=2),
        "qwen2_moe": Qwen2MoeConfig(**common, moe_intermediate_size=I, shared_expert_intermediate_size=2 * I,
                                    num_experts=E, num_experts_per_tok=2, intermediate_size=4 * I),
        "qwen3_moe": Qwen3MoeConfig(**common, moe_intermediate_size=I, num_experts=E, num_experts_per_tok=2,
                                    intermediate_size=4 * I, head_dim=8),
        "llama": LlamaConfig(**common, intermediate_size=4 * I),
    }
    return {name: write_config(tmp_path_factory.mktemp(name), cfg) for name, cfg in made.items()}


def plan_json(capsys, *args):
    code = cli(["plan", *map(str, args), "--json"])
    return code, json.loads(capsys.readouterr().out)


def test_bundled_26b_is_exact_against_memory(capsys):
    code, report = plan_json(capsys, memory.GEMMA4_26B_CONFIG_PATH)
    config = memory.load_gemma4_26b_config()
    expected = memory.plan(config, 2, "int8_squeeze").table.set_index("group")
    inventory = memory.inventory(config).set_index("group")
    assert list(report) == list(planner.JSON_KEYS)
    for group in memory.GROUPS:
        assert report["groups"][group]["bytes_per_rank"] == expected.loc[group, "bytes_per_rank"]
        assert report["groups"][group]["params"] == inventory.loc[group, "params"]
    allowance = memory.inferred_runtime_allowance()
    assert report["total_bytes_per_rank"] == memory.plan(config, 2, "int8_squeeze",
                                                         runtime_allowance_bytes=allowance.high_bytes).total_bytes
    assert (report["tp"], report["scheme"], report["context_len"]) == (2, "int8_squeeze", 512)
    assert code == 0 and report["fits"] and report["instance"] == report["cheapest_fit"]["instance"] == "inf2.xlarge"
    assert report["cheapest_fit"]["usd_per_hour"] == INSTANCES["inf2.xlarge"].usd_per_hour


def test_26b_in_bf16_fits_no_two_core_box_and_the_cheapest_at_tp4(capsys):
    code, report = plan_json(capsys, memory.GEMMA4_26B_CONFIG_PATH, "--scheme", "bf16")
    assert code == 1 and not report["fits"] and report["instance"] is None and report["cheapest_fit"] is None
    code, report = plan_json(capsys, memory.GEMMA4_26B_CONFIG_PATH, "--scheme", "bf16", "--tp", "4")
    two_core = [r for r in report["instances"] if r["neuron_cores"] < 4]
    assert all(not r["fits"] and r["headroom_gb"] is None for r in two_core)
    # 14.3 GB of weights per rank: it fits a 16 GiB core only if the runtime takes the low end of its window
    assert code == 3 and report["verdict"] == "marginal" and report["instance"] == "inf2.24xlarge"
    assert report["cheapest_fit"] is None and report["advice"].startswith("Try --tp 2 --scheme int8_squeeze: it fits inf2.xlarge")


def test_judging_one_instance(capsys):
    code, report = plan_json(capsys, memory.GEMMA4_26B_CONFIG_PATH, "--scheme", "int8_squeeze",
                             "--instance", "inf2.xlarge", "--budget", "story", "--runtime-allowance", "2")
    fit = memory.plan(memory.load_gemma4_26b_config(), 2, "int8_squeeze", runtime_allowance_bytes=2 * 10**9)
    assert report["instance"] == "inf2.xlarge" and report["budget"] == "story"
    assert report["budget_gb_per_core"] == 16.0 and report["headroom_gb"] == pytest.approx(16 - fit.total_gb)
    assert report["fits"] == (fit.total_bytes <= 16e9) and code == (0 if report["fits"] else 1)


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe"])
def test_moe_configs_count_every_expert_weight(configs, capsys, name):
    code, report = plan_json(capsys, configs[name], "--scheme", "bf16")
    assert report["groups"]["experts"]["params"] == L * E * 3 * H * I
    assert report["groups"]["router"]["params"] == L * E * H
    assert report["groups"]["experts"]["bytes_per_rank"] == L * E * 3 * H * I * 2 // 2  # bf16, halved at TP=2
    assert report["groups"]["embeddings"]["placement"] == "host"
    assert code == 0


def test_qwen2_moe_shared_expert_is_the_dense_mlp(configs, capsys):
    _, report = plan_json(capsys, configs["qwen2_moe"], "--scheme", "bf16")
    assert report["groups"]["shared_mlp"]["params"] == L * 3 * H * 2 * I
    assert report["groups"]["router"]["params"] == L * (E * H + H)  # router + shared_expert_gate


def test_dense_llama_has_no_experts_and_kv_cache_per_context(configs, capsys):
    _, short = plan_json(capsys, configs["llama"], "--context", "128")
    _, long = plan_json(capsys, configs["llama"], "--context", "256")
    assert short["groups"]["experts"]["params"] == 0
    assert short["groups"]["shared_mlp"]["params"] == L * 3 * H * 4 * I
    head_dim, kv_per_rank = H // 8, 2 // 2
    per_token = L * 2 * kv_per_rank * head_dim * 4  # K and V, fp32 KV (the port's), one KV head per rank
    assert short["kv_cache_gb_per_rank"] * 1e9 == pytest.approx(128 * per_token)
    assert long["kv_cache_gb_per_rank"] == pytest.approx(2 * short["kv_cache_gb_per_rank"])


def test_text_output_names_the_verdict(capsys):
    assert cli(["plan", str(memory.GEMMA4_26B_CONFIG_PATH)]) == 0
    text = capsys.readouterr().out
    assert "fits inf2.xlarge" in text and "cheapest that fits: inf2.xlarge" in text and "experts" in text


@pytest.mark.parametrize("args, message", [
    (["--tp", "3"], "tp=3 does not divide num_attention_heads=8; choose one of 1, 2, 4"),
    (["--instance", "inf3.large"], "instance 'inf3.large' is not in the catalog; known: inf2.xlarge"),
    (["--scheme", "int4"], "scheme 'int4' is not one of bf16, int8_experts"),
])
def test_bad_input_names_the_fix(configs, capsys, args, message):
    assert cli(["plan", str(configs["mixtral"]), *args]) == 2
    assert message in capsys.readouterr().err


def test_tp_the_experts_do_not_divide(tmp_path, capsys):
    from transformers import MixtralConfig

    write_config(tmp_path, MixtralConfig(hidden_size=H, num_hidden_layers=1, num_attention_heads=8,
                                         num_key_value_heads=8, num_local_experts=6, intermediate_size=I))
    assert cli(["plan", str(tmp_path), "--tp", "4"]) == 2
    assert "tp=4 does not divide num_experts=6" in capsys.readouterr().err


def test_not_a_causal_lm_or_no_config(tmp_path, capsys):
    from transformers import BertConfig

    write_config(tmp_path / "bert", BertConfig(hidden_size=H, num_hidden_layers=1, num_attention_heads=8))
    assert cli(["plan", str(tmp_path / "bert")]) == 2
    assert "encoder or encoder-decoder model" in capsys.readouterr().err
    assert cli(["plan", str(tmp_path / "nowhere")]) == 2
    assert "pass a config.json or a model folder" in capsys.readouterr().err
    (tmp_path / "broken.json").write_text("{not json")
    assert cli(["plan", str(tmp_path / "broken.json")]) == 2
    assert "is not JSON" in capsys.readouterr().err


def test_host_needs_scale_the_ports_26b_peaks():
    from gemma_nb.story import CLAIMS

    needs = planner.host_needs(memory.load_gemma4_26b_config())
    assert needs["compile_bytes"] == int(CLAIMS["compile_peak_host_gb"].value * 1e9)
    assert needs["deploy_bytes"] == int(CLAIMS["deploy_peak_rss_gb"].value * 1e9)
    assert needs["host_embedding_bytes"] == 2 * 262144 * 2816


def test_a_multimodal_hub_config_is_planned_by_its_language_model(tmp_path, capsys):
    """The hub's Gemma-4 config.json is multimodal (model_type gemma4): its text model is the 26B."""
    from transformers import Gemma4Config

    text = json.loads(memory.GEMMA4_26B_CONFIG_PATH.read_text())
    text.pop("model_type")
    write_config(tmp_path, Gemma4Config(text_config=text))
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "gemma4"
    _, hub = plan_json(capsys, tmp_path)
    _, bundled = plan_json(capsys, memory.GEMMA4_26B_CONFIG_PATH)
    assert hub["total_bytes_per_rank"] == bundled["total_bytes_per_rank"] and hub["groups"] == bundled["groups"]
