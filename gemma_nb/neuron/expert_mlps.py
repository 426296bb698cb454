"""The routed experts on NxD's expert-fused int8 layers (notebooks 04, 07): the port's dense op and
the sparse decode, in NxD Inference's expert-major layout. Not NxD's ``ExpertMLPsV2``: its
activation table has no ``gelu_pytorch_tanh``, and its prefill path needs kernels inf2 lacks."""

from types import SimpleNamespace

import torch
from torch import nn
from transformers.activations import ACT2FN

from gemma_nb.experts import dense_router_weights, gated
from gemma_nb.formats import quantize_int8_per_channel
from gemma_nb.neuron.sdk import import_sdk
from gemma_nb.targets import TargetError


def import_nxd() -> SimpleNamespace:
    """The SDK namespace (``gemma_nb.neuron.sdk.import_sdk``), or ``TargetError`` with the install
    hint."""
    try:
        return import_sdk()
    except ImportError as error:
        raise TargetError(str(error)) from None


def int8_kwargs(sdk, dtype: torch.dtype) -> dict:  # NxD's int8 per-channel (axis 0) layers, no bias
    return dict(
        bias=False,
        dtype=dtype,
        quantized_dtype=sdk.QuantizedDtype.INT8,
        quantization_type=sdk.QuantizationType.PER_CHANNEL_SYMMETRIC,
        quantization_per_channel_axis=0,
    )


class _ExpertMajorExperts(nn.Module):
    """``gate_up [E, H, 2I/tp]`` and ``down [E, I/tp, H]`` per rank: NxD's expert-fused int8
    layers."""

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        tp: int,
        sdk,
        dtype: torch.dtype = torch.bfloat16,
        activation: str = "gelu_pytorch_tanh",
    ):
        super().__init__()
        assert intermediate_size % tp == 0, (
            f"moe_intermediate_size={intermediate_size} is not divisible by tp={tp}"
        )
        self.num_experts, self.hidden_size = num_experts, hidden_size
        self.act_fn = ACT2FN[activation]
        self.reduce = sdk.mappings.reduce_from_tensor_model_parallel_region
        int8 = dict(
            bias=False,
            dtype=dtype,
            quantized_dtype=sdk.QuantizedDtype.INT8,
            scale_dtype=torch.float32,  # expert-wise
            quantization_type=sdk.QuantizationType.EXPERT_WISE_PER_CHANNEL_SYMMETRIC,
            quantization_per_channel_axis=2,
        )
        self.gate_up = sdk.QuantizedExpertFusedColumnParallel(
            num_experts, hidden_size, 2 * intermediate_size, stride=2, is_fused_gate_up=True, **int8
        )
        self.down = sdk.QuantizedExpertFusedRowParallel(
            num_experts, intermediate_size, hidden_size, reduce_output=False, **int8
        )
        rank_shape = (num_experts, hidden_size, 2 * intermediate_size // tp)
        assert tuple(self.gate_up.weight.shape) == rank_shape, f"the SDK's TP is not tp={tp}"

    def _experts(self, hidden_states: torch.Tensor, expert_indices=None) -> torch.Tensor:
        """``hidden_states [T, H]`` through ``expert_indices`` (all when None): this rank's partials
        ``[E', T, H]``."""
        tokens = hidden_states.shape[0]
        gate_up = self.gate_up(
            hidden_states.view(1, 1, tokens, self.hidden_size), expert_indices=expert_indices
        )
        return self.down(gated(gate_up, self.act_fn), expert_indices=expert_indices)[:, 0]

    def _all_reduce(self, partial: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        # fp32 all-reduce, as NxD's RowParallelLinear (reduce_dtype=torch.float32)
        return self.reduce(partial.float(), process_group=self.down.tensor_parallel_group).to(dtype)


class NeuronDenseExperts(_ExpertMajorExperts):
    """The port's dense op: every expert on every token, weighted by the dense router weights; ``[T,
    H]`` out."""

    def forward(self, hidden_states, top_k_index, top_k_weights):
        weights = dense_router_weights(top_k_index, top_k_weights, self.num_experts)  # [T, E] fp32
        outputs = self._experts(hidden_states)  # [E, T, H]
        partial = (outputs.float() * weights.T[..., None]).sum(dim=0)
        return self._all_reduce(partial, hidden_states.dtype)


class NeuronSparseExperts(_ExpertMajorExperts):
    """Selective loading (decode, ``T * K < E``): per token, its K experts gathered on the weights'
    leading axis."""

    def forward(self, hidden_states, top_k_index, top_k_weights):
        tokens, top_k = top_k_index.shape
        assert tokens * top_k < self.num_experts, (
            f"{tokens} tokens x top_k {top_k} >= {self.num_experts} experts: a decode path "
            "(NxD's rule)"
        )
        rows = []
        for token in range(tokens):  # as NxD's forward_selective_loading: one gather per token
            # [K, 1, H]
            outputs = self._experts(
                hidden_states[token : token + 1], expert_indices=top_k_index[token]
            )
            rows.append((outputs[:, 0].float() * top_k_weights[token][:, None].float()).sum(dim=0))
        return self._all_reduce(torch.stack(rows), hidden_states.dtype)


def experts_checkpoint(
    gate_up_proj: torch.Tensor, down_proj: torch.Tensor, prefix: str = ""
) -> dict:
    """One layer's unsharded entries from transformers' ``gate_up_proj [E, 2I, H]`` and ``down_proj
    [E, H, I]``."""
    experts, two_inter, hidden = gate_up_proj.shape
    assert tuple(down_proj.shape) == (experts, hidden, two_inter // 2), (
        f"down_proj {tuple(down_proj.shape)} does not fit gate_up_proj {tuple(gate_up_proj.shape)}"
    )
    out = {}
    for name, tensor in (("gate_up", gate_up_proj), ("down", down_proj)):
        # [E, out, in], [E, out, 1]
        q, scale = quantize_int8_per_channel(tensor, name=f"{prefix}{name}")
        out[f"{prefix}{name}.weight"] = q.transpose(1, 2).contiguous()  # NxD's int8 [E, in, out]
        out[f"{prefix}{name}.scale"] = scale.transpose(1, 2).contiguous()  # fp32 [E, 1, out]
    return out
