"""The routed experts on Inferentia2, both ways: the port's dense op and the selective-loading decode (SDK 2.31).

Not run on an inf2 here. Written against neuronx-distributed 0.19 (Neuron SDK 2.31); the contracts
were read in the newest public source, neuronx-distributed 0.18 (aws-neuron/neuronx-distributed):
``quantization/quantization_layers.py`` (``QuantizedExpertFusedColumnParallel`` /
``QuantizedExpertFusedRowParallel``), ``modules/moe/experts.py`` and ``expert_mlps_v2.py``
(``Experts.forward``, ``ExpertMLPsV2.forward_all_experts`` / ``forward_selective_loading``),
``modules/moe/model_utils.py`` (the activation table, ``DEFAULT_SELECTIVE_LOADING_THRESHOLD``),
``trace/trace.py`` (``shard_children``). Nothing from the SDK is imported at module import time;
building a module without ``sdk=`` imports it and raises ``TargetError`` with the install hint.

**One expert-major weight layout for both graphs, on NxD's own layers.** Both modules hold
``gate_up = QuantizedExpertFusedColumnParallel(E, H -> 2I, stride=2, is_fused_gate_up=True)``
(weight ``[E, H, 2I/tp]``: the stride-2 split gives each rank its slice of the gate half and of the
up half) and ``down = QuantizedExpertFusedRowParallel(E, I -> H, reduce_output=False)`` (weight
``[E, I/tp, H]``), int8 with expert-wise per-channel fp32 scales ``[E, 1, out]`` (each expert's own
output channels, ``EXPERT_WISE_PER_CHANNEL_SYMMETRIC``), exactly NxD Inference's MoE layout. One
ModelBuilder artifact shares one set of sharded weights between its graphs, so the dense prefill
and either decode hold the same parameters, names and shapes. The checkpoint is transformers'
``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]`` transposed, with no reordering: the
sharding does the split.

- ``NeuronDenseExperts`` (the port's op; prefill, and the port's decode): the layers' own forward
  over every expert, ``[E, 1, T, ...]``, as ``ExpertMLPsV2.forward_all_experts`` does; each expert's
  output weighted by its dense router weight (zero outside the top-k) and summed.
- ``NeuronSparseExperts`` (decode, ``T * K < E``: NxD's selective-loading rule): per token, the
  layers' forward with ``expert_indices`` = its top-k, which **gathers whole experts on the weights'
  leading axis** (``weight[expert_indices]``: K contiguous ``[H, 2I/tp]`` and ``[I/tp, H]`` blocks),
  as ``ExpertMLPsV2.forward_selective_loading`` does; each rank reads ``K x 3 x H x I/tp`` int8
  weights per token.

Both all-reduce the per-rank partial sums once, in fp32 (as NxD's RowParallelLinear reduces,
``reduce_dtype=torch.float32``), and cast back.

**Why this module and not NxD's ``ExpertMLPsV2``.** (1) Its activation table
(``modules/moe/model_utils.py`` ``ACT2FN``) has no ``gelu_pytorch_tanh``, Gemma-4's activation;
its ``"gelu"`` is the exact erf gelu, which would change the model's numbers. (2) Its inference
``forward`` sends a 128-token prefill (128 x 8 >= the 512-token block) to ``forward_blockwise``,
whose kernels are not available on inf2, so the port's prefill would have to call
``forward_all_experts`` past it anyway. (3) It needs NxD's world and expert-parallel groups, an
``SPMDRank`` and its MoE config classes in the graph, none of which this build uses. What this
module keeps from it is what matters for the bytes: the same layers, layout, int8 scheme and the
same two forward paths.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from gemma_nb.experts import dense_router_weights, gated
from gemma_nb.formats import quantize_int8_per_channel
from gemma_nb.neuron.sdk import import_sdk

# NxD's rule (modules/moe/model_utils.py): selective loading while tokens x top_k / experts < 1.0
SELECTIVE_LOADING_THRESHOLD = 1.0


def import_nxd() -> SimpleNamespace:
    """The SDK namespace (``gemma_nb.neuron.sdk.import_sdk``), or ``TargetError`` with the install hint."""
    return import_sdk()


def int8_kwargs(sdk, dtype: torch.dtype) -> dict:
    """NxD's int8 per-channel (axis 0) layer arguments, fp32 scales, no bias."""
    return dict(bias=False, dtype=dtype, quantized_dtype=sdk.QuantizedDtype.INT8,
                quantization_type=sdk.QuantizationType.PER_CHANNEL_SYMMETRIC, quantization_per_channel_axis=0)


def experts_kwargs(sdk, dtype: torch.dtype) -> dict:
    """NxD's int8 expert-wise per-channel (axis 2) arguments of the expert-fused layers, fp32 scales."""
    return dict(bias=False, dtype=dtype, quantized_dtype=sdk.QuantizedDtype.INT8, scale_dtype=torch.float32,
                quantization_type=sdk.QuantizationType.EXPERT_WISE_PER_CHANNEL_SYMMETRIC,
                quantization_per_channel_axis=2)


