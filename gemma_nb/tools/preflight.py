"""``python -m gemma_nb preflight``: the checklist to run on a box before a 40-minute compile finds
out (SDK, versions, NeuronCores, RAM and swap, disk, model folder, artifacts); non-zero exit naming
the first blocker and its fix."""

import json
import math
import os
import re
import shutil
import subprocess
import sys
from collections import namedtuple
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import torch

from gemma_nb import memory, params
from gemma_nb.cli import STEPS
from gemma_nb.hardware import GB, GiB
from gemma_nb.neuron import sdk as neuron_sdk
from gemma_nb.neuron.build import package_versions
from gemma_nb.neuron.build_folder import MODEL_FILE, ArtifactError, read_artifact
from gemma_nb.paths import REPO_ROOT
from gemma_nb.targets import check_target_name, default_model_id, local_model_dir
from gemma_nb.tools import plan as planner

REQUIREMENTS = REPO_ROOT / "envs" / "neuron" / "requirements.txt"
OK, WARN, FAIL, SKIP = "ok", "warn", "fail", "skip"
HF_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


# status: OK, WARN, FAIL or SKIP
Check = namedtuple("Check", "name status detail fix", defaults=("",))


def _neuron_ls() -> str | None:  # None: the tool is not installed
    if shutil.which("neuron-ls") is None:
        return None
    done = subprocess.run(
        ["neuron-ls", "--json-output"], capture_output=True, text=True, timeout=60
    )
    return done.stdout if done.returncode == 0 else f"error: {done.stderr.strip()[:200]}"


@dataclass
class System:
    """The machine's answers; tests pass fakes."""

    check_sdk: Callable = lambda: neuron_sdk.check_sdk()
    package_version: Callable[[str], str | None] = lambda name: package_versions([name])[name]
    neuron_ls: Callable[[], str | None] = _neuron_ls
    memory: Callable[[], tuple[int, int]] = lambda: (
        psutil.virtual_memory().total,
        psutil.swap_memory().total,
    )
    disk_free: Callable[[str], int] = field(default=lambda path: shutil.disk_usage(path).free)
    env: Mapping[str, str] = field(default_factory=lambda: os.environ)
    cuda_available: Callable[[], bool] = torch.cuda.is_available


def check_sdk(system: System) -> Check:
    status = system.check_sdk()
    if status.missing:
        return Check(
            "sdk",
            FAIL,
            f"{', '.join(status.missing)} not installed",
            "activate the SDK 2.31 DLAMI's /opt/aws_neuronx_venv_pytorch_2_9 (elsewhere: pip "
            "install -r envs/neuron/requirements.txt), then sh envs/neuron/install.sh, as the "
            "runbook's install step says (docs/inf2.md)",
        )
    if status.error:
        return Check(
            "sdk",
            FAIL,
            status.message(),
            "reinstall torch-neuronx and neuronx-distributed from one SDK "
            "release: pip install -r envs/neuron/requirements.txt",
        )
    return Check("sdk", OK, status.message())


def pinned_versions(path: Path = REQUIREMENTS) -> dict[str, str]:
    """``name==version`` lines of a requirements file, names normalised to pip's dashes."""
    lines = [line.split("#", 1)[0].strip() for line in path.read_text().splitlines()]
    pairs = [line.split("==", 1) for line in lines if "==" in line and not line.startswith("-")]
    return {name.strip().lower().replace("_", "-"): version.strip() for name, version in pairs}


def check_versions(
    system: System, pins: Mapping[str, str] | None = None, emulated: bool = False
) -> Check:
    if emulated:
        return Check(
            "versions",
            SKIP,
            "emulated SDK: no Neuron wheels here; the versions are checked on the box",
        )
    pins = pinned_versions() if pins is None else pins
    found = {name: system.package_version(name) for name in pins}
    # A version's local label (+...) is not what a pin names.
    differ = [
        f"{n} {found[n] or 'not installed'} (pinned {v})"
        for n, v in pins.items()
        if (found[n] or "").split("+")[0] != v
    ]
    if not differ:
        return Check(
            "versions", OK, f"{len(pins)} packages as pinned in envs/neuron/requirements.txt"
        )
    return Check(
        "versions",
        WARN,
        "; ".join(differ),
        "the repo was written against the pins in envs/neuron/requirements.txt; other SDK "
        "releases may differ in the ModelBuilder API",
    )


