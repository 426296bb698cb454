"""``make rehearse``: the runbook's commands in order (preflight, smoke run, copy, deploy, the
server asked by the openai client) against the emulated SDK at the SDK's torch (``.venv-xla``); the
record goes to ``outputs/neuron-rehearsal/rehearsal.json`` and must match ``docs/rehearsal.json``'s
disk figures."""

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import openai
import torch

from gemma_nb import memory
from gemma_nb.endpoint import wait_until_healthy
from gemma_nb.hardware import GiB
from gemma_nb.neuron.artifact import DECODE_PATHS, read_artifact
from gemma_nb.neuron.build import NeuronBuildConfig, example_inputs
from gemma_nb.neuron.checkpoint import read_hf_state, text_config
from gemma_nb.paths import OUTPUTS_DIR, REPO_ROOT
from gemma_nb.ranks import free_port
from gemma_nb.rehearsal import nxd_model
from gemma_nb.tiny import BUNDLED_TP2_ID, TP2_CHECKPOINT_DIR
from gemma_nb.tools import plan as planner
from gemma_nb.tools import runbook

SDK_PATH = Path(__file__).resolve().parent / "sdk_path"
SMOKE_DIR = OUTPUTS_DIR / "neuron-rehearsal"
SERVING_DIR = OUTPUTS_DIR / "neuron-rehearsal-serving"
RECORD = "rehearsal.json"
PROMPT, API_KEY = "The capital of France is", "rehearsal-key"
SDK_TORCH = "2.9.0"


def emulated_hbm_bytes() -> tuple[int, int]:
    """(HBM per emulated NeuronCore, the runtime's allowance per loaded model) for the smoke run."""
    tiny = memory.plan(text_config(TP2_CHECKPOINT_DIR), 2, planner.DEFAULT_SCHEME)
    plan_26b = memory.plan(memory.load_gemma4_26b_config(), 2, planner.DEFAULT_SCHEME).total_bytes
    return int(tiny.total_bytes * 16 * GiB / plan_26b), tiny.bytes("runtime_allowance")


def environment(hbm_bytes: int, runtime_bytes: int) -> dict:
    """The subprocesses' environment: the emulated SDK on the path, its budget, no hub, the
    runbook's API key."""
    python_path = os.pathsep.join(
        filter(None, [str(SDK_PATH), str(REPO_ROOT), os.environ.get("PYTHONPATH")])
    )
    return {
        **os.environ,
        "PYTHONPATH": python_path,
        "PATH": os.pathsep.join([str(SDK_PATH / "bin"), os.environ.get("PATH", "")]),
        "GEMMA_NB_EMULATED_HBM_BYTES": str(hbm_bytes),
        "GEMMA_NB_EMULATED_RUNTIME_BYTES": str(runtime_bytes),
        "HF_HUB_OFFLINE": "1",
        "GEMMA_NB_API_KEY": API_KEY,
        # the emulated NeuronCores are threads of one process: one cpu thread each (~3x faster on a
        # 2-core box)
        "OMP_NUM_THREADS": "1",
    }


