"""Gemma-4 routed experts computed two ways: all of them (the port's DenseExperts) or only the routed top-k.

Both classes are drop-ins for transformers' ``Gemma4TextExperts`` (notebook 07): same forward,
``forward(hidden_states [T, H], top_k_index [T, K], top_k_weights [T, K]) -> [T, H]``, and the
same stacked weights, ``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]``. Each expert is
``down(gelu_tanh(gate) * up)``; the layer output is the router-weighted sum over the K experts
the router picked for each token.

- ``DenseExperts``: every expert for every token (static shapes, E/K times the work), combined with
  dense router weights ``[T, E]`` that are zero outside each token's top-k. The port shipped this
  op, and its decode ran at ~6 tok/s.
- ``SparseExperts``: reads only the selected experts' weights. The decode path (``T * K < E``,
  NxD Inference's rule for "selective loading") has static shapes and exports with
  ``torch.export``; prefill groups tokens by expert.

Both take the float weights as they are (shared with the model, never copied) or int8
per-output-channel weights with fp32 scales (``int8=True``, quantized with
``gemma_nb.quant.quantize_int8_per_channel``, one expert at a time). ``swap_experts(model, impl)``
puts one of them into every MoE layer of a loaded model.
"""

from __future__ import annotations

import copy
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

IMPLEMENTATIONS = ("transformers", "dense", "sparse", "dense_int8", "sparse_int8")
SELECTIONS = ("view", "gather")
# "fused": torch._weight_int8pack_mm on the cpu; "upcast": a bf16 copy of each weight, then matmul.
INT8_KERNELS = ("fused", "upcast")
# Tokens per chunk in DenseExperts: bounds the [E, T, H] temporary to ~46 MB at full size.
DENSE_TOKEN_CHUNK = 32
# torch._weight_int8pack_mm's AVX-512 kernel steps over the input dimension 16 at a time with
# aligned loads and no tail: other sizes read past the row (wrong numbers or a segfault).
INT8PACK_K_MULTIPLE = 16
INT8PACK_ALIGN_BYTES = 32


# --------------------------------------------------------------------------------------------
# Routing inputs
# --------------------------------------------------------------------------------------------


def _is_tracing() -> bool:
    return torch.compiler.is_compiling() or torch.compiler.is_exporting()


def check_routing(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                  num_experts: int, hidden_dim: int) -> None:
    """ValueError naming the problem if the three forward inputs do not fit an E-expert, H-wide layer.

    Shapes are always checked (free: no data is read). Index values are checked in eager mode on
    the cpu only; elsewhere an out-of-range index fails inside torch (a device assert or
    ``torch._check``), because reading values would add a host sync per layer.
    """
    if hidden_states.dim() != 2 or hidden_states.shape[1] != hidden_dim:
        raise ValueError(
            f"hidden_states has shape {tuple(hidden_states.shape)}; expected [T, {hidden_dim}] "
            "(tokens x hidden_size): flatten batch and sequence first, as Gemma4TextDecoderLayer does"
        )
    if top_k_index.dim() != 2 or top_k_index.shape[0] != hidden_states.shape[0]:
        raise ValueError(
            f"top_k_index has shape {tuple(top_k_index.shape)}; expected [T, K] with T = "
            f"{hidden_states.shape[0]} tokens (one row of expert ids per token)"
        )
    if top_k_weights.shape != top_k_index.shape:
        raise ValueError(
            f"top_k_weights has shape {tuple(top_k_weights.shape)} but top_k_index has "
            f"{tuple(top_k_index.shape)}: pass the router's weights and indices together"
        )
    if top_k_index.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"top_k_index has dtype {top_k_index.dtype}; expected int64 expert ids (torch.topk's)")
    top_k = top_k_index.shape[1]
    if not 1 <= top_k <= num_experts:
        raise ValueError(
            f"top_k={top_k} must be between 1 and num_experts={num_experts}: "
            f"route each token to at most {num_experts} experts (the 26B routes 8 of 128)"
        )
    if not _is_tracing() and top_k_index.device.type == "cpu" and top_k_index.numel():
        low, high = int(top_k_index.min()), int(top_k_index.max())
        if low < 0 or high >= num_experts:
            bad = low if low < 0 else high
            raise ValueError(f"top_k_index holds expert id {bad}; ids must lie in [0, {num_experts - 1}]")


