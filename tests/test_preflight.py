"""``python -m gemma_nb preflight``: each check on fakes of the system queries (no SDK, no inf2
here)."""

import json
import os
import shutil

import pytest

from gemma_nb.cli import main as cli
from gemma_nb.hardware import GB, GiB
from gemma_nb.neuron.sdk import SdkStatus
from gemma_nb.tiny import CHECKPOINT_DIR
from gemma_nb.tools import plan as planner
from gemma_nb.tools import preflight as P

INF2_XLARGE_LS = json.dumps(
    [{"neuron_device": 0, "bdf": "00:1f.0", "nc_count": 2, "memory_size": 32 * GiB}]
)


def fake_system(**overrides):
    values = dict(
        check_sdk=lambda: SdkStatus(),
        package_version=lambda name: None,
        neuron_ls=lambda: INF2_XLARGE_LS,
        memory=lambda: (16 * GiB, 0),
        disk_free=lambda path: 500 * GB,
        env={},
    )
    values.update(overrides)
    return P.System(**values)


def test_sdk_missing_is_the_blocker_with_the_install_step():
    check = P.check_sdk(
        fake_system(check_sdk=lambda: SdkStatus(missing=["torch-neuronx", "neuronx-distributed"]))
    )
    assert check.status == P.FAIL and "torch-neuronx, neuronx-distributed" in check.detail
    assert "pip install -r envs/neuron/requirements.txt" in check.fix


def test_the_fx_workaround_passes_and_says_so():
    check = P.check_sdk(fake_system(check_sdk=lambda: SdkStatus(fx_problem=True)))
    assert (
        check.status == P.OK
        and "transformers 5 removed" in check.detail
        and "not installed" not in check.detail
    )


def test_versions_against_the_pins():
    pins = {"torch-neuronx": "2.9.0.2.15.32035", "neuronx-distributed": "0.19.28492"}
    same = P.check_versions(fake_system(package_version=pins.get), pins)
    assert same.status == P.OK
    other = P.check_versions(
        fake_system(package_version=lambda n: "0.18.0" if n == "neuronx-distributed" else pins[n]),
        pins,
    )
    assert (
        other.status == P.WARN and other.detail == "neuronx-distributed 0.18.0 (pinned 0.19.28492)"
    )
    assert set(P.pinned_versions()) >= {"torch-neuronx", "neuronx-distributed", "neuronx-cc"}
    assert "neuronx-distributed-inference" not in P.pinned_versions()


def test_a_neuron_wheel_s_local_version_label_is_the_pinned_version():
    pins = {"torch-neuronx": "2.9.0.2.15.32035", "neuronx-cc": "2.26.6360.0"}
    local = {"torch-neuronx": "2.9.0.2.15.32035+0f2a1b3c", "neuronx-cc": "2.26.6360.0+df09d4f4"}
    assert P.check_versions(fake_system(package_version=local.get), pins).status == P.OK
    other = P.check_versions(
        fake_system(package_version=lambda n: "2.26.1.0+ab" if n == "neuronx-cc" else local[n]),
        pins,
    )
    assert other.status == P.WARN and other.detail == "neuronx-cc 2.26.1.0+ab (pinned 2.26.6360.0)"
    emulated = P.check_versions(fake_system(package_version=lambda n: None), pins, emulated=True)
    assert emulated.status == P.SKIP and emulated.detail.startswith("emulated SDK")


def test_neuron_cores_and_hbm_per_core():
    ok = P.check_neuron_cores(fake_system(), tp=2, bytes_per_rank=int(14e9))
    assert ok.status == P.OK and ok.detail.startswith("2 NeuronCores, 16.0 GiB HBM per core")
    too_many = P.check_neuron_cores(fake_system(), tp=4, bytes_per_rank=None)
    assert too_many.status == P.FAIL and "TP=4 needs 4" in too_many.detail
    too_big = P.check_neuron_cores(fake_system(), tp=2, bytes_per_rank=int(18e9))
    assert too_big.status == P.FAIL and "18.00 GB" in too_big.detail
    absent = P.check_neuron_cores(fake_system(neuron_ls=lambda: None), tp=2, bytes_per_rank=None)
    assert absent.status == P.FAIL and "neuron-ls" in absent.detail
    no_driver = P.check_neuron_cores(
        fake_system(neuron_ls=lambda: "error: failed to discover Neuron devices"),
        tp=2,
        bytes_per_rank=None,
    )
    assert no_driver.status == P.FAIL and "Neuron device" in no_driver.detail
    garbled = P.check_neuron_cores(
        fake_system(neuron_ls=lambda: '[{"cores": 2}]'), tp=2, bytes_per_rank=None
    )
    assert garbled.status == P.WARN


