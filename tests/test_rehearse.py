"""make rehearse runs the runbook's own commands, and its record is the runbook's disk basis."""

import re
import subprocess

from gemma_nb.paths import REPO_ROOT
from gemma_nb.rehearsal import rehearse as R
from gemma_nb.tools import plan as planner
from gemma_nb.tools import runbook


def _as_in_the_runbook(command: str) -> str:
    """A rehearsal command with its own folders and address put back to the runbook's."""
    command = command.split("  (as: ")[0]
    command = re.sub(r" --output-dir outputs/neuron-rehearsal(-serving)?$", "", command)
    command = command.replace("outputs/neuron-rehearsal-serving", runbook.OUTPUTS)
    return re.sub(r"--host 127\.0\.0\.1 --port \d+", "--host 0.0.0.0 --port 8080", command)


def test_every_rehearsed_step_is_a_runbook_command_and_every_one_passed():
    record, text = planner.rehearsal_record(), runbook.render()
    names = [step["name"] for step in record["steps"]]
    assert names == [
        "install",
        "preflight",
        "smoke run",
        "copy",
        "preflight the copied artifacts",
        "deploy and benchmark",
        "serve",
    ]
    for step in record["steps"]:
        assert step["status"] == "ok" and step["torch"].startswith(R.SDK_TORCH)
        assert f"    {_as_in_the_runbook(step['command'])}\n" in text, step["command"]
    assert {b["answer"] for b in record["builds"].values()} == {"Paris ."} and "Paris" in record[
        "serve"
    ]["answer"]
    for name, build in record["builds"].items():
        assert build["routed_by_the_emulated_runtime"] == {
            "prefill": "prefill",
            "decode": f"decode_{name}",
        }
        assert build["sdk"].startswith("emulated SDK")


def test_the_rehearsal_writes_into_its_own_ignored_folders():
    for folder in (R.SMOKE_DIR, R.SERVING_DIR):
        assert folder.name != "neuron" and folder.parent == REPO_ROOT / "outputs"
        ignored = subprocess.run(["git", "check-ignore", "-q", str(folder / "x")], cwd=REPO_ROOT)
        assert ignored.returncode == 0, f"{folder} is not git-ignored"


def test_a_build_that_changed_on_disk_is_reported_with_the_fix():
    committed = planner.rehearsal_record()
    same = {"builds": {n: dict(b) for n, b in committed["builds"].items()}}
    assert R.disk_drift(same, committed) == []
    same["builds"]["sparse"]["artifact_bytes"] = int(
        committed["builds"]["sparse"]["artifact_bytes"] * 1.02
    )
    assert R.disk_drift(same, committed)[0].startswith("sparse: ")
    assert R.disk_drift(same, None) == ["docs/rehearsal.json is missing"]
