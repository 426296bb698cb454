"""The command line's edges: every bad input is refused with its value and its fix (exit 2), never a
traceback; ``--help`` loads none of the heavy packages; the repo is found from the package."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

import gemma_nb
from gemma_nb import cli as commands
from gemma_nb.cli import main as cli
from gemma_nb.paths import REPO_ROOT
from gemma_nb.tools import run as runner

HEAVY = ("torch", "transformers", "papermill", "fastapi", "matplotlib")
GEMMA4_26B = REPO_ROOT / "gemma_nb" / "configs" / "gemma4_26b_a4b.json"
MIXTRAL = {
    "model_type": "mixtral",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "vocab_size": 1000,
    "intermediate_size": 96,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
}


def outcome(capsys, argv: list[str]) -> tuple[int, str]:
    """(exit status, stderr) of the command line, argparse's refusals included."""
    try:
        code = cli(argv)
    except SystemExit as exit_info:
        code = exit_info.code
    return code, capsys.readouterr().err


def fresh_python(code: str, cwd: Path | str = REPO_ROOT) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "HF_HUB_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


@pytest.mark.parametrize("command", ["", *commands.COMMANDS])
def test_help_imports_none_of_the_heavy_packages(command):
    argv = [command, "--help"] if command else ["--help"]
    done = fresh_python(
        "import sys\nfrom gemma_nb.cli import main\ntry:\n"
        f"    main({argv!r})\nexcept SystemExit as exit_info:\n"
        "    assert exit_info.code == 0, exit_info.code\n"
        f"print(sorted(set({HEAVY!r}) & set(sys.modules)), file=sys.stderr)"
    )
    assert done.returncode == 0 and "usage: python -m gemma_nb" in done.stdout, done.stderr
    assert done.stderr.strip() == "[]", f"--help of {command or 'the CLI'} imported {done.stderr}"


def test_a_command_s_module_is_imported_when_it_runs_and_has_a_main():
    for command, (module, _) in commands.COMMANDS.items():
        assert callable(__import__(module, fromlist=["main"]).main), command


def write_config(tmp_path, **changes) -> str:
    raw = {**json.loads(GEMMA4_26B.read_text()), **changes}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    return str(tmp_path / "config.json")


@pytest.mark.parametrize(
    "changes, names",
    [
        ({"hidden_size": -4096}, ["hidden_size is -4096", "JSON integer from 1"]),
        ({"hidden_size": "4096"}, ["hidden_size is '4096'", 'not "4096"']),
        ({"num_experts": 4.5}, ["num_experts is 4.5", "fix the config"]),
        ({"layer_types": 7}, ["transformers refuses this gemma4_text config"]),
        ({"model_type": ["gemma4_text"]}, ["model_type", "add one (e.g. 'gemma4_text'"]),
        # a typo's million layers: refused before the planner builds them (minutes, ~100 GB)
        ({"num_hidden_layers": 10**6}, ["num_hidden_layers is 1000000", "from 1 to 4096"]),
    ],
)
def test_configs_with_wrong_types_or_signs_are_refused(tmp_path, capsys, changes, names):
    code, err = outcome(capsys, ["plan", write_config(tmp_path, **changes)])
    assert code == 2 and "Traceback" not in err
    assert all(name in err for name in names), err


def test_more_experts_per_token_than_experts_is_refused(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({**MIXTRAL, "num_experts_per_tok": 16}))
    code, err = outcome(capsys, ["plan", str(tmp_path)])
    assert code == 2 and "routes each token to 16 of 8 experts" in err
    assert "set num_experts_per_tok (or top_k_experts) between 1 and 8" in err


def test_a_binary_or_huge_file_is_named_not_decoded(tmp_path, capsys):
    (tmp_path / "config.json").write_bytes(b"\xff\xfe\x00garbage\x80")
    code, err = outcome(capsys, ["plan", str(tmp_path)])
    assert code == 2 and "config.json is not UTF-8 text (byte 0)" in err
    weights = tmp_path / "model.safetensors"
    with weights.open("wb") as file:
        file.truncate(20_000_000)  # sparse: 20 MB on paper, nothing on disk
    code, err = outcome(capsys, ["plan", str(weights)])
    assert code == 2 and "model.safetensors is 20,000,000 bytes, not a config.json" in err


@pytest.mark.parametrize("value", ["1e308", "inf", "nan", "-1", "three"])
def test_an_impossible_runtime_allowance_is_refused_by_the_parser(capsys, value):
    code, err = outcome(capsys, ["plan", str(GEMMA4_26B), "--runtime-allowance", value])
    assert (
        code == 2 and f"argument --runtime-allowance: {value!r} is not a runtime allowance" in err
    )
    assert "pass GB per NeuronCore" in err


