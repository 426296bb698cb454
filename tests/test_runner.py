"""The papermill runner: target checks, notebook selection, and that failures keep old outputs."""

import json
import shutil

import nbformat
import pytest

from gemma_nb.targets import TargetError, check_target, check_target_name
from gemma_nb.tools import run as runner


def _write_notebook(folder, name, body):
    nb = nbformat.v4.new_notebook()
    params = nbformat.v4.new_code_cell('target = "cpu"')
    params.metadata["tags"] = ["parameters"]
    nb.cells = [params, nbformat.v4.new_code_cell(body)]
    nb.metadata["kernelspec"] = {
        "name": "python3",
        "display_name": "Python 3",
        "language": "python",
    }
    nbformat.write(nb, folder / name)


SAVE_METRICS = (
    "from gemma_nb.metrics import save_metrics, headline\n"
    "save_metrics(target, '{stem}', {{'answer': 42}}, headline=[headline('answer', 42, 'x')])\n"
    "print('ran', target)"
)


def _two_notebooks(folder):
    folder.mkdir()
    _write_notebook(folder, "01_first.ipynb", SAVE_METRICS.format(stem="01_first"))
    _write_notebook(folder, "02_second.ipynb", SAVE_METRICS.format(stem="02_second"))
    return folder


@pytest.fixture
def notebooks(tmp_path):
    return _two_notebooks(tmp_path / "notebooks")


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    """The two notebooks run once, the second also writing a second metrics file: each kernel
    imports gemma_nb (seconds), so the tests below read this run, or run again on a copy of it."""
    folder = _two_notebooks(tmp_path_factory.mktemp("first_run") / "notebooks")
    extra = SAVE_METRICS.format(stem="02_extra").replace("'answer'", "'extra'")
    _write_notebook(folder, "02_second.ipynb", SAVE_METRICS.format(stem="02_second") + "\n" + extra)
    out = folder.parent / "out"
    results = runner.run("cpu", output_dir=out, notebooks_dir=folder, progress=False)
    return out, results


def test_unknown_target_is_named():
    with pytest.raises(TargetError, match="'tpu'.*cpu, neuron, cuda"):
        check_target_name("tpu")


def test_neuron_without_sdk_says_what_is_missing():
    with pytest.raises(TargetError, match="torch_neuronx.*Neuron SDK 2.31"):
        check_target("neuron")


