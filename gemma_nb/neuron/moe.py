"""The routed experts on Inferentia2, both ways: the port's DenseExperts and a selective-loading decode (SDK 2.31).

NOT RUN HERE: written against neuronx-distributed 0.19 (Neuron SDK 2.31). Signatures were read in
aws-neuron/neuronx-distributed: ``quantization/quantization_layers.py`` (QuantizedColumnParallel,
QuantizedRowParallel, QuantizedExpertFused*), ``parallel_layers/layers.py`` (SPMDRank),
``parallel_layers/mappings.py`` (scatter_to_process_group_spmd, reduce_from_tensor_model_parallel_region),
``modules/moe/expert_mlps_v2.py`` (ExpertMLPsV2.forward_selective_loading) and
``modules/moe/moe_parallel_layers.py`` (ExpertFused*ParallelLinear: ``weight[expert_indices]``),
``trace/trace.py`` (which module types ModelBuilder shards). Nothing from the SDK is imported at
module import time; building a module raises ``TargetError`` with the install hint when it is missing.
The state-dict converters are plain torch and are tested on the cpu.

Both modules are drop-ins for transformers' ``Gemma4TextExperts`` inside a traced Gemma-4 layer
(``forward(hidden_states [T, H], top_k_index [T, K], top_k_weights [T, K]) -> [T, H]``) at TP = ``tp``,
and both hold the *same* int8 numbers, so the two NEFFs differ only in what they read:

- ``NeuronDenseExperts`` (the port's op; docs/sources.md: port-recipe): ``gate_up = QuantizedColumnParallel(H -> E*2I)``
  (rank r holds experts ``[r E/tp, (r+1) E/tp)`` whole), ``down = QuantizedRowParallel(E*I -> H)``
  (all-reduce). The dense ``[T, E]`` router weights are cut to this rank's experts with
  ``scatter_to_process_group_spmd(..., rank=SPMDRank.get_rank())``: a plain
  ``scatter_to_tensor_model_parallel_region`` bakes rank 0's slice into the single SPMD trace
  (the bug the port hit). Every expert is read every token.
- ``NeuronSparseExperts`` (decode, ``T * K < E``): NxD Inference's "selective loading": gathers
  ``weight[top_k_index]`` and computes only the K routed experts. The same parallel layers hold the
  weights (so ModelBuilder shards them: its ``shard_children`` only shards ColumnParallel /
  RowParallel / ParallelEmbedding / Quantized* modules), but their rows and columns are permuted
  in the checkpoint so that the contiguous TP split gives every rank the ``I / tp`` slice of
  *every* expert: each rank then reads ``K x 3 x H x I / tp`` weights per token, evenly, instead
  of K whole experts on whichever rank owns them. The forward never calls the layers' own
  forward (it would read all experts); it indexes their ``weight`` and ``scale`` and upcasts
  only the gathered rows. Prefill keeps ``NeuronDenseExperts`` (blockwise kernels are prefill-only
  and unavailable on inf2; docs/sources.md: nxdi-source): compile the prefill graph with the dense module and the
  decode graph with the sparse one, from their own checkpoints.

int8 numbers (both modules, ``experts_checkpoint``): gate/up rows quantized per expert per row (the
port's ``QuantizedColumnParallel(H -> E*2I)`` per-channel on axis 0); ``down`` quantized as the
port's ``QuantizedRowParallel(E*I -> H)``, one fp32 scale per output row over all experts. NxD's
own ``QuantizedExpertFused*`` layers share one scale per output column across experts
(``scale [1, 1, out]``), a third choice, not used here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gemma_nb.quant import quantize_int8_per_channel
from gemma_nb.targets import NEURON_HELP, TargetError

MODES = ("dense", "sparse")


def _import_nxd():
    try:
        from neuronx_distributed.parallel_layers import mappings
        from neuronx_distributed.parallel_layers.layers import ColumnParallelLinear, RowParallelLinear, SPMDRank
        from neuronx_distributed.quantization.quantization_config import QuantizationType, QuantizedDtype
        from neuronx_distributed.quantization.quantization_layers import QuantizedColumnParallel, QuantizedRowParallel
    except ImportError as error:
        raise TargetError(f"cannot import neuronx_distributed ({error}): {NEURON_HELP}") from None
    return dict(mappings=mappings, ColumnParallelLinear=ColumnParallelLinear, RowParallelLinear=RowParallelLinear,
                SPMDRank=SPMDRank, QuantizationType=QuantizationType, QuantizedDtype=QuantizedDtype,
                QuantizedColumnParallel=QuantizedColumnParallel, QuantizedRowParallel=QuantizedRowParallel)


def _column(sdk, input_size, output_size, int8, dtype):
    common = dict(input_size=input_size, output_size=output_size, bias=False, gather_output=False, dtype=dtype)
    if not int8:
        return sdk["ColumnParallelLinear"](**common)
    return sdk["QuantizedColumnParallel"](
        **common, quantized_dtype=sdk["QuantizedDtype"].INT8,
        quantization_type=sdk["QuantizationType"].PER_CHANNEL_SYMMETRIC, quantization_per_channel_axis=0,
        scale_dtype=torch.float32)


def _row(sdk, input_size, output_size, int8, dtype):
    common = dict(input_size=input_size, output_size=output_size, bias=False, input_is_parallel=True, dtype=dtype)
    if not int8:
        return sdk["RowParallelLinear"](**common)
    # No scale_dtype argument on QuantizedRowParallel (its fp32 scale is [out, 1], replicated).
    return sdk["QuantizedRowParallel"](
        **common, quantized_dtype=sdk["QuantizedDtype"].INT8,
        quantization_type=sdk["QuantizationType"].PER_CHANNEL_SYMMETRIC, quantization_per_channel_axis=0)


def _out_of_place_scale_dequantize(tensor, scale, upcast_dtype):
    # The port's patch: NxD's scale_dequantize multiplies in place, which broke its trace.
    return (tensor.to(torch.float32) * scale.unsqueeze(len(scale.shape) - 1)).to(upcast_dtype)


def patch_scale_dequantize() -> None:
    """Swap NxD's in-place ``scale_dequantize`` for an out-of-place one, as the port did (docs/sources.md: port-recipe)."""
    try:
        from neuronx_distributed.quantization import dequantize, quantization_layers
    except ImportError as error:
        raise TargetError(f"cannot import neuronx_distributed ({error}): {NEURON_HELP}") from None
    dequantize.scale_dequantize = _out_of_place_scale_dequantize
    quantization_layers.scale_dequantize = _out_of_place_scale_dequantize