def test_host_memory_against_the_step():
    need = 228 * GiB  # the compile box's recipe: 128 GiB + 100 GiB of swap
    # the RAM the box reads, below its nominal 128 GiB, and no swap: the whole difference to add
    short = P.check_host_memory(fake_system(memory=lambda: (124 * GiB, 0)), "compile", need)
    assert short.status == P.FAIL and "fallocate -l 104G /swapfile " in short.fix
    assert "124.0 GiB RAM + 0.0 GiB swap; the compile needs 228.0 GiB" in short.detail
    # a swapfile made before: a second one for the rest
    some = P.check_host_memory(fake_system(memory=lambda: (124 * GiB, 41 * GiB)), "compile", need)
    assert some.status == P.FAIL and "fallocate -l 63G /swapfile2 " in some.fix
    swapped = P.check_host_memory(
        fake_system(memory=lambda: (124 * GiB, 104 * GiB)), "compile", need
    )
    assert swapped.status == P.OK


def test_the_deploy_needs_the_artifact_s_model_pt_beside_the_load_peak(tmp_path):
    """On the serving box, preflight reads model.pt's size from the artifact: a model.pt bigger
    than the recipe's headroom raises the need."""
    folder = tmp_path / "artifact"
    folder.mkdir()
    shutil.copy(CHECKPOINT_DIR / "config.json", folder / "config.json")
    for size in (1, 10**9):
        (folder / "model.pt").write_bytes(b"")
        os.truncate(folder / "model.pt", size)
        checks = P.run_checks("cpu", artifact=str(folder), system=fake_system())
        memory = next(c for c in checks if c.name == "host_memory")
        host = planner.host_needs(planner.read_config(folder).config, size)
        assert f"needs {host['deploy_bytes'] / GiB:.1f} GiB" in memory.detail
    assert host["deploy_bytes"] == host["deploy_load_bytes"] > 10**9  # model.pt + the peak


def test_disk_of_a_folder_not_made_yet(tmp_path):
    seen = []
    check = P.check_disk(
        fake_system(disk_free=lambda p: seen.append(p) or 10 * GB), str(tmp_path / "a" / "b"), 0
    )
    assert check.status == P.OK and seen == [str(tmp_path)]


def test_disk():
    short = P.check_disk(fake_system(disk_free=lambda p: 10 * GB), "/data", int(53.4e9))
    assert short.status == P.FAIL and short.fix.startswith(
        "grow the EBS volume to at least 54 GB (the runbook's figure"
    )
    assert P.check_disk(fake_system(), "/data", int(53.4e9)).status == P.OK


def gemma_26b_folder(tmp_path):
    from gemma_nb.params import GEMMA4_26B_CONFIG_PATH

    folder = tmp_path / "gemma"
    folder.mkdir()
    (folder / "config.json").write_text(GEMMA4_26B_CONFIG_PATH.read_text())
    for name in ("tokenizer.json", "tokenizer_config.json", "model.safetensors"):
        (folder / name).write_text("{}")
    return folder


