"""NxD 0.18's ``quantization_layers.py`` as cpu stand-ins: int8/fp8 per-tensor or per-channel, the
expert-fused layers; ``scale_dequantize`` kept as NxD writes it, so a 2-D input fails here as on the
box unless the port patches it."""

import enum

import torch
import torch.nn.functional as F
from torch import nn

from gemma_nb.rehearsal import nxd_layers as L


class QuantizationType(enum.Enum):
    PER_TENSOR_SYMMETRIC = "per_tensor_symmetric"
    PER_CHANNEL_SYMMETRIC = "per_channel_symmetric"
    PER_KEY_SYMMETRIC = "per_key_symmetric"
    BLOCKWISE_SYMMETRIC = "blockwise_symmetric"
    EXPERT_WISE_PER_CHANNEL_SYMMETRIC = "expert_wise_per_channel_symmetric"


class QuantizedDtype(enum.Enum):
    INT8 = torch.int8
    F8E4M3 = torch.float8_e4m3fn
    F8E5M2 = torch.float8_e5m2
    F4E2M1FN_X4 = torch.uint16


class ScaleDtype(enum.Enum):
    F32 = torch.float32
    F8E8M0 = torch.uint8


_PER_CHANNEL = (
    QuantizationType.PER_CHANNEL_SYMMETRIC,
    QuantizationType.EXPERT_WISE_PER_CHANNEL_SYMMETRIC,
)
NOT_EMULATED = (
    "the emulated SDK does not implement {what} (on the box the SDK refuses FP4 on a NeuronCore: "
    "blockwise_scale_dequantize asserts the cpu); it keeps int8 and fp8 per-tensor / per-channel "
    "only"
)


def sdk_scale_dequantize(
    tensor: torch.Tensor, scale: torch.Tensor, upcast_dtype: torch.dtype
) -> torch.Tensor:
    upcast = tensor.to(torch.float32)
    upcast *= scale.unsqueeze(len(scale.shape) - 1)
    return upcast.to(upcast_dtype)


def direct_cast_dequantize(tensor: torch.Tensor, upcast_dtype: torch.dtype) -> torch.Tensor:
    return tensor.to(upcast_dtype)


class _QuantizedLinear(nn.Module):
    """Shared by the quantized stand-ins: the frozen quantized ``weight``, fp32 ``scale``, their
    tags."""

    # a namespace holding scale_dequantize: set per cpu_sdk() / emulated module
    quantization_layers = None

    def _setup(
        self,
        weight_shape,
        partition_dim: int,
        dtype,
        stride: int,
        quantization_type="per_tensor_symmetric",
        quantized_dtype=QuantizedDtype.INT8,
        device=None,
        quantization_per_channel_axis: int | None = None,
        scale_dtype=torch.float32,
        rank_ordering=None,
        keep_master_weight: bool = False,
        block_axis=None,
        block_size=None,
        **unsupported,
    ) -> None:
        """The quantization arguments every quantized layer takes, keyword only (NxD's names and
        defaults): a stand-in accepts no positional call the SDK would read otherwise."""
        L._check_unsupported(type(self).__name__, unsupported)
        self.quantization_type = QuantizationType(quantization_type)
        self.quantized_dtype = QuantizedDtype(quantized_dtype)
        self.scale_dtype = ScaleDtype(scale_dtype)
        self.dequantized_dtype, self.rank_ordering = dtype, rank_ordering
        if self.quantization_type == QuantizationType.BLOCKWISE_SYMMETRIC:
            raise NotImplementedError(NOT_EMULATED.format(what="blockwise quantization"))
        if self.quantized_dtype == QuantizedDtype.F4E2M1FN_X4 or self.scale_dtype != ScaleDtype.F32:
            what = f"{self.quantized_dtype.name} with {self.scale_dtype.name} scales"
            raise NotImplementedError(NOT_EMULATED.format(what=what))
        # the output channels of [out, in] or of the experts' [E, in, out]
        out_axis = 2 if len(weight_shape) == 3 else 0
        channel_axis_ok = quantization_per_channel_axis in (None, out_axis)
        if self.quantization_type in _PER_CHANNEL and not channel_axis_ok:
            raise AssertionError(
                f"Only per_channel_axis={out_axis} supported for post-matmul output dequantization"
            )
        L._tagged_weight(
            self,
            weight_shape,
            self.quantized_dtype.value,
            device,
            partition_dim,
            stride,
            rank_ordering,
        )
        if self.quantization_type == QuantizationType.PER_TENSOR_SYMMETRIC:
            scale_shape, split = [1], False  # one scale, replicated
        elif self.quantization_type in _PER_CHANNEL:
            scale_shape = [1] * len(weight_shape)
            scale_shape[out_axis] = weight_shape[out_axis]
            if self.quantization_type == QuantizationType.EXPERT_WISE_PER_CHANNEL_SYMMETRIC:
                assert len(weight_shape) == 3, (
                    f"{type(self).__name__}: expert-wise scales need an experts layer"
                )
                scale_shape[0] = weight_shape[0]  # the experts
            split = partition_dim == out_axis  # the scale is split with the channels it scales
        else:
            raise ValueError(f"scale for quantization_type: {self.quantization_type} not supported")
        self.scale = nn.Parameter(torch.ones(scale_shape, device=device), requires_grad=False)
        scale_tags = (
            (True, partition_dim, stride, self.tensor_parallel_group.tp, rank_ordering)
            if split
            else (False, 0, 1, 1)
        )
        L.set_tensor_model_parallel_attributes(self.scale, *scale_tags)

    def _scale_dequantize(self, output, scale):
        return self.quantization_layers.scale_dequantize(
            tensor=output, scale=scale, upcast_dtype=output.dtype
        )

    def _matmul(self, input_):
        output = F.linear(input_, direct_cast_dequantize(self.weight, input_.dtype))
        return self._scale_dequantize(output, self.scale.T)


