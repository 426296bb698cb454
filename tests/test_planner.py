"""``python -m gemma_nb plan``: any causal-LM config.json, exact against memory's inventory and
plan."""

import json

import pytest

from gemma_nb import memory, params
from gemma_nb.cli import build_parser
from gemma_nb.cli import main as cli
from gemma_nb.hardware import INSTANCES
from gemma_nb.params import GEMMA4_26B_CONFIG_PATH
from gemma_nb.tools import plan as planner

H, L, E, I, V = 64, 2, 4, 96, 1000  # hidden, layers, experts, expert intermediate, vocab


def write_config(folder, config):
    config.save_pretrained(folder)  # config.json only: no weights anywhere in these tests
    return folder


@pytest.fixture(scope="module")
def configs(tmp_path_factory):
    from transformers import LlamaConfig, MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

    common = dict(
        hidden_size=H,
        num_hidden_layers=L,
        num_attention_heads=8,
        num_key_value_heads=2,
        vocab_size=V,
    )
    made = {
        "mixtral": MixtralConfig(
            **common, intermediate_size=I, num_local_experts=E, num_experts_per_tok=2
        ),
        "qwen2_moe": Qwen2MoeConfig(
            **common,
            moe_intermediate_size=I,
            shared_expert_intermediate_size=2 * I,
            num_experts=E,
            num_experts_per_tok=2,
            intermediate_size=4 * I,
        ),
        "qwen3_moe": Qwen3MoeConfig(
            **common,
            moe_intermediate_size=I,
            num_experts=E,
            num_experts_per_tok=2,
            intermediate_size=4 * I,
            head_dim=8,
        ),
        "llama": LlamaConfig(**common, intermediate_size=4 * I),
    }
    return {name: write_config(tmp_path_factory.mktemp(name), cfg) for name, cfg in made.items()}


def readme_json_keys() -> list[str]:
    """The keys of the README's table under "--json prints the plan with these keys", in order."""
    from gemma_nb.paths import REPO_ROOT

    readme = (REPO_ROOT / "README.md").read_text()
    table = readme[readme.index("prints the plan with these keys") :].split("\n\n")[1]
    return [line.split("`")[1] for line in table.splitlines()[2:]]


def refused(capsys, *args) -> str:
    """stderr of ``plan`` refusing bad input with exit 2, by argparse or by the planner."""
    try:
        code = cli(["plan", *map(str, args)])
    except SystemExit as exit_info:
        code = exit_info.code
    assert code == 2
    return capsys.readouterr().err


def plan_json(capsys, *args):
    code = cli(["plan", *map(str, args), "--json"])
    return code, json.loads(capsys.readouterr().out)


def test_bundled_26b_is_exact_against_memory(capsys):
    code, report = plan_json(capsys, GEMMA4_26B_CONFIG_PATH)
    config = memory.load_gemma4_26b_config()
    expected = memory.plan(config, 2, "int8_squeeze").table.set_index("group")
    inventory = memory.inventory(config).set_index("group")
    assert list(report) == readme_json_keys()
    for group in memory.GROUPS:
        assert report["groups"][group]["bytes_per_rank"] == expected.loc[group, "bytes_per_rank"]
        assert report["groups"][group]["params"] == inventory.loc[group, "params"]
    allowance = memory.inferred_runtime_allowance()
    assert (
        report["total_bytes_per_rank"]
        == memory.plan(
            config, 2, "int8_squeeze", runtime_allowance_bytes=allowance.high_bytes
        ).total_bytes
    )
    assert (report["tp"], report["scheme"], report["context_len"]) == (2, "int8_squeeze", 512)
    assert (
        code == 0
        and report["fits"]
        and report["instance"] == report["cheapest_fit"]["instance"] == "inf2.xlarge"
    )
    assert report["cheapest_fit"]["usd_per_hour"] == INSTANCES["inf2.xlarge"].usd_per_hour