def _dense_router_weights(top_k_index, top_k_weights, num_experts):
    dense = torch.zeros(top_k_index.shape[0], num_experts, dtype=torch.float32, device=top_k_index.device)
    return dense.scatter(1, top_k_index, top_k_weights.float())


def _dequantized_matmul(x, weight, scale):
    """``x @ weight.T`` with an int8 weight upcast to ``x.dtype`` and the fp32 row scale on the output (NxD's order)."""
    out = x @ weight.to(x.dtype).transpose(-1, -2)
    if scale is None:
        return out
    return (out.float() * scale.reshape(-1)).to(x.dtype)


def dense_rank_forward(x, top_k_index, top_k_weights, gate_up, gate_up_scale, down, down_scale, rank: int,
                       tp: int, num_experts: int):
    """One rank's partial output of the dense recipe (sum over ranks = the layer output).

    ``gate_up [E/tp*2I, H]`` (rank's experts, int8 or float), ``gate_up_scale [E/tp*2I, 1]`` or None;
    ``down [H, E/tp*I]``, ``down_scale [H, 1]`` or None. What ``NeuronDenseExperts`` computes on a
    rank, in plain torch, so the checkpoint layout can be checked on the cpu.
    """
    tokens, local = x.shape[0], num_experts // tp
    inter = gate_up.shape[0] // (2 * local)
    weights = _dense_router_weights(top_k_index, top_k_weights, num_experts)[:, rank * local:(rank + 1) * local]
    gate, up = _dequantized_matmul(x, gate_up, gate_up_scale).view(tokens, local, 2 * inter).chunk(2, dim=-1)
    hidden = F.gelu(gate, approximate="tanh") * up * weights[..., None].to(up.dtype)
    return _dequantized_matmul(hidden.reshape(tokens, local * inter), down, down_scale)