def test_cuda_without_gpu_fails_before_any_notebook(notebooks, tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(TargetError, match="CUDA GPU"):
        runner.run("cuda", output_dir=tmp_path / "out", notebooks_dir=notebooks, progress=False)
    assert not (tmp_path / "out").exists()


def test_select_by_number_and_unknown_selector(notebooks):
    found = runner.discover_notebooks(notebooks)
    assert [p.stem for p in runner.select_notebooks(found, "2")] == ["02_second"]
    assert [p.stem for p in runner.select_notebooks(found, "02,01")] == ["01_first", "02_second"]
    with pytest.raises(ValueError, match="'07'.*available: 01_first, 02_second"):
        runner.select_notebooks(found, "07")


def test_run_writes_notebooks_summary_and_report(first_run):
    out, results = first_run
    assert [r.name for r in results] == ["01_first", "02_second"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["notebooks"]["02_second"]["metrics"] == {"answer": 42}
    report = (out / "REPORT.md").read_text()
    assert "| answer | 42 | x |" in report
    assert [line for line in report.splitlines() if line.startswith("## ")] == [
        "## 01_first",
        "## 02_second",
    ]
    executed = nbformat.read(out / "01_first.ipynb", as_version=4)
    assert "ran cpu" in executed.cells[-1].outputs[0]["text"]
    assert executed.metadata["papermill"]["output_path"] == "01_first.ipynb"  # no machine paths
    # the installed kernel's spec, as JupyterLab writes it on opening, not the source's "Python 3"
    assert (
        executed.metadata["kernelspec"]
        == runner.kernelspec_metadata()
        != {"name": "python3", "display_name": "Python 3", "language": "python"}
    )
    injected = [c for c in executed.cells if "injected-parameters" in c.metadata.get("tags", [])]
    # papermill's random id would differ per run
    assert [c.id for c in injected] == ["injected-parameters"]


def test_failed_run_keeps_previous_outputs(first_run, notebooks, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(first_run[0], out)
    before = (out / "REPORT.md").read_text()
    _write_notebook(notebooks, "02_second.ipynb", "raise ValueError('boom at cell two')")
    with pytest.raises(
        runner.RunError,
        match=r"02_second.*cell \d+.*ValueError: boom",
    ):
        runner.run("cpu", only="02", output_dir=out, notebooks_dir=notebooks, progress=False)
    assert (out / "REPORT.md").read_text() == before
    assert json.loads((out / "summary.json").read_text())["notebooks"]["02_second"]["metrics"] == {
        "answer": 42
    }
    assert (tmp_path / ".out.failed" / "02_second.ipynb").exists()
    assert not list(tmp_path.glob(".out.tmp-*"))


# ---------------------------------------------------------------- refusing what the run cannot
# honour


PARAMETERS = (
    'target = "cpu"\ncontext_len = 512\nmodel_id = "gemma-nb/tiny-gemma4-moe"\nartifact_dir = ""'
)


@pytest.fixture
def parameterised(tmp_path):
    folder = tmp_path / "pnotebooks"
    folder.mkdir()
    nb = nbformat.v4.new_notebook()
    params = nbformat.v4.new_code_cell(PARAMETERS)
    params.metadata["tags"] = ["parameters"]
    nb.cells = [params, nbformat.v4.new_code_cell("print(model_id)")]
    nbformat.write(nb, folder / "01_only.ipynb")
    return folder


def test_unknown_parameter_names_the_closest_known_one(parameterised, tmp_path):
    assert runner.notebook_parameters(parameterised / "01_only.ipynb") == [
        "target",
        "context_len",
        "model_id",
        "artifact_dir",
    ]
    with pytest.raises(
        ValueError,
        match=r"-p contxt_len.*'context_len'\?.*artifact_dir, context_len, model_id",
    ):
        runner.run(
            "cpu",
            output_dir=tmp_path / "out",
            notebooks_dir=parameterised,
            parameters={"contxt_len": 5},
        )
    assert not (tmp_path / "out").exists()


def test_cli_refuses_a_typo_and_an_empty_only(capsys):
    from gemma_nb.cli import main

    assert main(["run", "--only", "01", "-p", "contxt_len", "5"]) == 2
    assert "'context_len'?" in capsys.readouterr().err
    for only in (",", "", " , "):
        assert main(["run", "--only", only]) == 2
        assert "--only" in capsys.readouterr().err


def test_relative_paths_are_the_callers(parameterised, tmp_path, monkeypatch):
    (tmp_path / "models" / "mine").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    seen = {}

    def pretend_to_execute(notebook, staging, target, parameters, progress):
        seen.update(parameters)
        shutil.copy(notebook, staging / notebook.name)

    monkeypatch.setattr(runner, "execute_one", pretend_to_execute)
    runner.run(
        "cpu",
        output_dir="out",
        notebooks_dir=parameterised,
        progress=False,
        parameters={"model_id": "models/mine", "artifact_dir": "build/neuron", "context_len": 64},
    )
    assert seen == {
        "model_id": str(tmp_path / "models" / "mine"),
        "artifact_dir": str(tmp_path / "build" / "neuron"),
        "context_len": 64,
    }
    assert (tmp_path / "out" / "summary.json").exists()  # output_dir too is relative to the caller
    # A hub id that is not a local folder stays a hub id.
    assert runner.resolve_path_parameters({"model_id": "google/gemma-4-26B-A4B-it"}) == {
        "model_id": "google/gemma-4-26B-A4B-it"
    }


def test_stale_staging_of_dead_processes_is_removed(parameterised, tmp_path, monkeypatch):
    import subprocess
    import sys

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # its pid is now free
    stale, live = tmp_path / f".out.tmp-{dead.pid}", tmp_path / ".out.tmp-1"
    for folder in (stale, live):
        folder.mkdir()
    monkeypatch.setattr(
        runner,
        "execute_one",
        lambda notebook, staging, *_: shutil.copy(notebook, staging / notebook.name),
    )
    runner.run("cpu", output_dir=tmp_path / "out", notebooks_dir=parameterised, progress=False)
    assert not stale.exists() and live.exists()  # pid 1 is alive


def test_sigterm_removes_staging_and_keeps_previous_outputs(tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import time

    folder = tmp_path / "slow"
    folder.mkdir()
    marker = tmp_path / "started"
    _write_notebook(
        folder, "01_slow.ipynb", f"import time\nopen({str(marker)!r}, 'w').close()\ntime.sleep(120)"
    )
    out = tmp_path / "out"
    out.mkdir()
    (out / "REPORT.md").write_text("previous run")
    code = (
        "import sys\nfrom gemma_nb.tools import run as runner\n"
        f"runner.run('cpu', output_dir={str(out)!r}, notebooks_dir={str(folder)!r}, progress=False)"
    )
    process = subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not marker.exists():
        assert process.poll() is None and time.monotonic() < deadline, (
            process.stderr.read() if process.poll() else ""
        )
        time.sleep(0.1)
    os.kill(process.pid, signal.SIGTERM)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode != 0 and "SIGTERM" in stderr
    assert (out / "REPORT.md").read_text() == "previous run"
    assert not list(tmp_path.glob(".out.tmp-*"))


def test_report_has_one_section_per_notebook_even_with_two_metrics_files(first_run):
    report = (first_run[0] / "REPORT.md").read_text()
    assert [line for line in report.splitlines() if line.startswith("## ")] == [
        "## 01_first",
        "## 02_second",
    ]
    assert "Also written: `metrics/02_extra.json`" in report and "| extra | 42 | x |" in report


def test_a_partial_run_links_the_previous_artifacts_and_copies_the_rest(tmp_path):
    """--only on the serving box must not need room for a second copy of a compiled model, and a
    writer that starts its artifact folder afresh never writes through to the previous run's
    files."""
    from gemma_nb.paths import fresh_dir

    final = tmp_path / "outputs" / "neuron"
    (final / "artifacts" / "04_neuron_dense").mkdir(parents=True)
    (final / "metrics").mkdir()
    model = final / "artifacts" / "04_neuron_dense" / "model.pt"
    model.write_bytes(b"compiled model")
    (final / "metrics" / "05_slim_deploy.json").write_text("{}")
    staging, _ = runner._staging_for(final, keep_previous=True)
    linked = staging / "artifacts" / "04_neuron_dense" / "model.pt"
    assert linked.stat().st_ino == model.stat().st_ino  # the same file: no second copy on disk
    assert (staging / "metrics" / "05_slim_deploy.json").stat().st_ino != (
        final / "metrics" / "05_slim_deploy.json"
    ).stat().st_ino
    (fresh_dir(linked.parent) / "model.pt").write_bytes(b"rebuilt")
    assert model.read_bytes() == b"compiled model"


def test_the_neuron_target_and_an_endpoint_run_skip_the_cells_tagged_cpu_measurement(tmp_path):
    """A neuron run spends its time on the device, an endpoint run on the server: the cpu
    measurements are skipped, the rest runs."""
    from gemma_nb.targets import CPU_MEASUREMENT_TAG

    nb = nbformat.v4.new_notebook()
    params = nbformat.v4.new_code_cell('target = "cpu"')
    params.metadata["tags"] = ["parameters"]
    measured = nbformat.v4.new_code_cell("raise RuntimeError('a cpu measurement ran on ' + target)")
    measured.metadata["tags"] = [CPU_MEASUREMENT_TAG]
    nb.cells = [params, measured, nbformat.v4.new_code_cell("print('ran', target)")]
    nb.metadata["kernelspec"] = {
        "name": "python3",
        "display_name": "Python 3",
        "language": "python",
    }
    source = tmp_path / "04_x.ipynb"
    nbformat.write(nb, source)
    with pytest.raises(Exception, match="a cpu measurement ran on cpu"):
        runner.execute_one(source, tmp_path, "cpu", {"endpoint": ""}, progress=False)
    for target, parameters in (("neuron", {}), ("cpu", {"endpoint": "http://127.0.0.1:9/v1"})):
        staging = tmp_path / target
        staging.mkdir()
        runner.execute_one(source, staging, target, parameters, progress=False)
        executed = nbformat.read(staging / source.name, as_version=4)
        assert executed.cells[2].outputs == []
        assert f"ran {target}" in executed.cells[3].outputs[0]["text"]


def test_report_writes_a_claim_as_its_source_wrote_it(tmp_path):
    summary = {
        "target": "cpu",
        "notebooks": {
            "01_memory_arithmetic": {
                "headline": [
                    {
                        "name": "overflow",
                        "value": -0.651,
                        "unit": "GB",
                        "claim": "int8_experts_gap_gb",
                        "claimed": 3.5,
                    },
                    {"name": "bit-exact", "value": True, "unit": ""},
                ]
            }
        },
    }
    (tmp_path / "01_memory_arithmetic.ipynb").write_text("{}")
    report = runner.write_report(tmp_path, summary).read_text()
    assert "| overflow | -0.651 | GB | 3-4 GB |" in report  # the quoted range, not its midpoint
    assert "| bit-exact | yes |  |  |" in report


@pytest.mark.parametrize(
    "manager, interrupts", [("AsyncKernelManager", True), ("QuietShutdownKernelManager", False)]
)
def test_the_runner_shuts_its_kernels_down_without_an_interrupt(manager, interrupts, monkeypatch):
    """jupyter_client sends SIGINT before its shutdown request; a kernel still finishing a message
    logs it as "ERROR | KeyboardInterrupt caught in kernel." at the end of a good run. The runner's
    manager asks the kernel to shut down and sends no signal."""
    import asyncio
    import signal

    from jupyter_client.manager import AsyncKernelManager

    cls = (
        AsyncKernelManager if manager == "AsyncKernelManager" else runner.QuietShutdownKernelManager
    )
    signals = []
    original = AsyncKernelManager._async_signal_kernel

    async def record(self, signum):
        signals.append(signum)
        await original(self, signum)

    monkeypatch.setattr(AsyncKernelManager, "_async_signal_kernel", record)

    async def start_and_stop():
        km = cls(kernel_name=runner.KERNEL_NAME)
        await km.start_kernel()
        try:
            client = km.client()
            client.start_channels()
            await client.wait_for_ready(timeout=60)
            client.stop_channels()
        finally:
            await km.shutdown_kernel()
        return await km.is_alive()

    assert asyncio.run(start_and_stop()) is False
    assert (signal.SIGINT in signals) is interrupts
