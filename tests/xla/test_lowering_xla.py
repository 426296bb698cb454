"""The neuron graphs on the XLA cpu device at the Neuron SDK 2.31's torch (run in .venv-xla: `make
test-xla`).

One lowering of every graph (module-scoped, ~1 min on 2 cores), then the checks per graph.
"""

import os

os.environ.setdefault("PJRT_DEVICE", "CPU")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch_xla  # noqa: E402

from gemma_nb.rehearsal import lowering  # noqa: E402

GRAPHS = [
    (graph, tp, experts)
    for tp in (1, 2)
    for graph, experts in (
        ("prefill", "dense"),
        ("decode", "dense"),
        ("decode", "sparse"),
        ("lm_head", None),
    )
]


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    # one thread for every lowering of this module, as on the 2-core box
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def shipped():
    return {(row["graph"], row["tp"], row["experts"]): row for row in lowering.shipped_graphs()}


@pytest.fixture(scope="module")
def contrast():
    return {row["experts"]: row for row in lowering.contrast_graphs()}


def test_the_environment_is_the_sdk_s_torch():
    # what lowering.report records as its versions
    from gemma_nb.neuron.build import (
        package_versions,
    )

    assert package_versions(("torch", "torch-xla", "transformers")) == {
        "torch": "2.9.0",
        "torch-xla": "2.9.0",
        "transformers": "5.24.0",
    }


def test_every_graph_the_build_traces_is_checked_at_tp_1_and_2(shipped):
    assert list(shipped) == GRAPHS
    assert [row["tokens"] for row in shipped.values()] == [128, 1, 1, 1] * 2
    # compiled by XLA's cpu backend without LLVM's optimizations (read when the client starts)
    assert lowering.CPU_BACKEND_FLAG in os.environ["XLA_FLAGS"].split()


@pytest.mark.parametrize("key", GRAPHS, ids=lambda key: "-".join(map(str, key)))
def test_graph_lowers_to_one_xla_graph_with_no_fallback_or_transfer(shipped, key):
    row = shipped[key]
    assert row["error"] is None
    assert row["aten_fallbacks"] == []
    assert row["device_to_host_transfers"] == 0
    assert row["xla_executions"] == 1
    assert row["dtype"] == "bfloat16"
    assert 0 <= row["max_abs_diff"] <= row["tolerance"]
    assert 0 <= row["max_abs_diff_fp32"] <= row["tolerance_fp32"]
    assert lowering.lowered_cleanly([row])


def test_selective_loading_gathers_whole_experts_on_the_leading_axis(shipped):
    """The sparse decode's weight gathers take whole experts (the leading axis of the expert-major
    weights and scales), four per layer: gate_up and down, each with its scales; no weight is
    gathered along a middle axis (a DMA of thousands of small pieces per token on the 26B)."""
    from gemma_nb.neuron.build import text_config
    from gemma_nb.tiny import TP2_CHECKPOINT_DIR

    layers = text_config(TP2_CHECKPOINT_DIR).num_hidden_layers
    for tp in (1, 2):
        dense, sparse = shipped[("decode", tp, "dense")], shipped[("decode", tp, "sparse")]
        assert sparse["weight_gathers"] - dense["weight_gathers"] == 4 * layers
        assert sparse["weight_gathers_leading_axis"] == sparse["weight_gathers"]
        # the router's per-expert scale
        assert dense["weight_gathers_leading_axis"] == dense["weight_gathers"]
        assert shipped[("lm_head", tp, None)]["gathers"] == 0


def test_each_step_writes_only_its_own_slots_of_the_kv_state(shipped):
    """The KV update is a scatter into the aliased state: a decode step writes one slot of 512, the
    prefill its 128-token bucket (an update computed anew would write all of the state)."""
    for tp in (1, 2):
        assert shipped[("prefill", tp, "dense")]["kv_write_fraction"] == 128 / 512
        for experts in ("dense", "sparse"):
            assert shipped[("decode", tp, experts)]["kv_write_fraction"] == 1 / 512
        assert shipped[("lm_head", tp, None)]["kv_write_fraction"] is None


def test_the_check_catches_host_syncs_and_failing_fallbacks(contrast):
    sparse = contrast["sparse (cpu)"]
    # it copies each token's expert ids to the host (tolist): no aten fallback, a transfer and a cut
    assert sparse["aten_fallbacks"] == []
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
