"""The three targets a notebook can run on, behind one check.

``cpu`` runs anywhere and is the reference run committed under ``outputs/cpu/``.
``neuron`` needs the AWS Neuron SDK 2.31 (torch-neuronx, neuronx-distributed) on inf2/trn1.
``cuda`` needs one CUDA GPU and a CUDA build of torch.
"""

from __future__ import annotations

import importlib.util

TARGETS = ("cpu", "neuron", "cuda")

NEURON_PACKAGES = ("torch_neuronx", "neuronx_distributed")
NEURON_HELP = (
    "the neuron target needs torch-neuronx and neuronx-distributed from the Neuron SDK 2.31, "
    "installed from AWS's Neuron pip index on an inf2/trn1 instance: "
    "see 'Running on Inferentia2' in README.md (envs/neuron/requirements.txt)"
)


class TargetError(ValueError):
    """A target that is unknown or cannot run on this machine."""


def check_target_name(target: str) -> str:
    """Return ``target`` if it is one of TARGETS, else raise TargetError naming it."""
    if target not in TARGETS:
        raise TargetError(f"target {target!r} is not one of {', '.join(TARGETS)}")
    return target


def missing_neuron_packages() -> list[str]:
    return [name for name in NEURON_PACKAGES if importlib.util.find_spec(name) is None]


def check_target(target: str) -> str:
    """Fail at once, with what is missing and how to get it, if ``target`` cannot run here."""
    check_target_name(target)
    if target == "neuron":
        missing = missing_neuron_packages()
        if missing:
            raise TargetError(f"cannot import {', '.join(missing)}: {NEURON_HELP}")
    elif target == "cuda":
        import torch

        if not torch.cuda.is_available():
            build = "a CPU-only torch build" if torch.version.cuda is None else f"CUDA {torch.version.cuda}"
            raise TargetError(
                f"target 'cuda' needs a CUDA GPU, but torch ({torch.__version__}, {build}) sees none: "
                "run on a GPU machine with a CUDA build of torch (see README, 'Targets')"
            )
    return target


def torch_device(target: str) -> str:
    """The torch device string the cpu and cuda targets compute on.

    The neuron target computes inside compiled NEFFs; host-side tensors stay on the cpu.
    """
    check_target_name(target)
    return "cuda" if target == "cuda" else "cpu"
