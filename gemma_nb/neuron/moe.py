"""The routed experts on Inferentia2, both ways: the port's dense op and a selective-loading decode (SDK 2.31).

Not run on an inf2 here. Written against neuronx-distributed 0.19 (Neuron SDK 2.31); the contracts
were read in the newest public source, neuronx-distributed 0.18 (aws-neuron/neuronx-distributed):
``quantization/quantization_layers.py`` (QuantizedColumnParallel, QuantizedRowParallel),
``parallel_layers/mappings.py`` (reduce_from_tensor_model_parallel_region),
``modules/moe/expert_mlps_v2.py`` (ExpertMLPsV2.forward_selective_loading: ``weight[expert_indices]``),
``trace/trace.py`` (``shard_children``: which module types ModelBuilder shards, and how). Nothing
from the SDK is imported at module import time; building a module without ``sdk=`` imports it and
raises ``TargetError`` with the install hint when it is missing. With
``sdk=gemma_nb.neuron.standins.cpu_sdk()`` the same modules run on the cpu, under real gloo
collectives at TP=2 (the stand-ins prove this code, not the SDK).

Both modules are drop-ins for transformers' ``Gemma4TextExperts`` inside a traced Gemma-4 layer
(``forward(hidden_states [T, H], top_k_index [T, K], top_k_weights [T, K]) -> [T, H]``) at TP = ``tp``
and hold **the same parameters, names, shapes and layout**, so one ModelBuilder artifact (whose
weights are sharded once for every graph) can hold a dense prefill graph and a sparse decode graph:

- ``gate_up = QuantizedColumnParallel(H -> E*2I)``, ``down = QuantizedRowParallel(E*I -> H)``, int8
  per row with fp32 scales, in a **rank-major** layout: the checkpoint orders ``gate_up``'s rows
  (rank, expert, gate|up, i) and ``down``'s columns (rank, expert, i), so the contiguous TP split
  gives rank r the ``I/tp`` slice ``[r I/tp, (r+1) I/tp)`` of *every* expert. The rows are a
  permutation of transformers' ``gate_up_proj``; at tp=1 the layout is transformers' own.
- ``NeuronDenseExperts`` (the port's op, docs/sources.md: port-recipe; every expert, every token): ``gate_up(x)`` gives
  ``[T, E, 2, I/tp]``; the dense router weights ``[T, E]`` (zero outside the top-k) scale the
  hidden ``[T, E, I/tp]``; ``down`` contracts it and all-reduces the partial sums over ranks in
  the output dtype (NxD's QuantizedRowParallel). The port split whole experts over ranks instead
  (E/tp each, the router weights scattered by ``SPMDRank``); the rank-major split does the same
  work per rank and needs no rank id in the graph.
- ``NeuronSparseExperts`` (decode, ``T * K < E``): NxD Inference's "selective loading": gathers the
  K routed experts' rows of ``gate_up.weight`` / ``scale`` and columns of ``down.weight`` and
  computes only those (the layers' own forward would read every expert), each rank its ``I/tp``
  slice, so each rank reads ``K x 3 x H x I/tp`` int8 weights per token; the partial sums are
  all-reduced in fp32, as NxD's RowParallelLinear reduces (``reduce_dtype=torch.float32``).

The math is the cpu experts' (``gemma_nb.experts.dense_router_weights`` and ``gated``,
``gemma_nb.formats.scale_rows``); only the weights' home differs: NxD's parallel layers here.

Prefill keeps the dense module (blockwise kernels are prefill-only and unavailable on inf2); the
decode graph takes either (``gemma_nb.neuron.build.NeuronBuildConfig.decode_experts``).

int8 numbers (``experts_checkpoint``): gate/up rows quantized per row (the port's
``QuantizedColumnParallel(H -> E*2I)`` per-channel on axis 0, split with the rows); ``down``
quantized as the port's ``QuantizedRowParallel(E*I -> H)``, one fp32 scale per output row over
all experts, replicated on every rank. Row permutations change none of these numbers. NxD's own
``QuantizedExpertFused*`` layers share one scale per output column across experts, a third
choice, not used here.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from gemma_nb.experts import dense_router_weights, gated
from gemma_nb.formats import quantize_int8_per_channel, scale_rows
from gemma_nb.neuron.sdk import import_sdk


def import_nxd() -> SimpleNamespace:
    """The SDK namespace (``gemma_nb.neuron.sdk.import_sdk``), or ``TargetError`` with the install hint."""
    return import_sdk()


def int8_kwargs(sdk, dtype: torch.dtype) -> dict:
    """NxD's int8 per-channel (axis 0) layer arguments, fp32 scales, no bias."""
    return dict(bias=False, dtype=dtype, quantized_dtype=sdk.QuantizedDtype.INT8,
                quantization_type=sdk.QuantizationType.PER_CHANNEL_SYMMETRIC, quantization_per_channel_axis=0)


