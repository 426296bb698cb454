"""Gemma-4's routed experts, one family: dense or sparse, bf16, int8 or any quantized format.

Every module here is a drop-in for transformers' ``Gemma4TextExperts`` (notebooks 02, 05, 07):
``forward(hidden_states [T, H], top_k_index [T, K], top_k_weights [T, K]) -> [T, H]`` on stacked
weights ``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]``. Each expert is
``down(gelu_tanh(gate) * up)``; the layer output is the router-weighted sum over the K experts the
router picked for each token. They differ in two choices:

- **strategy**: ``DenseExperts`` runs every expert on every token, combined with the dense router
  weights ``[T, E]`` of :func:`dense_router_weights` (static shapes: the port's Neuron op, ~6
  tok/s); ``SparseExperts`` reads only the routed experts' weights (decode: a static loop over
  the T x K pairs that ``torch.export`` traces; prefill: tokens grouped by expert);
  ``QuantizedExperts`` groups tokens by expert in transformers' eager order, so on the same float
  weights it gives transformers' numbers bit for bit; ``Int8Experts`` (the slim deploy's, notebook
  05) runs sparse for one token and dense otherwise, in a few vectorised ops that export keeps small.
- **weights** (``RoutedExperts``): the model's float tensors (shared, never copied); int8 per
  output row with fp32 scales (``int8=True``; matmul on the upcast weight, scale on the output, as
  NxD's int8 layers, or ``torch._weight_int8pack_mm`` on the cpu); or any format of
  ``gemma_nb.formats`` as a ``QuantizedTensor`` (``QuantizedExperts.from_experts(..., fmt)``),
  dequantized to the activation dtype expert by expert.

``gemma_nb.neuron.moe`` builds the same math on NxD's parallel layers; ``gemma_nb.moe`` swaps these
modules into a loaded model.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from gemma_nb.formats import (
    QuantizedTensor,
    int8_matmul,
    quantize,
    register_quantized,
    registered_quantized,
    scale_rows,
)

SELECTIONS = ("view", "gather")
# "fused": torch._weight_int8pack_mm on the cpu; "upcast": a copy of each weight in the activation
# dtype, then matmul (vectorised over experts where the strategy allows).
INT8_KERNELS = ("fused", "upcast")
# Tokens per chunk in DenseExperts: bounds the [E, T, H] temporary to ~46 MB at full size.
DENSE_TOKEN_CHUNK = 32
# Experts upcast at once by the vectorised int8 dense path: the float copy of all experts would be
# a transient as large as the layer's int8 weights times 4.
EXPERT_CHUNK = 16
# torch._weight_int8pack_mm's AVX-512 kernel steps over the input dimension 16 at a time with
# aligned loads and no tail: other sizes read past the row (wrong numbers or a segfault).
INT8PACK_K_MULTIPLE = 16
INT8PACK_ALIGN_BYTES = 32


# --------------------------------------------------------------------------------------------
# The math every strategy shares
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
    int8 scales). Otherwise ``gemma_nb.formats.int8_matmul``: upcast the weight to a ``x.dtype`` copy,
    matmul, fp32 scale on the output (NxD's order; 1 + 2 + 2 bytes of traffic per weight in bf16).
    """
    if fused and int8pack_usable(x, q):
        return torch._weight_int8pack_mm(x, q, kernel_scale)
    return int8_matmul(x, q, scale)



def gated(gate_up: torch.Tensor, act_fn: Callable, dim: int = -1) -> torch.Tensor:
    """``act_fn(gate) * up`` for ``gate_up`` holding gate then up along ``dim`` (transformers' order)."""
    gate, up = gate_up.chunk(2, dim=dim)
    return act_fn(gate) * up