def test_26b_in_bf16_fits_no_two_core_box_and_the_cheapest_at_tp4(capsys):
    code, report = plan_json(capsys, GEMMA4_26B_CONFIG_PATH, "--scheme", "bf16")
    assert (
        code == 1
        and not report["fits"]
        and report["instance"] is None
        and report["cheapest_fit"] is None
    )
    code, report = plan_json(capsys, GEMMA4_26B_CONFIG_PATH, "--scheme", "bf16", "--tp", "4")
    two_core = [r for r in report["instances"] if r["neuron_cores"] < 4]
    assert all(not r["fits"] and r["headroom_gb"] is None for r in two_core)
    # 14.3 GB of weights per rank: it fits a 16 GiB core only if the runtime takes the low end of
    # its window
    assert code == 3 and report["verdict"] == "marginal" and report["instance"] == "inf2.24xlarge"
    assert report["cheapest_fit"] is None and report["advice"].startswith(
        "Try --tp 2 --scheme int8_squeeze: it fits inf2.xlarge"
    )


def test_judging_one_instance(capsys):
    code, report = plan_json(
        capsys,
        GEMMA4_26B_CONFIG_PATH,
        "--scheme",
        "int8_squeeze",
        "--instance",
        "inf2.xlarge",
        "--budget",
        "story",
        "--runtime-allowance",
        "2",
    )
    fit = memory.plan(
        memory.load_gemma4_26b_config(), 2, "int8_squeeze", runtime_allowance_bytes=2 * 10**9
    )
    assert report["instance"] == "inf2.xlarge" and report["budget"] == "story"
    assert report["budget_gb_per_core"] == 16.0 and report["headroom_gb"] == pytest.approx(
        16 - fit.total_gb
    )
    assert report["fits"] == (fit.total_bytes <= 16e9) and code == (0 if report["fits"] else 1)


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe"])
def test_moe_configs_count_every_expert_weight(configs, capsys, name):
    code, report = plan_json(capsys, configs[name], "--scheme", "bf16")
    assert report["groups"]["experts"]["params"] == L * E * 3 * H * I
    assert report["groups"]["router"]["params"] == L * E * H
    # bf16, halved at TP=2
    assert report["groups"]["experts"]["bytes_per_rank"] == L * E * 3 * H * I * 2 // 2
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
    # K and V, fp32 KV (the port's), one KV head per rank
    per_token = L * 2 * kv_per_rank * head_dim * 4
    assert short["kv_cache_gb_per_rank"] * 1e9 == pytest.approx(128 * per_token)
    assert long["kv_cache_gb_per_rank"] == pytest.approx(2 * short["kv_cache_gb_per_rank"])


def test_text_output_names_the_verdict(capsys):
    assert cli(["plan", str(GEMMA4_26B_CONFIG_PATH)]) == 0
    text = capsys.readouterr().out
    assert "fits inf2.xlarge" in text and "fits: inf2.xlarge" in text and "experts" in text


@pytest.mark.parametrize(
    "args, message",
    [
        (["--tp", "3"], "tp=3 does not divide num_attention_heads=8; choose one of 1, 2, 4"),
        (
            ["--instance", "inf3.large"],
            "instance 'inf3.large' is not in the catalog; known: inf2.xlarge",
        ),
        (["--scheme", "int4"], "scheme 'int4' is not one of bf16, int8_experts"),
    ],
)
def test_bad_input_names_the_fix(configs, capsys, args, message):
    assert cli(["plan", str(configs["mixtral"]), *args]) == 2
    assert message in capsys.readouterr().err


def test_tp_the_experts_do_not_divide(tmp_path, capsys):
    from transformers import MixtralConfig

    write_config(
        tmp_path,
        MixtralConfig(
            hidden_size=H,
            num_hidden_layers=1,
            num_attention_heads=8,
            num_key_value_heads=8,
            num_local_experts=6,
            intermediate_size=I,
        ),
    )
    assert cli(["plan", str(tmp_path), "--tp", "4"]) == 2
    assert "num_experts=6" in capsys.readouterr().err


def test_not_a_causal_lm_or_no_config(tmp_path, capsys):
    from transformers import BertConfig

    write_config(
        tmp_path / "bert", BertConfig(hidden_size=H, num_hidden_layers=1, num_attention_heads=8)
    )
    assert cli(["plan", str(tmp_path / "bert")]) == 2
    assert "encoder-decoder" in capsys.readouterr().err
    assert "nowhere" in refused(capsys, tmp_path / "nowhere")
    (tmp_path / "broken.json").write_text("{not json")
    assert "broken.json" in refused(capsys, tmp_path / "broken.json")


