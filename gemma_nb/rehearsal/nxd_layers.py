"""NxD's parallel state, mappings and linear layers as cpu stand-ins (neuronx-distributed 0.18's
contracts). Collectives go to a gloo group, the emulated NeuronCores (``spmd=True``), or nowhere
(one rank's graph: its partial sums)."""

import contextlib
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from gemma_nb.rehearsal import spmd  # noqa: F401 (defines torch.ops.nxd_emulated)

NXD_CONTRACT_VERSION = (
    "0.18.0"  # the newest public neuronx-distributed source (the Neuron 2.29 release)
)


class ParallelState(NamedTuple):
    """What a stand-in layer captures when built: TP degree, rank, gloo group (or None), emulated
    cores or not."""

    tp: int
    rank: int = 0
    group: object = None
    spmd: bool = False


STATE: ParallelState | None = None  # the one being built in (use_state), or None


@contextlib.contextmanager
def use_state(state: ParallelState):
    """The parallel state the stand-in layers read at construction (and keep for their forward), for
    the duration."""
    global STATE
    previous, STATE = STATE, state
    try:
        yield state
    finally:
        STATE = previous


def model_parallel(tp: int, rank: int = 0, group=None):
    assert type(tp) is int and 0 <= rank < tp, (tp, rank)
    assert group is None or (dist.get_world_size(group), dist.get_rank(group)) == (tp, rank), (
        "tp, rank != the group's"
    )
    return use_state(ParallelState(tp, rank, group))


def current_state() -> ParallelState:
    if STATE is None:
        raise RuntimeError(
            "the stand-in NxD layers need a parallel state: build them inside "
            "gemma_nb.rehearsal.standins.model_parallel(tp, rank, group)"
        )
    return STATE


def _divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what}={numerator} is not divisible by tp={denominator}")
    return numerator // denominator


def set_tensor_model_parallel_attributes(
    tensor: torch.Tensor,
    is_parallel: bool,
    dim: int,
    stride: int,
    num_partitions: int,
    rank_ordering: list | None = None,
) -> None:
    """NxD's tags on a parameter; like NxD, refuses to tag a tensor twice, and a ``rank_ordering``
    missing a rank."""
    tags = {
        "tensor_model_parallel": is_parallel,
        "partition_dim": dim,
        "partition_stride": stride,
        "num_partitions": num_partitions,
        "rank_ordering": rank_ordering,
    }
    carried = [name for name in tags if hasattr(tensor, name)]
    assert not carried, f"tensor already carries {carried}"
    if rank_ordering is not None and any(
        rank not in rank_ordering for rank in range(num_partitions)
    ):
        raise ValueError(
            f"all ranks 0...{num_partitions} must be present in given rank ordering {rank_ordering}"
        )
    vars(tensor).update(tags)


def reduce_from_tensor_model_parallel_region(input_, process_group=None):
    """All-reduce (sum) over the TP group, in the input's dtype; identity at tp=1 or without a
    group."""
    state = process_group or current_state()
    if state.tp > 1 and state.spmd:
        # the emulated cores' sum, in the input's dtype
        return torch.ops.nxd_emulated.all_reduce(input_)
    if state.tp == 1 or state.group is None:
        return input_
    output = input_.clone()
    dist.all_reduce(output, op=dist.ReduceOp.SUM, group=state.group)
    return output


def gather_from_tensor_model_parallel_region(input_, process_group=None):
    """All-gather along the last dim over the TP group; identity at tp=1 or without a group."""
    state = process_group or current_state()
    if state.tp > 1 and state.spmd:
        return torch.ops.nxd_emulated.all_gather(input_, input_.dim() - 1)  # in rank order
    if state.tp == 1 or state.group is None:
        return input_
    parts = [torch.empty_like(input_) for _ in range(state.tp)]
    dist.all_gather(parts, input_.contiguous(), group=state.group)
    return torch.cat(parts, dim=-1).contiguous()


def _check_unsupported(cls: str, unsupported: dict, **flags) -> None:
    """Refuse arguments the stand-in does not implement: unknown ones, and features switched on."""
    used = sorted(unsupported) + sorted(name for name, value in flags.items() if value)
    if used:
        raise TypeError(
            f"the cpu stand-in {cls} does not implement {used}; it keeps only what "
            "gemma_nb.neuron uses"
        )


def _column_setup(
    layer: nn.Module,
    input_size: int,
    output_size: int,
    gather_output: bool,
    dtype,
    stride: int,
    pad: bool,
    group,
) -> None:
    """The sizes both column-parallel stand-ins set, as NxD's: the padded output, this rank's
    share."""
    layer.tensor_parallel_group = group or current_state()
    tp = layer.tensor_parallel_group.tp
    layer.input_size, layer.gather_output = input_size, gather_output
    layer.stride, layer.dtype = stride, dtype
    layer.pad, layer.pad_size = pad, (-output_size) % tp if pad else 0
    layer.output_size = output_size + layer.pad_size
    layer.output_size_per_partition = _divide(layer.output_size, tp, "output_size")


