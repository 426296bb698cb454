"""CPU stand-ins for the neuronx-distributed pieces the neuron build uses. NOT the Neuron SDK.

These classes and functions prove *this repo's* sharding, checkpoint conversion, KV-state and graph
code on a cpu, under real ``torch.distributed`` (gloo) when there are two ranks. They prove nothing
about the SDK itself: its layers, neuronx-cc, the NeuronCore's HBM or its speed need an inf2.

They are our own code, written after reading the contracts in neuronx-distributed **0.18.0** (the
newest public source, the Neuron 2.29 release; the notebooks run against 0.19 from SDK 2.31), in
aws-neuron/neuronx-distributed:

- ``parallel_layers/layers.py``: ``ColumnParallelLinear`` holds ``weight [out/tp, in]`` split on
  dim 0, ``RowParallelLinear`` ``weight [out, in/tp]`` split on dim 1, both tagged with
  ``tensor_model_parallel``, ``partition_dim``, ``partition_stride``, ``num_partitions``;
  ``RowParallelLinear`` all-reduces in ``reduce_dtype`` (fp32 by default) and casts back;
  ``SPMDRank.rank`` is an int32 ``[1]`` parameter split on dim 0, loaded from ``arange(tp)``.
- ``parallel_layers/mappings.py``: ``gather_from_tensor_model_parallel_region`` all-gathers the last
  dim, ``reduce_from_tensor_model_parallel_region`` all-reduces (sum),
  ``scatter_to_process_group_spmd`` keeps the ``rank``-th slice with ``index_select``.
- ``quantization/quantization_layers.py``: ``QuantizedColumnParallel`` / ``QuantizedRowParallel``
  hold an int8 ``weight`` and an fp32 ``scale``; per-channel (axis 0) the scale is ``[out/tp, 1]``,
  split with the rows, in the column layer and ``[out, 1]``, replicated, in the row layer. The
  forward upcasts the weight to the input's dtype, matmuls, then calls the module-level
  ``scale_dequantize(output, scale.T, output.dtype)`` (looked up at call time, which is why a
  patch of ``quantization_layers.scale_dequantize`` takes effect); the row layer all-reduces in
  the output's own dtype. ``QuantizedColumnParallel`` does not trim a padded vocab.
- ``quantization/dequantize.py``: ``scale_dequantize`` multiplies **in place** by
  ``scale.unsqueeze(len(scale.shape) - 1)``: for ``scale.T [1, out]`` that is ``[1, 1, out]``, which
  broadcasts against a 3-D ``[B, S, out]`` output but not in place against a 2-D ``[T, out]`` one.
  The stand-in keeps exactly that, so a 2-D input fails here as it does on the box unless
  ``gemma_nb.neuron.quant.patch_scale_dequantize`` is applied.
- ``trace/trace.py`` ``shard_children`` and ``trace/model_builder.py`` ``shard_checkpoint``: for every
  parallel module, each direct parameter found in the checkpoint is cut along ``partition_dim``
  with ``partition_stride`` if it carries ``tensor_model_parallel``, kept whole otherwise, then
  checked: ``expected shape ... for ... but found ...``. Before that the checkpoint is padded by
  the modules' ``preshard_hook``, stripped of keys the module does not have, and cast to each
  parameter's dtype (``cast_weights``).
- ``utils/model_utils.py`` ``init_on_device(meta, force_custom_init_on_device=True)``: ModelBuilder
  builds the module for sharding with every registered parameter moved to the meta device,
  attributes kept; buffers stay where they are.

Parallel state: :func:`model_parallel` sets what the layers read when they are built (the TP
degree, this rank, the gloo group). With ``group`` a real ``torch.distributed`` process group of
``tp`` ranks, the mappings run real collectives. With ``group=None`` and ``tp > 1`` the layers hold
one rank's shard shapes and every collective is the identity: that mode only lets one rank's graph
be built, lowered or inspected in a single process; its numbers are not the sharded model's.
"""

from __future__ import annotations

import contextlib
import enum
from dataclasses import dataclass
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

NXD_CONTRACT_VERSION = "0.18.0"

_PARALLEL_ATTRIBUTES = ("tensor_model_parallel", "partition_dim", "partition_stride", "num_partitions")


