"""The one import of the Neuron SDK, with a stand-in for the ``transformers.utils.fx`` NxD imports
and transformers 5 removed."""

import importlib
import importlib.util
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.fx

from gemma_nb.targets import NEURON_HELP, SDK_PACKAGES, TargetError, check_target

FX_MODULE = "transformers.utils.fx"
EMULATED_LABEL = (
    "emulated SDK (gemma_nb.rehearsal: torch-neuronx and neuronx-distributed "
    "emulated on the cpu, not the Neuron SDK)"
)
FX_NOTE = (
    f"note: neuronx-distributed imports {FX_MODULE} (pipeline/trace.py, for its "
    "pipeline-parallel HF tracer), which transformers 5 removed; gemma_nb.neuron.sdk provides a "
    "stand-in module of that name so the import succeeds. Only NxD's pipeline-parallel tracing "
    "of HF models is unavailable; ModelBuilder does not use it."
)


def install_fx_stand_in(modules: dict | None = None) -> bool:
    """Put a ``transformers.utils.fx`` whose ``HFTracer`` raises when built in ``modules``
    (``sys.modules``); False if one is."""
    modules = sys.modules if modules is None else modules
    if FX_MODULE in modules:
        return False

    class HFTracer(torch.fx.Tracer):  # a Tracer, for the MRO of NxD's HFTracerWrapper
        def __init__(self, *args, **kwargs):
            raise RuntimeError(
                f"{FX_MODULE} does not exist in transformers 5: NxD's pipeline-parallel tracing "
                "of Hugging Face models (HFTracerWrapper) is unavailable with it. gemma_nb "
                "never uses it; for NxD pipeline parallelism use transformers 4.x in a separate "
                "environment."
            )

    module = types.ModuleType(
        FX_MODULE, "Stand-in for the module transformers 5 removed (gemma_nb.neuron.sdk)."
    )
    module.HFTracer = HFTracer
    module.__gemma_nb_stand_in__ = True
    modules[FX_MODULE] = module
    parent = modules.get("transformers.utils")
    if parent is not None and not hasattr(parent, "fx"):
        parent.fx = module
    return True


@dataclass
class SdkStatus:
    """What ``check_sdk`` found; ``missing`` pip names are the only "SDK missing" case."""

    missing: list[str] = field(default_factory=list)
    fx_problem: bool = False  # met, and the stand-in put in
    error: str | None = None
    emulated: bool = False

    @property
    def ok(self) -> bool:
        return not self.missing and self.error is None

    def message(self) -> str:
        if self.missing:
            modules = ", ".join(name for name, pip in SDK_PACKAGES.items() if pip in self.missing)
            return f"{', '.join(self.missing)} not installed (no module {modules}): {NEURON_HELP}"
        if self.error:
            hint = (
                " (the transformers.utils.fx stand-in was applied and the import still failed)"
                if self.fx_problem
                else ""
            )
            return (
                f"the Neuron SDK is installed but does not import{hint}: {self.error}. Check "
                "that torch, torch-neuronx and neuronx-distributed come from the same SDK "
                "release (envs/neuron/requirements.txt)"
            )
        found = EMULATED_LABEL if self.emulated else "torch-neuronx and neuronx-distributed"
        if self.fx_problem:
            return f"{found} import, with the transformers-5 workaround: " + FX_NOTE.removeprefix(
                "note: "
            )
        return f"{found} import"


def check_sdk(
    find_spec: Callable = importlib.util.find_spec,
    import_module: Callable = importlib.import_module,
    modules: dict | None = None,
) -> SdkStatus:
    """Try the SDK imports, again after the stand-in on the fx error; the arguments can be fakes."""
    status = SdkStatus(
        missing=[pip for name, pip in SDK_PACKAGES.items() if find_spec(name) is None]
    )
    if status.missing:
        return status
    for name in SDK_PACKAGES:
        while True:  # once more after the stand-in went in
            try:
                status.emulated |= bool(getattr(import_module(name), "__emulated__", False))
                break
            except ImportError as error:
                if status.fx_problem or not (error.name == FX_MODULE or FX_MODULE in str(error)):
                    status.error = f"import {name}: {type(error).__name__}: {error}"
                    return status
                status.fx_problem = True
                install_fx_stand_in(modules)
    return status


def check_target_with_sdk(target: str) -> str:
    """``check_target``, and on neuron the SDK imported in this process (the transformers.utils.fx
    stand-in put in before NxD imports, with a note): ``TargetError`` naming what fails."""
    if check_target(target) == "neuron":
        status = check_sdk()
        if not status.ok:
            raise TargetError(status.message())
        if status.fx_problem:
            print(FX_NOTE, file=sys.stderr)
    return target


def import_sdk(note: Callable[[str], None] = print) -> types.SimpleNamespace:
    """The SDK pieces as one namespace, or ``ImportError`` naming what is missing and the fix."""
    status = check_sdk()
    if not status.ok:
        raise ImportError(f"cannot use the Neuron SDK: {status.message()}")
    if status.fx_problem:
        note(FX_NOTE)
    from neuronx_distributed import NxDParallelState
    from neuronx_distributed.parallel_layers import mappings
    from neuronx_distributed.parallel_layers.layers import ColumnParallelLinear, RowParallelLinear
    from neuronx_distributed.quantization import quantization_layers as layers
    from neuronx_distributed.quantization.quantization_config import (
        QuantizationType,
        QuantizedDtype,
        ScaleDtype,
    )
    from neuronx_distributed.trace import model_builder, model_builder_v2

    return types.SimpleNamespace(
        NxDParallelState=NxDParallelState,
        mappings=mappings,
        quantization_layers=layers,
        ColumnParallelLinear=ColumnParallelLinear,
        RowParallelLinear=RowParallelLinear,
        QuantizationType=QuantizationType,
        QuantizedDtype=QuantizedDtype,
        ScaleDtype=ScaleDtype,
        QuantizedColumnParallel=layers.QuantizedColumnParallel,
        QuantizedRowParallel=layers.QuantizedRowParallel,
        QuantizedExpertFusedRowParallel=layers.QuantizedExpertFusedRowParallel,
        QuantizedExpertFusedColumnParallel=layers.QuantizedExpertFusedColumnParallel,
        ModelBuilder=model_builder.ModelBuilder,
        BaseModelInstance=model_builder.BaseModelInstance,
        ModelBuilderV2=model_builder_v2.ModelBuilder,
        fx_workaround=status.fx_problem,
        emulated=status.emulated,
    )