class Rehearsal:
    """The steps run so far and their record; :meth:`step` runs one command."""

    def __init__(self, env: dict):
        self.env, self.torch, self.steps = env, torch.__version__, []

    def _record(
        self, name: str, command: str, seconds: float, detail: str = "", failure: str = ""
    ) -> None:
        """Record a step, ``failed`` with ``failure`` (then raised as ``RuntimeError``) or
        ``ok``."""
        status = "failed" if failure else "ok"
        self.steps.append(
            {
                "name": name,
                "command": command,
                "status": status,
                "seconds": round(seconds, 1),
                "torch": self.torch,
                **({"detail": detail} if detail else {}),
            }
        )
        print(
            f"[rehearse] {name}: {status} in {seconds:.1f} s: {command}",
            file=sys.stderr,
            flush=True,
        )
        if failure:
            raise RuntimeError(failure)

    def step(self, name: str, command: str, timeout_s: float = 900) -> None:
        """Run a runbook command (``python`` is this interpreter); raise ``RuntimeError`` on
        failure."""
        argv = (
            [sys.executable, *command.split()[1:]]
            if command.startswith("python ")
            else command.split()
        )
        started = time.perf_counter()
        done = subprocess.run(
            argv, cwd=REPO_ROOT, env=self.env, capture_output=True, text=True, timeout=timeout_s
        )
        tail = (done.stdout + done.stderr)[-4000:]
        self._record(
            name,
            command,
            time.perf_counter() - started,
            tail if done.returncode else "",
            f"rehearsal step {name} failed (exit {done.returncode}):\n{tail}"
            if done.returncode
            else "",
        )

    def copy(self, source: Path, target: Path) -> None:
        """Runbook step 7's rsync, as a copy to a fresh folder without the compiler workdir."""
        started = time.perf_counter()
        shutil.rmtree(target, ignore_errors=True)  # a folder left behind fails the copy
        shutil.copytree(source, target, ignore=shutil.ignore_patterns("compiler_workdir", RECORD))
        self._record(
            "copy",
            runbook.COMMANDS["copy"][0] + f"  (as: copy to {target.relative_to(REPO_ROOT)})",
            time.perf_counter() - started,
        )

    def serve(self, artifact: Path) -> str:
        """Runbook step 9's server on loopback, asked the bundled fact by the openai client; its
        answer."""
        port = free_port()
        command = runbook.COMMANDS["serve"][1].replace(
            runbook.ARTIFACT_DIRS["sparse"], str(artifact.relative_to(REPO_ROOT))
        )
        command = command.replace("--host 0.0.0.0 --port 8080", f"--host 127.0.0.1 --port {port}")
        started, log = time.perf_counter(), SMOKE_DIR / "serve.log"
        with open(log, "w") as handle:
            process = subprocess.Popen(
                [sys.executable, *command.split()[1:]],
                cwd=REPO_ROOT,
                env=self.env,
                stdout=handle,
                stderr=subprocess.STDOUT,
            )
        try:
            wait_until_healthy(
                f"http://127.0.0.1:{port}/v1", timeout_s=300, process=process, log_path=log
            )
            client = openai.OpenAI(
                base_url=f"http://127.0.0.1:{port}/v1", api_key=API_KEY, max_retries=0, timeout=120
            )
            reply = client.chat.completions.create(
                model=client.models.list().data[0].id,
                temperature=0,
                max_tokens=8,
                messages=[{"role": "user", "content": PROMPT}],
            )
            answer = reply.choices[0].message.content
        finally:
            process.terminate()
            process.wait(timeout=60)
        self._record(
            "serve",
            command,
            time.perf_counter() - started,
            f"answered {answer!r}",
            "" if "Paris" in answer else f"the server answered {answer!r} to {PROMPT!r}, not Paris",
        )
        return answer