# --------------------------------------------------------------------------------------------
# Parallel state
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ParallelState:
    """What a stand-in layer captures when it is built: TP degree, this rank, the gloo group (or None)."""

    tp: int
    rank: int = 0
    group: object = None

    def size(self) -> int:
        return self.tp


_STATE: ParallelState | None = None


@contextlib.contextmanager
def model_parallel(tp: int, rank: int = 0, group=None):
    """Set the parallel state the stand-in layers read at construction (and keep for their forward).

    ``group``: a ``torch.distributed`` process group of ``tp`` ranks (gloo) in which this process is
    ``rank``; collectives then run for real. ``group=None`` with ``tp > 1``: one rank's shard
    shapes, collectives as identities, for building or lowering a single rank's graph in one
    process only (its outputs are that rank's partial sums, not the model's).
    """
    global _STATE
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp={tp!r} must be a positive integer (the port used 2)")
    if not 0 <= rank < tp:
        raise ValueError(f"rank={rank} is outside 0..{tp - 1} for tp={tp}")
    if group is not None:
        import torch.distributed as dist

        if dist.get_world_size(group) != tp:
            raise ValueError(f"the process group has {dist.get_world_size(group)} ranks but tp={tp}; "
                             "start one rank per shard")
        if dist.get_rank(group) != rank:
            raise ValueError(f"rank={rank} but this process is rank {dist.get_rank(group)} of the group")
    previous, _STATE = _STATE, ParallelState(tp, rank, group)
    try:
        yield _STATE
    finally:
        _STATE = previous


def current_state() -> ParallelState:
    if _STATE is None:
        raise RuntimeError("the stand-in NxD layers need a parallel state: build them inside "
                           "gemma_nb.neuron.standins.model_parallel(tp, rank, group)")
    return _STATE


def _divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what}={numerator} is not divisible by tp={denominator}")
    return numerator // denominator


def set_tensor_model_parallel_attributes(tensor: torch.Tensor, is_parallel: bool, dim: int, stride: int,
                                         num_partitions: int) -> None:
    """NxD's tags on a parameter; like NxD, refuses to tag a tensor twice."""
    for name in _PARALLEL_ATTRIBUTES:
        if hasattr(tensor, name):
            raise AssertionError(f"tensor already carries {name}")
    tensor.tensor_model_parallel = is_parallel
    tensor.partition_dim = dim
    tensor.partition_stride = stride
    tensor.num_partitions = num_partitions


# --------------------------------------------------------------------------------------------
# Mappings (parallel_layers/mappings.py)
# --------------------------------------------------------------------------------------------
def _group(process_group) -> ParallelState:
    return process_group if process_group is not None else current_state()


def copy_to_tensor_model_parallel_region(input_, process_group=None):
    return input_


def reduce_from_tensor_model_parallel_region(input_, process_group=None):
    """All-reduce (sum) over the TP group, in the input's dtype; identity at tp=1 or without a group."""
    state = _group(process_group)
    if state.tp == 1 or state.group is None:
        return input_
    import torch.distributed as dist

    output = input_.clone()
    dist.all_reduce(output, op=dist.ReduceOp.SUM, group=state.group)
    return output


def gather_from_tensor_model_parallel_region(input_, process_group=None):
    """All-gather along the last dim over the TP group; identity at tp=1 or without a group."""
    state = _group(process_group)
    if state.tp == 1 or state.group is None:
        return input_
    import torch.distributed as dist

    parts = [torch.empty_like(input_) for _ in range(state.tp)]
    dist.all_gather(parts, input_.contiguous(), group=state.group)
    return torch.cat(parts, dim=-1).contiguous()


def scatter_to_tensor_model_parallel_region(input_, process_group=None):
    """This rank's slice of the last dim (the rank known to the process, as in NxD)."""
    state = _group(process_group)
    if state.tp == 1:
        return input_
    size = _divide(input_.shape[-1], state.tp, "last dim")
    return input_.narrow(-1, state.rank * size, size)


def scatter_to_process_group_spmd(input_, partition_dim: int, rank: torch.Tensor, process_group=None):
    """The ``rank``-th slice along ``partition_dim``, with ``rank`` a tensor (SPMD: one trace, every rank)."""
    state = _group(process_group)
    if input_.size(partition_dim) % state.tp:
        raise AssertionError(f"tensor dim to scatter ({input_.size(partition_dim)}) must be multiple of group "
                             f"size ({state.tp})")
    per_rank = input_.size(partition_dim) // state.tp
    indices = torch.arange(per_rank, device=input_.device) + rank.to(input_.device) * per_rank
    return torch.index_select(input_, partition_dim, indices.reshape(-1))