def sparse_rank_forward(x, top_k_index, top_k_weights, gate, gate_scale, up, up_scale, down, down_scale,
                        num_experts: int):
    """One rank's partial output of selective loading: only the routed experts' rows are gathered.

    ``gate``/``up [E*I/tp, H]`` in (expert, i) order, scales ``[E*I/tp, 1]`` or None; ``down
    [H, E*I/tp]``, ``down_scale [H, 1]`` or None: this rank's ``I/tp`` slice of every expert (the
    TP-major checkpoint of ``experts_checkpoint``). Sum over ranks = the layer output.
    """
    hidden_size = x.shape[1]
    local_inter = gate.shape[0] // num_experts

    def project(weight, scale, index, x_t):
        rows = weight.view(num_experts, local_inter, hidden_size)[index]  # [K, I/tp, H]: the gather
        out = torch.einsum("h,kih->ki", x_t, rows.to(x_t.dtype))
        if scale is None:
            return out
        return (out.float() * scale.view(num_experts, local_inter)[index]).to(x_t.dtype)

    columns = down.view(hidden_size, num_experts, local_inter)
    rows = []
    for t in range(top_k_index.shape[0]):
        index = top_k_index[t]
        hidden = F.gelu(project(gate, gate_scale, index, x[t]), approximate="tanh") * project(up, up_scale, index, x[t])
        partial = torch.einsum("ki,hki->kh", hidden, columns[:, index, :].to(hidden.dtype))  # [K, H]
        if down_scale is not None:
            partial = (partial.float() * down_scale.view(1, hidden_size)).to(hidden.dtype)
        rows.append((top_k_weights[t].float()[:, None] * partial.float()).sum(dim=0).to(hidden.dtype))
    return torch.stack(rows)


class NeuronDenseExperts(nn.Module):
    """The port's DenseExperts at TP = ``tp``: all E experts every token (see the module docstring)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, tp: int, int8: bool = True,
                 dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        sdk = _import_nxd()
        if num_experts % tp:
            raise ValueError(f"num_experts={num_experts} is not divisible by tp={tp}")
        self.num_experts, self.hidden_size, self.intermediate_size, self.tp = num_experts, hidden_size, intermediate_size, tp
        self.mappings = sdk["mappings"]
        self.gate_up = _column(sdk, hidden_size, num_experts * 2 * intermediate_size, int8, dtype)
        self.down = _row(sdk, num_experts * intermediate_size, hidden_size, int8, dtype)
        self.spmd_rank = sdk["SPMDRank"](world_size=tp)

    def forward(self, hidden_states, top_k_index, top_k_weights):
        tokens, local = hidden_states.shape[0], self.num_experts // self.tp
        weights = _dense_router_weights(top_k_index, top_k_weights, self.num_experts)  # [T, E]
        weights = self.mappings.scatter_to_process_group_spmd(weights, partition_dim=1, rank=self.spmd_rank.get_rank())
        gate, up = self.gate_up(hidden_states).view(tokens, local, 2 * self.intermediate_size).chunk(2, dim=-1)
        hidden = F.gelu(gate, approximate="tanh") * up * weights[..., None].to(up.dtype)  # [T, E/tp, I]
        return self.down(hidden.reshape(tokens, local * self.intermediate_size))  # all-reduced [T, H]


class NeuronSparseExperts(nn.Module):
    """Selective loading at TP = ``tp``: only the K routed experts' ``I / tp`` slices are read (decode only)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, tp: int, int8: bool = True,
                 dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        sdk = _import_nxd()
        if intermediate_size % tp:
            raise ValueError(f"moe_intermediate_size={intermediate_size} is not divisible by tp={tp}")
        self.num_experts, self.hidden_size, self.intermediate_size, self.tp = num_experts, hidden_size, intermediate_size, tp
        self.int8 = int8
        self.mappings = sdk["mappings"]
        self.gate = _column(sdk, hidden_size, num_experts * intermediate_size, int8, dtype)
        self.up = _column(sdk, hidden_size, num_experts * intermediate_size, int8, dtype)
        self.down = _row(sdk, num_experts * intermediate_size, hidden_size, int8, dtype)

    def forward(self, hidden_states, top_k_index, top_k_weights):
        tokens, top_k = top_k_index.shape
        if tokens * top_k >= self.num_experts:
            raise ValueError(f"{tokens} tokens x top_k {top_k} >= {self.num_experts} experts: selective loading is "
                             "the decode path; compile prefill with NeuronDenseExperts")
        scale = (lambda layer: layer.scale) if self.int8 else (lambda layer: None)
        partial = sparse_rank_forward(hidden_states, top_k_index, top_k_weights, self.gate.weight, scale(self.gate),
                                      self.up.weight, scale(self.up), self.down.weight, scale(self.down),
                                      self.num_experts)
        return self.mappings.reduce_from_tensor_model_parallel_region(partial)


