"""gemma_nb.neuron.lowering's plain-Python helpers (the XLA runs themselves are in tests/xla)."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from gemma_nb.rehearsal import lowering

# A small HLO module in torch-xla's text form: a reduction sub-computation and an entry with a
# gather, a tuple-shaped instruction and the ROOT tuple.
HLO = """HloModule IrToHlo.20, entry_computation_layout={(f32[8,4]{1,0}, s64[2]{0})->(f32[4]{0})}

%AddComputation.10 (x.11: f32[], y.12: f32[]) -> f32[] {
  %x.11 = f32[] parameter(0)
  %y.12 = f32[] parameter(1)
  ROOT %add.13 = f32[] add(f32[] %x.11, f32[] %y.12)
}

ENTRY %IrToHlo.20 (p0.1: f32[8,4], p1.2: s64[2]) -> (f32[4]) {
  %p0.1 = f32[8,4]{1,0} parameter(0)
  %p1.2 = s64[2]{0} parameter(1)
  %reshape.3 = s64[2,1]{1,0} reshape(s64[2]{0} %p1.2)
  %gather.4 = f32[2,4]{1,0} gather(f32[8,4]{1,0} %p0.1, s64[2,1]{1,0} %reshape.3), offset_dims={1}, \
collapsed_slice_dims={0}, start_index_map={0}, index_vector_dim=1, slice_sizes={1,4}
  %pair.5 = (f32[2,4]{1,0}, s64[2]{0}) tuple(f32[2,4]{1,0} %gather.4, s64[2]{0} %p1.2)
  %get-tuple-element.6 = f32[2,4]{1,0} get-tuple-element((f32[2,4]{1,0}, s64[2]{0}) %pair.5), index=0
  %constant.7 = f32[] constant(0)
  %reduce.8 = f32[4]{0} reduce(f32[2,4]{1,0} %get-tuple-element.6, f32[] %constant.7), dimensions={0}, to_apply=%AddComputation.10
  ROOT %tuple.9 = (f32[4]{0}) tuple(f32[4]{0} %reduce.8)
}
"""  # noqa: E501 (HLO text as torch-xla prints it)


def test_hlo_opcodes_reads_every_instruction_of_every_computation():
    assert lowering.hlo_opcodes(HLO) == [
        "parameter",
        "parameter",
        "add",
        "parameter",
        "parameter",
        "reshape",
        "gather",
        "tuple",
        "get-tuple-element",
        "constant",
        "reduce",
        "tuple",
    ]


def test_hlo_counts_counts_instructions_and_gathers():
    assert lowering.hlo_counts(HLO) == {
        "hlo_instructions": 12,
        "gathers": 1,
        "weight_gathers": 1,
        "weight_gathers_leading_axis": 1,
    }
    two_gathers = HLO.replace(
        "%pair.5 = (f32[2,4]{1,0}, s64[2]{0}) tuple(",
        "%pair.5 = (f32[2,4]{1,0}, s64[2]{0}) gather(",
    )
    assert lowering.hlo_counts(two_gathers)["gathers"] == 2


# torch-xla's text of the two ways of picking K=2 experts' down weights out of a stacked int8
# tensor: expert-major [E, I, H] (whole experts, the leading axis) and the [H, E, I] view indexed on
# its middle axis.
LEADING = (
    "  %gather.7 = s8[2,16,128]{2,1,0} gather(s8[32,16,128]{2,1,0} %p74.781, s64[2,1]{1,0} "
    "%c.780), offset_dims={1,2}, collapsed_slice_dims={0}, start_index_map={0}, "
    "index_vector_dim=1, slice_sizes={1,16,128}"
)
MIDDLE = (
    "  %gather.9 = s8[128,2,16]{2,1,0} gather(s8[128,32,16]{2,1,0} %p74.781, s64[2,1]{1,0} "
    "%c.780), offset_dims={0,2}, collapsed_slice_dims={1}, start_index_map={1}, "
    "index_vector_dim=1, slice_sizes={128,1,16}"
)
ACTIVATION = (
    "  %gather.5 = bf16[1,1,128]{2,1,0} gather(bf16[1,1,128]{2,1,0} %convert.5314, s32[1,1]{1,0} "
    "%c.18), offset_dims={0,2}, collapsed_slice_dims={1}, start_index_map={1}, "
    "index_vector_dim=1, slice_sizes={1,1,128}"
)


def test_hlo_gathers_tell_whole_experts_on_the_leading_axis_from_a_middle_axis_gather():
    text = "\n".join(
        [
            "ENTRY %e (p74.781: s8[32,16,128]) -> s8[] {",
            "  %p74.781 = s8[32,16,128]{2,1,0} parameter(0)",
            LEADING,
            MIDDLE,
            ACTIVATION,
            "}",
        ]
    )
    leading, middle, activation = lowering.hlo_gathers(text)
    assert leading == {
        "operand_shape": [32, 16, 128],
        "of_parameter": True,
        "start_index_map": [0],
        "slice_sizes": [1, 16, 128],
    }
    assert lowering.takes_whole_leading_slices(leading) and not lowering.takes_whole_leading_slices(
        middle
    )
    assert middle["start_index_map"] == [1] and not activation["of_parameter"]
    counts = lowering.hlo_counts(text)
    assert (counts["gathers"], counts["weight_gathers"], counts["weight_gathers_leading_axis"]) == (
        3,
        2,
        1,
    )


# torch-xla's text of a decode step's KV update written two ways, as the step's output 0 aliasing
# the state parameter: one position scattered into it, and the whole state rewritten (the one-hot
# formula: state * keep + update).
KV_WRITES = """ENTRY %IrToHlo.13 (p0.1: bf16[1,4,1,64], p1.3: s32[1,1], p2.7: f32[1,4,512,64]) -> (f32[1,4,512,64], f32[1,4,512,64], f32[1,4,512,64]) {
  %p2.7 = f32[1,4,512,64]{3,2,1,0} parameter(2)
  %p1.3 = s32[1,1]{1,0} parameter(1)
  %convert.6 = s64[1]{0} convert(s32[1,1]{1,0} %p1.3)
  %p0.1 = bf16[1,4,1,64]{3,2,1,0} parameter(0)
  %convert.2 = f32[1,4,1,64]{3,2,1,0} convert(bf16[1,4,1,64]{3,2,1,0} %p0.1)
  %scatter.11 = f32[1,4,512,64]{3,2,1,0} scatter(f32[1,4,512,64]{3,2,1,0} %p2.7, s64[1]{0} %convert.6, f32[1,4,1,64]{3,2,1,0} %convert.2), update_window_dims={0,1,3}, inserted_window_dims={2}, scatter_dims_to_operand_dims={2}, index_vector_dim=1, to_apply=%ScatterCombiner.8
  %add.12 = f32[1,4,512,64]{3,2,1,0} add(f32[1,4,512,64]{3,2,1,0} %p2.7, f32[1,4,512,64]{3,2,1,0} %p2.7)
  %scatter.14 = f32[1,4,512,64]{3,2,1,0} scatter(f32[1,4,512,64]{3,2,1,0} %add.12, s64[1]{0} %convert.6, f32[1,4,1,64]{3,2,1,0} %convert.2), update_window_dims={0,1,3}, inserted_window_dims={2}, scatter_dims_to_operand_dims={2}, index_vector_dim=1, to_apply=%ScatterCombiner.8
  ROOT %tuple.15 = (f32[1,4,512,64]{3,2,1,0}, f32[1,4,512,64]{3,2,1,0}, f32[1,4,512,64]{3,2,1,0}) tuple(f32[1,4,512,64]{3,2,1,0} %scatter.11, f32[1,4,512,64]{3,2,1,0} %add.12, f32[1,4,512,64]{3,2,1,0} %scatter.14)
}
"""  # noqa: E501 (HLO text as torch-xla prints it)


def test_state_write_fraction_counts_a_scatter_into_the_state_as_its_update_alone():
    # [1, 4, 1, 64] of [1, 4, 512, 64]: one slot of 512, in place
    assert lowering.hlo_state_write_fraction(KV_WRITES, [0]) == 1 / 512
    # the whole state computed anew, and a scatter into that new tensor: written whole
    assert lowering.hlo_state_write_fraction(KV_WRITES, [1]) == 1.0
    assert lowering.hlo_state_write_fraction(KV_WRITES, [2]) == 1.0
    assert lowering.hlo_state_write_fraction(KV_WRITES, [0, 1]) == (1 / 512 + 1) / 2


def test_aten_fallbacks_keeps_only_aten_counters_sorted():
    names = [
        "xla::add",
        "aten::nonzero",
        "CreateXlaTensor",
        "aten::_local_scalar_dense",
        "MarkStep",
    ]
    assert lowering.aten_fallbacks(names) == ["aten::_local_scalar_dense", "aten::nonzero"]
    assert lowering.aten_fallbacks(["xla::mm", "ExecuteComputation"]) == []


def test_tolerance_is_ulps_of_the_largest_logit():
    assert lowering.ulp(12.0, torch.bfloat16) == 2.0 ** (3 - 7)
    assert lowering.ulp(-0.75, torch.float32) == 2.0 ** (-1 - 23)
    assert lowering.ulp(0.0, torch.bfloat16) == 0.0
    logits = torch.tensor([[1.0, -12.0, 3.0]])
    assert lowering.tolerance(logits, torch.bfloat16) == 32 * 2.0**-4
    assert lowering.tolerance(logits, torch.float32) == 64 * 2.0**-20


def _row(**changes):
    row = dict(
        graph="decode",
        tp=1,
        experts="dense",
        aten_fallbacks=[],
        device_to_host_transfers=0,
        xla_executions=1,
        error=None,
        max_abs_diff=0.0625,
        tolerance=0.5,
        max_abs_diff_fp32=2e-6,
        tolerance_fp32=3e-5,
    )
    return {**row, **changes}


def test_lowered_cleanly_fails_on_any_fallback_transfer_extra_graph_error_or_drift():
    assert lowering.lowered_cleanly([_row(), _row(graph="prefill")])
    assert not lowering.lowered_cleanly([])
    for bad in (
        dict(aten_fallbacks=["aten::nonzero"]),
        dict(device_to_host_transfers=1),
        dict(xla_executions=2),
        dict(error="NotImplementedError: histc"),
        dict(max_abs_diff=0.75),
        dict(max_abs_diff_fp32=1e-4),
    ):
        assert not lowering.lowered_cleanly([_row(), _row(**bad)]), bad


def test_xla_python_names_the_fix_when_the_environment_is_missing(tmp_path, monkeypatch):
    monkeypatch.delenv(lowering.XLA_PYTHON_ENV, raising=False)
    with pytest.raises(FileNotFoundError, match=r"make xla"):
        lowering.xla_python(tmp_path)
    venv_python = tmp_path / ".venv-xla" / "bin" / "python"
    venv_python.parent.mkdir(parents=True)
    venv_python.touch()
    assert lowering.xla_python(tmp_path) == venv_python
    monkeypatch.setenv(lowering.XLA_PYTHON_ENV, sys.executable)
    assert lowering.xla_python(tmp_path) == Path(sys.executable)


def test_run_in_xla_env_reports_the_subprocess_error(monkeypatch):
    # The main environment has no torch_xla: the check fails there with the hint, surfaced as
    # RuntimeError.
    if importlib.util.find_spec("torch_xla") is not None:
        pytest.skip(
            "torch_xla is importable here; the failure path needs an interpreter without it"
        )
    monkeypatch.setenv(lowering.XLA_PYTHON_ENV, sys.executable)
    with pytest.raises(RuntimeError, match="torch_xla"):
        lowering.run_in_xla_env(timeout_s=120)