mappings = SimpleNamespace(
    copy_to_tensor_model_parallel_region=copy_to_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region=reduce_from_tensor_model_parallel_region,
    gather_from_tensor_model_parallel_region=gather_from_tensor_model_parallel_region,
    scatter_to_tensor_model_parallel_region=scatter_to_tensor_model_parallel_region,
    scatter_to_process_group_spmd=scatter_to_process_group_spmd,
)


# --------------------------------------------------------------------------------------------
# Layers (parallel_layers/layers.py)
# --------------------------------------------------------------------------------------------
def _check_unsupported(cls: str, unsupported: dict, **flags) -> None:
    """Refuse arguments the stand-in does not implement: unknown ones, and features switched on."""
    used = sorted(unsupported) + sorted(name for name, value in flags.items() if value)
    if used:
        raise TypeError(f"the cpu stand-in {cls} does not implement {used}; it keeps only what gemma_nb.neuron uses")


def _padding(size: int, multiple: int) -> int:
    return (-size) % multiple


def _column_setup(layer: nn.Module, input_size: int, output_size: int, gather_output: bool, dtype, stride: int,
                  pad: bool, group) -> int:
    """The sizes both column-parallel stand-ins set, as NxD's do: the padded output and this rank's
    share of it (``output_size_per_partition``). Returns the TP degree."""
    layer.tensor_parallel_group = group or current_state()
    tp = layer.tensor_parallel_group.tp
    layer.input_size, layer.gather_output, layer.stride, layer.dtype = input_size, gather_output, stride, dtype
    layer.pad, layer.pad_size = pad, _padding(output_size, tp) if pad else 0
    layer.output_size = output_size + layer.pad_size
    layer.output_size_per_partition = _divide(layer.output_size, tp, "output_size")
    return tp


class BaseParallelLinear(nn.Module):
    """Shared by the stand-in linear layers: the captured parallel state and the tagged weight."""

    def _make_weight(self, shape, dtype, device, partition_dim: int, stride: int) -> None:
        self.weight = nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)
        # Tagged after registration, as NxD does (on meta or on cpu): init_on_device's hook has
        # replaced the parameter by then, so the tags land on the one the module holds.
        set_tensor_model_parallel_attributes(self.weight, True, partition_dim, stride, self.tensor_parallel_group.tp)


class ColumnParallelLinear(BaseParallelLinear):
    """``weight [out/tp, in]``; output ``[..., out/tp]``, or all-gathered ``[..., out]`` with ``gather_output``."""

    def __init__(self, input_size: int, output_size: int, bias: bool = True, gather_output: bool = True,
                 dtype: torch.dtype = torch.float32, device=None, stride: int = 1, pad: bool = False,
                 tensor_model_parallel_group=None, reduce_dtype: torch.dtype = torch.float32,
                 init_method=None, sequence_parallel_enabled: bool = False, keep_master_weight: bool = False,
                 skip_bias_add: bool = False, **unsupported):
        super().__init__()
        _check_unsupported("ColumnParallelLinear", unsupported, sequence_parallel_enabled=sequence_parallel_enabled,
                           skip_bias_add=skip_bias_add)
        tp = _column_setup(self, input_size, output_size, gather_output, dtype, stride, pad,
                           tensor_model_parallel_group)
        self._make_weight((self.output_size_per_partition, input_size), dtype, device, 0, stride)
        if bias:
            size = self.output_size if gather_output else self.output_size_per_partition
            self.bias = nn.Parameter(torch.zeros(size, dtype=dtype, device=device), requires_grad=False)
            if not gather_output:
                set_tensor_model_parallel_attributes(self.bias, True, 0, stride, tp)
        else:
            self.register_parameter("bias", None)

    def forward(self, input_):
        output = F.linear(input_, self.weight)
        if self.gather_output:
            output = gather_from_tensor_model_parallel_region(output, self.tensor_parallel_group)
            if self.pad_size:
                output = output.narrow(-1, 0, self.output_size - self.pad_size)
        return output + self.bias if self.bias is not None else output

    def preshard_hook(self, state_dict: dict, prefix: str) -> None:
        if self.pad_size and prefix in state_dict:
            state_dict[prefix] = F.pad(state_dict[prefix], (0, 0, 0, self.pad_size))