def builds_record(serving: Path) -> dict:
    """Per build (the serving copy's artifacts): decode path, routed graphs, files, workdir on the
    compile box, answer."""
    answers = {
        row["build"]: row["completion"]
        for row in json.loads((serving / "metrics" / "05_slim_deploy.json").read_text())["metrics"][
            "neuron"
        ]
    }
    builds = {}
    for folder in (serving / "artifacts" / f"04_neuron_{decode}" for decode in DECODE_PATHS):
        artifact = read_artifact(folder)
        record, files, build = (
            artifact.record,
            artifact.manifest["files"],
            NeuronBuildConfig(**artifact.record["build"]),
        )
        compiled = json.loads(
            (SMOKE_DIR / "artifacts" / folder.name / "build_record.json").read_text()
        )
        # the graph the emulated runtime's router reaches in model.pt for a prefill and a decode
        # call
        router = nxd_model.executor_from_saved(
            torch.jit.load(str(folder / "model.pt"))
        ).nxd_model.router
        routed = {
            kind: router(example_inputs(artifact.config, build, tokens))[0]
            for kind, tokens in (("prefill", build.bucket), ("decode", 1))
        }
        builds[record["build"]["decode_experts"]] = {
            "decode_experts": record["build"]["decode_experts"],
            "routed_graphs": record["routed_graphs"],
            "routed_by_the_emulated_runtime": routed,
            "graphs": artifact.graphs,
            "compiler_args": record["build"]["compiler_args"],
            "sdk": record["sdk"],
            "artifact_files_bytes": files,
            "artifact_bytes": sum(files.values()),
            "compiler_workdir_bytes": compiled["compiler_workdir_bytes"],
            "answer": answers[folder.name],
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
    """Every step in order (module docstring); the record, also written to
    ``SMOKE_DIR/rehearsal.json``."""
    if torch.__version__.split("+")[0] != SDK_TORCH:
        raise RuntimeError(
            f"the rehearsal runs at the SDK's torch {SDK_TORCH}, not {torch.__version__}: "
            "run it in .venv-xla (make rehearse)"
        )
    hbm, runtime_bytes = emulated_hbm_bytes()
    rehearsal = Rehearsal(environment(hbm, runtime_bytes))
    # make rehearse-env writes the install's seconds
    if (stamp := REPO_ROOT / ".venv-xla" / ".rehearsal-env").is_file():
        rehearsal._record(
            "install",
            runbook.COMMANDS["install"][-1],
            float(stamp.read_text().strip() or 0),
            "seconds of make rehearse-env, when it last ran",
        )
    # what the planner scales the builds by (planner.disk_needs): the smoke checkpoint's device
    # weight bytes (the planner's, as for the 26B) and its embedding table as stored (fp32)
    weights = planner.device_weight_bytes(text_config(TP2_CHECKPOINT_DIR))
    table = read_hf_state(
        TP2_CHECKPOINT_DIR, only=lambda name: name == "model.embed_tokens.weight"
    )["model.embed_tokens.weight"]
    record = {
        "emulated_sdk": "gemma_nb.rehearsal (torch-neuronx and neuronx-distributed emulated on "
        "the cpu)",
        "torch": rehearsal.torch,
        "hbm_bytes_per_core": hbm,
        "runtime_bytes_per_model": runtime_bytes,
        "model_id": BUNDLED_TP2_ID,
        "scale": {
            "device_weight_bytes": weights,
            "embedding_table_bytes": table.numel() * table.element_size(),
        },
        "steps": rehearsal.steps,
    }
    started = time.perf_counter()
    try:
        rehearsal.step("preflight", runbook.COMMANDS["preflight"][0])
        rehearsal.step(
            "smoke run",
            f"{runbook.COMMANDS['smoke'][0]} --output-dir {SMOKE_DIR.relative_to(REPO_ROOT)}",
        )
        rehearsal.copy(SMOKE_DIR, SERVING_DIR)
        preflight = runbook.COMMANDS["copy"][1].replace(
            f"{runbook.OUTPUTS}/", f"{SERVING_DIR.relative_to(REPO_ROOT)}/"
        )
        rehearsal.step("preflight the copied artifacts", preflight)
        rehearsal.step(
            "deploy and benchmark",
            f"{runbook.COMMANDS['benchmark'][0]} --output-dir {SERVING_DIR.relative_to(REPO_ROOT)}",
        )
        record["builds"] = builds_record(SERVING_DIR)
        record["serve"] = {
            "answer": rehearsal.serve(SERVING_DIR / "artifacts" / "04_neuron_sparse")
        }
    finally:
        record["seconds"] = round(time.perf_counter() - started, 1)
        SMOKE_DIR.mkdir(parents=True, exist_ok=True)
        (SMOKE_DIR / RECORD).write_text(json.dumps(record, indent=2) + "\n")
    return record


def main() -> int:
    try:
        record = rehearse()
    except (RuntimeError, subprocess.TimeoutExpired) as error:
        print(
            f"rehearsal failed: {error}\nthe record so far: "
            f"{(SMOKE_DIR / RECORD).relative_to(REPO_ROOT)}",
            file=sys.stderr,
        )
        return 1
    drift = disk_drift(record, planner.rehearsal_record())
    print(
        f"rehearsal: {len(record['steps'])} steps ok in {record['seconds']:.0f} s on torch "
        f"{record['torch']}",
        file=sys.stderr,
    )
    if drift:
        print(
            "the builds on disk no longer match docs/rehearsal.json, the runbook's disk basis: "
            + "; ".join(drift)
            + f"\nrefresh it: cp {(SMOKE_DIR / RECORD).relative_to(REPO_ROOT)} "
            "docs/rehearsal.json && python -m gemma_nb runbook",
            file=sys.stderr,
        )
    return 1 if drift else 0