def _column(sdk, input_size, output_size, int8, dtype):
    if not int8:
        return sdk.ColumnParallelLinear(input_size, output_size, bias=False, gather_output=False, dtype=dtype)
    return sdk.QuantizedColumnParallel(input_size, output_size, gather_output=False, scale_dtype=torch.float32,
                                       **int8_kwargs(sdk, dtype))


def _row(sdk, input_size, output_size, int8, dtype):
    if not int8:
        return sdk.RowParallelLinear(input_size, output_size, bias=False, input_is_parallel=True, dtype=dtype)
    # QuantizedRowParallel's per-channel fp32 scale is [out, 1], replicated on every rank.
    return sdk.QuantizedRowParallel(input_size, output_size, input_is_parallel=True, **int8_kwargs(sdk, dtype))


class _RankMajorExperts(nn.Module):
    """``gate_up`` (column-parallel, H -> E*2I) and ``down`` (row-parallel, E*I -> H) in the rank-major layout."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, tp: int, int8: bool = True,
                 dtype: torch.dtype = torch.bfloat16, sdk=None, activation: str = "gelu_pytorch_tanh"):
        super().__init__()
        from transformers.activations import ACT2FN

        sdk = import_nxd() if sdk is None else sdk
        if intermediate_size % tp:
            raise ValueError(f"moe_intermediate_size={intermediate_size} is not divisible by tp={tp}: each rank "
                             "holds an equal slice of every expert")
        self.num_experts, self.hidden_size, self.tp = num_experts, hidden_size, tp
        self.intermediate_size = intermediate_size
        self.local_inter = intermediate_size // tp
        self.int8 = int8
        self.act_fn = ACT2FN[activation]
        self.reduce = sdk.mappings.reduce_from_tensor_model_parallel_region
        self.gate_up = _column(sdk, hidden_size, num_experts * 2 * intermediate_size, int8, dtype)
        self.down = _row(sdk, num_experts * intermediate_size, hidden_size, int8, dtype)
        expected = (num_experts * 2 * self.local_inter, hidden_size)
        if tuple(self.gate_up.weight.shape) != expected:
            raise ValueError(f"gate_up holds {tuple(self.gate_up.weight.shape)} per rank, expected {expected}: the "
                             f"NxD parallel state's TP degree is not tp={tp}")


class NeuronDenseExperts(_RankMajorExperts):
    """The port's dense op at TP = ``tp``: every expert's ``I/tp`` slice on every token (module docstring)."""

    def forward(self, hidden_states, top_k_index, top_k_weights):
        tokens = hidden_states.shape[0]
        weights = dense_router_weights(top_k_index, top_k_weights, self.num_experts)  # [T, E]
        gate_up = self.gate_up(hidden_states).view(tokens, self.num_experts, 2 * self.local_inter)
        hidden = gated(gate_up, self.act_fn) * weights[..., None].to(gate_up.dtype)
        return self.down(hidden.reshape(tokens, self.num_experts * self.local_inter))  # all-reduced [T, H]


class NeuronSparseExperts(_RankMajorExperts):
    """Selective loading at TP = ``tp``: only the K routed experts' ``I/tp`` slices are read (decode only)."""

    def forward(self, hidden_states, top_k_index, top_k_weights):
        tokens, top_k = top_k_index.shape
        if tokens * top_k >= self.num_experts:
            raise ValueError(f"{tokens} tokens x top_k {top_k} >= {self.num_experts} experts: selective loading is "
                             "the decode path; compile prefill with NeuronDenseExperts")
        dtype, hidden_size = hidden_states.dtype, self.hidden_size
        rows = self.gate_up.weight.view(self.num_experts, 2 * self.local_inter, hidden_size)[top_k_index]
        gate_up = torch.einsum("th,tkih->tki", hidden_states, rows.to(dtype))  # [T, K, 2 I/tp]
        if self.int8:  # NxD's order: matmul in the activation dtype, then the fp32 row scale
            gate_up = scale_rows(gate_up, self.gate_up.scale.view(self.num_experts, 2 * self.local_inter)[top_k_index],
                                 dtype)
        hidden = gated(gate_up, self.act_fn) * top_k_weights[..., None].to(dtype)
        # [H, T, K, I/tp]: the routed experts' columns of this rank's down slice
        columns = self.down.weight.view(hidden_size, self.num_experts, self.local_inter)[:, top_k_index]
        partial = torch.einsum("tki,htki->th", hidden, columns.to(dtype))
        if self.int8:
            partial = scale_rows(partial, self.down.scale.T, dtype)
        # fp32 all-reduce, as NxD's RowParallelLinear (reduce_dtype=torch.float32)
        return self.reduce(partial.float(), process_group=self.down.tensor_parallel_group).to(dtype)