def _row_setup(
    layer: nn.Module,
    input_size: int,
    output_size: int,
    input_is_parallel: bool,
    reduce_output: bool,
    dtype,
    stride: int,
    group,
) -> None:
    """The sizes the row-parallel stand-ins set, as NxD's do (``input_size_per_partition``)."""
    # NxD's default scatters the input first; gemma_nb.neuron feeds them shards
    if not input_is_parallel:
        raise TypeError(
            "the cpu stand-in row-parallel layers take input_is_parallel=True only, as "
            "gemma_nb.neuron builds them"
        )
    layer.tensor_parallel_group = group or current_state()
    layer.input_size, layer.output_size = input_size, output_size
    layer.input_is_parallel = input_is_parallel
    layer.reduce_output, layer.stride, layer.dtype = reduce_output, stride, dtype
    layer.input_size_per_partition = _divide(
        input_size, layer.tensor_parallel_group.tp, "input_size"
    )


def _tagged_weight(
    layer: nn.Module, shape, dtype, device, partition_dim: int, stride: int, rank_ordering=None
) -> None:
    # frozen, no bias
    layer.weight = nn.Parameter(
        torch.empty(*shape, dtype=dtype, device=device), requires_grad=False
    )
    # tagged after registration, as NxD does: on the parameter init_on_device's hook left in the
    # module
    set_tensor_model_parallel_attributes(
        layer.weight, True, partition_dim, stride, layer.tensor_parallel_group.tp, rank_ordering
    )
    layer.register_parameter("bias", None)


class BaseParallelLinear(nn.Module):
    """Shared by the stand-in linear layers: the captured parallel state, the tagged weight."""


class ColumnParallelLinear(BaseParallelLinear):
    """``weight [out/tp, in]``; output ``[..., out/tp]``, or all-gathered ``[..., out]`` with
    ``gather_output``."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = True,
        gather_output: bool = True,
        dtype: torch.dtype = torch.float32,
        device=None,
        stride: int = 1,
        pad: bool = False,
        tensor_model_parallel_group=None,
        reduce_dtype: torch.dtype = torch.float32,
        init_method=None,
        sequence_parallel_enabled: bool = False,
        keep_master_weight: bool = False,
        skip_bias_add: bool = False,
        **unsupported,
    ):
        super().__init__()
        _check_unsupported(
            "ColumnParallelLinear",
            unsupported,
            bias=bias,
            skip_bias_add=skip_bias_add,
            sequence_parallel_enabled=sequence_parallel_enabled,
        )
        _column_setup(
            self,
            input_size,
            output_size,
            gather_output,
            dtype,
            stride,
            pad,
            tensor_model_parallel_group,
        )
        _tagged_weight(self, (self.output_size_per_partition, input_size), dtype, device, 0, stride)

    def forward(self, input_):
        output = F.linear(input_, self.weight)
        if self.gather_output:
            output = gather_from_tensor_model_parallel_region(output, self.tensor_parallel_group)
            if self.pad_size:
                output = output.narrow(-1, 0, self.output_size - self.pad_size)
        return output

    def preshard_hook(self, state_dict: dict, prefix: str) -> None:
        if self.pad_size and prefix in state_dict:
            state_dict[prefix] = F.pad(state_dict[prefix], (0, 0, 0, self.pad_size))


class RowParallelLinear(BaseParallelLinear):
    """``weight [out, in/tp]``; all-reduces the output in ``reduce_dtype`` (fp32) and casts back."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = True,
        input_is_parallel: bool = False,
        dtype: torch.dtype = torch.float32,
        device=None,
        stride: int = 1,
        pad: bool = False,
        reduce_output: bool = True,
        tensor_model_parallel_group=None,
        reduce_dtype: torch.dtype = torch.float32,
        init_method=None,
        sequence_parallel_enabled: bool = False,
        keep_master_weight: bool = False,
        skip_bias_add: bool = False,
        **unsupported,
    ):
        super().__init__()
        _check_unsupported(
            "RowParallelLinear",
            unsupported,
            bias=bias,
            skip_bias_add=skip_bias_add,
            pad=pad,
            sequence_parallel_enabled=sequence_parallel_enabled,
        )
        _row_setup(
            self,
            input_size,
            output_size,
            input_is_parallel,
            reduce_output,
            dtype,
            stride,
            tensor_model_parallel_group,
        )
        self.reduce_dtype = reduce_dtype
        _tagged_weight(self, (output_size, self.input_size_per_partition), dtype, device, 1, stride)

    def forward(self, input_):
        output = F.linear(input_, self.weight)
        if self.reduce_output:
            output = reduce_from_tensor_model_parallel_region(
                output.to(self.reduce_dtype), self.tensor_parallel_group
            ).to(output.dtype)
        return output
