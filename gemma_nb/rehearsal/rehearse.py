"""``make rehearse``: every command of the runbook's steps 2-9 (``docs/inf2.md``; not the
optional 5a), in order and as written but for the declared ``substitutions``, on this cpu at the
SDK's torch (``.venv-xla``) against the emulated SDK: each box a shell kept from command to command,
with its RAM + swap at the 26B's scale. The record (``outputs/neuron-rehearsal/rehearsal.json``)
must match ``docs/rehearsal.json``'s disk figures."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import openai
import torch

from gemma_nb import memory
from gemma_nb.endpoint import wait_until_healthy
from gemma_nb.hardware import GB, GiB
from gemma_nb.neuron.build_folder import DECODE_PATHS, read_artifact
from gemma_nb.neuron.checkpoint import read_hf_state, text_config
from gemma_nb.paths import REPO_ROOT
from gemma_nb.peak_rss import HostMemorySampler
from gemma_nb.ranks import free_port
from gemma_nb.rehearsal import host
from gemma_nb.tiny import BUNDLED_TP2_ID, TP2_CHECKPOINT_DIR
from gemma_nb.tools import plan as planner
from gemma_nb.tools import runbook

SDK_PATH = Path(__file__).resolve().parent / "sdk_path"
REHEARSAL_DIR = REPO_ROOT / "outputs" / "neuron-rehearsal"
# each box's folder, relative to the repository: its outputs (GEMMA_NB_OUTPUTS), the serving box's
# shell too
BOXES = {
    "compile": "outputs/neuron-rehearsal/compile-box",
    "serving": "outputs/neuron-rehearsal/serving-box",
}
MODEL_COPY = "outputs/neuron-rehearsal/data/gemma-4-26b-a4b-it"
RECORD = "rehearsal.json"
PROMPT, API_KEY = "The capital of France is", "rehearsal-key"
SDK_TORCH = "2.9.0"


def runbook_commands(text: str) -> list[tuple[int, str]]:
    """(step, command) for every line of the code blocks of steps 2-9, in order; not the optional
    5a, notebook 02 on the cpu target, whose code path the reference run executes."""
    commands, step = [], 0
    for line in text.splitlines():
        if heading := re.match(r"## (\d+)(a?)\. ", line):
            step = 0 if heading.group(2) else int(heading.group(1))
        elif 2 <= step <= 9 and re.match(r" {4}\S", line):
            commands.append((step, line.strip()))
    return commands


def substitutions(port: int) -> list[tuple[str, str]]:
    """What the rehearsal changes in a runbook command (from -> to); where two match at one place,
    the first."""
    sdk = "$PWD/gemma_nb/rehearsal/sdk_path"
    return [
        ("/opt/aws_neuronx_venv_pytorch_2_9", ".venv-xla"),
        ("git clone <this repository> gemma-nb && cd gemma-nb", "cd ."),
        (
            "pip install -r envs/neuron/requirements.txt",
            f"export PYTHONPATH={sdk}:$PYTHONPATH PATH={sdk}/bin:$PATH",
        ),
        ("<your token>", "rehearsal-token"),
        (
            f"hf download {runbook.HUB_ID} --local-dir {runbook.MODEL_DIR}",
            f"mkdir -p {Path(MODEL_COPY).parent} && cp -r "
            f"{TP2_CHECKPOINT_DIR.relative_to(REPO_ROOT)} {MODEL_COPY}",
        ),
        (runbook.MODEL_DIR, MODEL_COPY),
        (
            f" {runbook.OUTPUTS}/ <serving-box>:gemma-nb/",
            f" {BOXES['compile']}/neuron/ {BOXES['serving']}/",
        ),
        ("<a key>", API_KEY),
        ("<the server's key>", API_KEY),
        ("--host 0.0.0.0 --port 8080", f"--host 127.0.0.1 --port {port}"),
        ("<serving-box>:8080", f"127.0.0.1:{port}"),
    ]


def box_of(step: int, command: str) -> str:
    """Steps 2-6 and the copy run on the compile box; the copy's preflight and steps 8-9 on the
    serving box."""
    return "serving" if step >= 8 or "--artifact" in command else "compile"


def box_environments() -> dict:
    """Per box, what the rehearsal sets in its shell's environment: its outputs folder, the emulated
    NeuronCores and its host memory at the 26B's scale (the runbook's recipe), no hub, no timing."""
    # an HBM budget the smoke build fills as the 26B's fills a core (16 GiB), and the allowance
    plan = memory.plan(text_config(TP2_CHECKPOINT_DIR), 2, planner.DEFAULT_SCHEME)
    plan_26b = memory.plan(memory.load_gemma4_26b_config(), 2, planner.DEFAULT_SCHEME)
    hbm = int(plan.total_bytes * 16 * GiB / plan_26b.total_bytes)
    host_26b = planner.host_needs(memory.load_gemma4_26b_config())
    tiny = planner.device_weight_bytes(text_config(TP2_CHECKPOINT_DIR))
    ledger = dict(
        scale=host_26b["model_pt_bytes"] / tiny, compile_bytes=host_26b["compile_peak_bytes"]
    )
    budgets = {"compile": host_26b["compile_bytes"], "serving": host_26b["deploy_bytes"]}
    return {
        box: {
            "GEMMA_NB_OUTPUTS": "outputs" if box == "serving" else BOXES[box],
            "GEMMA_NB_EMULATED_HBM_BYTES": str(hbm),
            "GEMMA_NB_EMULATED_RUNTIME_BYTES": str(plan.bytes("runtime_allowance")),
            host.ENV: json.dumps({"budget_bytes": budget, **ledger}),
            "HF_HUB_OFFLINE": "1",
            # the emulated NeuronCores are threads: one cpu thread each (~3x faster on 2 cores)
            "OMP_NUM_THREADS": "1",
            "GEMMA_NB_TIMING": "smoke",  # timing loops run once: a rehearsal times nothing
        }
        for box, budget in budgets.items()
    }


class Rehearsal:
    """Each box's shell (environment and folder, kept from command to command) and the record of
    every command run."""

    def __init__(self, port: int):
        self.torch, self.port, self.steps, self.server = torch.__version__, port, [], None
        self.boxes = box_environments()
        self.shells = {"compile": {"env": {**os.environ, **self.boxes["compile"]}, "cwd": "."}}

    def entry(self, step: int, command: str) -> dict:
        """The record of ``command``: the substitutions that applied and the command as run."""
        pairs = dict(substitutions(self.port))  # at once: no substitute is substituted again
        pattern = "|".join(re.escape(old) for old in pairs)
        applied = {}

        def substitute(match) -> str:
            applied[match.group()] = pairs[match.group()]
            return applied[match.group()]

        as_run = re.sub(pattern, substitute, command)
        box = box_of(step, command)
        if box not in self.shells:  # the compile box's install, in the serving box's folder
            self.shells[box] = {"env": dict(self.shells["compile"]["env"]), "cwd": BOXES[box]}
            (REPO_ROOT / BOXES[box]).mkdir(parents=True, exist_ok=True)
        entry = {"step": step, "box": box, "runbook_command": command}
        return entry | {"substitutions": applied, "as_run": as_run, "torch": self.torch}

    def start(self, entry: dict) -> tuple[subprocess.Popen, Path]:
        """``as_run`` in its box's shell (bash), which writes its environment and folder after."""
        shell, logs = self.shells[entry["box"]], REHEARSAL_DIR / "host" / str(len(self.steps))
        logs.parent.mkdir(parents=True, exist_ok=True)
        script = (
            f'{entry["as_run"]}\nstatus=$?\nenv -0 > "{logs}.env"\npwd > "{logs}.cwd"\nexit $status'
        )
        process = subprocess.Popen(
            ["bash", "-c", script],
            cwd=REPO_ROOT / shell["cwd"],
            env={**shell["env"], **self.boxes[entry["box"]], host.LOG_ENV: str(logs)},
            stdout=open(f"{logs}.log", "w"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        budget = json.loads(self.boxes[entry["box"]][host.ENV])["budget_bytes"]
        self.steps.append(entry | {"host_budget_gb": round(budget / GB, 1)})
        return process, logs

    def finish(self, entry: dict, logs: Path, returncode: int, seconds: float, rss: int) -> None:
        """Record how ``entry`` ended (its box's shell carried on); raise if it failed."""
        shell = self.shells[entry["box"]]
        if Path(f"{logs}.env").is_file():
            pairs = Path(f"{logs}.env").read_text().split("\0")
            shell["env"] = dict(p.split("=", 1) for p in pairs if "=" in p and p[0] != "_")
            shell["cwd"] = os.path.relpath(Path(f"{logs}.cwd").read_text().strip(), REPO_ROOT)
        peaks = [json.loads(p.read_text())["peak_bytes"] for p in logs.glob("*.json")]
        entry |= {
            "status": "failed" if returncode else "ok",
            "seconds": round(seconds, 1),
            "host_peak_gb": round(max([rss, *peaks]) / GB, 1),
        }
        print(
            f"[rehearse] {entry['status']} in {seconds:.1f} s: {entry['as_run']}", file=sys.stderr
        )
        if returncode:
            tail = Path(f"{logs}.log").read_text()[-4000:]
            entry["detail"] = tail
            raise RuntimeError(f"step {entry['step']} failed (exit {returncode}):\n{tail}")

    def run(self, step: int, command: str, timeout_s: float = 1200) -> None:
        process, logs = self.start(self.entry(step, command))
        with HostMemorySampler(interval_s=0.5, pid=process.pid) as sampler:
            returncode = process.wait(timeout=timeout_s)
        self.finish(self.steps[-1], logs, returncode, sampler.wall_s, sampler.peak_rss_bytes)

    def serve(self, step: int, command: str) -> str:
        """Start the server in the background; its answer to ``PROMPT`` by the openai client."""
        started = time.perf_counter()
        process, logs = self.start(self.entry(step, command))
        self.server = (process, self.steps[-1], logs, started)
        url = f"http://127.0.0.1:{self.port}/v1"
        wait_until_healthy(url, timeout_s=300, process=process, log_path=Path(f"{logs}.log"))
        client = openai.OpenAI(base_url=url, api_key=API_KEY, max_retries=0, timeout=120)
        reply = client.chat.completions.create(
            model=client.models.list().data[0].id,
            temperature=0,
            max_tokens=8,
            messages=[{"role": "user", "content": PROMPT}],
        )
        self.steps[-1]["answer"] = reply.choices[0].message.content
        return self.steps[-1]["answer"]

    def stop_server(self) -> None:
        """The server stopped as Ctrl-C stops it, and how it ended recorded."""
        if self.server is not None:
            process, entry, logs, started = self.server
            os.killpg(process.pid, signal.SIGTERM)
            stopped = process.wait(timeout=60) in (0, -signal.SIGTERM)
            self.finish(entry, logs, 0 if stopped else 1, time.perf_counter() - started, 0)


def builds_record(serving: Path, compiled: Path) -> dict:
    """Per build (the serving box's copies): flags, SDK, files, workdir on the compile box,
    answer."""
    deployed = json.loads((serving / "metrics" / "05_slim_deploy.json").read_text())["metrics"]
    answers = {row["build"]: row["completion"] for row in deployed["neuron"]}
    builds = {}
    for decode in DECODE_PATHS:
        artifact = read_artifact(serving / "artifacts" / f"04_neuron_{decode}")
        files, folder = artifact.manifest["files"], artifact.folder.name
        workdir = json.loads((compiled / folder / "build_record.json").read_text())
        builds[decode] = {
            "compiler_args": artifact.record["build"]["compiler_args"],
            "sdk": artifact.record["sdk"],
            "artifact_files_bytes": files,
            "artifact_bytes": sum(files.values()),
            "compiler_workdir_bytes": workdir["compiler_workdir_bytes"],
            "answer": answers[folder],
        }
    return builds


def disk_drift(record: dict, committed: dict | None) -> list[str]:
    """Builds whose bytes on disk differ by more than 1% from the committed record's (the runbook's
    basis)."""
    if committed is None:
        return ["docs/rehearsal.json is missing"]
    drift = []
    for name, build in record["builds"].items():
        before = committed["builds"].get(name, {}).get("artifact_bytes", 0)
        if abs(build["artifact_bytes"] - before) > 0.01 * max(before, 1):
            drift.append(
                f"{name}: {build['artifact_bytes']:,} bytes on disk, docs/rehearsal.json says "
                f"{before:,}"
            )
    return drift


def rehearse() -> dict:
    """Every command in order (module docstring); the record, also written to
    ``REHEARSAL_DIR/rehearsal.json``."""
    if torch.__version__.split("+")[0] != SDK_TORCH:
        raise RuntimeError(
            f"the rehearsal runs at the SDK's torch {SDK_TORCH}, not {torch.__version__}: "
            "run it in .venv-xla (make rehearse)"
        )
    shutil.rmtree(REHEARSAL_DIR, ignore_errors=True)
    rehearsal = Rehearsal(free_port())
    # what the planner scales the builds by (planner.disk_needs): the smoke checkpoint's device
    # weight bytes (the planner's, as for the 26B) and its embedding table as stored (fp32)
    table = read_hf_state(
        TP2_CHECKPOINT_DIR, only=lambda name: name == "model.embed_tokens.weight"
    )["model.embed_tokens.weight"]
    record = {
        "emulated_sdk": "gemma_nb.rehearsal: torch-neuronx and neuronx-distributed on the cpu",
        "torch": rehearsal.torch,
        "model_id": BUNDLED_TP2_ID,
        "boxes": {
            box: {"folder": BOXES[box], "environment": env} for box, env in rehearsal.boxes.items()
        },
        "scale": {
            "device_weight_bytes": planner.device_weight_bytes(text_config(TP2_CHECKPOINT_DIR)),
            "embedding_table_bytes": table.numel() * table.element_size(),
        },
        "steps": rehearsal.steps,
    }
    started = time.perf_counter()
    try:
        for step, command in runbook_commands(runbook.RUNBOOK_PATH.read_text()):
            if " gemma_nb serve " in command:
                record["serve"] = {"answer": rehearsal.serve(step, command)}
            else:
                rehearsal.run(step, command)
        serving = REPO_ROOT / BOXES["serving"] / "outputs" / "neuron"
        record["builds"] = builds_record(
            serving, REPO_ROOT / BOXES["compile"] / "neuron" / "artifacts"
        )
    finally:
        rehearsal.stop_server()
        record["seconds"] = round(time.perf_counter() - started, 1)
        (REHEARSAL_DIR / RECORD).write_text(json.dumps(record, indent=2) + "\n")
    return record


def main() -> int:
    try:
        record = rehearse()
    except (RuntimeError, subprocess.TimeoutExpired) as error:
        print(
            f"rehearsal failed: {error}\nthe record so far: "
            f"{(REHEARSAL_DIR / RECORD).relative_to(REPO_ROOT)}",
            file=sys.stderr,
        )
        return 1
    drift = disk_drift(record, planner.rehearsal_record())
    print(
        f"rehearsal: {len(record['steps'])} commands ok in {record['seconds']:.0f} s on torch "
        f"{record['torch']}",
        file=sys.stderr,
    )
    if drift:
        print(
            "the builds on disk no longer match docs/rehearsal.json, the runbook's disk basis: "
            + "; ".join(drift)
            + f"\nrefresh it: cp {(REHEARSAL_DIR / RECORD).relative_to(REPO_ROOT)} "
            "docs/rehearsal.json && python -m gemma_nb runbook",
            file=sys.stderr,
        )
    return 1 if drift else 0