# --------------------------------------------------------------------------------------------
# Checkpoints (plain torch: runs and is tested on the cpu)
# --------------------------------------------------------------------------------------------


def _linear_entries(prefix: str, weight: torch.Tensor, int8: bool, dtype: torch.dtype) -> dict:
    if not int8:
        return {f"{prefix}weight": weight.to(dtype)}
    q, scale = quantize_int8_per_channel(weight, axis=0, name=prefix + "weight")
    return {f"{prefix}weight": q, f"{prefix}scale": scale}


def _tp_major_rows(weight: torch.Tensor, tp: int) -> torch.Tensor:
    """``[E, I, H]`` -> ``[E*I, H]`` with rows ordered (rank, expert, i): a contiguous split by ``tp``
    then gives rank r the i-slice ``[r I/tp, (r+1) I/tp)`` of every expert."""
    experts, inter, hidden = weight.shape
    return weight.view(experts, tp, inter // tp, hidden).transpose(0, 1).reshape(experts * inter, hidden)


def experts_checkpoint(gate_up_proj: torch.Tensor, down_proj: torch.Tensor, mode: str, tp: int = 2,
                       int8: bool = True, prefix: str = "", dtype: torch.dtype = torch.bfloat16) -> dict:
    """State-dict entries for one layer's ``NeuronDenseExperts`` / ``NeuronSparseExperts`` (full, unsharded).

    ``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``: transformers' tensors. ``prefix`` is the
    module's path (e.g. ``"layers.3.experts."``). int8 tensors come from
    ``gemma_nb.quant.quantize_int8_per_channel`` (fp32 scales ``[out, 1]``). dense: ``gate_up``
    ``[E*2I, H]`` as stored, ``down`` ``[E,H,I] -> [H, E*I]`` (the port's permute), and
    ``spmd_rank.rank = arange(tp)`` (int32). sparse: ``gate`` / ``up`` / ``down`` in TP-major order
    (see ``_tp_major_rows``). Both modes quantize the same rows with the same scales, so the dense
    and sparse NEFFs compute the same numbers.
    """
    if mode not in MODES:
        raise ValueError(f"mode {mode!r} is not one of {', '.join(MODES)}")
    experts, two_inter, hidden = gate_up_proj.shape
    inter = two_inter // 2
    if tuple(down_proj.shape) != (experts, hidden, inter):
        raise ValueError(f"down_proj {tuple(down_proj.shape)} does not match gate_up_proj {tuple(gate_up_proj.shape)}")
    down_h_ei = down_proj.permute(1, 0, 2).reshape(hidden, experts * inter)  # [H, E*I], columns (expert, i)
    if mode == "dense":
        if experts % tp:
            raise ValueError(f"num_experts={experts} is not divisible by tp={tp}")
        out = _linear_entries(f"{prefix}gate_up.", gate_up_proj.reshape(experts * two_inter, hidden), int8, dtype)
        out.update(_linear_entries(f"{prefix}down.", down_h_ei, int8, dtype))
        out[f"{prefix}spmd_rank.rank"] = torch.arange(tp, dtype=torch.int32)
        return out
    if inter % tp:
        raise ValueError(f"moe_intermediate_size={inter} is not divisible by tp={tp}")
    gate, up = gate_up_proj[:, :inter], gate_up_proj[:, inter:]
    out = _linear_entries(f"{prefix}gate.", _tp_major_rows(gate, tp), int8, dtype)
    out.update(_linear_entries(f"{prefix}up.", _tp_major_rows(up, tp), int8, dtype))
    # Columns in (rank, expert, i) order; the per-row scales are over whole rows, as in dense mode.
    down_tp = down_proj.view(experts, hidden, tp, inter // tp).permute(1, 2, 0, 3).reshape(hidden, experts * inter)
    out.update(_linear_entries(f"{prefix}down.", down_tp, int8, dtype))
    return out


def rank_shard(checkpoint: dict, rank: int, tp: int, prefix: str = "") -> dict:
    """What ModelBuilder gives rank ``rank`` of ``experts_checkpoint``'s entries: column layers
    (``gate_up`` / ``gate`` / ``up``) split by rows with their scales, ``down`` split by columns with
    its scale replicated, ``spmd_rank.rank`` split into one element. Plain torch (cpu checks)."""
    out = {}
    for key, tensor in checkpoint.items():
        name = key[len(prefix):]
        if name.startswith("down.weight"):
            out[key] = tensor.chunk(tp, dim=1)[rank]
        elif name.startswith("down.scale"):
            out[key] = tensor
        else:
            out[key] = tensor.chunk(tp, dim=0)[rank]
    return out


def swap_in_neuron_experts(model: nn.Module, mode: str, tp: int = 2, int8: bool = True,
                           dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    """Replace each layer's ``experts`` of a transformers Gemma-4 model with the NxD module for ``mode``.

    Call it inside the ModelBuilder model factory, where NxD's parallel state exists (the
    compile recipe of ``gemma_nb.neuron``); the weights come from ``experts_checkpoint`` in the
    checkpoint loader. Returns ``model``.
    """
    from gemma_nb.moe import experts_modules

    if mode not in MODES:
        raise ValueError(f"mode {mode!r} is not one of {', '.join(MODES)}")
    cls = NeuronDenseExperts if mode == "dense" else NeuronSparseExperts
    for parent, name, module in experts_modules(model):
        experts, two_inter, hidden = module.gate_up_proj.shape
        setattr(parent, name, cls(experts, hidden, two_inter // 2, tp, int8=int8, dtype=dtype))
    return model


def benchmark_deployed(artifacts: dict, prompt_ids, new_tokens: int = 64, repeats: int = 3, load=None):
    """Decode speed of the deployed model (notebook 05) with each expert path, side by side.

    ``artifacts``: name -> artifact folder, e.g. ``{"dense": ..., "sparse": ...}`` (the prefill graph
    dense in both; the decode graph dense or selective-loading). ``load``: folder -> a deployed
    model with ``generate(input_ids, max_new_tokens)`` (notebook 05's neuron slim deploy). Returns
    ``gemma_nb.bench.time_runners``' table: time to first token and decode tok/s per path.
    NOT RUN HERE.
    """
    from gemma_nb.bench import time_runners

    if load is None:
        try:
            from gemma_nb.neuron.deploy import load_slim as load  # notebook 05's neuron deploy
        except ImportError as error:
            raise TargetError(f"no neuron deploy loader ({error}): pass load=folder -> deployed model; "
                              f"{NEURON_HELP}") from None
    runners = {name: load(folder) for name, folder in artifacts.items()}
    return time_runners(runners, prompt_ids, new_tokens=new_tokens, repeats=repeats)