class QuantizedColumnParallel(_QuantizedLinear):
    """int8 ``weight [out/tp, in]``, fp32 ``scale [out/tp, 1]`` (per channel) split with the
    rows."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = True,
        *,
        gather_output: bool = True,
        dtype: torch.dtype = torch.float32,
        stride: int = 1,
        tensor_model_parallel_group=None,
        pad: bool = False,
        sequence_parallel_enabled: bool = False,
        **quantization,
    ):
        super().__init__()
        L._check_unsupported(
            "QuantizedColumnParallel",
            {},
            bias=bias,
            sequence_parallel_enabled=sequence_parallel_enabled,
        )
        L._column_setup(
            self,
            input_size,
            output_size,
            gather_output,
            dtype,
            stride,
            pad,
            tensor_model_parallel_group,
        )
        shape = (self.output_size_per_partition, input_size)
        self._setup(shape, 0, dtype, stride, **quantization)

    def forward(self, input_):
        output = self._matmul(input_)
        if self.gather_output:  # no trim of a padded vocab: NxD 0.18's quantized layer leaves it on
            output = L.gather_from_tensor_model_parallel_region(output, self.tensor_parallel_group)
        return output

    def preshard_hook(self, state_dict: dict, prefix: str) -> None:
        if not self.pad or not self.pad_size:
            return
        size = state_dict[prefix].shape[0]
        if self.output_size != size + self.pad_size:
            raise RuntimeError(
                f"State dict {prefix} is of an unexpected size {size} expected "
                f"{size - self.pad_size}"
            )
        for key in (prefix, prefix.replace(".weight", ".scale")):  # the rows and their scales
            state_dict[key] = F.pad(state_dict[key], (0, 0, 0, self.pad_size))


class QuantizedRowParallel(_QuantizedLinear):
    """int8 ``weight [out, in/tp]``, fp32 ``scale [out, 1]`` replicated; all-reduce in the output
    dtype."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = True,
        *,
        input_is_parallel: bool = False,
        dtype: torch.dtype = torch.float32,
        stride: int = 1,
        reduce_output: bool = True,
        tensor_model_parallel_group=None,
        pad: bool = False,
        sequence_parallel_enabled: bool = False,
        **quantization,
    ):
        super().__init__()
        L._check_unsupported(
            "QuantizedRowParallel",
            {},
            bias=bias,
            pad=pad,
            sequence_parallel_enabled=sequence_parallel_enabled,
        )
        L._row_setup(
            self,
            input_size,
            output_size,
            input_is_parallel,
            reduce_output,
            dtype,
            stride,
            tensor_model_parallel_group,
        )
        shape = (output_size, self.input_size_per_partition)
        self._setup(shape, 1, dtype, stride, **quantization)

    def forward(self, input_):
        output = self._matmul(input_)
        if self.reduce_output:
            output = L.reduce_from_tensor_model_parallel_region(output, self.tensor_parallel_group)
        return output