# --------------------------------------------------------------------------------------------
# Checkpoints (plain torch: runs and is tested on the cpu)
# --------------------------------------------------------------------------------------------


def _linear_entries(prefix: str, weight: torch.Tensor, int8: bool, dtype: torch.dtype) -> dict:
    if not int8:
        return {f"{prefix}weight": weight.to(dtype)}
    q, scale = quantize_int8_per_channel(weight, axis=0, name=prefix + "weight")
    return {f"{prefix}weight": q, f"{prefix}scale": scale}


def rank_major_gate_up(gate_up_proj: torch.Tensor, tp: int) -> torch.Tensor:
    """transformers' ``gate_up_proj [E, 2I, H]`` (gate rows, then up rows) -> ``[E*2I, H]`` with rows in
    (rank, expert, gate|up, i) order: the contiguous split by ``tp`` gives rank r ``[E, 2, I/tp, H]``."""
    experts, two_inter, hidden = gate_up_proj.shape
    local = two_inter // 2 // tp
    return (gate_up_proj.reshape(experts, 2, tp, local, hidden).permute(2, 0, 1, 3, 4)
            .reshape(experts * two_inter, hidden))


def rank_major_down(down_proj: torch.Tensor, tp: int) -> torch.Tensor:
    """transformers' ``down_proj [E, H, I]`` -> ``[H, E*I]`` with columns in (rank, expert, i) order."""
    experts, hidden, inter = down_proj.shape
    return (down_proj.reshape(experts, hidden, tp, inter // tp).permute(1, 2, 0, 3)
            .reshape(hidden, experts * inter))


def experts_checkpoint(gate_up_proj: torch.Tensor, down_proj: torch.Tensor, tp: int = 2, int8: bool = True,
                       prefix: str = "", dtype: torch.dtype = torch.bfloat16) -> dict:
    """Full (unsharded) state-dict entries for one layer's ``NeuronDenseExperts`` *or* ``NeuronSparseExperts``.

    ``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``: transformers' tensors. ``prefix``: the
    module's path (e.g. ``"layers.3.experts."``). ``{prefix}gate_up.weight [E*2I, H]`` and
    ``{prefix}down.weight [H, E*I]`` in the rank-major layout (:func:`rank_major_gate_up`,
    :func:`rank_major_down`); int8 with fp32 ``scale`` ``[E*2I, 1]`` / ``[H, 1]`` from
    ``gemma_nb.formats.quantize_int8_per_channel``, or ``dtype`` weights with ``int8=False``.
    """
    experts, two_inter, hidden = gate_up_proj.shape
    inter = two_inter // 2
    if tuple(down_proj.shape) != (experts, hidden, inter):
        raise ValueError(f"down_proj {tuple(down_proj.shape)} does not match gate_up_proj {tuple(gate_up_proj.shape)}")
    if inter % tp:
        raise ValueError(f"moe_intermediate_size={inter} is not divisible by tp={tp}")
    out = _linear_entries(f"{prefix}gate_up.", rank_major_gate_up(gate_up_proj, tp), int8, dtype)
    out.update(_linear_entries(f"{prefix}down.", rank_major_down(down_proj, tp), int8, dtype))
    return out
