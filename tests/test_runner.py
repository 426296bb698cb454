"""The papermill runner: target checks, notebook selection, and that failures keep old outputs."""

import json

import nbformat
import pytest

from gemma_nb import runner
from gemma_nb.targets import TargetError, check_target, check_target_name


def _write_notebook(folder, name, body):
    nb = nbformat.v4.new_notebook()
    params = nbformat.v4.new_code_cell('target = "cpu"')
    params.metadata["tags"] = ["parameters"]
    nb.cells = [params, nbformat.v4.new_code_cell(body)]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, folder / name)


SAVE_METRICS = (
    "from gemma_nb.metrics import save_metrics, headline\n"
    "save_metrics(target, '{stem}', {{'answer': 42}}, headline=[headline('answer', 42, 'x')])\n"
    "print('ran', target)"
)


@pytest.fixture
def notebooks(tmp_path):
    folder = tmp_path / "notebooks"
    folder.mkdir()
    _write_notebook(folder, "01_first.ipynb", SAVE_METRICS.format(stem="01_first"))
    _write_notebook(folder, "02_second.ipynb", SAVE_METRICS.format(stem="02_second"))
    return folder


def test_unknown_target_is_named():
    with pytest.raises(TargetError, match="target 'tpu' is not one of cpu, neuron, cuda"):
        check_target_name("tpu")


def test_neuron_without_sdk_says_what_is_missing():
    with pytest.raises(TargetError, match="torch_neuronx.*Neuron SDK 2.31"):
        check_target("neuron")


def test_cuda_without_gpu_fails_before_any_notebook(notebooks, tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(TargetError, match="needs a CUDA GPU"):
        runner.run("cuda", output_dir=tmp_path / "out", notebooks_dir=notebooks, progress=False)
    assert not (tmp_path / "out").exists()


def test_select_by_number_and_unknown_selector(notebooks):
    found = runner.discover_notebooks(notebooks)
    assert [p.stem for p in runner.select_notebooks(found, "2")] == ["02_second"]
    assert [p.stem for p in runner.select_notebooks(found, "02,01")] == ["01_first", "02_second"]
    with pytest.raises(runner.RunError, match="'07' matches no notebook; available: 01_first, 02_second"):
        runner.select_notebooks(found, "07")


def test_run_writes_notebooks_summary_and_report(notebooks, tmp_path):
    out = tmp_path / "out"
    results = runner.run("cpu", output_dir=out, notebooks_dir=notebooks, progress=False)
    assert [r.name for r in results] == ["01_first", "02_second"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["notebooks"]["02_second"]["metrics"] == {"answer": 42}
    report = (out / "REPORT.md").read_text()
    assert "| answer | 42 | x |" in report
    assert [line for line in report.splitlines() if line.startswith("## ")] == ["## 01_first", "## 02_second"]
    executed = nbformat.read(out / "01_first.ipynb", as_version=4)
    assert "ran cpu" in executed.cells[-1].outputs[0]["text"]
    assert executed.metadata["papermill"]["output_path"] == "01_first.ipynb"  # no machine paths


def test_failed_run_keeps_previous_outputs(notebooks, tmp_path):
    out = tmp_path / "out"
    runner.run("cpu", output_dir=out, notebooks_dir=notebooks, progress=False)
    before = (out / "REPORT.md").read_text()
    _write_notebook(notebooks, "02_second.ipynb", "raise ValueError('boom at cell two')")
    with pytest.raises(runner.RunError, match=r"notebook 02_second failed in cell \d+.*ValueError: boom at cell two"):
        runner.run("cpu", only="02", output_dir=out, notebooks_dir=notebooks, progress=False)
    assert (out / "REPORT.md").read_text() == before
    assert json.loads((out / "summary.json").read_text())["notebooks"]["02_second"]["metrics"] == {"answer": 42}
    assert (tmp_path / ".out.failed" / "02_second.ipynb").exists()
    assert not list(tmp_path.glob(".out.tmp-*"))


def test_report_has_one_section_per_notebook_even_with_two_metrics_files(tmp_path):
    folder = tmp_path / "notebooks"
    folder.mkdir()
    body = SAVE_METRICS.format(stem="07_first") + "\n" + SAVE_METRICS.format(stem="07_extra").replace("'answer'", "'extra'")
    _write_notebook(folder, "07_first.ipynb", body)
    out = tmp_path / "out"
    runner.run("cpu", output_dir=out, notebooks_dir=folder, progress=False)
    report = (out / "REPORT.md").read_text()
    assert [line for line in report.splitlines() if line.startswith("## ")] == ["## 07_first"]
    assert "Also written: `metrics/07_extra.json`" in report and "| extra | 42 | x |" in report