class _QuantizedExpertFused(_QuantizedLinear):
    """Shared by the expert-fused stand-ins: experts indexed on the leading axis, upcast, einsum,
    scaled; no collective."""

    def _experts_setup(
        self, num_experts: int, expert_model_parallel_group, is_fused_gate_up: bool
    ) -> None:
        if (
            expert_model_parallel_group is not None
            and getattr(expert_model_parallel_group, "tp", 1) != 1
        ):
            raise NotImplementedError(
                "the emulated SDK keeps expert parallelism off (EP=1), as gemma_nb.neuron builds"
            )
        self.num_experts = self._n_local_experts = num_experts
        self.is_fused_gate_up = is_fused_gate_up

    def forward(self, input_, expert_indices=None):
        weight, scale = self.weight, self.scale
        if expert_indices is not None:
            weight, scale = weight[expert_indices, :, :], scale[expert_indices, :, :]
        if input_.shape[0] != weight.shape[0] and input_.shape[0] > 1:
            raise RuntimeError(
                f"input and weight disagree on number of experts (first dimension). "
                f"input_shape={tuple(input_.shape)}, weight_shape={tuple(weight.shape)}"
            )
        output = torch.einsum(
            "e...h,ehi->e...i", input_, direct_cast_dequantize(weight, input_.dtype)
        )
        return self._scale_dequantize(output, scale)


class QuantizedExpertFusedColumnParallel(_QuantizedExpertFused):
    """``weight [E, in, out/tp]`` split on dim 2 (``stride`` 2: gate and up halves each split),
    scale ``[E or 1, 1, out/tp]``; forward ``[E or 1, ..., in] -> [E', ..., out/tp]``, no
    collective."""

    def __init__(
        self,
        num_experts: int,
        input_size: int,
        output_size: int,
        bias: bool = False,
        *,
        dtype: torch.dtype = torch.float32,
        stride: int = 1,
        tensor_model_parallel_group=None,
        expert_model_parallel_group=None,
        is_prefill: bool = True,
        is_fused_gate_up: bool = False,
        **quantization,
    ):
        super().__init__()
        L._check_unsupported("QuantizedExpertFusedColumnParallel", {}, bias=bias)
        self._experts_setup(num_experts, expert_model_parallel_group, is_fused_gate_up)
        L._column_setup(
            self, input_size, output_size, False, dtype, stride, False, tensor_model_parallel_group
        )
        shape = (num_experts, input_size, self.output_size_per_partition)
        self._setup(shape, 2, dtype, stride, **quantization)


class QuantizedExpertFusedRowParallel(_QuantizedExpertFused):
    """``weight [E, in/tp, out]`` split on dim 1, scale ``[E or 1, 1, out]`` replicated; forward
    ``[E', ..., in/tp] -> [E', ..., out]``: this rank's partial sums (the port all-reduces them in
    fp32)."""

    def __init__(
        self,
        num_experts: int,
        input_size: int,
        output_size: int,
        reduce_output: bool = False,
        bias: bool = False,
        *,
        dtype: torch.dtype = torch.float32,
        stride: int = 1,
        tensor_model_parallel_group=None,
        expert_model_parallel_group=None,
        is_prefill: bool = True,
        is_fused_gate_up: bool = False,
        **quantization,
    ):
        super().__init__()
        L._check_unsupported(
            "QuantizedExpertFusedRowParallel", {}, bias=bias, reduce_output=reduce_output
        )
        self._experts_setup(num_experts, expert_model_parallel_group, is_fused_gate_up)
        L._row_setup(
            self, input_size, output_size, True, False, dtype, stride, tensor_model_parallel_group
        )
        shape = (num_experts, self.input_size_per_partition, output_size)
        self._setup(shape, 1, dtype, stride, **quantization)


QUANTIZED_LAYERS = (
    QuantizedColumnParallel,
    QuantizedRowParallel,
    QuantizedExpertFusedColumnParallel,
    QuantizedExpertFusedRowParallel,
)