def test_host_needs_are_the_port_s_boxes_and_swapfiles_scaled():
    from gemma_nb.hardware import GiB
    from gemma_nb.story import CLAIMS

    needs = planner.host_needs(memory.load_gemma4_26b_config())
    assert needs["compile_peak_bytes"] == int(CLAIMS["compile_peak_host_gb"].value * 1e9)
    assert needs["compile_bytes"] == (128 + 100) * GiB  # inf2.8xlarge + the port's swap
    assert needs["deploy_bytes"] == (16 + 40) * GiB  # inf2.xlarge + the port's swapfile
    # what loading needs stays under it: model.pt (the device weights) beside the 11 GB peak
    assert needs["model_pt_bytes"] == planner.device_weight_bytes(memory.load_gemma4_26b_config())
    assert (
        needs["deploy_load_bytes"] == needs["model_pt_bytes"] + 11 * 10**9 < needs["deploy_bytes"]
    )
    assert needs["host_embedding_bytes"] == 2 * 262144 * 2816
    half = planner.host_needs(memory.load_gemma4_26b_config(), model_pt_bytes=70 * 10**9)
    assert half["deploy_bytes"] == 81 * 10**9  # a bigger model.pt than the recipe holds


def test_a_multimodal_hub_config_is_planned_by_its_language_model(tmp_path, capsys):
    """The hub's Gemma-4 config.json is multimodal (model_type gemma4): its text model is the
    26B."""
    from transformers import Gemma4Config

    text = json.loads(GEMMA4_26B_CONFIG_PATH.read_text())
    text.pop("model_type")
    write_config(tmp_path, Gemma4Config(text_config=text))
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "gemma4"
    _, hub = plan_json(capsys, tmp_path)
    _, bundled = plan_json(capsys, GEMMA4_26B_CONFIG_PATH)
    assert (
        hub["total_bytes_per_rank"] == bundled["total_bytes_per_rank"]
        and hub["groups"] == bundled["groups"]
    )


# The runtime allowance: notebook 01's window by default, printed, settable
# ------------------------------------------------------------------------------------------------


def test_the_int8_experts_build_does_not_fit_an_inf2_xlarge_by_default(capsys):
    """The port's failed build must not "fit": the default allowance is the window notebook 01
    infers."""
    code, report = plan_json(
        capsys,
        GEMMA4_26B_CONFIG_PATH,
        "--scheme",
        "int8_experts",
        "--instance",
        "inf2.xlarge",
    )
    window = memory.allowance_window(
        memory.load_gemma4_26b_config(), "int8_experts", "int8_squeeze"
    )
    assert code == 1 and report["verdict"] == "does not fit" and not report["fits"]
    assert report["runtime_allowance"]["low_gb"] == window["min_to_fail_bytes"] / 1e9
    assert (
        report["runtime_allowance"]["high_gb"]
        == report["runtime_allowance_gb"]
        == window["max_to_fit_bytes"] / 1e9
    )
    # short at every allowance above the window's low end
    assert report["headroom_gb_if_low"] == 0.0
    code, squeeze = plan_json(capsys, GEMMA4_26B_CONFIG_PATH, "--instance", "inf2.xlarge")
    assert code == 0 and squeeze["verdict"] == "fits" and squeeze["headroom_gb"] == 0.0


def test_the_allowance_is_printed_and_can_be_set(capsys):
    assert cli(["plan", str(GEMMA4_26B_CONFIG_PATH), "--scheme", "int8_experts"]) == 1
    text = capsys.readouterr().out
    assert "2.47-3.84 GB" in text
    assert "Try --scheme int8_squeeze" in text
    code, report = plan_json(
        capsys,
        GEMMA4_26B_CONFIG_PATH,
        "--scheme",
        "int8_experts",
        "--runtime-allowance",
        "0.638",
    )
    assert code == 0 and report["runtime_allowance"] == {
        "low_gb": 0.638,
        "high_gb": 0.638,
        "source": "given",
    }
    # the documented floor alone: it "fits"
    assert report["headroom_gb"] == pytest.approx(1.83, abs=0.01)
    err = refused(capsys, GEMMA4_26B_CONFIG_PATH, "--runtime-allowance", "-1")
    assert "--runtime-allowance: '-1'" in err and "GB" in err