def int8_gather_upcast(x, top_k_index, top_k_weights, gate_up, gate_up_scale, down, down_scale, act_fn):
    """Selective loading on int8 weights, vectorised: the routed experts' weights gathered, upcast, batched.

    ``x [T, H]``; ``gate_up`` int8 ``[E, 2I, H]`` with ``gate_up_scale [E, 2I, 1]``, ``down`` int8
    ``[E, H, I]`` with ``down_scale [E, H, 1]``. Static shapes (the gathered ``[T, K, ...]``), so
    ``torch.export`` traces it into a handful of ops. Returns ``[T, H]`` fp32, summed over K in fp32.
    """
    dtype = x.dtype
    hidden = torch.matmul(gate_up[top_k_index].to(dtype), x[:, None, :, None])  # [T, K, 2I, 1]
    hidden = gated(scale_rows(hidden, gate_up_scale[top_k_index], dtype), act_fn, dim=2)  # [T, K, I, 1]
    out = scale_rows(torch.matmul(down[top_k_index].to(dtype), hidden), down_scale[top_k_index], torch.float32)
    return (top_k_weights[..., None].float() * out[..., 0]).sum(1)


def int8_dense_upcast(x, router_weights, gate_up, gate_up_scale, down, down_scale, act_fn):
    """Every int8 expert on every token, ``EXPERT_CHUNK`` experts upcast at a time, weighted by
    ``router_weights [T, E]`` (:func:`dense_router_weights`). Shapes as :func:`int8_gather_upcast`;
    returns ``[T, H]`` fp32."""
    dtype, tokens = x.dtype, x.shape[0]
    num_experts, two_inter, _ = gate_up.shape
    out = torch.zeros(tokens, down.shape[1], dtype=torch.float32, device=x.device)
    for first in range(0, num_experts, EXPERT_CHUNK):
        chunk = slice(first, min(first + EXPERT_CHUNK, num_experts))
        experts = chunk.stop - chunk.start
        hidden = x @ gate_up[chunk].reshape(experts * two_inter, -1).to(dtype).T
        hidden = scale_rows(hidden, gate_up_scale[chunk].reshape(1, -1), dtype)
        hidden = gated(hidden.reshape(tokens, experts, two_inter), act_fn).transpose(0, 1)  # [e, T, I]
        partial = torch.bmm(hidden, down[chunk].to(dtype).transpose(1, 2)).float()
        partial = partial * down_scale[chunk].transpose(1, 2)  # [e, T, H]
        out += (partial * router_weights[:, chunk].T[:, :, None]).sum(0)
    return out


# --------------------------------------------------------------------------------------------
# Weights: shared float tensors, int8 + fp32 scales, or a QuantizedTensor of any format
# --------------------------------------------------------------------------------------------


