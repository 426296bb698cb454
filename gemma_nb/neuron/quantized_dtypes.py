"""NxD's quantized dtypes on inf2 (notebook 02): support matrix, a trial per dtype,
``scale_dequantize`` (our one NxD patch)."""

import traceback
from collections import OrderedDict

import pandas as pd
import torch
from torch import nn

from gemma_nb import formats
from gemma_nb.neuron.expert_mlps import import_nxd

# One NxD quantized dtype a row: is it a usable *inference* path on inf2 in SDK 2.31, and why we
# think so.
SUPPORT_COLUMNS = (
    "dtype",
    "torch_container",
    "quantization_types",
    "inference_on_inf2",
    "evidence",
    "sources",
)
SDK_SUPPORT_MATRIX = (
    (
        "INT8",
        "torch.int8",
        "per-tensor, per-channel symmetric (ColumnParallel: per_channel_axis 0)",
        "supported",
        "NxD inference quantization officially supports INT8 and FP8; the port ran int8 experts, "
        "shared MLP and lm_head with QuantizedColumnParallel / QuantizedRowParallel. Forward: "
        "the int8 weight is upcast (direct_cast_dequantize), matmul, then scale_dequantize "
        "multiplies the output by the fp32 scale (in place: the port monkey-patched an "
        "out-of-place version to trace).",
        "port-review, port-recipe, nxd-source: quantization_layers.py "
        "(QuantizedColumnParallel.forward), dequantize.py",
    ),
    (
        "F8E4M3",
        "torch.float8_e4m3fn",
        "per-tensor, per-channel symmetric; blockwise",
        "supported",
        "INT8 and FP8 are the officially supported inference formats. Neuron's e4m3 is the "
        "IEEE-style FP8_EXP4 with range +-240, not OCP e4m3fn's +-448: NxD clamps at "
        "DtypeBound.F8E4M3_MAX = 240 and asks for checkpoints to be rescaled by 448/240 (values "
        "beyond 240 may become NaN).",
        "nxd-source: quantization_config.py (DtypeBound), README_rescaling_fp8_for_neuron.md",
    ),
    (
        "F8E5M2",
        "torch.float8_e5m2",
        "per-tensor, per-channel symmetric",
        "not established",
        "The enum exists; no source or document we read shows it used for inference on inf2.",
        "quantization_config.py (QuantizedDtype)",
    ),
    (
        "F4E2M1FN_X4",
        "torch.uint16 (4 E2M1 values per element; float16 with NEURON_FLOAT4X4_IS_FLOAT16=1)",
        "blockwise symmetric, F8E8M0 (uint8) block scales = OCP MX",
        "not usable",
        "The weight is dequantized by blockwise_scale_dequantize, which asserts tensor.device == "
        "cpu for FP4 ('FP4 dequantization in torch is only supported on CPU'): a torch reference "
        "that cannot be traced for a NeuronCore. The blockwise_mm NKI kernel is pre-production "
        "and failed to import for the port; the MX paths live under "
        "experimental/quantization/microscaling.",
        "port-review, nxd-source: dequantize.py (blockwise_scale_dequantize), "
        "quantization_config.py (get_float4x4_torch_dtype, is_ocp_mx_quantized)",
    ),
)

TRIAL_DTYPES = ("INT8", "F8E4M3", "F4E2M1FN_X4")
NEURON_FP8_MAX = 240.0  # DtypeBound.F8E4M3_MAX: Neuron's IEEE-style e4m3 range
MX_BLOCK = 32


def support_matrix_table():
    return pd.DataFrame(list(SDK_SUPPORT_MATRIX), columns=list(SUPPORT_COLUMNS))


def scale_dequantize(
    tensor: torch.Tensor, scale: torch.Tensor, upcast_dtype: torch.dtype
) -> torch.Tensor:
    """NxD's ``scale_dequantize`` out of place, for a 2-D output ``[T, out]`` too; 3-D numbers equal
    NxD's."""
    factor = scale.unsqueeze(len(scale.shape) - 1)
    extra = factor.dim() - tensor.dim()
    if extra > 0:
        assert all(size == 1 for size in factor.shape[:extra]), (
            f"scale {tuple(scale.shape)} does not broadcast"
        )
        factor = factor.reshape(factor.shape[extra:])
    return (tensor.to(torch.float32) * factor).to(upcast_dtype)


def patch_scale_dequantize(quantization_layers) -> None:
    """Point ``quantization_layers.scale_dequantize`` (looked up by NxD's layers at call time) at
    ours."""
    quantization_layers.scale_dequantize = scale_dequantize