def dense_router_weights(top_k_index: torch.Tensor, top_k_weights: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Router weights as a dense ``[T, E]`` fp32 matrix: ``top_k_weights`` at ``top_k_index``, zero elsewhere."""
    dense = torch.zeros(top_k_index.shape[0], num_experts, dtype=torch.float32, device=top_k_index.device)
    return dense.scatter(1, top_k_index.long(), top_k_weights.float())


# --------------------------------------------------------------------------------------------
# Weights: shared float tensors, or int8 + fp32 scales
# --------------------------------------------------------------------------------------------


def quantize_experts_int8(weight: torch.Tensor, name: str = "experts") -> tuple[torch.Tensor, torch.Tensor]:
    """``weight [E, out, in]`` -> ``q int8 [E, out, in]``, ``scale fp32 [E, out, 1]``, one expert at a time.

    Same numbers as ``quantize_int8_per_channel(weight, axis=1)`` (every row has its own scale);
    looping over experts bounds the fp32 temporaries to one expert (16 MB at full size, not 2 GB).
    """
    from gemma_nb.quant import quantize_int8_per_channel

    if weight.dim() != 3:
        raise ValueError(f"{name} has shape {tuple(weight.shape)}; expected stacked experts [E, out, in]")
    num_experts, rows, cols = weight.shape
    q = torch.empty(num_experts, rows, cols, dtype=torch.int8, device=weight.device)
    scale = torch.empty(num_experts, rows, 1, dtype=torch.float32, device=weight.device)
    for e in range(num_experts):
        q[e], scale[e] = quantize_int8_per_channel(weight[e].detach(), axis=0, name=f"{name}[{e}]")
    return q, scale


def int8pack_usable(x: torch.Tensor, q: torch.Tensor) -> bool:
    """Whether ``torch._weight_int8pack_mm(x, q, scales)`` is safe and fast for these operands.

    torch 2.13's cpu kernel (aten/src/ATen/native/cpu/int8mm_kernel.cpp): ``x [M, K]`` bf16
    contiguous with rows 32-byte aligned, ``q [N, K]`` int8 contiguous, ``scales [N]`` 1-D in
    ``x``'s dtype; its AVX-512 / AVX2 loop has no tail, so K must be a multiple of 16 (a K of 33
    segfaulted here). fp32 and fp16 inputs are accepted but take a scalar loop on x86, so they use
    the dequantizing fallback instead.
    """
    if x.device.type != "cpu" or x.dtype != torch.bfloat16 or x.dim() != 2:
        return False
    if x.shape[1] % INT8PACK_K_MULTIPLE or not (x.is_contiguous() and q.is_contiguous()):
        return False
    offset_bytes = x.storage_offset() * x.element_size()
    if offset_bytes % INT8PACK_ALIGN_BYTES:
        return False
    if not _is_tracing() and x.data_ptr() % INT8PACK_ALIGN_BYTES:
        return False
    return True


def int8_linear(x: torch.Tensor, q: torch.Tensor, kernel_scale: torch.Tensor, scale: torch.Tensor,
                fused: bool = True) -> torch.Tensor:
    """``x [M, K] @ (q [N, K] * scale [N, 1]).T`` -> ``[M, N]`` in ``x.dtype``, weight-only int8.

    ``fused`` and on the cpu with bf16 activations: ``torch._weight_int8pack_mm`` (reads the int8
    weight once; ``kernel_scale [N]`` is ``scale`` rounded to ``x.dtype``, as gpt-fast stores its
    int8 scales). Otherwise ``gemma_nb.quant.int8_matmul``: upcast the weight to a ``x.dtype`` copy,
    matmul, fp32 scale on the output (NxD's order; 1 + 2 + 2 bytes of traffic per weight in bf16).
    """
    if fused and int8pack_usable(x, q):
        return torch._weight_int8pack_mm(x, q, kernel_scale)
    from gemma_nb.quant import int8_matmul

    return int8_matmul(x, q, scale)


class _Experts(nn.Module):
    """Weights and one expert's MLP, shared by DenseExperts and SparseExperts."""

    def __init__(self, gate_up_proj: torch.Tensor, down_proj: torch.Tensor, act_fn: Callable, int8: bool = False,
                 compute_dtype: torch.dtype | None = None, int8_kernel: str = "fused",
                 scales: tuple[torch.Tensor, torch.Tensor] | None = None):
        super().__init__()
        if int8_kernel not in INT8_KERNELS:
            raise ValueError(f"int8_kernel {int8_kernel!r} is not one of {', '.join(INT8_KERNELS)}")
        self.fused = int8_kernel == "fused"
        if gate_up_proj.dim() != 3 or down_proj.dim() != 3:
            raise ValueError(
                f"gate_up_proj {tuple(gate_up_proj.shape)} and down_proj {tuple(down_proj.shape)} must be "
                "stacked [E, 2I, H] and [E, H, I]"
            )
        num_experts, two_i, hidden = gate_up_proj.shape
        if two_i % 2 or tuple(down_proj.shape) != (num_experts, hidden, two_i // 2):
            raise ValueError(
                f"down_proj has shape {tuple(down_proj.shape)}; with gate_up_proj {tuple(gate_up_proj.shape)} "
                f"it must be [E, H, I] = {(num_experts, hidden, two_i // 2)}"
            )
        self.num_experts, self.hidden_dim, self.intermediate_dim = num_experts, hidden, two_i // 2
        self.act_fn = act_fn
        self.int8 = bool(int8)
        if not self.int8:
            if not gate_up_proj.dtype.is_floating_point:
                raise ValueError(f"gate_up_proj has dtype {gate_up_proj.dtype}; pass float weights, or int8=True "
                                 "with scales=(gate_up_scale, down_scale) for weights already quantized")
            # The model's own tensors: the same storage, no copy.
            self.gate_up_proj = _as_parameter(gate_up_proj)
            self.down_proj = _as_parameter(down_proj)
            return
        if scales is None:
            if not gate_up_proj.dtype.is_floating_point:
                raise ValueError("int8 weights need their scales: pass scales=(gate_up_scale, down_scale)")
            dtype = compute_dtype or gate_up_proj.dtype
            q_gate_up, s_gate_up = quantize_experts_int8(gate_up_proj, "gate_up_proj")
            q_down, s_down = quantize_experts_int8(down_proj, "down_proj")
        else:
            dtype = compute_dtype or torch.bfloat16
            (q_gate_up, q_down), (s_gate_up, s_down) = (gate_up_proj, down_proj), scales
            if q_gate_up.dtype != torch.int8 or q_down.dtype != torch.int8:
                raise ValueError(f"with scales, the weights must be int8; got {q_gate_up.dtype} and {q_down.dtype}")
            if s_gate_up.shape != (*q_gate_up.shape[:2], 1) or s_down.shape != (*q_down.shape[:2], 1):
                raise ValueError(f"scales {tuple(s_gate_up.shape)}, {tuple(s_down.shape)} must be [E, out, 1] for "
                                 f"weights {tuple(q_gate_up.shape)}, {tuple(q_down.shape)}")
        self.register_buffer("gate_up_proj", q_gate_up)
        self.register_buffer("gate_up_scale", s_gate_up)
        self.register_buffer("down_proj", q_down)
        self.register_buffer("down_scale", s_down)
        # The fused cpu kernel wants 1-D scales in the activation dtype: derived, not saved.
        self.register_buffer("gate_up_kernel_scale", s_gate_up[..., 0].to(dtype), persistent=False)
        self.register_buffer("down_kernel_scale", s_down[..., 0].to(dtype), persistent=False)
        self.compute_dtype = dtype

    @classmethod
    def from_experts(cls, experts: nn.Module, int8: bool = False, **options):
        """Built on another experts module's tensors (shared when float, quantized when ``int8``)."""
        if getattr(experts, "int8", False):
            raise ValueError(
                f"{type(experts).__name__} already holds int8 weights; build from the float experts "
                "(reload the model) rather than re-quantizing quantized weights"
            )
        return cls(experts.gate_up_proj, experts.down_proj, experts.act_fn, int8=int8, **options)

    @classmethod
    def sharing(cls, other: "_Experts", **options):
        """A ``cls`` on exactly ``other``'s weights (float or already int8): no copy, no re-quantization."""
        if other.int8:
            options = {"compute_dtype": other.compute_dtype, **options}
            return cls(other.gate_up_proj, other.down_proj, other.act_fn, int8=True,
                       scales=(other.gate_up_scale, other.down_scale), **options)
        return cls(other.gate_up_proj, other.down_proj, other.act_fn, **options)

    @property
    def weight_bytes(self) -> int:
        """Stored bytes of all experts' weights (int8: plus fp32 scales, as ``memory.tensor_bytes`` counts)."""
        names = ("gate_up_proj", "down_proj") + (("gate_up_scale", "down_scale") if self.int8 else ())
        return sum(getattr(self, n).numel() * getattr(self, n).element_size() for n in names)

    def expert_mlp(self, x: torch.Tensor, expert: int | torch.SymInt) -> torch.Tensor:
        """One expert on ``x [M, H]`` -> ``[M, H]``: ``down(act(gate) * up)``, reading only that expert's weights."""
        if self.int8:
            gate_up = int8_linear(x, self.gate_up_proj[expert], self.gate_up_kernel_scale[expert],
                                  self.gate_up_scale[expert], self.fused)
        else:
            gate_up = F.linear(x, self.gate_up_proj[expert])
        gate, up = gate_up.chunk(2, dim=-1)
        hidden = self.act_fn(gate) * up
        if self.int8:
            return int8_linear(hidden, self.down_proj[expert], self.down_kernel_scale[expert], self.down_scale[expert],
                               self.fused)
        return F.linear(hidden, self.down_proj[expert])

    def _inputs(self, hidden_states, top_k_index, top_k_weights):
        check_routing(hidden_states, top_k_index, top_k_weights, self.num_experts, self.hidden_dim)
        if self.int8 and hidden_states.dtype != self.compute_dtype:
            return hidden_states.to(self.compute_dtype)
        if not self.int8 and hidden_states.dtype != self.gate_up_proj.dtype:
            return hidden_states.to(self.gate_up_proj.dtype)
        return hidden_states

    def extra_repr(self) -> str:
        weights = "int8 per-channel + fp32 scales" if self.int8 else str(self.gate_up_proj.dtype).replace("torch.", "")
        return (f"num_experts={self.num_experts}, hidden={self.hidden_dim}, "
                f"intermediate={self.intermediate_dim}, weights={weights}")


def _as_parameter(tensor: torch.Tensor) -> nn.Parameter:
    if isinstance(tensor, nn.Parameter):
        return tensor
    return nn.Parameter(tensor, requires_grad=False)


class DenseExperts(_Experts):
    """All E experts for every token, combined with dense ``[T, E]`` router weights (the port's op).

    Static shapes and no data-dependent control flow, which is why the port chose it for a
    compiled Neuron graph, at E/K = 16 times the expert work and weight traffic of top-8 routing.
    float: one ``[T, H] x [H, E*2I]`` matmul for gate/up (the port's ``ColumnParallel(H -> E*2I)``),
    then a batched matmul per expert for down. int8: one fused int8 matmul for gate/up, one per
    expert for down (each expert has its own per-row scales). Outputs are summed in fp32.
    """

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        out_dtype = hidden_states.dtype
        x = self._inputs(hidden_states, top_k_index, top_k_weights)
        weights = dense_router_weights(top_k_index, top_k_weights, self.num_experts)  # [T, E]
        chunks = [self._chunk(x[s:s + DENSE_TOKEN_CHUNK], weights[s:s + DENSE_TOKEN_CHUNK])
                  for s in range(0, x.shape[0], DENSE_TOKEN_CHUNK)]
        out = chunks[0] if len(chunks) == 1 else torch.cat(chunks)
        return out.to(out_dtype)

    def _chunk(self, x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        tokens, experts, inter = x.shape[0], self.num_experts, self.intermediate_dim
        flat_gate_up = self.gate_up_proj.view(experts * 2 * inter, self.hidden_dim)
        if self.int8:
            gate_up = int8_linear(x, flat_gate_up, self.gate_up_kernel_scale.view(-1),
                                  self.gate_up_scale.view(-1, 1), self.fused)
        else:
            gate_up = F.linear(x, flat_gate_up)
        gate, up = gate_up.view(tokens, experts, 2 * inter).chunk(2, dim=-1)
        hidden = (self.act_fn(gate) * up).transpose(0, 1).contiguous()  # [E, T, I]
        if self.int8:
            per_expert = torch.stack([
                int8_linear(hidden[e], self.down_proj[e], self.down_kernel_scale[e], self.down_scale[e], self.fused)
                for e in range(experts)
            ])  # [E, T, H]
        else:
            per_expert = torch.bmm(hidden, self.down_proj.transpose(1, 2))  # [E, T, H]
        return (per_expert.float() * weights.t()[:, :, None]).sum(dim=0)


class SparseExperts(_Experts):
    """Only the routed experts' weights are read: ``K / E`` of DenseExperts' traffic per token.

    Decode (``T * K < E``; every batch up to 15 tokens for the 26B): a static loop over the T x K
    (token, expert) pairs. Each expert id is read as a 0-d integer, so ``torch.export`` records it
    as a bounded symbolic int and the graph has static shapes. ``selection`` says how the weights
    are reached:

    - ``"view"`` (default): ``gate_up_proj[e]`` is a view of the stacked tensor; the matmul reads
      the expert's weights in place, once. Fastest on a cpu.
    - ``"gather"``: ``gate_up_proj[top_k_index]`` copies the K experts' weights into a new
      ``[T, K, 2I, H]`` tensor first, then runs batched matmuls: NxD Inference's "selective
      loading" and gpt-fast's mixtral-moe. On a cpu the copy costs a write and a second read of
      every selected byte (measured in notebook 07); on an accelerator the compiler can turn it
      into a DMA gather feeding the matmul.

    Prefill (``T * K >= E``): tokens are sorted by expert and each expert that has tokens runs
    once on its rows (the loop transformers' eager path uses). Once T * K >= E nearly every
    expert has a token, so each expert's weights are read once for all its tokens, while the
    decode path would re-read an expert for every (token, expert) pair. The loop length depends
    on the routing, so this path is eager-only; prefill graphs on Neuron use blockwise kernels
    (NxD Inference) or DenseExperts.

    float weights use ``F.linear``; int8 uses ``torch._weight_int8pack_mm`` on the cpu (see
    ``int8_linear``). Outputs are summed over the K experts in fp32, as transformers' grouped_mm does.
    """

    def __init__(self, gate_up_proj, down_proj, act_fn, int8: bool = False, compute_dtype=None,
                 int8_kernel: str = "fused", scales=None, selection: str = "view"):
        super().__init__(gate_up_proj, down_proj, act_fn, int8=int8, compute_dtype=compute_dtype,
                         int8_kernel=int8_kernel, scales=scales)
        if selection not in SELECTIONS:
            raise ValueError(f"selection {selection!r} is not one of {', '.join(SELECTIONS)}")
        self.selection = selection

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        out_dtype = hidden_states.dtype
        x = self._inputs(hidden_states, top_k_index, top_k_weights)
        tokens, top_k = top_k_index.shape
        if tokens * top_k < self.num_experts:
            decode = self._decode_gather if self.selection == "gather" else self._decode_view
            out = decode(x, top_k_index, top_k_weights)
        else:
            out = self._prefill(x, top_k_index, top_k_weights)
        return out.to(out_dtype)

    def _expert_id(self, top_k_index: torch.Tensor, t: int, k: int):
        expert = top_k_index[t, k].item()
        torch._check(expert >= 0)
        torch._check(expert < self.num_experts)
        return expert

    def _decode_view(self, x, top_k_index, top_k_weights):
        rows = []
        for t in range(x.shape[0]):
            token = x[t:t + 1]
            outputs = torch.cat([self.expert_mlp(token, self._expert_id(top_k_index, t, k))
                                 for k in range(top_k_index.shape[1])])  # [K, H]
            rows.append(top_k_weights[t:t + 1].float() @ outputs.float())  # [1, H]
        return rows[0] if len(rows) == 1 else torch.cat(rows)

    def _decode_gather(self, x, top_k_index, top_k_weights):
        tokens, top_k = top_k_index.shape
        gate_up_w = self.gate_up_proj[top_k_index]  # [T, K, 2I, H]: a copy of the K experts' weights
        down_w = self.down_proj[top_k_index]  # [T, K, H, I]
        if self.int8:
            gate_up_s, gate_up_ks = self.gate_up_scale[top_k_index], self.gate_up_kernel_scale[top_k_index]
            down_s, down_ks = self.down_scale[top_k_index], self.down_kernel_scale[top_k_index]
            rows = []
            for t in range(tokens):
                outputs = []
                for k in range(top_k):
                    gate, up = int8_linear(x[t:t + 1], gate_up_w[t, k], gate_up_ks[t, k], gate_up_s[t, k],
                                           self.fused).chunk(2, -1)
                    hidden = self.act_fn(gate) * up
                    outputs.append(int8_linear(hidden, down_w[t, k], down_ks[t, k], down_s[t, k], self.fused))
                rows.append(top_k_weights[t:t + 1].float() @ torch.cat(outputs).float())
            return rows[0] if len(rows) == 1 else torch.cat(rows)
        gate_up = torch.matmul(gate_up_w, x[:, None, :, None]).squeeze(-1)  # [T, K, 2I]
        gate, up = gate_up.chunk(2, dim=-1)
        hidden = self.act_fn(gate) * up  # [T, K, I]
        outputs = torch.matmul(down_w, hidden[..., None]).squeeze(-1)  # [T, K, H]
        return (outputs.float() * top_k_weights.float()[..., None]).sum(dim=1)

    def _prefill(self, x, top_k_index, top_k_weights):
        tokens, top_k = top_k_index.shape
        flat_experts = top_k_index.reshape(-1)
        order = torch.argsort(flat_experts, stable=True)
        token_of = order // top_k
        weight_of = top_k_weights.reshape(-1)[order].float()
        counts = torch.bincount(flat_experts, minlength=self.num_experts).tolist()
        out = torch.zeros(tokens, self.hidden_dim, dtype=torch.float32, device=x.device)
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            rows = token_of[start:start + count]
            y = self.expert_mlp(x[rows], expert)
            out.index_add_(0, rows, y.float() * weight_of[start:start + count, None])
            start += count
        return out


# --------------------------------------------------------------------------------------------
# Swapping the experts of a loaded model
# --------------------------------------------------------------------------------------------


def default_selection(device: str | torch.device) -> str:
    """How SparseExperts should reach the selected weights on ``device``.

    cpu: ``"view"``: no copy, and the per-expert ``.item()`` costs nothing on the host. cuda:
    ``"gather"``: each ``.item()`` would be a device-to-host sync (8 per layer per token), while the
    gather copy of 8 experts runs at HBM speed and keeps the step free of host syncs.
    """
    return "gather" if torch.device(device).type == "cuda" else "view"


def experts_modules(model: nn.Module) -> list[tuple[nn.Module, str, nn.Module]]:
    """Every routed-experts module of ``model`` as ``(parent, attribute, module)``."""
    found = []
    for parent in model.modules():
        child = getattr(parent, "experts", None)
        if isinstance(child, nn.Module) and hasattr(child, "gate_up_proj") and hasattr(child, "down_proj"):
            found.append((parent, "experts", child))
    return found


def _transformers_experts(source: nn.Module, config, experts_implementation: str | None = None) -> nn.Module:
    from transformers.models.gemma4.modeling_gemma4 import Gemma4TextExperts

    if experts_implementation is not None:
        # A private copy: the model's config (shared by every layer) keeps its own choice.
        config = copy.deepcopy(config)
        config._experts_implementation = experts_implementation
    with torch.device("meta"):
        module = Gemma4TextExperts(config)
    module.gate_up_proj = _as_parameter(source.gate_up_proj)
    module.down_proj = _as_parameter(source.down_proj)
    module.act_fn = source.act_fn
    return module


def make_experts(source: nn.Module, impl: str, config=None, **options) -> nn.Module:
    """A new experts module of kind ``impl`` on ``source``'s weights (float weights shared, not copied).

    ``impl``: ``transformers`` (its ``Gemma4TextExperts``, dispatching on ``config._experts_implementation``),
    ``dense``, ``sparse``, ``dense_int8``, ``sparse_int8``. ``options`` go to the class
    (``selection="gather"`` for SparseExperts; ``experts_implementation="grouped_mm"`` for a
    standalone transformers module, whose config would otherwise leave it unset).
    """
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"experts implementation {impl!r} is not one of {', '.join(IMPLEMENTATIONS)}")
    if getattr(source, "int8", False):
        raise ValueError(
            f"the model's experts are already {type(source).__name__} with int8 weights; "
            "reload the model to swap to another implementation"
        )
    if impl == "transformers":
        if config is None:
            raise ValueError("impl 'transformers' needs the model's text config (Gemma4TextConfig)")
        return _transformers_experts(source, config, **options)
    cls = DenseExperts if impl.startswith("dense") else SparseExperts
    return cls.from_experts(source, int8=impl.endswith("_int8"), **options)


def swap_experts(model: nn.Module, impl: str, **options) -> nn.Module:
    """Replace every MoE layer's experts module of ``model`` in place; returns ``model``.

    Float weights are shared with the previous module (same tensors, no copy), so swapping between
    ``transformers``, ``dense`` and ``sparse`` is free and reversible. ``*_int8`` quantizes each
    layer's experts (one expert at a time) and is one-way: reload to go back.
    """
    found = experts_modules(model)
    if not found:
        raise ValueError(f"{type(model).__name__} has no routed-experts modules (no '.experts' with gate_up_proj)")
    config = getattr(model, "config", None)
    config = getattr(config, "get_text_config", lambda: config)() if config is not None else None
    for parent, name, module in found:
        setattr(parent, name, make_experts(module, impl, config=config, **options))
    return model


def experts_kind(model: nn.Module) -> str:
    """Which implementation the model's experts use now (``transformers``, ``dense``, ``sparse_int8``, ...)."""
    kinds = set()
    for _, _, module in experts_modules(model):
        if isinstance(module, DenseExperts):
            kinds.add("dense_int8" if module.int8 else "dense")
        elif isinstance(module, SparseExperts):
            kinds.add("sparse_int8" if module.int8 else "sparse")
        else:
            kinds.add("transformers")
    return ",".join(sorted(kinds))


def random_experts(config, seed: int = 0, dtype: torch.dtype = torch.bfloat16, device: str = "cpu",
                   std: float = 0.02) -> nn.Module:
    """One layer's ``Gemma4TextExperts`` with deterministic N(0, std) weights, allocated on ``device``.

    ``config``: a Gemma4TextConfig (only ``num_experts``, ``moe_intermediate_size``, ``hidden_size``,
    ``hidden_activation`` are used). One full-size 26B layer is 1.52 GB in bf16.
    """
    from transformers.models.gemma4.modeling_gemma4 import Gemma4TextExperts

    with torch.device("meta"):
        module = Gemma4TextExperts(config)
    generator = torch.Generator(device=device).manual_seed(seed)
    for name in ("gate_up_proj", "down_proj"):
        # Drawn directly in ``dtype``: no fp32 copy of the whole stack.
        weight = torch.empty(getattr(module, name).shape, dtype=dtype, device=device).normal_(0.0, std, generator=generator)
        setattr(module, name, nn.Parameter(weight, requires_grad=False))
    return module


def random_routing(num_tokens: int, num_experts: int, top_k: int, seed: int = 0,
                   device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """``(top_k_index [T, K] int64, top_k_weights [T, K] fp32)``: K distinct experts per token, weights sum to 1."""
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k={top_k} must be between 1 and num_experts={num_experts}")
    generator = torch.Generator().manual_seed(seed)
    scores = torch.rand(num_tokens, num_experts, generator=generator)
    weights, index = torch.softmax(scores * 4.0, dim=-1).topk(top_k, dim=-1)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    return index.to(device), weights.to(device)


def compare_outputs(modules: dict, reference: str, hidden_states: torch.Tensor,
                    routes: list[tuple[torch.Tensor, torch.Tensor]]):
    """How far each module's output is from ``modules[reference]``'s on the same inputs, over ``routes``.

    Columns: ``max_abs_diff`` (max over routes and elements), ``ref_max_abs`` (largest reference
    output element), ``bf16_ulps``: max_abs_diff in units of one bf16 rounding step (2^-8) of
    ``ref_max_abs``; a handful means "equal within bf16 rounding".
    """
    import pandas as pd

    if reference not in modules:
        raise ValueError(f"reference {reference!r} is not one of {', '.join(modules)}")
    with torch.inference_mode():
        wanted = [modules[reference](hidden_states, *route).float() for route in routes]
        ref_max = max(float(w.abs().max()) for w in wanted)
        rows = []
        for name, module in modules.items():
            diff = max(float((module(hidden_states, *route).float() - want).abs().max())
                       for route, want in zip(routes, wanted))
            rows.append({"candidate": name, "max_abs_diff": diff, "ref_max_abs": ref_max,
                         "bf16_ulps": diff / (ref_max * 2.0**-8) if ref_max else float("nan")})
    return pd.DataFrame(rows).set_index("candidate")