def _check_stacked(gate_up_shape, down_shape) -> tuple[int, int, int]:
    """``(E, H, I)`` of stacked ``gate_up [E, 2I, H]`` and ``down [E, H, I]``; ValueError if they do not fit."""
    if len(gate_up_shape) != 3 or len(down_shape) != 3:
        raise ValueError(f"gate_up_proj {tuple(gate_up_shape)} and down_proj {tuple(down_shape)} must be "
                         "stacked [E, 2I, H] and [E, H, I]")
    num_experts, two_i, hidden = gate_up_shape
    if two_i % 2 or tuple(down_shape) != (num_experts, hidden, two_i // 2):
        raise ValueError(f"down_proj has shape {tuple(down_shape)}; with gate_up_proj {tuple(gate_up_shape)} "
                         f"it must be [E, H, I] = {(num_experts, hidden, two_i // 2)}")
    return num_experts, hidden, two_i // 2


def as_parameter(tensor: torch.Tensor) -> nn.Parameter:
    """``tensor`` as a frozen parameter sharing its storage (itself if it already is one)."""
    if isinstance(tensor, nn.Parameter):
        return tensor
    return nn.Parameter(tensor, requires_grad=False)


class RoutedExperts(nn.Module):
    """The experts' weights and one expert's MLP; each subclass is one strategy over them.

    ``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]`` are, by ``weights``:

    - ``"float"``: the model's own tensors as parameters (same storage, no copy);
    - ``"int8"`` (``int8=True``): int8 buffers with fp32 scales ``gate_up_scale [E, 2I, 1]`` /
      ``down_scale [E, H, 1]``, quantized from float weights (``gemma_nb.formats.quantize``, per
      output row of each expert) or passed with ``scales=``; run by :func:`int8_linear`
      (``int8_kernel="fused"``) or by upcasting (``"upcast"``);
    - ``"quantized"``: two ``QuantizedTensor`` of any format (``gate_up``, ``down`` properties),
      dequantized to the activation dtype just before each expert's matmuls.
    """

    def __init__(self, gate_up_proj, down_proj, act_fn: Callable, int8: bool = False,
                 compute_dtype: torch.dtype | None = None, int8_kernel: str = "fused",
                 scales: tuple[torch.Tensor, torch.Tensor] | None = None):
        super().__init__()
        if int8_kernel not in INT8_KERNELS:
            raise ValueError(f"int8_kernel {int8_kernel!r} is not one of {', '.join(INT8_KERNELS)}")
        self.fused = int8_kernel == "fused"
        self.num_experts, self.hidden_dim, self.intermediate_dim = _check_stacked(gate_up_proj.shape, down_proj.shape)
        self.act_fn = act_fn
        self.int8 = bool(int8)
        self.compute_dtype = compute_dtype
        if isinstance(gate_up_proj, QuantizedTensor):
            self.weights = "quantized"
            self._quantized_meta = {}
            register_quantized(self, "gate_up", gate_up_proj)
            register_quantized(self, "down", down_proj)
        elif self.int8:
            self.weights = "int8"
            self._init_int8(gate_up_proj, down_proj, scales, compute_dtype)
        else:
            self.weights = "float"
            if not gate_up_proj.dtype.is_floating_point:
                raise ValueError(f"gate_up_proj has dtype {gate_up_proj.dtype}; pass float weights, or int8=True "
                                 "with scales=(gate_up_scale, down_scale) for weights already quantized")
            self.gate_up_proj = as_parameter(gate_up_proj)
            self.down_proj = as_parameter(down_proj)

    def _init_int8(self, gate_up_proj, down_proj, scales, compute_dtype) -> None:
        if scales is None:
            if not gate_up_proj.dtype.is_floating_point:
                raise ValueError("int8 weights need their scales: pass scales=(gate_up_scale, down_scale)")
            dtype = compute_dtype or gate_up_proj.dtype
            gate_up = quantize(gate_up_proj.detach(), "int8", name="gate_up_proj")
            down = quantize(down_proj.detach(), "int8", name="down_proj")
            (q_gate_up, s_gate_up), (q_down, s_down) = (gate_up.data, gate_up.scale), (down.data, down.scale)
        else:
            dtype = compute_dtype or torch.bfloat16
            (q_gate_up, q_down), (s_gate_up, s_down) = (gate_up_proj, down_proj), scales
            if q_gate_up.dtype != torch.int8 or q_down.dtype != torch.int8:
                raise ValueError(f"with scales, the weights must be int8; got {q_gate_up.dtype} and {q_down.dtype}")
            if s_gate_up.shape != (*q_gate_up.shape[:2], 1) or s_down.shape != (*q_down.shape[:2], 1):
                raise ValueError(f"scales {tuple(s_gate_up.shape)}, {tuple(s_down.shape)} must be [E, out, 1] for "
                                 f"weights {tuple(q_gate_up.shape)}, {tuple(q_down.shape)}")
        self.register_buffer("gate_up_proj", q_gate_up)
        self.register_buffer("gate_up_scale", s_gate_up.float())
        self.register_buffer("down_proj", q_down)
        self.register_buffer("down_scale", s_down.float())
        if self.fused:
            # The fused cpu kernel wants 1-D scales in the activation dtype: derived, not saved.
            self.register_buffer("gate_up_kernel_scale", s_gate_up[..., 0].to(dtype), persistent=False)
            self.register_buffer("down_kernel_scale", s_down[..., 0].to(dtype), persistent=False)
        self.compute_dtype = dtype

    @classmethod
    def from_experts(cls, experts: nn.Module, int8: bool = False, **options):
        """Built on another experts module's float tensors (shared when float, quantized when ``int8``)."""
        if getattr(experts, "int8", False) or getattr(experts, "weights", "float") != "float":
            raise ValueError(
                f"{type(experts).__name__} already holds quantized weights; build from the float experts "
                "(reload the model) rather than re-quantizing quantized weights"
            )
        return cls(experts.gate_up_proj, experts.down_proj, experts.act_fn, int8=int8, **options)

    @classmethod
    def sharing(cls, other: RoutedExperts, **options):
        """A ``cls`` on exactly ``other``'s weights (float, int8 or quantized): no copy, no re-quantization."""
        if other.weights == "quantized":
            return cls(other.gate_up, other.down, other.act_fn, **options)
        if other.int8:
            options = {"compute_dtype": other.compute_dtype, **options}
            return cls(other.gate_up_proj, other.down_proj, other.act_fn, int8=True,
                       scales=(other.gate_up_scale, other.down_scale), **options)
        return cls(other.gate_up_proj, other.down_proj, other.act_fn, **options)

    @property
    def gate_up(self) -> QuantizedTensor:
        """``gate_up_proj`` as a QuantizedTensor (``weights == "quantized"`` only)."""
        return registered_quantized(self, "gate_up")

    @property
    def down(self) -> QuantizedTensor:
        return registered_quantized(self, "down")

    @property
    def fmt(self) -> str:
        """The weights' format name: ``bf16``-style dtype for float, ``int8``, or the QuantizedTensor's."""
        if self.weights == "quantized":
            return self.gate_up.fmt
        return "int8" if self.int8 else str(self.gate_up_proj.dtype).replace("torch.", "")

    @property
    def weight_bytes(self) -> int:
        """Stored bytes of all experts' weights, scales included (as ``formats.tensor_bytes`` counts)."""
        if self.weights == "quantized":
            return self.gate_up.nbytes + self.down.nbytes
        names = ("gate_up_proj", "down_proj") + (("gate_up_scale", "down_scale") if self.int8 else ())
        return sum(getattr(self, n).numel() * getattr(self, n).element_size() for n in names)

    nbytes = weight_bytes

    def expert_weights(self, expert, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert ``expert``'s float ``gate_up [2I, H]`` and ``down [H, I]`` (quantized: dequantized to ``dtype``)."""
        if self.weights == "quantized":
            return self.gate_up[expert].dequantize(dtype), self.down[expert].dequantize(dtype)
        return self.gate_up_proj[expert], self.down_proj[expert]

    def expert_mlp(self, x: torch.Tensor, expert: int | torch.SymInt) -> torch.Tensor:
        """One expert on ``x [M, H]`` -> ``[M, H]``: ``down(act(gate) * up)``, reading only that expert's weights."""
        if not self.int8:
            gate_up, down = self.expert_weights(expert, x.dtype)
            return F.linear(gated(F.linear(x, gate_up), self.act_fn), down)
        kernel_scales = (None, None)
        if self.fused:
            kernel_scales = (self.gate_up_kernel_scale[expert], self.down_kernel_scale[expert])
        gate_up = int8_linear(x, self.gate_up_proj[expert], kernel_scales[0], self.gate_up_scale[expert], self.fused)
        return int8_linear(gated(gate_up, self.act_fn), self.down_proj[expert], kernel_scales[1],
                           self.down_scale[expert], self.fused)

    def _inputs(self, hidden_states, top_k_index, top_k_weights):
        check_routing(hidden_states, top_k_index, top_k_weights, self.num_experts, self.hidden_dim)
        if self.weights == "quantized":
            return hidden_states
        dtype = self.compute_dtype if self.int8 else self.gate_up_proj.dtype
        return hidden_states if hidden_states.dtype == dtype else hidden_states.to(dtype)

    def extra_repr(self) -> str:
        weights = {"int8": "int8 per-channel + fp32 scales", "quantized": self.fmt}.get(self.weights, self.fmt)
        return (f"num_experts={self.num_experts}, hidden={self.hidden_dim}, "
                f"intermediate={self.intermediate_dim}, weights={weights}")

    def stacked_weights(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """All experts' float ``gate_up [E, 2I, H]`` and ``down [E, H, I]`` (the stored ones when float)."""
        if self.weights == "quantized":
            return self.gate_up.dequantize(dtype), self.down.dequantize(dtype)
        return self.gate_up_proj, self.down_proj


class DenseExperts(RoutedExperts):
    """All E experts for every token, combined with dense ``[T, E]`` router weights (the port's op).

    Static shapes and no data-dependent control flow, which is why the port chose it for a
    compiled Neuron graph, at E/K = 16 times the expert work and weight traffic of top-8 routing.
    float: one ``[T, H] x [H, E*2I]`` matmul for gate/up (the port's ``ColumnParallel(H -> E*2I)``),
    then a batched matmul per expert for down. int8 fused: one fused int8 matmul for gate/up, one
    per expert for down (each expert has its own per-row scales); int8 upcast:
    :func:`int8_dense_upcast`. Outputs are summed in fp32.
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
        if self.int8 and not self.fused:
            return int8_dense_upcast(x, weights, self.gate_up_proj, self.gate_up_scale, self.down_proj,
                                     self.down_scale, self.act_fn)
        tokens, experts, inter = x.shape[0], self.num_experts, self.intermediate_dim
        if self.int8:
            flat_gate_up = self.gate_up_proj.view(experts * 2 * inter, self.hidden_dim)
            gate_up = int8_linear(x, flat_gate_up, self.gate_up_kernel_scale.view(-1),
                                  self.gate_up_scale.view(-1, 1), self.fused)
        else:
            gate_up_proj, down_proj = self.stacked_weights(x.dtype)
            gate_up = F.linear(x, gate_up_proj.reshape(experts * 2 * inter, self.hidden_dim))
        hidden = gated(gate_up.view(tokens, experts, 2 * inter), self.act_fn).transpose(0, 1).contiguous()  # [E, T, I]
        if self.int8:
            per_expert = torch.stack([
                int8_linear(hidden[e], self.down_proj[e], self.down_kernel_scale[e], self.down_scale[e], self.fused)
                for e in range(experts)
            ])  # [E, T, H]
        else:
            per_expert = torch.bmm(hidden, down_proj.transpose(1, 2))  # [E, T, H]
        return (per_expert.float() * weights.t()[:, :, None]).sum(dim=0)


class SparseExperts(RoutedExperts):
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
      into a DMA gather feeding the matmul. int8 upcast: :func:`int8_gather_upcast`.

    Prefill (``T * K >= E``): tokens are grouped by expert and each expert that has tokens runs
    once on its rows (:meth:`grouped`, the loop transformers' eager path uses). Once T * K >= E
    nearly every expert has a token, so each expert's weights are read once for all its tokens,
    while the decode path would re-read an expert for every (token, expert) pair. The loop length
    depends on the routing, so this path is eager-only; prefill graphs on Neuron use blockwise
    kernels (NxD Inference) or DenseExperts.

    float weights use ``F.linear``; int8 uses ``torch._weight_int8pack_mm`` on the cpu (see
    ``int8_linear``). Outputs are summed over the K experts in fp32, as transformers' grouped_mm does.
    """

    def __init__(self, gate_up_proj, down_proj, act_fn, int8: bool = False, compute_dtype=None,
                 int8_kernel: str = "fused", scales=None, selection: str = "view"):
        super().__init__(gate_up_proj, down_proj, act_fn, int8=int8, compute_dtype=compute_dtype,
                         int8_kernel=int8_kernel, scales=scales)
        if selection not in SELECTIONS:
            raise ValueError(f"selection {selection!r} is not one of {', '.join(SELECTIONS)}")
        if selection == "gather" and self.weights == "quantized":
            raise ValueError(f"selection 'gather' needs float or int8 weights, not {self.fmt}: use 'view'")
        self.selection = selection

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        out_dtype = hidden_states.dtype
        x = self._inputs(hidden_states, top_k_index, top_k_weights)
        tokens, top_k = top_k_index.shape
        if tokens * top_k < self.num_experts:
            decode = self._decode_gather if self.selection == "gather" else self._decode_view
            out = decode(x, top_k_index, top_k_weights)
        else:
            out = self.grouped(x, top_k_index, top_k_weights)
        return out.to(out_dtype)

    def experts_read(self, top_k_index: torch.Tensor) -> int:
        """Expert weight sets a forward on ``top_k_index [T, K]`` reads: T x K on the decode path
        (a repeated expert is read again for each of its tokens), each distinct expert once on the grouped path."""
        tokens, top_k = top_k_index.shape
        if tokens * top_k < self.num_experts:
            return tokens * top_k
        return int(top_k_index.unique().numel())

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
        if self.int8 and not self.fused:
            return int8_gather_upcast(x, top_k_index, top_k_weights, self.gate_up_proj, self.gate_up_scale,
                                      self.down_proj, self.down_scale, self.act_fn)
        gate_up_w = self.gate_up_proj[top_k_index]  # [T, K, 2I, H]: a copy of the K experts' weights
        down_w = self.down_proj[top_k_index]  # [T, K, H, I]
        if self.int8:
            return self._decode_gather_fused(x, top_k_index, top_k_weights, gate_up_w, down_w)
        hidden = gated(torch.matmul(gate_up_w, x[:, None, :, None]).squeeze(-1), self.act_fn)  # [T, K, I]
        outputs = torch.matmul(down_w, hidden[..., None]).squeeze(-1)  # [T, K, H]
        return (outputs.float() * top_k_weights.float()[..., None]).sum(dim=1)

    def _decode_gather_fused(self, x, top_k_index, top_k_weights, gate_up_w, down_w):
        gate_up_s, gate_up_ks = self.gate_up_scale[top_k_index], self.gate_up_kernel_scale[top_k_index]
        down_s, down_ks = self.down_scale[top_k_index], self.down_kernel_scale[top_k_index]
        rows = []
        for t in range(top_k_index.shape[0]):
            outputs = []
            for k in range(top_k_index.shape[1]):
                hidden = gated(int8_linear(x[t:t + 1], gate_up_w[t, k], gate_up_ks[t, k], gate_up_s[t, k]), self.act_fn)
                outputs.append(int8_linear(hidden, down_w[t, k], down_ks[t, k], down_s[t, k]))
            rows.append(top_k_weights[t:t + 1].float() @ torch.cat(outputs).float())
        return rows[0] if len(rows) == 1 else torch.cat(rows)

    def grouped(self, x, top_k_index, top_k_weights, accumulate_dtype: torch.dtype = torch.float32):
        """Tokens grouped by expert, each routed expert run once on its rows, in ascending expert order.

        ``accumulate_dtype`` fp32 (default): outputs weighted and summed in fp32. ``None``: in
        ``x.dtype`` with the router weights as given, transformers' eager loop bit for bit.
        """
        tokens, top_k = top_k_index.shape
        flat_experts = top_k_index.reshape(-1)
        order = torch.argsort(flat_experts, stable=True)
        token_of = order // top_k
        weight_of = top_k_weights.reshape(-1)[order]
        counts = torch.bincount(flat_experts, minlength=self.num_experts).tolist()
        out = torch.zeros(tokens, self.hidden_dim, dtype=accumulate_dtype or x.dtype, device=x.device)
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            rows = token_of[start:start + count]
            y, weight = self.expert_mlp(x[rows], expert), weight_of[start:start + count, None]
            if accumulate_dtype is not None:
                y, weight = y.to(accumulate_dtype), weight.to(accumulate_dtype)
            out.index_add_(0, rows, (y * weight).to(out.dtype))
            start += count
        return out


class QuantizedExperts(SparseExperts):
    """Experts on ``QuantizedTensor`` weights of any format, run as transformers' eager loop.

    Stores ``gate_up [E, 2I, H]`` and ``down [E, H, I]`` as ``gemma_nb.formats.QuantizedTensor``
    (scales per expert per output row / block) and, for every expert some token routed to,
    dequantizes its weights to the activation dtype just before its matmuls (as the port's Neuron
    graph upcasts its int8 weights); outputs are weighted and summed in the activation dtype, so on
    the same float weights this equals transformers' eager ``Gemma4TextExperts`` bit for bit.
    ``quant.apply_scheme`` puts one in every MoE layer.
    """

    def __init__(self, gate_up: QuantizedTensor, down: QuantizedTensor, act_fn: Callable):
        super().__init__(gate_up, down, act_fn)

    @classmethod
    def from_experts(cls, experts: nn.Module, fmt: str, name: str = "experts") -> QuantizedExperts:
        """``experts``' float weights quantized to ``fmt`` (one of ``gemma_nb.formats.QUANTIZED_FORMATS``)."""
        gate_up = quantize(experts.gate_up_proj, fmt, name=f"{name}.gate_up_proj")
        down = quantize(experts.down_proj, fmt, name=f"{name}.down_proj")
        return cls(gate_up, down, experts.act_fn)

    def forward(self, hidden_states, top_k_index, top_k_weights):
        x = self._inputs(hidden_states, top_k_index, top_k_weights)
        return self.grouped(x, top_k_index, top_k_weights, accumulate_dtype=None)


class Int8Experts(RoutedExperts):
    """int8 experts the slim deploy exports (notebook 05): sparse for one token, dense otherwise.

    One token (decode): :func:`int8_gather_upcast`, only K/E of the weights read; several tokens
    (prefill): :func:`int8_dense_upcast`, every expert on every token with dense router weights.
    Both are a few vectorised ops, so ``torch.export`` keeps the programs small (DenseExperts' and
    SparseExperts' per-expert Python loops would unroll E times). Buffers (the artifact's weights):
    ``gate_up_proj`` int8 [E, 2I, H], ``gate_up_scale`` fp32 [E, 2I, 1], ``down_proj`` int8
    [E, H, I], ``down_scale`` fp32 [E, H, 1]; the activation dtype is the input's.
    """

    def __init__(self, gate_up, down, act_fn, scales):
        super().__init__(gate_up, down, act_fn, int8=True, int8_kernel="upcast", scales=scales)

    @classmethod
    def from_quantized(cls, experts: RoutedExperts) -> Int8Experts:
        """Built on int8 ``QuantizedExperts`` (as ``apply_scheme`` makes): its tensors, not a copy."""
        if experts.fmt != "int8":
            raise ValueError(f"experts quantized to {experts.fmt!r}; Int8Experts takes int8 (the squeeze's format)")
        if experts.weights == "quantized":
            gate_up, down = experts.gate_up, experts.down
            return cls(gate_up.data, down.data, experts.act_fn, scales=(gate_up.scale, down.scale))
        return cls(experts.gate_up_proj, experts.down_proj, experts.act_fn,
                   scales=(experts.gate_up_scale, experts.down_scale))

    def forward(self, hidden_states, top_k_index, top_k_weights):
        check_routing(hidden_states, top_k_index, top_k_weights, self.num_experts, self.hidden_dim)
        args = (self.gate_up_proj, self.gate_up_scale, self.down_proj, self.down_scale, self.act_fn)
        if hidden_states.shape[0] == 1:
            out = int8_gather_upcast(hidden_states, top_k_index, top_k_weights, *args)
        else:
            router_weights = dense_router_weights(top_k_index, top_k_weights, self.num_experts)
            out = int8_dense_upcast(hidden_states, router_weights, *args)
        return out.to(hidden_states.dtype)
