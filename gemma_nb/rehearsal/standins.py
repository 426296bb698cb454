"""CPU stand-ins of the neuronx-distributed 0.18 pieces the port uses (notebook 05, ``make
rehearse``): not the SDK. They prove this repo's code under real collectives; where they and the
emulated SDK diverge from NxD: sdk_path/README.md."""

from types import SimpleNamespace

from gemma_nb.rehearsal import nxd_layers as L
from gemma_nb.rehearsal import nxd_quant as Q
from gemma_nb.rehearsal.nxd_layers import NXD_CONTRACT_VERSION, model_parallel
from gemma_nb.rehearsal.nxd_quant import sdk_scale_dequantize
from gemma_nb.rehearsal.sharding import (
    init_on_device,
    init_on_meta,
    load_rank_module,
    shard_checkpoint,
)


def bind_quantized_layers(quantization_layers) -> dict:
    """The quantized stand-ins subclassed to look ``scale_dequantize`` up in
    ``quantization_layers``."""
    return {
        cls.__name__: type(cls.__name__, (cls,), {"quantization_layers": quantization_layers})
        for cls in Q.QUANTIZED_LAYERS
    }


def cpu_sdk() -> SimpleNamespace:
    """The stand-ins under ``import_sdk()``'s names, each call with its own unpatched
    ``quantization_layers``."""
    quantization_layers = SimpleNamespace(
        scale_dequantize=sdk_scale_dequantize, direct_cast_dequantize=Q.direct_cast_dequantize
    )
    classes = bind_quantized_layers(quantization_layers)
    vars(quantization_layers).update(classes)
    # mappings: NxD's is a module of the collectives' functions, as nxd_layers is
    return SimpleNamespace(
        ColumnParallelLinear=L.ColumnParallelLinear,
        RowParallelLinear=L.RowParallelLinear,
        mappings=L,
        quantization_layers=quantization_layers,
        QuantizationType=Q.QuantizationType,
        QuantizedDtype=Q.QuantizedDtype,
        ScaleDtype=Q.ScaleDtype,
        **classes,
        emulated=False,
    )


__all__ = [
    "NXD_CONTRACT_VERSION",
    "model_parallel",
    "cpu_sdk",
    "sdk_scale_dequantize",
    "init_on_device",
    "init_on_meta",
    "shard_checkpoint",
    "load_rank_module",
    "bind_quantized_layers",
]