class RowParallelLinear(BaseParallelLinear):
    """``weight [out, in/tp]``; all-reduces the output in ``reduce_dtype`` (fp32) and casts back."""

    def __init__(self, input_size: int, output_size: int, bias: bool = True, input_is_parallel: bool = False,
                 dtype: torch.dtype = torch.float32, device=None, stride: int = 1, pad: bool = False,
                 reduce_output: bool = True, tensor_model_parallel_group=None,
                 reduce_dtype: torch.dtype = torch.float32, init_method=None,
                 sequence_parallel_enabled: bool = False, keep_master_weight: bool = False,
                 skip_bias_add: bool = False, **unsupported):
        super().__init__()
        _check_unsupported("RowParallelLinear", unsupported, sequence_parallel_enabled=sequence_parallel_enabled,
                           skip_bias_add=skip_bias_add, pad=pad)
        self.tensor_parallel_group = tensor_model_parallel_group or current_state()
        tp = self.tensor_parallel_group.tp
        self.input_size, self.output_size, self.input_is_parallel = input_size, output_size, input_is_parallel
        self.reduce_output, self.reduce_dtype, self.stride, self.dtype = reduce_output, reduce_dtype, stride, dtype
        self.input_size_per_partition = _divide(input_size, tp, "input_size")
        self._make_weight((output_size, self.input_size_per_partition), dtype, device, 1, stride)
        if bias:
            self.bias = nn.Parameter(torch.zeros(output_size, dtype=dtype, device=device), requires_grad=False)
        else:
            self.register_parameter("bias", None)

    def forward(self, input_):
        if not self.input_is_parallel:
            input_ = scatter_to_tensor_model_parallel_region(input_, self.tensor_parallel_group)
        output = F.linear(input_, self.weight)
        if self.reduce_output:
            dtype = output.dtype
            output = reduce_from_tensor_model_parallel_region(output.to(self.reduce_dtype), self.tensor_parallel_group)
            output = output.to(dtype)
        return output + self.bias if self.bias is not None else output


class SPMDRank(nn.Module):
    """``rank`` int32 ``[1]``, split on dim 0: load ``arange(world_size)`` and each rank holds its id."""

    def __init__(self, world_size: int, tensor_model_parallel_size: int | None = None):
        super().__init__()
        self.world_size = world_size
        self.rank = nn.Parameter(torch.zeros(1, dtype=torch.int32), requires_grad=False)
        set_tensor_model_parallel_attributes(self.rank, True, 0, 1, world_size)

    def get_rank(self) -> torch.Tensor:
        return self.rank


# --------------------------------------------------------------------------------------------
# Quantization (quantization/quantization_config.py, dequantize.py, quantization_layers.py)
# --------------------------------------------------------------------------------------------
class QuantizationType(enum.Enum):
    PER_TENSOR_SYMMETRIC = "per_tensor_symmetric"
    PER_CHANNEL_SYMMETRIC = "per_channel_symmetric"


class QuantizedDtype(enum.Enum):
    INT8 = torch.int8
    F8E4M3 = torch.float8_e4m3fn


def sdk_scale_dequantize(tensor: torch.Tensor, scale: torch.Tensor, upcast_dtype: torch.dtype) -> torch.Tensor:
    """NxD 0.18's ``scale_dequantize`` as written: fp32 upcast, **in-place** multiply by
    ``scale.unsqueeze(len(scale.shape) - 1)``, cast. A 2-D ``[T, out]`` tensor with ``scale.T
    [1, out]`` raises (the broadcast shape is ``[1, T, out]``), as on the box."""
    upcast = tensor.to(torch.float32)
    upcast *= scale.unsqueeze(len(scale.shape) - 1)
    return upcast.to(upcast_dtype)


def direct_cast_dequantize(tensor: torch.Tensor, upcast_dtype: torch.dtype) -> torch.Tensor:
    return tensor.to(upcast_dtype)