class _ExpertMajorExperts(nn.Module):
    """``gate_up [E, H, 2I/tp]`` and ``down [E, I/tp, H]`` per rank: NxD's expert-fused int8 layers."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, tp: int,
                 dtype: torch.dtype = torch.bfloat16, sdk=None, activation: str = "gelu_pytorch_tanh"):
        super().__init__()
        from transformers.activations import ACT2FN

        sdk = import_nxd() if sdk is None else sdk
        if intermediate_size % tp:
            raise ValueError(f"moe_intermediate_size={intermediate_size} is not divisible by tp={tp}: each rank "
                             "holds an equal slice of every expert")
        self.num_experts, self.hidden_size, self.tp = num_experts, hidden_size, tp
        self.intermediate_size, self.local_inter = intermediate_size, intermediate_size // tp
        self.act_fn = ACT2FN[activation]
        self.reduce = sdk.mappings.reduce_from_tensor_model_parallel_region
        self.gate_up = sdk.QuantizedExpertFusedColumnParallel(num_experts, hidden_size, 2 * intermediate_size, stride=2,
                                                              is_fused_gate_up=True, **experts_kwargs(sdk, dtype))
        self.down = sdk.QuantizedExpertFusedRowParallel(num_experts, intermediate_size, hidden_size, reduce_output=False,
                                                        **experts_kwargs(sdk, dtype))
        expected = (num_experts, hidden_size, 2 * self.local_inter)
        if tuple(self.gate_up.weight.shape) != expected:
            raise ValueError(f"gate_up holds {tuple(self.gate_up.weight.shape)} per rank, expected {expected}: the "
                             f"NxD parallel state's TP degree is not tp={tp}")

    def _experts(self, hidden_states: torch.Tensor, expert_indices=None) -> torch.Tensor:
        """``hidden_states [T, H]`` through the experts named by ``expert_indices`` (all when None):
        this rank's partial outputs ``[E', T, H]``."""
        tokens = hidden_states.shape[0]
        gate_up = self.gate_up(hidden_states.view(1, 1, tokens, self.hidden_size), expert_indices=expert_indices)
        return self.down(gated(gate_up, self.act_fn), expert_indices=expert_indices)[:, 0]

    def _all_reduce(self, partial: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        # fp32 all-reduce, as NxD's RowParallelLinear (reduce_dtype=torch.float32)
        return self.reduce(partial.float(), process_group=self.down.tensor_parallel_group).to(dtype)


class NeuronDenseExperts(_ExpertMajorExperts):
    """The port's dense op at TP = ``tp``: every expert's ``I/tp`` slice on every token (module docstring).

    ``forward(hidden_states [T, H], top_k_index [T, K], top_k_weights [T, K]) -> [T, H]``.
    """

    def forward(self, hidden_states, top_k_index, top_k_weights):
        weights = dense_router_weights(top_k_index, top_k_weights, self.num_experts)  # [T, E] fp32
        outputs = self._experts(hidden_states)  # [E, T, H]
        partial = (outputs.float() * weights.T[..., None]).sum(dim=0)
        return self._all_reduce(partial, hidden_states.dtype)


class NeuronSparseExperts(_ExpertMajorExperts):
    """Selective loading at TP = ``tp``: per token only its K experts' weights are read (decode only)."""

    def forward(self, hidden_states, top_k_index, top_k_weights):
        tokens, top_k = top_k_index.shape
        if tokens * top_k / self.num_experts >= SELECTIVE_LOADING_THRESHOLD:
            raise ValueError(f"{tokens} tokens x top_k {top_k} >= {self.num_experts} experts: selective loading is "
                             "the decode path; compile prefill with NeuronDenseExperts")
        rows = []
        for token in range(tokens):  # as NxD's forward_selective_loading: one gather per token
            outputs = self._experts(hidden_states[token: token + 1], expert_indices=top_k_index[token])  # [K, 1, H]
            rows.append((outputs[:, 0].float() * top_k_weights[token][:, None].float()).sum(dim=0))
        return self._all_reduce(torch.stack(rows), hidden_states.dtype)


# --------------------------------------------------------------------------------------------
# Checkpoints (plain torch: runs and is tested on the cpu)
# --------------------------------------------------------------------------------------------
def expert_major_int8(weight: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' stacked ``[E, out, in]`` -> NxD's expert-fused int8 ``[E, in, out]`` and fp32
    scales ``[E, 1, out]``: per expert and output channel, absmax / 127 (``quantize_int8_per_channel``)."""
    q, scale = quantize_int8_per_channel(weight, axis=1, name=name)  # [E, out, in], [E, out, 1]
    return q.transpose(1, 2).contiguous(), scale.transpose(1, 2).contiguous()


def experts_checkpoint(gate_up_proj: torch.Tensor, down_proj: torch.Tensor, prefix: str = "") -> dict:
    """Full (unsharded) state-dict entries for one layer's ``NeuronDenseExperts`` *or* ``NeuronSparseExperts``.

    ``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``: transformers' tensors. ``prefix``: the
    module's path (e.g. ``"layers.3.experts."``). ``{prefix}gate_up.weight`` int8 ``[E, H, 2I]`` with
    ``scale [E, 1, 2I]``, ``{prefix}down.weight`` int8 ``[E, I, H]`` with ``scale [E, 1, H]``; the
    same for every TP degree (ModelBuilder's sharding cuts them).
    """
    experts, two_inter, hidden = gate_up_proj.shape
    if tuple(down_proj.shape) != (experts, hidden, two_inter // 2):
        raise ValueError(f"down_proj {tuple(down_proj.shape)} does not match gate_up_proj {tuple(gate_up_proj.shape)}")
    out = {}
    for name, tensor in (("gate_up", gate_up_proj), ("down", down_proj)):
        out[f"{prefix}{name}.weight"], out[f"{prefix}{name}.scale"] = expert_major_int8(tensor, f"{prefix}{name}")
    return out


__all__ = ["NeuronDenseExperts", "NeuronSparseExperts", "experts_checkpoint", "expert_major_int8", "int8_kwargs",
           "experts_kwargs", "import_nxd", "SELECTIVE_LOADING_THRESHOLD"]
