"""The neuron graphs on the XLA cpu device at the Neuron SDK 2.31's torch (run in .venv-xla: `make test-xla`)."""

import os

os.environ.setdefault("PJRT_DEVICE", "CPU")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch_xla  # noqa: E402

from gemma_nb.neuron import lowering  # noqa: E402



@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    # tests/conftest.py's one_thread needs gemma_nb.bench (pandas), not installed here.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def shipped():
    return lowering.shipped_graphs()


@pytest.fixture(scope="module")
def contrast():
    return {row["experts"]: row for row in lowering.contrast_graphs()}


def test_the_environment_is_the_sdk_s_torch():
    assert lowering.versions() == {"torch": "2.9.0", "torch-xla": "2.9.0", "transformers": "5.24.0"}


def test_every_graph_the_build_traces_is_checked(shipped):
    assert [(row["graph"], row["tp"], row["experts"]) for row in shipped] == [
        ("prefill", 1, "dense"), ("decode", 1, "dense"),
    ]
    assert [row["tokens"] for row in shipped] == [128, 1]


@pytest.mark.parametrize("index", [0, 1])
def test_graph_lowers_to_one_xla_graph_with_no_fallback_or_transfer(shipped, index):
    row = shipped[index]
    assert row["error"] is None
    assert row["aten_fallbacks"] == []
    assert row["device_to_host_transfers"] == 0
    assert row["xla_executions"] == 1
    assert row["hlo_instructions"] > 1000
    assert 0 <= row["max_abs_diff"] <= row["tolerance"]
    assert lowering.lowered_cleanly([row])


def test_in_fp32_the_lowered_prefill_equals_eager_to_float_rounding():
    config, state, build = lowering._tiny()
    build.dtype = "float32"
    module = lowering._cpu_module(config, state, build, "dense")
    row = lowering.lower_step(module, lowering.prefill_inputs(config, state, build), torch.float32, graph="prefill")
    assert row["aten_fallbacks"] == [] and row["device_to_host_transfers"] == 0
    assert row["max_abs_diff"] <= row["tolerance"] < 1e-4


def test_the_check_catches_host_syncs_and_failing_fallbacks(contrast):
    sparse = contrast["sparse (cpu)"]
    assert sparse["aten_fallbacks"] == ["aten::_local_scalar_dense"]
    assert sparse["device_to_host_transfers"] > 0 and sparse["xla_executions"] > 1
    assert not lowering.lowered_cleanly([sparse])
    default = contrast["transformers (cpu)"]
    assert default["aten_fallbacks"] == ["aten::histc"] and "histogram_cpu" in default["error"]


def test_hlo_counts_read_torch_xla_s_own_text():
    device = torch_xla.device()
    table = torch.arange(32.0, device=device).view(8, 4)
    picked = table[torch.tensor([1, 6], device=device)].sum(0)
    counts = lowering.hlo_counts(torch_xla._XLAC._get_xla_tensors_hlo([picked]))
    assert counts["gathers"] == 1 and counts["hlo_instructions"] > 5
    assert picked.cpu().tolist() == [28.0, 30.0, 32.0, 34.0]