class _QuantizedLinear(nn.Module):
    """Shared by the quantized stand-ins: int8 ``weight``, fp32 ``scale``, the SDK's dequant order."""

    quantization_layers: SimpleNamespace  # set per cpu_sdk(): where scale_dequantize is looked up

    def _setup(self, weight_shape, partition_dim: int, quantization_type, quantized_dtype,
               quantization_per_channel_axis, stride: int, device, scale_dtype) -> None:
        self.quantization_type = QuantizationType(quantization_type)
        self.quantized_dtype = QuantizedDtype(quantized_dtype)
        tp = self.tensor_parallel_group.tp
        self.weight = nn.Parameter(torch.empty(*weight_shape, dtype=self.quantized_dtype.value, device=device),
                                   requires_grad=False)
        set_tensor_model_parallel_attributes(self.weight, True, partition_dim, stride, tp)
        if scale_dtype != torch.float32:
            raise TypeError(f"scale_dtype={scale_dtype}: the stand-ins keep NxD's per-channel fp32 scales only")
        if self.quantization_type == QuantizationType.PER_TENSOR_SYMMETRIC:
            self.scale = nn.Parameter(torch.ones(1, device=device), requires_grad=False)
            set_tensor_model_parallel_attributes(self.scale, False, 0, 1, 1)
            return
        axis = 0 if quantization_per_channel_axis is None else quantization_per_channel_axis
        if axis != 0:
            raise AssertionError("Only per_channel_axis=0 supported for post-matmul output dequantization")
        scale_shape = [1] * len(weight_shape)
        scale_shape[axis] = weight_shape[axis]
        self.scale = nn.Parameter(torch.ones(scale_shape, device=device), requires_grad=False)
        if partition_dim == axis:  # the scale is split with the rows it scales
            set_tensor_model_parallel_attributes(self.scale, True, partition_dim, stride, tp)
        else:
            set_tensor_model_parallel_attributes(self.scale, False, 0, 1, 1)

    def _dequantized_matmul(self, input_):
        output = F.linear(input_, direct_cast_dequantize(self.weight, input_.dtype))
        return self.quantization_layers.scale_dequantize(tensor=output, scale=self.scale.T, upcast_dtype=output.dtype)


class QuantizedColumnParallel(_QuantizedLinear):
    """int8 ``weight [out/tp, in]``, fp32 ``scale [out/tp, 1]`` (per channel) split with the rows."""

    def __init__(self, input_size: int, output_size: int, bias: bool = True,
                 quantization_type="per_tensor_symmetric", gather_output: bool = True,
                 dtype: torch.dtype = torch.float32, quantized_dtype=QuantizedDtype.INT8, device=None,
                 stride: int = 1, quantization_per_channel_axis: int | None = None,
                 scale_dtype: torch.dtype = torch.float32, tensor_model_parallel_group=None, pad: bool = False,
                 sequence_parallel_enabled: bool = False, keep_master_weight: bool = False, **unsupported):
        super().__init__()
        _check_unsupported("QuantizedColumnParallel", unsupported, bias=bias,
                           sequence_parallel_enabled=sequence_parallel_enabled)
        _column_setup(self, input_size, output_size, gather_output, dtype, stride, pad, tensor_model_parallel_group)
        self._setup((self.output_size_per_partition, input_size), 0, quantization_type, quantized_dtype,
                    quantization_per_channel_axis, stride, device, scale_dtype)
        self.register_parameter("bias", None)

    def forward(self, input_):
        output = self._dequantized_matmul(input_)
        if self.gather_output:  # no trim of a padded vocab: NxD 0.18's quantized layer leaves it on
            output = gather_from_tensor_model_parallel_region(output, self.tensor_parallel_group)
        return output

    def preshard_hook(self, state_dict: dict, prefix: str) -> None:
        if self.pad_size and prefix in state_dict:
            state_dict[prefix] = F.pad(state_dict[prefix], (0, 0, 0, self.pad_size))
            scale = prefix.replace(".weight", ".scale")
            state_dict[scale] = F.pad(state_dict[scale], (0, 0, 0, self.pad_size))


