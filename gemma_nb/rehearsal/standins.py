"""CPU stand-ins for the neuronx-distributed pieces the neuron build uses. NOT the Neuron SDK.

Our own code, written after reading the contracts in neuronx-distributed **0.18.0** (the newest
public source, the Neuron 2.29 release; the box runs 0.19 from SDK 2.31): the parallel state,
mappings and linear layers (``nxd_layers``), the quantized layers (``nxd_quant``), ModelBuilder's
checkpoint path (``sharding``). They prove *this repo's* sharding, checkpoint conversion, KV-state
and graph code on a cpu, under real collectives: gloo between processes (notebook 05's TP=2
emulation, ``emulate``) or between emulated NeuronCores (``spmd``, the emulated SDK of ``make
rehearse``). They prove nothing about the SDK itself: its layers, neuronx-cc, the NeuronCore's HBM
or its speed need an inf2.

Where they differ from NxD 0.18, on purpose or by necessity (each one that could hide a defect of
this repo has a test in ``tests/test_standins.py`` or ``tests/test_emulated_sdk.py``):

1. Only what ``gemma_nb.neuron`` uses exists: a constructor argument or a feature switched on that
   the stand-in does not implement (``bias=True``, sequence parallelism, padded row-parallel input,
   blockwise or FP4 quantization, expert parallelism) raises ``TypeError`` / ``NotImplementedError``
   naming it, where NxD would run it. NxD's default ``bias=True`` is refused, not emulated.
2. No master weights, no initialisation: parameters are ``torch.empty`` / ones until loaded; NxD
   fills zeros. A parameter this repo forgets to load therefore holds garbage here, where NxD
   would compute with zeros: the load (``load_rank_module``, the emulated ``initialize``) names
   every missing one instead.
3. Parallel state: a plain Python object (``ParallelState``), not process groups; the collectives
   are gloo (``group``), the emulated cores' barrier (``spmd``) or identities (one rank's graph).
4. ``init_on_device`` without ``force_custom_init_on_device=True`` reproduces the accelerate
   behaviour NxD's docstring names (``requires_grad`` reset to True: int8 weights cannot be built),
   whatever the installed accelerate does.
5. ``QuantizedExpertFused*`` with plain per-channel scales ``[1, 1, out]``: indexing them by
   ``expert_indices`` fails on the cpu as in NxD's cpu mode (an XLA gather clamps the index to 0 on
   the device, so there it would silently use the shared scale); ``gemma_nb.neuron`` uses
   expert-wise scales ``[E, 1, out]`` and never meets the difference.
"""

from __future__ import annotations

from types import SimpleNamespace

from gemma_nb.rehearsal import nxd_layers, nxd_quant
from gemma_nb.rehearsal.nxd_layers import (
    NXD_CONTRACT_VERSION,
    ColumnParallelLinear,
    ParallelState,
    RowParallelLinear,
    SPMDRank,
    current_state,
    gather_from_tensor_model_parallel_region,
    mappings,
    model_parallel,
    reduce_from_tensor_model_parallel_region,
    scatter_to_process_group_spmd,
    set_tensor_model_parallel_attributes,
)
from gemma_nb.rehearsal.nxd_quant import (
    QuantizationType,
    QuantizedDtype,
    ScaleDtype,
    direct_cast_dequantize,
    sdk_scale_dequantize,
)
from gemma_nb.rehearsal.sharding import init_on_device, init_on_meta, load_rank_module, shard_checkpoint


def bind_quantized_layers(quantization_layers) -> dict:
    """The quantized stand-in classes, subclassed so that they look ``scale_dequantize`` up in
    ``quantization_layers`` (a module or namespace): a patch there reaches only these classes."""
    bound = {"quantization_layers": quantization_layers}
    return {cls.__name__: type(cls.__name__, (cls,), bound) for cls in nxd_quant.QUANTIZED_LAYERS}


def cpu_sdk() -> SimpleNamespace:
    """The stand-ins under the attribute names ``gemma_nb.neuron.sdk.import_sdk()`` returns.

    Each call has its own ``quantization_layers`` namespace (holding the SDK's ``scale_dequantize``
    as written), so patching one instance leaves the others as the SDK ships. Build layers from it
    inside :func:`model_parallel`.
    """
    quantization_layers = SimpleNamespace(scale_dequantize=sdk_scale_dequantize,
                                          direct_cast_dequantize=direct_cast_dequantize)
    classes = bind_quantized_layers(quantization_layers)
    vars(quantization_layers).update(classes)
    return SimpleNamespace(
        ColumnParallelLinear=ColumnParallelLinear, RowParallelLinear=RowParallelLinear, SPMDRank=SPMDRank,
        scatter_to_process_group_spmd=scatter_to_process_group_spmd, mappings=mappings,
        quantization_layers=quantization_layers, QuantizationType=QuantizationType, QuantizedDtype=QuantizedDtype,
        ScaleDtype=ScaleDtype, **classes, is_standin=True, emulated=False,
    )


__all__ = [
    "NXD_CONTRACT_VERSION", "ParallelState", "model_parallel", "current_state", "cpu_sdk", "mappings",
    "ColumnParallelLinear", "RowParallelLinear", "SPMDRank", "QuantizationType", "QuantizedDtype", "ScaleDtype",
    "sdk_scale_dequantize", "scatter_to_process_group_spmd", "reduce_from_tensor_model_parallel_region",
    "gather_from_tensor_model_parallel_region", "init_on_device", "init_on_meta", "shard_checkpoint",
    "load_rank_module", "set_tensor_model_parallel_attributes", "bind_quantized_layers", "nxd_layers",
]