def _layer_kwargs(dtype_name: str, sdk) -> dict:
    if dtype_name == "F4E2M1FN_X4":
        return dict(
            quantization_type=sdk.QuantizationType.BLOCKWISE_SYMMETRIC,
            quantized_dtype=sdk.QuantizedDtype.F4E2M1FN_X4,
            block_axis=[1],
            block_size=[MX_BLOCK],
            scale_dtype=sdk.ScaleDtype.F8E8M0,
        )
    return dict(
        quantization_type=sdk.QuantizationType.PER_CHANNEL_SYMMETRIC,
        quantized_dtype=sdk.QuantizedDtype[dtype_name],
        quantization_per_channel_axis=0,
        scale_dtype=torch.float32,
    )


def trial_weights(dtype_name: str, weight: torch.Tensor) -> tuple[dict, torch.Tensor]:
    """(NxD state dict, the fp32 weight it dequantizes to): int8, fp8 at Neuron's +-240, MXFP4
    viewed as uint16."""
    if dtype_name == "INT8":
        q, scale = formats.quantize_int8_per_channel(weight, name="trial.weight")
        return {"layer.weight": q, "layer.scale": scale}, formats.dequantize_int8(q, scale)
    if dtype_name == "F8E4M3":
        # per-row absmax maps to 240 (Neuron's e4m3 top), not to 448 as in gemma_nb.formats's OCP
        # fp8
        scale = (weight.abs().amax(dim=1, keepdim=True) / NEURON_FP8_MAX).clamp_min(
            torch.finfo(torch.float32).tiny
        )
        q = (weight / scale).clamp(-NEURON_FP8_MAX, NEURON_FP8_MAX).to(torch.float8_e4m3fn)
        return {"layer.weight": q, "layer.scale": scale}, q.float() * scale
    assert dtype_name == "F4E2M1FN_X4", dtype_name
    qt = formats.quantize(weight, "mxfp4", name="trial.weight")
    assert qt.data.shape[-1] % 2 == 0, "fp4 bytes view as uint16 in fours"
    return {
        "layer.weight": qt.data.contiguous().view(torch.uint16),
        "layer.scale": qt.scale,
    }, qt.dequantize()


def run_trials(
    in_features: int = 256,
    out_features: int = 256,
    tokens: int = 4,
    workdir: str = "/tmp/gemma_nb_quant_trials",
):
    """On a NeuronCore, per dtype: ``ok``, the ``stage`` reached, ``max_abs_diff`` against the cpu,
    the ``error``."""
    sdk = import_nxd()
    patch_scale_dequantize(sdk.quantization_layers)  # the trial's input is 2-D [tokens, in]
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(out_features, in_features, generator=generator) * 0.02
    x = torch.randn(tokens, in_features, generator=generator).to(torch.bfloat16)
    rows = []
    for dtype_name in TRIAL_DTYPES:
        row = {
            "dtype": dtype_name,
            "ok": False,
            "stage": "build",
            "max_abs_diff": None,
            "error": "",
        }
        try:
            with sdk.NxDParallelState(world_size=1, tensor_model_parallel_size=1):
                layer = sdk.QuantizedColumnParallel(
                    in_features,
                    out_features,
                    bias=False,
                    gather_output=False,
                    dtype=torch.bfloat16,
                    **_layer_kwargs(dtype_name, sdk),
                )
                # checkpoint keys layer.weight / layer.scale
                model = nn.Sequential(OrderedDict(layer=layer)).eval()
                row["stage"] = "load_weights"
                state, dequantized = trial_weights(dtype_name, weight)
                expected = {k: (tuple(v.shape), v.dtype) for k, v in model.state_dict().items()}
                got = {k: (tuple(v.shape), v.dtype) for k, v in state.items()}
                assert all(expected.get(k) == v for k, v in got.items()), (got, expected)
                row["stage"] = "trace"
                builder = sdk.ModelBuilderV2(model).trace(
                    args=(x,), tag=f"quant_{dtype_name.lower()}"
                )
                row["stage"] = "compile"
                nxd_model = builder.compile(compiler_workdir=f"{workdir}/{dtype_name.lower()}")
                row["stage"] = "run"
                nxd_model.set_weights([state])
                nxd_model.to_neuron()
                output = nxd_model(x)
                output = output[0] if isinstance(output, (tuple, list)) else output
                reference = torch.nn.functional.linear(x, dequantized.to(torch.bfloat16))
                row["max_abs_diff"] = float((output.float().cpu() - reference.float()).abs().max())
                row["ok"] = True
        except Exception as error:  # the point is to record what each dtype raises
            row["error"] = f"{type(error).__name__}: {error}".strip()
            row["traceback_tail"] = "".join(traceback.format_exception(error)[-3:])
        rows.append(row)
    return pd.DataFrame(rows)
