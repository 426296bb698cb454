"""The three targets a notebook can run on (cpu, the reference run; neuron, SDK 2.31 on inf2; cuda),
behind one check."""

import importlib.util
from contextlib import contextmanager
from pathlib import Path

import torch

from gemma_nb import tiny
from gemma_nb.tiny import BUNDLED_ID, BUNDLED_IDS

# import -> pip name of the Neuron SDK's packages the neuron target needs
SDK_PACKAGES = {
    "torch_neuronx": "torch-neuronx",
    "neuronx_distributed": "neuronx-distributed",
}
NEURON_HELP = (
    "the neuron target needs torch-neuronx and neuronx-distributed from the Neuron SDK 2.31, "
    "installed from AWS's Neuron pip index on an inf2/trn1 instance: see the runbook, "
    "docs/inf2.md (envs/neuron/requirements.txt)"
)

# Cells tagged so are the notebooks' cpu measurements: the runner skips them on the neuron target
# and in a run that times a remote endpoint (tools/run.py, execute_one).
CPU_MEASUREMENT_TAG = "cpu-measurement"

# The cpu kernels (and thread count) of every reference run, the same on any AVX2 machine
# (CONTRIBUTING); `make test` re-executes it under CHECK_KERNELS and requires the same checked
# outputs.
REFERENCE_KERNELS = {
    "ATEN_CPU_CAPABILITY": "avx2",
    "MKL_CBWR": "AVX2",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "OMP_NUM_THREADS": "2",
}
CHECK_KERNELS = {
    "ATEN_CPU_CAPABILITY": "default",
    "MKL_CBWR": "COMPATIBLE",
    "ONEDNN_MAX_CPU_ISA": "SSE41",
    "OMP_NUM_THREADS": "1",
}


class TargetError(ValueError):
    """A target that is unknown or cannot run on this machine."""


def check_target_name(target: str) -> str:
    if target not in ("cpu", "neuron", "cuda"):
        raise TargetError(f"target {target!r} is not one of cpu, neuron, cuda")
    return target


def check_target(target: str) -> str:
    """Fail at once, with what is missing and how to get it, if ``target`` cannot run here; whether
    an installed SDK imports is the port's check (``gemma_nb.neuron.sdk.check_target_with_sdk``)."""
    if check_target_name(target) == "neuron":
        if missing := [name for name in SDK_PACKAGES if importlib.util.find_spec(name) is None]:
            raise TargetError(f"cannot import {', '.join(missing)}: {NEURON_HELP}")
    elif target == "cuda" and not torch.cuda.is_available():
        build = (
            "a CPU-only torch build" if torch.version.cuda is None else f"CUDA {torch.version.cuda}"
        )
        raise TargetError(
            f"target 'cuda' needs a CUDA GPU, but torch ({torch.__version__}, {build}) sees none: "
            "run on a GPU machine with a CUDA build of torch (see README, 'Targets')"
        )
    return target


def torch_device(target: str) -> str:
    """The torch device the cpu and cuda targets compute on (neuron: host tensors stay on the
    cpu)."""
    return "cuda" if check_target_name(target) == "cuda" else "cpu"


def default_model_id(target: str) -> str:
    """The model a plain run uses: the bundled checkpoint, on neuron its TP=2 twin (a minutes-long
    smoke run)."""
    return tiny.BUNDLED_TP2_ID if check_target_name(target) == "neuron" else tiny.BUNDLED_ID


def local_model_dir(model_id: str) -> Path | None:
    """The local folder of ``model_id`` (the bundled ids' included), or None for a hub id."""
    if model_id in BUNDLED_IDS:
        return BUNDLED_IDS[model_id]
    path = Path(model_id).expanduser()
    return path if path.exists() or model_id.count("/") != 1 else None


def neuron_checkpoint_dir(model_id: str, target: str = "neuron", override: str = "") -> str:
    """The checkpoint the neuron compile reads: ``override``, else ``model_id``'s (bundled: its TP=2
    twin; hub: TargetError)."""
    if override:
        return override
    chosen = default_model_id(target) if model_id == BUNDLED_ID else model_id
    folder = local_model_dir(chosen)
    if folder is None:
        raise TargetError(
            f"model_id {chosen!r} is a hub id; the compile reads a local folder: hf download "
            f"{chosen} --local-dir /data/model (with HF_TOKEN set), then -p model_id /data/model"
        )
    return str(folder)


@contextmanager
def one_thread():
    """Run the block on one torch cpu thread, then restore the previous count (the package's one
    limiter)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