def test_headroom_inside_the_window_is_marginal(capsys):
    """int8 experts and dense MLP, bf16 head: it fits only if the runtime took little, so exit 3."""
    code, report = plan_json(capsys, GEMMA4_26B_CONFIG_PATH, "--scheme", "int8_experts_shared_mlp")
    assert code == 3 and report["verdict"] == "marginal" and report["instance"] == "inf2.xlarge"
    assert (
        report["headroom_gb"] < 0 < report["headroom_gb_if_low"] and report["cheapest_fit"] is None
    )
    assert cli(["plan", str(GEMMA4_26B_CONFIG_PATH), "--scheme", "int8_experts_shared_mlp"]) == 3
    assert "MARGINAL on inf2.xlarge" in capsys.readouterr().out


# Decode predictions
# ------------------------------------------------------------------------------------------------


def test_decode_predictions_per_instance_are_notebook_07s_model(capsys):
    from gemma_nb import decode_roofline

    _, report = plan_json(capsys, GEMMA4_26B_CONFIG_PATH)
    config = memory.load_gemma4_26b_config()
    story = decode_roofline.story_decode(config)
    xlarge = next(row for row in report["instances"] if row["instance"] == "inf2.xlarge")
    decode = xlarge["decode"]
    assert decode["batch_1"]["dense"]["tok_s"] == pytest.approx(story["dense_tok_s"], rel=1e-12)
    assert decode["batch_1"]["sparse"]["usd_per_m_tokens"] == pytest.approx(
        story["sparse_usd_per_m_tokens"], rel=1e-12
    )
    assert (decode["largest_batch"], decode["largest_batch_if_low"], decode["replicas"]) == (
        1,
        12,
        1,
    )
    at_low = decode["at_largest_batch_if_low"]
    costs = decode_roofline.step_costs(config, "int8_squeeze", 2, 512)
    deployment = decode_roofline.DEPLOYMENTS[0]
    assert at_low["sparse"]["tok_s"] == pytest.approx(
        decode_roofline.step_speed(costs, deployment, 12, "sparse")["tok_s"]
    )
    assert at_low["dense"]["tok_s"] < at_low["sparse"]["tok_s"] and at_low["batch"] == 12
    assert report["decode"]["expected_distinct_experts"] == {
        "1": 8.0,
        "12": pytest.approx(decode_roofline.expected_distinct_experts(128, 8, 12)),
    }
    big = next(row for row in report["instances"] if row["instance"] == "inf2.24xlarge")["decode"]
    assert big["replicas"] == 6 and big["batch_1"]["sparse"]["tok_s"] == pytest.approx(
        6 * story["sparse_tok_s"]
    )


def test_parameter_counts_in_the_output(capsys):
    _, report = plan_json(capsys, GEMMA4_26B_CONFIG_PATH)
    params, table = report["params"], 262144 * 2816
    assert (
        params["total"] == 25_233_141_760
        and params["total_excl_input_embedding"] == 25_233_141_760 - table
    )
    assert (
        params["active"] == memory.param_summary(memory.load_gemma4_26b_config())["active_params"]
    )
    assert (
        params["active_excl_input_embedding"] == params["active"] - table and params["towers"] == 0
    )
    assert cli(["plan", str(GEMMA4_26B_CONFIG_PATH)]) == 0
    assert (
        "parameters: 25.233B total (24.495B without the input embedding), 3.823B active"
        in capsys.readouterr().out
    )


def test_json_keys_and_exit_codes_are_documented():
    from gemma_nb.paths import REPO_ROOT

    readme = (REPO_ROOT / "README.md").read_text()
    section = readme[readme.index("## Will it fit?") : readme.index("## Serving the model")]
    assert "| 1 | does not fit" in section and "| 3 | marginal" in section
    window = memory.inferred_runtime_allowance()
    assert (
        f"more than the {window.low_bytes / 1e9:.2f} GB" in section
        and f"at most the\n{window.high_bytes / 1e9:.2f} GB" in section
    )
    text = build_parser()._subparsers._group_actions[0].choices["plan"].format_help()
    assert "3 marginal" in text and "lists the --json keys" in text


# Bad input ends in an error naming the fix, never a traceback
# ------------------------------------------------------------------------------------------------


def test_a_json_array_is_not_a_config(tmp_path, capsys):
    (tmp_path / "config.json").write_text("[1, 2]")
    assert "JSON list" in refused(capsys, tmp_path)