class QuantizedRowParallel(_QuantizedLinear):
    """int8 ``weight [out, in/tp]``, fp32 ``scale [out, 1]`` replicated; all-reduce in the output dtype."""

    def __init__(self, input_size: int, output_size: int, bias: bool = True,
                 quantization_type="per_tensor_symmetric", input_is_parallel: bool = False,
                 dtype: torch.dtype = torch.float32, quantized_dtype=QuantizedDtype.INT8, device=None,
                 stride: int = 1, quantization_per_channel_axis: int | None = None, reduce_output: bool = True,
                 scale_dtype: torch.dtype = torch.float32, tensor_model_parallel_group=None, pad: bool = False,
                 sequence_parallel_enabled: bool = False, keep_master_weight: bool = False, **unsupported):
        super().__init__()
        _check_unsupported("QuantizedRowParallel", unsupported, bias=bias, pad=pad,
                           sequence_parallel_enabled=sequence_parallel_enabled)
        self.tensor_parallel_group = tensor_model_parallel_group or current_state()
        tp = self.tensor_parallel_group.tp
        self.input_size, self.output_size, self.input_is_parallel = input_size, output_size, input_is_parallel
        self.reduce_output, self.stride, self.dtype = reduce_output, stride, dtype
        self.input_size_per_partition = _divide(input_size, tp, "input_size")
        self._setup((output_size, self.input_size_per_partition), 1, quantization_type, quantized_dtype,
                    quantization_per_channel_axis, stride, device, scale_dtype)
        self.register_parameter("bias", None)

    def forward(self, input_):
        if not self.input_is_parallel:
            input_ = scatter_to_tensor_model_parallel_region(input_, self.tensor_parallel_group)
        output = self._dequantized_matmul(input_)
        if self.reduce_output:
            output = reduce_from_tensor_model_parallel_region(output, self.tensor_parallel_group)
        return output


_SHARDED_MODULES = (BaseParallelLinear, _QuantizedLinear, SPMDRank)


def cpu_sdk() -> SimpleNamespace:
    """The stand-ins under the attribute names ``gemma_nb.neuron.build._import_sdk()`` returns.

    Each call has its own ``quantization_layers`` namespace (holding the SDK's ``scale_dequantize``
    as written), so patching one instance leaves the others as the SDK ships. Build layers from it
    inside :func:`model_parallel`.
    """
    quantization_layers = SimpleNamespace(scale_dequantize=sdk_scale_dequantize,
                                          direct_cast_dequantize=direct_cast_dequantize)
    bound = {"quantization_layers": quantization_layers}
    column = type("QuantizedColumnParallel", (QuantizedColumnParallel,), bound)
    row = type("QuantizedRowParallel", (QuantizedRowParallel,), bound)
    quantization_layers.QuantizedColumnParallel, quantization_layers.QuantizedRowParallel = column, row
    return SimpleNamespace(
        ColumnParallelLinear=ColumnParallelLinear, RowParallelLinear=RowParallelLinear, SPMDRank=SPMDRank,
        scatter_to_process_group_spmd=scatter_to_process_group_spmd, mappings=mappings,
        quantization_layers=quantization_layers, QuantizationType=QuantizationType, QuantizedDtype=QuantizedDtype,
        QuantizedColumnParallel=column, QuantizedRowParallel=row, is_standin=True,
    )


# --------------------------------------------------------------------------------------------
# ModelBuilder's checkpoint path (model_utils.init_on_device, trace.shard_children)
# --------------------------------------------------------------------------------------------
@contextlib.contextmanager
def init_on_meta():
    """Like NxD's ``init_on_device(torch.device("meta"), force_custom_init_on_device=True)``: every
    parameter registered inside is replaced by a meta copy of the same class, its ``__dict__``
    (attributes) and ``requires_grad`` kept; buffers are left where they are."""
    meta = torch.device("meta")
    original = nn.Module.register_parameter

    def register_on_meta(module, name, param):
        original(module, name, param)
        if param is not None and param.device != meta:
            held = module._parameters[name]
            kwargs = dict(held.__dict__, requires_grad=held.requires_grad)
            module._parameters[name] = type(held)(held.to(meta), **kwargs)

    nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = original


