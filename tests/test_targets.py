"""Which model a target runs by default, and where its checkpoint folder is."""

import pytest

from gemma_nb import targets, tiny
from gemma_nb.targets import TargetError


def test_default_model_per_target():
    assert targets.default_model_id("cpu") == targets.default_model_id("cuda") == tiny.BUNDLED_ID
    assert targets.default_model_id("neuron") == tiny.BUNDLED_TP2_ID
    assert targets.neuron_checkpoint_dir("/data/gemma", "neuron") == "/data/gemma"
    with pytest.raises(TargetError, match="'tpu'.*cpu, neuron, cuda"):
        targets.default_model_id("tpu")


def test_local_model_dir():
    assert targets.local_model_dir(tiny.BUNDLED_ID) == tiny.CHECKPOINT_DIR
    assert targets.local_model_dir(tiny.BUNDLED_TP2_ID) == tiny.TP2_CHECKPOINT_DIR
    assert targets.local_model_dir("google/gemma-4-26B-A4B-it") is None
    assert str(targets.local_model_dir("/data/nowhere")) == "/data/nowhere"


def test_neuron_checkpoint_dir():
    assert targets.neuron_checkpoint_dir("anything", override="/data/x") == "/data/x"
    with pytest.raises(TargetError, match="download google/gemma-4-26B-A4B-it --local-dir"):
        targets.neuron_checkpoint_dir("google/gemma-4-26B-A4B-it")
    assert targets.neuron_checkpoint_dir(tiny.BUNDLED_ID) == str(tiny.TP2_CHECKPOINT_DIR)


def test_the_port_imports_the_sdk_and_says_when_it_worked_around(monkeypatch, capsys):
    from gemma_nb.neuron import sdk

    monkeypatch.setattr(targets.importlib.util, "find_spec", lambda name: object())  # installed
    monkeypatch.setattr(sdk, "check_sdk", lambda: sdk.SdkStatus(fx_problem=True))
    assert sdk.check_target_with_sdk("neuron") == "neuron"
    assert sdk.FX_NOTE in capsys.readouterr().err
    monkeypatch.setattr(
        sdk, "check_sdk", lambda: sdk.SdkStatus(error="import neuronx_distributed: OSError: libnrt")
    )
    assert targets.check_target("neuron") == "neuron"  # the library alone imports no SDK
    with pytest.raises(TargetError, match="libnrt"):
        sdk.check_target_with_sdk("neuron")
