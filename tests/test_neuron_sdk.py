"""The Neuron SDK import check, with fakes of the import system (no SDK here)."""

import pytest
import torch

from gemma_nb.neuron import sdk
from gemma_nb.neuron.expert_mlps import import_nxd
from gemma_nb.targets import TargetError

INSTALLED = {"torch_neuronx": object(), "neuronx_distributed": object()}


def fx_error():
    return ModuleNotFoundError(f"No module named '{sdk.FX_MODULE}'", name=sdk.FX_MODULE)


def fake_importer(modules, fail_until_stand_in=False, other_error=None):
    def import_module(name):
        if other_error is not None and name == "neuronx_distributed":
            raise other_error
        if fail_until_stand_in and name == "neuronx_distributed" and sdk.FX_MODULE not in modules:
            raise fx_error()
        return object()

    return import_module


def test_missing_packages_are_the_only_sdk_missing_case():
    status = sdk.check_sdk(find_spec=lambda name: None, import_module=fake_importer({}), modules={})
    assert status.missing == ["torch-neuronx", "neuronx-distributed"] and not status.ok
    assert "torch-neuronx, neuronx-distributed" in status.message()
    assert "envs/neuron/requirements.txt" in status.message()


def test_the_fx_problem_is_detected_worked_around_and_not_called_missing():
    modules = {}
    status = sdk.check_sdk(
        find_spec=INSTALLED.get,
        import_module=fake_importer(modules, fail_until_stand_in=True),
        modules=modules,
    )
    assert status.ok and status.fx_problem and not status.missing
    assert "not installed" not in status.message() and "transformers 5 removed" in status.message()
    assert getattr(modules[sdk.FX_MODULE], "__gemma_nb_stand_in__", False)


def test_another_import_error_is_reported_as_such():
    status = sdk.check_sdk(
        find_spec=INSTALLED.get,
        modules={},
        import_module=fake_importer({}, other_error=ImportError("libnrt.so.1: cannot open")),
    )
    assert not status.ok and not status.missing and not status.fx_problem
    assert "libnrt.so.1" in status.message()


def test_the_stand_in_lets_nxd_define_its_tracer_class_and_refuses_to_trace():
    modules = {}
    assert sdk.install_fx_stand_in(modules) is True
    module = modules[sdk.FX_MODULE]

    class NxDTracer(torch.fx.Tracer):  # NxD 0.18 pipeline/trace.py's shape of the class statement
        pass

    class HFTracerWrapper(NxDTracer, module.HFTracer):
        def __init__(self):
            super().__init__()

    with pytest.raises(RuntimeError, match="transformers.utils.fx"):
        HFTracerWrapper()


def test_the_stand_in_never_replaces_a_real_module():
    real = object()
    modules = {sdk.FX_MODULE: real}
    assert sdk.install_fx_stand_in(modules) is False and modules[sdk.FX_MODULE] is real


def test_import_sdk_here_names_the_packages_and_the_install_step():
    with pytest.raises(ImportError, match=r"torch-neuronx, neuronx-distributed.*pip index"):
        sdk.import_sdk()
    with pytest.raises(TargetError, match=r"torch-neuronx, neuronx-distributed.*pip index"):
        import_nxd()


def test_only_the_fx_import_error_gets_the_stand_in():
    other = ModuleNotFoundError("No module named 'torch_xla'", name="torch_xla")
    status = sdk.check_sdk(
        find_spec=INSTALLED.get, modules={}, import_module=fake_importer({}, other_error=other)
    )
    assert not status.ok and not status.fx_problem and "torch_xla" in status.message()