def test_preflight_names_an_index_without_weight_map(tmp_path, capsys):
    for name in ("config.json", "tokenizer_config.json", "tokenizer.json"):
        (tmp_path / name).write_text("{}")
    (tmp_path / "config.json").write_text(GEMMA4_26B.read_text())
    for index in ('{"metadata": {}}', "[1, 2]", "\xff not json"):
        (tmp_path / "model.safetensors.index.json").write_text(index)
        assert cli(["preflight", "--target", "cpu", "--model-id", str(tmp_path)]) == 1
        out = capsys.readouterr().out
        assert "model.safetensors.index.json holds no weight_map of shard file names" in out


def test_preflight_refuses_cuda_without_a_gpu(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert cli(["preflight", "--target", "cuda"]) == 1
    last = capsys.readouterr().out.splitlines()[-1]
    assert last.startswith("BLOCKED by gpu: torch sees no CUDA GPU on this machine")
    assert "run on a GPU machine with a CUDA build of torch" in last


def test_run_refuses_an_output_dir_under_a_file(tmp_path, capsys):
    (tmp_path / "a-file").write_text("not a folder")
    code, err = outcome(capsys, ["run", "--only", "01", "--output-dir", str(tmp_path / "a-file/x")])
    assert code == 2 and "is a file, not a folder; pass a folder" in err and "Traceback" not in err


def test_run_refuses_bad_input_with_2_and_a_target_parameter(capsys):
    code, err = outcome(capsys, ["run", "--target", "tpu"])
    assert code == 2 and "'tpu'" in err and "cpu, neuron, cuda" in err
    code, err = outcome(capsys, ["run", "-p", "target", "cuda"])
    assert code == 2 and "-p target is not a notebook parameter: use --target" in err


def test_ctrl_c_in_run_prints_a_clean_line(monkeypatch, capsys):
    def interrupted(**_):
        raise KeyboardInterrupt

    monkeypatch.setattr(runner, "run", interrupted)
    assert cli(["run"]) == 130
    err = capsys.readouterr().err
    assert err.startswith("interrupted (Ctrl-C)") and err.count("\n") == 1  # one line, no traceback


def test_a_signal_between_the_renames_waits_until_the_new_outputs_are_in(tmp_path, monkeypatch):
    """SIGTERM lands after the old outputs are moved aside: it takes effect once the new ones are
    in, so outputs/<target> is never missing."""
    notebooks = tmp_path / "notebooks"
    notebooks.mkdir()
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("x = 1")])
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3"}
    notebook.metadata["kernelspec"]["language"] = "python"
    nbformat.write(notebook, notebooks / "01_one.ipynb")
    out = tmp_path / "out"
    out.mkdir()
    (out / "REPORT.md").write_text("previous run")
    rename = Path.rename

    def rename_then_sigterm(path, target):
        moved = rename(path, target)
        if path == out:  # the old outputs just went aside
            signal.raise_signal(signal.SIGTERM)
        return moved

    monkeypatch.setattr(Path, "rename", rename_then_sigterm)
    with pytest.raises(runner.Terminated):
        runner.run("cpu", output_dir=out, notebooks_dir=notebooks, progress=False)
    assert "previous run" not in (out / "REPORT.md").read_text()  # the new run, whole


def test_the_repo_is_the_package_s_folder_from_any_working_directory(tmp_path):
    assert REPO_ROOT == Path(gemma_nb.__file__).resolve().parent.parent
    done = fresh_python(
        "import sys\nfrom gemma_nb.cli import main\nsys.exit(main(['runbook', '--check']))",
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-2000:]


def test_the_sdk_image_is_told_one_install(capsys):
    """The runbook's install step everywhere: never ``pip install -e .`` over the SDK's packages."""
    requirements = (REPO_ROOT / "envs" / "neuron" / "requirements.txt").read_text()
    assert "sh envs/neuron/install.sh" in requirements and "pip install -e" not in requirements
    assert cli(["preflight", "--target", "neuron"]) == 1
    last = capsys.readouterr().out.splitlines()[-1]
    assert "then sh envs/neuron/install.sh" in last and "pip install -e" not in last


def test_serve_says_where_the_readme_s_artifact_comes_from(capsys):
    code, err = outcome(capsys, ["serve", "--artifact", "outputs/cpu/artifacts/no_such_build"])
    assert code == 2 and "04_tiny is made by make run" in err
    readme = (REPO_ROOT / "README.md").read_text()
    line = next(line for line in readme.splitlines() if "--artifact outputs/cpu/artifacts" in line)
    assert "make run" in line


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--max-context", "-5"], "argument --max-context: '-5' is not an integer >= 2"),
        (["--queue-size", "0"], "argument --queue-size: '0' is not an integer >= 1"),
        (["--port", "70000"], "argument --port: '70000' is not a TCP port (0-65535)"),
        (["--body-timeout-s", "1e308"], "'1e308' is not a number of seconds from 0.001 to 86400"),
    ],
)
def test_serve_checks_its_numbers_before_anything_starts(capsys, flags, message):
    code, err = outcome(capsys, ["serve", *flags])
    assert code == 2 and message in err


def test_preflight_refuses_tp_zero(capsys):
    code, err = outcome(capsys, ["preflight", "--target", "cpu", "--tp", "0"])
    assert code == 2 and "--tp: '0'" in err and ">= 1" in err