def test_more_ranks_than_the_instance_has_cores_is_a_verdict(capsys):
    assert cli(["plan", str(GEMMA4_26B_CONFIG_PATH), "--tp", "4", "--instance", "inf2.xlarge"]) == 1
    text = capsys.readouterr().out
    assert "TP=4 needs 4 NeuronCores; inf2.xlarge has 2" in text
    assert "fits: inf2.24xlarge" in text


def test_tp_zero_is_refused_by_the_parser(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli(["plan", str(GEMMA4_26B_CONFIG_PATH), "--tp", "0"])
    assert exit_info.value.code == 2 and "argument --tp: '0'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="tp=0.*>= 1"):
        params.tp_problem(memory.load_gemma4_26b_config(), 0)


# Verdicts that promise no more than the box gives
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("scheme", ["mxfp4_experts", "nvfp4_experts"])
def test_fp4_is_not_loadable_whatever_its_bytes(capsys, scheme):
    code, report = plan_json(capsys, GEMMA4_26B_CONFIG_PATH, "--scheme", scheme)
    fp4 = scheme.split("_")[0]
    assert code == 1 and report["verdict"] == "not loadable" and not report["fits"]
    assert report["instance"] is None and report["cheapest_fit"] is None
    assert {row["verdict"] for row in report["instances"]} == {"not loadable"}
    assert all(f"not {fp4} (notebook 02)" in row["reason"] for row in report["instances"])
    assert all(row["headroom_gb"] > 0 for row in report["instances"])  # the bytes would fit
    assert report["advice"].startswith("Try --scheme int8_squeeze: it fits inf2.xlarge")
    code = cli(
        [
            "plan",
            str(GEMMA4_26B_CONFIG_PATH),
            "--scheme",
            scheme,
            "--instance",
            "inf2.xlarge",
        ]
    )
    loads = "NxD loads bf16, fp32, int8, fp8 weights on inf2"
    assert (
        code == 1 and f"NOT loadable on inf2.xlarge: {loads}, not {fp4}" in capsys.readouterr().out
    )


def test_the_roofline_is_labelled_an_upper_bound_beside_the_measured_speed(capsys):
    from gemma_nb.story import CLAIMS

    code, report = plan_json(capsys, GEMMA4_26B_CONFIG_PATH)
    assert report["decode"]["basis"].startswith("upper bounds, from a bandwidth roofline")
    assert report["decode"]["measured_tok_s"] == CLAIMS["decode_tok_s"].value == 6.0
    xlarge = next(row for row in report["instances"] if row["instance"] == "inf2.xlarge")
    assert xlarge["decode"]["batch_1"]["dense"]["tok_s"] > 5 * report["decode"]["measured_tok_s"]
    assert cli(["plan", str(GEMMA4_26B_CONFIG_PATH)]) == 0
    text = capsys.readouterr().out
    assert "upper bounds on tok/s (all streams), lower bounds on $ per million tokens" in text
    assert "measured, for scale: 6 tok/s, the port's 26B with dense experts on inf2.xlarge" in text


def test_a_refusal_says_when_it_is_the_port_s_sharding_not_the_hardware(tmp_path, capsys):
    """Mixtral-8x22B: 8 experts cap a whole-expert sharding at TP=8, where a core is short; the
    weights are well under inf2.48xlarge's HBM."""
    from pathlib import Path

    configs = Path(__file__).resolve().parent / "configs"
    code, report = plan_json(capsys, configs / "mixtral_8x22b.json")
    assert code == 1 and report["instance"] is None
    assert "TP is at most 8" in report["advice"]
    assert "That is the limit of this port's sharding, not of the hardware" in report["advice"]
    assert (
        "so a port that splits each expert across ranks could fit it at TP=24" in report["advice"]
    )
    llama_405b = {
        "model_type": "llama",
        "hidden_size": 16384,
        "num_hidden_layers": 126,
        "num_attention_heads": 128,
        "num_key_value_heads": 8,
        "intermediate_size": 53248,
        "vocab_size": 128256,
    }
    (tmp_path / "config.json").write_text(json.dumps(llama_405b))
    code, report = plan_json(capsys, tmp_path)  # dense, 405 GB in int8: more than any inf2 holds
    assert code == 1 and report["advice"].startswith("No inf2 holds it: TP is at most 16")
    assert "sharding, not of the hardware" not in report["advice"]
