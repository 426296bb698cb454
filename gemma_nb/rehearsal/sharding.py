"""ModelBuilder's checkpoint path, emulated as NxD 0.18's ``init_on_device``,
``preprocess_checkpoint``, ``cast_weights`` and ``shard_children``: the module on meta, each
parallel parameter cut by ``partition_dim``, ``rank_ordering`` and stride."""

import contextlib

import torch
from torch import nn

from gemma_nb.rehearsal.nxd_layers import BaseParallelLinear, model_parallel
from gemma_nb.rehearsal.nxd_quant import _QuantizedLinear

SHARDED_MODULES = (BaseParallelLinear, _QuantizedLinear)


@contextlib.contextmanager
def init_on_device(
    device: torch.device, include_buffers: bool = False, force_custom_init_on_device: bool = False
):
    """NxD's ``init_on_device`` (module docstring): parameters registered inside go to
    ``device``."""
    if include_buffers:
        raise NotImplementedError(
            "the emulated init_on_device keeps buffers where they are (include_buffers=False)"
        )
    original = nn.Module.register_parameter

    def register_on_device(module, name, param):
        original(module, name, param)
        if param is None or param.device == device:
            return
        held = module._parameters[name]
        # accelerate's re-creation (NxD without force_custom_init_on_device) loses
        # requires_grad=False
        kwargs = {
            **held.__dict__,
            "requires_grad": held.requires_grad if force_custom_init_on_device else True,
        }
        module._parameters[name] = type(held)(held.to(device), **kwargs)

    nn.Module.register_parameter = register_on_device
    try:
        yield
    finally:
        nn.Module.register_parameter = original


def init_on_meta():  # as ModelBuilder builds
    return init_on_device(torch.device("meta"), force_custom_init_on_device=True)


def local_slice(tensor: torch.Tensor, rank: int, parts: int, dim: int, stride: int) -> torch.Tensor:
    """NxD's ``create_local_weight``: split into ``parts * stride`` chunks, keep every ``parts``-th
    from ``rank``."""
    per_partition = tensor.shape[dim] // parts
    if per_partition * parts != tensor.shape[dim] or per_partition % stride:
        raise RuntimeError(
            f"cannot split dim {dim} of size {tensor.shape[dim]} into {parts} partitions with "
            f"stride {stride}"
        )
    chunks = torch.split(tensor, per_partition // stride, dim=dim)[rank::parts]
    return torch.cat(chunks, dim=dim) if stride > 1 else chunks[0]


def shard_checkpoint(module: nn.Module, checkpoint: dict, rank: int, tp: int) -> dict:
    """Rank ``rank``'s checkpoint (a new dict) as ModelBuilder cuts the full one, in NxD's steps
    (named inline)."""
    assert 0 <= rank < tp, (rank, tp)
    state = dict(checkpoint)
    for path, child in module.named_modules(remove_duplicate=False):  # NxD's invoke_preshard_hooks
        if hasattr(child, "preshard_hook"):
            child.preshard_hook(state, f"{path}.weight" if path else "weight")
    # cast_weights, unknown keys dropped
    own = module.state_dict(keep_vars=True)
    parameters = dict(module.named_parameters())
    state = {
        key: tensor.to(parameters[key].dtype) if key in parameters else tensor
        for key, tensor in state.items()
        if key in own
    }
    for path, child in module.named_modules(remove_duplicate=False):  # NxD's shard_children
        if not isinstance(child, SHARDED_MODULES):
            continue
        for name, parameter in child.named_parameters(recurse=False):
            key = f"{path}.{name}" if path else name
            if key not in state:
                # NxD's get_tensor_from_state_dict; its two messages differ by "the"
                if isinstance(child, _QuantizedLinear):
                    raise RuntimeError(
                        f"Cannot find {key} in "
                        f"{'the state_dict' if name == 'weight' else 'state_dict'}"
                    )
                continue
            # tagged with rank_ordering and the partitions
            if getattr(parameter, "tensor_model_parallel", False):
                ordering, parts = parameter.rank_ordering, parameter.num_partitions
                part = (rank if ordering is None else ordering[rank]) % parts
                state[key] = local_slice(
                    state[key], part, parts, parameter.partition_dim, parameter.partition_stride
                )
            if state[key].shape != parameter.shape:
                raise RuntimeError(
                    f"expected shape {parameter.shape} for {key} but found {state[key].shape}"
                )
    return state


def load_rank_module(
    factory,
    checkpoint: dict,
    tp: int,
    rank: int,
    group=None,
    not_in_checkpoint: tuple[str, ...] = (),
) -> nn.Module:
    """Build ``factory()`` for rank ``rank`` and load its shard of the full ``checkpoint``, as
    ModelBuilder does."""
    with model_parallel(tp, rank), init_on_meta():
        skeleton = factory()
    shard = shard_checkpoint(skeleton, checkpoint, rank, tp)
    with model_parallel(tp, rank, group):
        module = factory()
    parameters = dict(module.named_parameters())
    missing = [
        k for k in parameters if k not in shard and not k.startswith(tuple(not_in_checkpoint))
    ]
    if missing:
        raise RuntimeError(
            f"the rank-{rank} shard holds no value for {len(missing)} parameters, e.g. "
            f"{missing[:3]}"
        )
    with torch.no_grad():
        for key, tensor in shard.items():
            target = module.get_parameter(key) if key in parameters else module.get_buffer(key)
            if target.shape != tensor.shape or target.dtype != tensor.dtype:
                raise RuntimeError(
                    f"{key}: the module holds {tuple(target.shape)} {target.dtype}, the "
                    f"rank-{rank} shard {tuple(tensor.shape)} {tensor.dtype}"
                )
            target.copy_(tensor)
    return module