def parse_neuron_ls(text: str) -> list[tuple[int, int, bool]]:
    """(NeuronCores, device memory bytes, emulated) per device of ``neuron-ls --json-output``."""
    return [
        (int(dev["nc_count"]), int(dev["memory_size"]), bool(dev.get("emulated")))
        for dev in json.loads(text)
    ]


def check_neuron_cores(system: System, tp: int, bytes_per_rank: int | None) -> Check:
    text = system.neuron_ls()
    if text is None:
        return Check(
            "neuron_cores",
            FAIL,
            "neuron-ls not found: no Neuron driver and tools on this machine",
            "run on an inf2/trn1 instance with the Neuron DLAMI (aws-neuronx-dkms, "
            "aws-neuronx-tools)",
        )
    if text.startswith("error:"):  # neuron-ls exits 1 when the driver finds no device
        return Check(
            "neuron_cores",
            FAIL,
            f"neuron-ls found no Neuron device ({text})",
            "check the Neuron driver (aws-neuronx-dkms) is loaded on an inf2/trn1 instance: "
            "neuron-ls",
        )
    try:
        devices = parse_neuron_ls(text)
    except (KeyError, TypeError, ValueError) as error:  # ValueError: JSONDecodeError too
        return Check(
            "neuron_cores",
            WARN,
            f"could not read neuron-ls --json-output ({error!r}): {text[:120]!r}",
            "run neuron-ls by hand and compare with the plan (python -m gemma_nb plan)",
        )
    cores = sum(c for c, _, _ in devices)
    if not cores:
        return Check(
            "neuron_cores",
            FAIL,
            "neuron-ls lists no NeuronCores",
            "check the Neuron driver: neuron-ls",
        )
    hbm_per_core = min(m // c for c, m, _ in devices if c)
    emulated = " (emulated NeuronCores)" if any(e for _, _, e in devices) else ""
    detail = (
        f"{cores} NeuronCores{emulated}, "
        f"{hbm_per_core / GiB:{'.1f' if hbm_per_core >= GiB else '.3g'}} GiB HBM per core"
    )
    if tp > cores:
        return Check(
            "neuron_cores",
            FAIL,
            f"{detail}; TP={tp} needs {tp}",
            f"use an instance with at least {tp} NeuronCores (python -m gemma_nb plan CONFIG "
            f"--tp {tp})",
        )
    if bytes_per_rank is not None and bytes_per_rank > hbm_per_core:
        return Check(
            "neuron_cores",
            FAIL,
            f"{detail}; the plan needs {bytes_per_rank / GB:.2f} GB per rank",
            "pick a scheme or TP that fits: python -m gemma_nb plan CONFIG",
        )
    return Check(
        "neuron_cores",
        OK,
        detail + (f"; plan {bytes_per_rank / GB:.2f} GB per rank" if bytes_per_rank else ""),
    )


def check_host_memory(system: System, step: str, need_bytes: int) -> Check:
    """RAM (as the box reads it, below its nominal) + swap against the step's need (the runbook's
    recipe, ``plan.host_needs``)."""
    ram, swap = system.memory()
    detail = (
        f"{ram / GiB:.1f} GiB RAM + {swap / GiB:.1f} GiB swap; the {step} needs "
        f"{need_bytes / GiB:.1f} GiB of RAM + swap (docs/inf2.md step 1)"
    )
    if ram + swap >= need_bytes:
        return Check("host_memory", OK, detail)
    add_gib = math.ceil((need_bytes - ram - swap) / GiB)
    path = "/swapfile2" if swap else "/swapfile"
    return Check(
        "host_memory",
        FAIL,
        detail,
        f"add {add_gib} GiB of swap (sudo fallocate -l {add_gib}G {path} && sudo chmod 600 {path} "
        f"&& sudo mkswap {path} && sudo swapon {path}) or use a box with more RAM",
    )


def check_disk(system: System, path: str, need_bytes: int) -> Check:
    folder = Path(path).absolute()  # it may not exist yet: its nearest existing parent's disk
    existing = next((p for p in (folder, *folder.parents) if p.exists()), Path(folder.anchor))
    free = system.disk_free(str(existing))
    detail = (
        f"{free / GB:.1f} GB free at {existing.name or existing}; needs ~{need_bytes / GB:.1f} GB"
    )
    if free >= need_bytes:
        return Check("disk", OK, detail)
    return Check(
        "disk",
        FAIL,
        detail,
        f"grow the EBS volume to at least {-(-need_bytes // GB)} GB (the runbook's "
        "figure for this step, docs/inf2.md step 1) or point --artifact elsewhere",
    )


def check_model(system: System, model_id: str) -> Check:
    folder = Path(model_id).expanduser()
    if not folder.exists() and HF_ID.match(model_id):
        if system.env.get("HF_TOKEN"):
            return Check("model", OK, f"hub id {model_id}; HF_TOKEN is set (not shown)")
        return Check(
            "model",
            WARN,
            f"hub id {model_id} and HF_TOKEN is not set",
            "gated models (Gemma) need it: export HF_TOKEN=... (never pass it as a flag), then "
            f"hf download {model_id} --local-dir /data/model and use --model-id /data/model",
        )
    if problem := model_folder_problem(folder):
        return Check(
            "model",
            FAIL,
            problem,
            "download the whole model folder again (hf download ... --local-dir DIR)",
        )
    shards = len(list(folder.glob("*.safetensors")))
    return Check("model", OK, f"{folder.name}/: config, tokenizer and {shards} safetensors file(s)")


def model_folder_problem(folder: Path) -> str | None:
    """What is missing from a checkpoint folder (None: complete)."""
    if not folder.is_dir():
        return f"model folder {str(folder)!r} does not exist"
    if not (folder / "config.json").is_file():
        return f"{folder.name}/ has no config.json"
    if not (folder / "tokenizer_config.json").is_file() or not any(
        (folder / n).is_file() for n in ("tokenizer.json", "tokenizer.model")
    ):
        return (
            f"{folder.name}/ has no complete tokenizer (tokenizer_config.json + "
            "tokenizer.json or tokenizer.model)"
        )
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(
                {str(name) for name in json.loads(index.read_bytes())["weight_map"].values()}
            )
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
            return f"{folder.name}/{index.name} holds no weight_map of shard file names"
        missing = [s for s in shards if not (folder / s).is_file()]
        if missing:
            return (
                f"{folder.name}/ lacks {len(missing)} of the {len(shards)} shards its index "
                f"names: {', '.join(missing[:3])}"
            )
    elif not any(folder.glob("*.safetensors")):
        return f"{folder.name}/ has no *.safetensors weights"
    return None


def check_artifact(folder: str) -> Check:
    try:
        artifact = read_artifact(folder)
    except ArtifactError as error:
        return Check(
            "artifact",
            FAIL,
            str(error),
            "copy the whole artifact folder from the compile box again",
        )
    return Check(
        "artifact",
        OK,
        f"{artifact.folder.name}/: graphs {', '.join(artifact.graphs)}, "
        f"TP={artifact.manifest['tp_degree']}, {len(artifact.manifest['files'])} files as listed",
    )


def run_checks(
    target: str,
    model_id: str | None = None,
    artifact=None,
    step: str | None = None,
    tp: int = 2,
    system: System | None = None,
) -> list[Check]:
    """Every check for ``target``; ``artifact``: one folder or several; ``step``: compile, or deploy
    with an artifact. The plan (bytes per rank, host and disk needs) reads the artifact's
    config.json, else the model folder's."""
    check_target_name(target)
    artifacts = [artifact] if isinstance(artifact, (str, Path)) else list(artifact or [])
    artifact = str(artifacts[0]) if artifacts else None
    system = system or System()
    step = step or ("deploy" if artifact else "compile")
    # the CLI's choices= refuses it with a message
    assert step in STEPS, f"step={step!r} is not one of {STEPS}"
    model_id = model_id or (None if artifact else default_model_id(target))
    folder = local_model_dir(model_id) if model_id else None  # None: a hub id
    model_checks = [check_model(system, str(folder) if folder else model_id)] if model_id else []
    source = next(
        (
            f
            for f in (Path(artifact) if artifact else None, folder)
            if f and (f / "config.json").is_file()
        ),
        None,
    )
    config = None if source is None else planner.read_config(source).config
    problem = None if config is None else params.tp_problem(config, tp)
    if problem:
        model_checks.append(
            Check(
                "plan",
                FAIL,
                problem,
                f"python -m gemma_nb plan {source} lists the TP degrees that work",
            )
        )
    bytes_per_rank = (
        None
        if config is None or problem
        else memory.plan(config, tp, planner.DEFAULT_SCHEME).total_bytes
    )
    checks = []
    if target == "neuron":
        sdk = check_sdk(system)
        checks += [
            sdk,
            check_versions(system, emulated=sdk.detail.startswith("emulated SDK"))
            if sdk.status == OK
            else Check("versions", SKIP, "SDK not importable"),
            check_neuron_cores(system, tp, bytes_per_rank),
        ]
    if target == "cuda" and not system.cuda_available():
        fix = "run on a GPU machine with a CUDA build of torch (README, 'Targets')"
        checks.append(Check("gpu", FAIL, "torch sees no CUDA GPU on this machine", fix))
    checks += model_checks
    # a deploy loads one build at a time: the largest model.pt
    model_pts = [Path(artifact) / MODEL_FILE for artifact in artifacts]
    model_pt = max((path.stat().st_size for path in model_pts if path.is_file()), default=None)
    need = 0 if config is None else planner.host_needs(config, model_pt)[f"{step}_bytes"]
    checks.append(check_host_memory(system, step, need))
    # what the step writes, scaled from make rehearse's builds (0 without them)
    record = planner.rehearsal_record()
    disk = (
        0
        if config is None or record is None
        else planner.disk_needs(config, record)[
            "compile_disk_bytes" if step == "compile" else "serve_disk_bytes"
        ]
    )
    checks.append(check_disk(system, str(Path(artifact).parent if artifact else REPO_ROOT), disk))
    return checks + [check_artifact(str(folder)) for folder in artifacts]


def first_blocker(checks: list[Check]) -> Check | None:
    return next((c for c in checks if c.status == FAIL), None)


def format_checks(checks: list[Check], target: str) -> str:
    marks = {OK: "[ok]  ", WARN: "[warn]", FAIL: "[FAIL]", SKIP: "[skip]"}
    lines = [f"preflight for target {target}:"]
    for check in checks:
        lines.append(f"  {marks[check.status]} {check.name:<13}{check.detail}")
        if check.fix and check.status != OK:
            lines.append(f"  {'':<20}fix: {check.fix}")
    blocker = first_blocker(checks)
    lines.append(
        f"BLOCKED by {blocker.name}: {blocker.detail}. Fix: {blocker.fix}"
        if blocker
        else "ready: no blocker found"
    )
    return "\n".join(lines)


def main(args) -> int:
    try:
        checks = run_checks(args.target, args.model_id, args.artifact, args.step, args.tp)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(format_checks(checks, args.target))
    return 1 if first_blocker(checks) else 0