def _local_slice(tensor: torch.Tensor, rank: int, parts: int, dim: int, stride: int) -> torch.Tensor:
    """NxD's ``create_local_weight``: split into ``parts * stride`` chunks, keep every ``parts``-th from ``rank``."""
    per_partition = tensor.shape[dim] // parts
    if per_partition * parts != tensor.shape[dim] or per_partition % stride:
        raise RuntimeError(f"cannot split dim {dim} of size {tensor.shape[dim]} into {parts} partitions "
                           f"with stride {stride}")
    chunks = torch.split(tensor, per_partition // stride, dim=dim)[rank::parts]
    return torch.cat(chunks, dim=dim) if stride > 1 else chunks[0]


def shard_checkpoint(module: nn.Module, checkpoint: dict, rank: int, tp: int) -> dict:
    """Rank ``rank``'s checkpoint as ModelBuilder makes it from the full one (a new dict).

    ``module``: built as ModelBuilder builds it for sharding (see :func:`init_on_meta`), inside
    ``model_parallel(tp)``. Steps as in NxD 0.18: ``preshard_hook``\\ s (vocab padding), keys the
    module does not have dropped, each tensor cast to its parameter's dtype, then every parallel
    module's direct parameters cut by their ``tensor_model_parallel`` / ``partition_dim`` /
    ``partition_stride`` tags (untagged or non-parallel ones kept whole) and checked against the
    parameter's shape: ``RuntimeError("expected shape ... for ... but found ...")`` on a mismatch.
    """
    if not 0 <= rank < tp:
        raise ValueError(f"rank={rank} is outside 0..{tp - 1} for tp={tp}")
    state = dict(checkpoint)
    for name, child in module.named_modules():
        if hasattr(child, "preshard_hook"):
            child.preshard_hook(state, f"{name}.weight" if name else "weight")
    own = module.state_dict(keep_vars=True)
    state = {k: v for k, v in state.items() if k in own}
    for key, tensor in state.items():
        if isinstance(own[key], nn.Parameter) and tensor.dtype != own[key].dtype:
            state[key] = tensor.to(own[key].dtype)  # ModelBuilder.cast_weights
    for prefix, child in module.named_modules():
        if not isinstance(child, _SHARDED_MODULES):
            continue
        for name, parameter in child.named_parameters(recurse=False):
            key = f"{prefix}.{name}" if prefix else name
            if key not in state:
                continue
            tensor = state[key]
            if getattr(parameter, "tensor_model_parallel", False):
                parts = parameter.num_partitions
                tensor = _local_slice(tensor, rank % parts, parts, parameter.partition_dim, parameter.partition_stride)
            if tuple(tensor.shape) != tuple(parameter.shape):
                raise RuntimeError(f"expected shape {parameter.shape} for {key} but found {tensor.shape}")
            state[key] = tensor
    return state


def load_rank_module(factory, checkpoint: dict, tp: int, rank: int, group=None,
                     not_in_checkpoint: tuple[str, ...] = ()) -> nn.Module:
    """Build ``factory()`` for rank ``rank`` and load its shard of the full ``checkpoint``, as ModelBuilder does.

    First the module is built on meta (:func:`init_on_meta`) and the checkpoint sharded against it
    (:func:`shard_checkpoint`), as ModelBuilder's ``shard_checkpoint`` does; then it is built again
    for real under ``model_parallel(tp, rank, group)`` and the shard loaded: every shard key must be
    a key of the module, and every parameter the shard lacks (other than those whose names start
    with one of ``not_in_checkpoint``, e.g. runtime state such as a KV cache) is named in the error.
    """
    with model_parallel(tp, rank), init_on_meta():
        skeleton = factory()
    shard = shard_checkpoint(skeleton, checkpoint, rank, tp)
    del skeleton
    with model_parallel(tp, rank, group):
        module = factory()
    parameters = dict(module.named_parameters())
    missing = [k for k in parameters if k not in shard and not k.startswith(tuple(not_in_checkpoint))]
    if missing:
        raise RuntimeError(f"the rank-{rank} shard holds no value for {len(missing)} parameters, e.g. {missing[:3]}")
    with torch.no_grad():
        for key, tensor in shard.items():
            target = module.get_parameter(key) if key in parameters else module.get_buffer(key)
            if target.shape != tensor.shape or target.dtype != tensor.dtype:
                raise RuntimeError(f"{key}: the module holds {tuple(target.shape)} {target.dtype}, the rank-{rank} "
                                   f"shard {tuple(tensor.shape)} {tensor.dtype}")
            target.copy_(tensor)
    return module


__all__ = [
    "NXD_CONTRACT_VERSION", "ParallelState", "model_parallel", "current_state", "cpu_sdk", "mappings",
    "ColumnParallelLinear", "RowParallelLinear", "SPMDRank", "QuantizedColumnParallel", "QuantizedRowParallel",
    "QuantizationType", "QuantizedDtype", "sdk_scale_dequantize", "scatter_to_process_group_spmd",
    "reduce_from_tensor_model_parallel_region", "gather_from_tensor_model_parallel_region",
    "init_on_meta", "shard_checkpoint", "load_rank_module", "set_tensor_model_parallel_attributes",
]