def test_the_disk_checked_is_the_runbook_s_figure_for_the_step(tmp_path):
    from gemma_nb.memory import load_gemma4_26b_config
    from gemma_nb.tools import plan as planner
    from gemma_nb.tools import runbook

    needs = planner.disk_needs(load_gemma4_26b_config(), planner.rehearsal_record())
    folder = gemma_26b_folder(tmp_path)
    for step, key in (("compile", "compile_disk_bytes"), ("deploy", "serve_disk_bytes")):
        disk = next(
            c
            for c in P.run_checks("cpu", str(folder), step=step, system=fake_system())
            if c.name == "disk"
        )
        assert disk.detail.endswith(f"needs ~{needs[key] / GB:.1f} GB")
    figures = runbook.figures()
    # the EBS volume: what the step writes, which preflight checks, and the swapfile
    swap = figures["serve_swap_gib"] * GiB
    assert figures["serve_disk_gb"] == -(-(needs["serve_disk_bytes"] + swap) // GB)
    assert (
        "500 GB"
        not in P.check_disk(
            fake_system(disk_free=lambda p: 0), "/data", needs["compile_disk_bytes"]
        ).fix
    )


def test_model_folder_complete_or_not(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    for name in (
        "config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "model-00001-of-00002.safetensors",
    ):
        (folder / name).write_text("{}")
    index = {
        "weight_map": {
            "a": "model-00001-of-00002.safetensors",
            "b": "model-00002-of-00002.safetensors",
        }
    }
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    missing = P.check_model(fake_system(), str(folder))
    assert missing.status == P.FAIL and "model-00002-of-00002" in missing.detail
    (folder / "model-00002-of-00002.safetensors").write_text("{}")
    assert P.check_model(fake_system(), str(folder)).status == P.OK
    (folder / "tokenizer.json").unlink()
    assert "tokenizer" in P.check_model(fake_system(), str(folder)).detail


def test_hf_token_only_for_a_hub_id_and_never_printed():
    secret = "hf_dontprintme"
    with_token = P.check_model(fake_system(env={"HF_TOKEN": secret}), "google/gemma-4-26B-A4B-it")
    assert with_token.status == P.OK and secret not in with_token.detail
    without = P.check_model(fake_system(), "google/gemma-4-26B-A4B-it")
    assert without.status == P.WARN and "export HF_TOKEN" in without.fix
    local = P.check_model(fake_system(), str(CHECKPOINT_DIR))
    assert local.status == P.OK and "HF_TOKEN" not in local.detail


def test_neuron_checklist_on_an_inf2_xlarge_blocks_the_26b_compile_on_ram(tmp_path):
    checks = P.run_checks("neuron", str(gemma_26b_folder(tmp_path)), system=fake_system())
    assert [c.name for c in checks] == [
        "sdk",
        "versions",
        "neuron_cores",
        "model",
        "host_memory",
        "disk",
    ]
    blocker = P.first_blocker(checks)
    assert blocker.name == "host_memory" and "228.0 GiB" in blocker.detail
    text = P.format_checks(checks, "neuron")
    assert text.splitlines()[-1].startswith("BLOCKED by host_memory")


def test_cpu_checklist_passes_on_fakes():
    checks = P.run_checks("cpu", system=fake_system())
    assert P.first_blocker(checks) is None and {c.name for c in checks} == {
        "model",
        "host_memory",
        "disk",
    }


def test_a_tp_the_model_cannot_take_is_a_blocker():
    from gemma_nb.tiny import BUNDLED_ID

    checks = P.run_checks("neuron", BUNDLED_ID, tp=3, system=fake_system())
    plan = next(c for c in checks if c.name == "plan")
    assert plan.status == P.FAIL and plan.detail.startswith(
        "tp=3 does not divide num_attention_heads=4"
    )


def test_a_bad_artifact_is_a_blocker(tmp_path):
    checks = P.run_checks("cpu", artifact=str(tmp_path / "missing"), system=fake_system())
    assert P.first_blocker(checks).name == "artifact"


def test_cli_here(capsys):
    assert cli(["preflight", "--target", "cpu"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "ready: no blocker found"
    assert cli(["preflight", "--target", "neuron"]) == 1
    last = capsys.readouterr().out.splitlines()[-1]
    assert last.startswith("BLOCKED by sdk: torch-neuronx, neuronx-distributed not installed")
    assert "pip install -r envs/neuron/requirements.txt" in last
    assert cli(["preflight", "--target", "tpu"]) == 2
    assert "target 'tpu'" in capsys.readouterr().err


@pytest.mark.parametrize(
    "text, expected",
    [
        (INF2_XLARGE_LS, [(2, 32 * GiB, False)]),
        (json.dumps([{"nc_count": 2, "memory_size": 1, "emulated": True}]), [(2, 1, True)]),
    ],
)
def test_parse_neuron_ls(text, expected):
    assert P.parse_neuron_ls(text) == expected
