"""Gemma-4's routed experts (notebooks 02, 05, 07): a class per weight format, a kernel per routing
strategy. A format (``FloatExperts``, ``Int8Experts``, ``QuantizedExperts``) stores ``gate_up
[E, 2I, H]`` and ``down [E, H, I]`` and does three matmuls on chosen experts (``linear``,
``batched``, ``gathered``); a ``KERNELS`` entry routes tokens through those alone, so every kernel
runs on every format. Each module is a drop-in for transformers' ``Gemma4TextExperts``:
``forward(hidden_states [T, H], top_k_index [T, K], top_k_weights [T, K]) -> [T, H]``."""

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn

from gemma_nb import gemv
from gemma_nb.formats import (
    QuantizedTensor,
    quantize,
    register_quantized,
    registered_quantized,
    scale_rows,
)

# Experts a dense step computes at once: bounds its [e, T, H] fp32 temporary, and an int8 upcast's
# float copy, to a fraction of the layer.
EXPERT_CHUNK = 16


def check_routing(
    hidden_states, top_k_index: torch.Tensor, top_k_weights, num_experts: int, hidden_dim: int
) -> None:
    """Assert the forward inputs fit an E-expert, H-wide layer (index values: eager cpu only, no
    host sync)."""
    tokens, top_k = top_k_index.shape
    assert (
        hidden_states.shape == (tokens, hidden_dim) and top_k_weights.shape == top_k_index.shape
    ), (
        f"hidden_states {tuple(hidden_states.shape)} and top_k_weights "
        f"{tuple(top_k_weights.shape)}: want [{tokens}, {hidden_dim}] and [{tokens}, {top_k}]"
    )
    assert 1 <= top_k <= num_experts, f"top_k={top_k} not in [1, {num_experts}]"
    if not gemv.is_tracing() and top_k_index.device.type == "cpu" and top_k_index.numel():
        assert 0 <= int(top_k_index.min()) and int(top_k_index.max()) < num_experts, (
            f"expert ids outside [0, {num_experts})"
        )


def dense_router_weights(
    top_k_index: torch.Tensor, top_k_weights: torch.Tensor, num_experts: int
) -> torch.Tensor:
    """Router weights as a dense ``[T, E]`` fp32 matrix: ``top_k_weights`` at ``top_k_index``, zero
    elsewhere."""
    dense = torch.zeros(
        top_k_index.shape[0], num_experts, dtype=torch.float32, device=top_k_index.device
    )
    return dense.scatter(1, top_k_index.long(), top_k_weights.float())


def gated(gate_up: torch.Tensor, act_fn: Callable, dim: int = -1) -> torch.Tensor:
    """``act_fn(gate) * up`` for ``gate_up`` holding gate then up along ``dim`` (transformers'
    order)."""
    gate, up = gate_up.chunk(2, dim=dim)
    return act_fn(gate) * up


def as_parameter(tensor: torch.Tensor) -> nn.Parameter:
    return tensor if isinstance(tensor, nn.Parameter) else nn.Parameter(tensor, requires_grad=False)


class RoutedExperts(nn.Module):
    """One weight format's experts, routed by ``kernel`` (a ``KERNELS`` name). A format implements
    ``weight``; the matmuls below are written once on it."""

    # what ``grouped`` sums the experts' outputs in (None: the activations' dtype)
    accumulate_dtype: torch.dtype | None = torch.float32

    def __init__(self, gate_up_shape, down_shape, act_fn: Callable, kernel: str, compute_dtype):
        super().__init__()
        assert kernel in KERNELS, f"kernel {kernel!r} is not one of {', '.join(KERNELS)}"
        self.num_experts, two_inter, self.hidden_dim = gate_up_shape
        self.intermediate_dim = two_inter // 2
        assert tuple(down_shape) == (self.num_experts, self.hidden_dim, self.intermediate_dim), (
            f"down_proj {tuple(down_shape)} does not fit gate_up_proj {tuple(gate_up_shape)}"
        )
        # compute_dtype None: the activations' own
        self.act_fn, self.kernel, self.compute_dtype = act_fn, kernel, compute_dtype

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        check_routing(hidden_states, top_k_index, top_k_weights, self.num_experts, self.hidden_dim)
        x = hidden_states.to(self.compute_dtype or hidden_states.dtype)
        out = KERNELS[self.kernel].forward(self, x, top_k_index, top_k_weights)
        return out.to(hidden_states.dtype)

    def weight(self, name: str, experts, dtype: torch.dtype):
        """``name``'s (gate_up or down) weights of ``experts`` (an id, a slice or an id tensor) as
        ``dtype``, and the fp32 scale per output row ``[..., out, 1]`` due after the matmul (or
        None)."""
        raise NotImplementedError

    def linear(self, x: torch.Tensor, name: str, experts) -> torch.Tensor:
        """``x [M, in]`` against the rows of ``experts`` (an id or a slice of n): ``[M, n out]``."""
        w, scale = self.weight(name, experts, x.dtype)
        out = gemv.linear(x, w.reshape(-1, w.shape[-1]))
        return out if scale is None else scale_rows(out, scale.reshape(-1), x.dtype)

    def linear_each(self, x: torch.Tensor, name: str, ids) -> torch.Tensor:
        """Row i of ``x [1 or K, in]`` (row 0 where one) against expert ``ids[i]`` (K ids):
        ``[K, out]``."""
        rows = [x[i : i + 1] if x.shape[0] > 1 else x for i in range(len(ids))]
        return torch.cat([self.linear(row, name, e) for row, e in zip(rows, ids)])

    def batched(self, h: torch.Tensor, name: str, experts: slice) -> torch.Tensor:
        """``h [n, T, in]``, one row block per expert of ``experts``: ``[n, T, out]``, fp32 where
        scaled."""
        w, scale = self.weight(name, experts, h.dtype)
        out = torch.bmm(h, w.transpose(1, 2))
        return out if scale is None else out.float() * scale.transpose(1, 2)

    def gathered(self, x, name: str, index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``x [T, 1 or K, in, 1]`` against a copy of experts ``index [T, K]``: ``[T, K, out, 1]``
        in ``dtype``."""
        w, scale = self.weight(name, index, x.dtype)
        out = torch.matmul(w, x)
        return out.to(dtype) if scale is None else scale_rows(out, scale, dtype)

    def expert_mlp(self, x: torch.Tensor, expert: int | torch.SymInt) -> torch.Tensor:
        """One expert on ``x [M, H]``: ``down(act(gate) * up)``, reading only that expert's
        weights."""
        return self.linear(gated(self.linear(x, "gate_up", expert), self.act_fn), "down", expert)

    def experts_read(self, top_k_index: torch.Tensor) -> int:
        """Expert weight sets a forward over ``top_k_index`` reads."""
        return KERNELS[self.kernel].experts_read(top_k_index, self.num_experts)

    # Stored bytes of all experts' weights, scales included: the state dict's.
    weight_bytes = property(
        lambda self: sum(t.numel() * t.element_size() for t in self.state_dict().values())
    )

    def read_bytes(self, top_k_index: torch.Tensor) -> int:
        """Weight bytes (scales included) a forward over ``top_k_index`` reads."""
        return self.experts_read(top_k_index) * self.weight_bytes // self.num_experts

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, hidden={self.hidden_dim}, "
            f"intermediate={self.intermediate_dim}, weights={self.fmt}, kernel={self.kernel}"
        )


class FloatExperts(RoutedExperts):
    """Float weights (bf16, fp32, ...), shared with the module they come from."""

    def __init__(self, gate_up_proj, down_proj, act_fn: Callable, kernel: str = "sparse"):
        assert gate_up_proj.dtype.is_floating_point, (
            f"{gate_up_proj.dtype} weights: use Int8Experts or QuantizedExperts"
        )
        super().__init__(gate_up_proj.shape, down_proj.shape, act_fn, kernel, gate_up_proj.dtype)
        self.gate_up_proj, self.down_proj = as_parameter(gate_up_proj), as_parameter(down_proj)

    @classmethod
    def from_experts(cls, experts: nn.Module, kernel: str = "sparse") -> "FloatExperts":
        return cls(experts.gate_up_proj, experts.down_proj, experts.act_fn, kernel)

    def sharing(self, **options) -> "FloatExperts":
        return type(self)(self.gate_up_proj, self.down_proj, self.act_fn, **options)

    fmt = property(lambda self: str(self.gate_up_proj.dtype).removeprefix("torch."))

    def weight(self, name, experts, dtype):
        return getattr(self, f"{name}_proj")[experts].to(dtype), None

    def linear_each(self, x, name, ids):
        w = getattr(self, f"{name}_proj")
        if w.dtype == torch.bfloat16 and gemv.usable(x, w, len(ids)):
            return gemv.gemv(x, w, ids)  # one call for the K experts
        return super().linear_each(x, name, ids)


class Int8Experts(RoutedExperts):
    """int8 weights with an fp32 scale per output row ``[E, out, 1]`` (the port's format, NxD's
    numerics). ``matmul="fused"``: one cpu kernel reads the int8 weights (``gemv``);
    ``"upcast"``: each weight copied to the activations' dtype first, as NxD's layers do."""

    def __init__(
        self,
        gate_up_proj,
        down_proj,
        act_fn: Callable,
        scales: tuple[torch.Tensor, torch.Tensor],
        kernel: str = "sparse",
        matmul: str = "fused",
        compute_dtype: torch.dtype | None = torch.bfloat16,
    ):
        assert matmul in ("fused", "upcast"), f"matmul {matmul!r} is not one of fused, upcast"
        assert gate_up_proj.dtype == down_proj.dtype == torch.int8
        super().__init__(gate_up_proj.shape, down_proj.shape, act_fn, kernel, compute_dtype)
        for prefix, q, s in zip(("gate_up", "down"), (gate_up_proj, down_proj), scales):
            assert s.shape == (*q.shape[:2], 1), f"{prefix} scale {tuple(s.shape)}"
            self.register_buffer(f"{prefix}_proj", q)
            self.register_buffer(f"{prefix}_scale", s.float())
        self.matmul = matmul

    @classmethod
    def from_experts(cls, experts: nn.Module, kernel: str = "sparse", **options) -> "Int8Experts":
        """``experts``' float weights quantized (``formats.quantize``), computed in their dtype."""
        pair = [
            quantize(getattr(experts, n).detach(), "int8", n) for n in ("gate_up_proj", "down_proj")
        ]
        options.setdefault("compute_dtype", experts.gate_up_proj.dtype)
        scales = (pair[0].scale, pair[1].scale)
        return cls(pair[0].data, pair[1].data, experts.act_fn, scales, kernel, **options)

    @classmethod
    def from_quantized(cls, experts: "QuantizedExperts") -> "Int8Experts":
        """The slim deploy's experts on int8 ``QuantizedExperts``' tensors (no copy): static shapes
        (``gather``), the upcast NxD compiles, in the activations' dtype."""
        assert experts.fmt == "int8", (
            f"experts quantized to {experts.fmt!r}; Int8Experts takes int8"
        )
        scales = (experts.gate_up_scale, experts.down_scale)
        return cls(
            experts.gate_up_data,
            experts.down_data,
            experts.act_fn,
            scales,
            "gather",
            "upcast",
            None,
        )

    def sharing(self, **options) -> "Int8Experts":
        scales = (self.gate_up_scale, self.down_scale)
        options = {"kernel": self.kernel, "matmul": self.matmul, **options}
        options.setdefault("compute_dtype", self.compute_dtype)
        return type(self)(self.gate_up_proj, self.down_proj, self.act_fn, scales, **options)

    fmt = "int8"

    def weight(self, name, experts, dtype):
        q, scale = getattr(self, f"{name}_proj")[experts], getattr(self, f"{name}_scale")[experts]
        return q.to(dtype), scale

    def linear(self, x, name, experts):
        if self.matmul == "upcast":
            return super().linear(x, name, experts)
        q, scale = getattr(self, f"{name}_proj")[experts], getattr(self, f"{name}_scale")[experts]
        return gemv.int8_linear(x, q.reshape(-1, q.shape[-1]), scale.reshape(-1, 1))

    def linear_each(self, x, name, ids):
        q, scale = getattr(self, f"{name}_proj"), getattr(self, f"{name}_scale")
        if self.matmul == "fused" and gemv.usable(x, q, len(ids)) and scale.is_contiguous():
            return gemv.gemv(x, q, ids, scale)  # one call for the K experts
        return super().linear_each(x, name, ids)

    def batched(self, h, name, experts):
        if self.matmul == "upcast":
            return super().batched(h, name, experts)
        ids = range(self.num_experts)[experts]
        return torch.stack([self.linear(h[i].contiguous(), name, e) for i, e in enumerate(ids)])


class QuantizedExperts(RoutedExperts):
    """Weights in a ``formats.QUANTIZED_FORMATS`` format (``QuantizedTensor``), each dequantized to
    the activations' dtype just before use; by default transformers' eager loop (``grouped``,
    summed in the activations' dtype)."""

    def __init__(self, gate_up: QuantizedTensor, down: QuantizedTensor, act_fn, kernel="grouped"):
        super().__init__(gate_up.shape, down.shape, act_fn, kernel, None)
        self._quantized_meta = {}
        register_quantized(self, "gate_up", gate_up)
        register_quantized(self, "down", down)

    @classmethod
    def from_experts(cls, experts: nn.Module, fmt: str, name: str = "experts"):
        """``experts``' float weights quantized to ``fmt``, a ``formats.QUANTIZED_FORMATS`` name."""
        gate_up, down = (
            quantize(getattr(experts, w), fmt, name=f"{name}.{w}")
            for w in ("gate_up_proj", "down_proj")
        )
        return cls(gate_up, down, experts.act_fn)

    def sharing(self, **options) -> "QuantizedExperts":
        return type(self)(self.gate_up, self.down, self.act_fn, **options)

    # QuantizedTensor, as are down's
    gate_up = property(lambda self: registered_quantized(self, "gate_up"))
    down = property(lambda self: registered_quantized(self, "down"))
    fmt = property(lambda self: self.gate_up.fmt)
    accumulate_dtype = None

    def weight(self, name, experts, dtype):
        return getattr(self, name)[experts].dequantize(dtype), None


def dense(experts: RoutedExperts, x, top_k_index, top_k_weights) -> torch.Tensor:
    """All E experts on every token, weighted by dense ``[T, E]`` router weights (the port's op):
    static shapes, ``EXPERT_CHUNK`` experts at a time. ``[T, H]`` fp32."""
    router = dense_router_weights(top_k_index, top_k_weights, experts.num_experts)
    tokens, two_inter = x.shape[0], 2 * experts.intermediate_dim
    out = torch.zeros(tokens, experts.hidden_dim, dtype=torch.float32, device=x.device)
    for first in range(0, experts.num_experts, EXPERT_CHUNK):
        chunk = slice(first, min(first + EXPERT_CHUNK, experts.num_experts))
        gate_up = experts.linear(x, "gate_up", chunk).reshape(tokens, -1, two_inter)
        hidden = gated(gate_up, experts.act_fn).transpose(0, 1)  # [e, T, I]
        partial = experts.batched(hidden, "down", chunk).float()  # [e, T, H]
        out += (partial * router[:, chunk].T[:, :, None]).sum(0)
    return out


def sparse(experts: RoutedExperts, x, top_k_index, top_k_weights) -> torch.Tensor:
    """Only the routed experts' weights, read in place. Decode (T x K < E): a static loop over
    tokens, a token's K experts at once (``linear_each``), exportable; more tokens: ``grouped``."""
    if top_k_index.numel() >= experts.num_experts:
        return grouped(experts, x, top_k_index, top_k_weights)
    rows = []
    for t in range(x.shape[0]):
        ids = top_k_index[t].tolist()
        for expert in ids if gemv.is_tracing() else (min(ids), max(ids)):  # traced: unbacked ints
            torch._check(expert >= 0)
            torch._check(expert < experts.num_experts)
        hidden = gated(experts.linear_each(x[t : t + 1], "gate_up", ids), experts.act_fn)
        outputs = experts.linear_each(hidden, "down", ids)  # [K, H]
        rows.append(top_k_weights[t : t + 1].float() @ outputs.float())  # [1, H]
    return rows[0] if len(rows) == 1 else torch.cat(rows)


def gather(experts: RoutedExperts, x, top_k_index, top_k_weights) -> torch.Tensor:
    """One token's K experts' weights copied first, then batched matmuls (NxD's selective loading,
    gpt-fast's decode); more tokens: ``dense``. Static shapes, no host sync."""
    if x.shape[0] > 1:
        return dense(experts, x, top_k_index, top_k_weights)
    hidden = experts.gathered(x[:, None, :, None], "gate_up", top_k_index, x.dtype)  # [T, K, 2I, 1]
    out = experts.gathered(gated(hidden, experts.act_fn, dim=2), "down", top_k_index, torch.float32)
    return (top_k_weights[..., None].float() * out[..., 0]).sum(1)


def grouped(experts: RoutedExperts, x, top_k_index, top_k_weights) -> torch.Tensor:
    """Each routed expert once on its tokens, summed in ``experts.accumulate_dtype`` (None:
    ``x.dtype``, transformers' eager loop)."""
    accumulate_dtype = experts.accumulate_dtype
    tokens, top_k = top_k_index.shape
    flat_experts = top_k_index.reshape(-1)
    order = torch.argsort(flat_experts, stable=True)
    token_of, weight_of = order // top_k, top_k_weights.reshape(-1)[order]
    counts = torch.bincount(flat_experts, minlength=experts.num_experts).tolist()
    out = torch.zeros(
        tokens, experts.hidden_dim, dtype=accumulate_dtype or x.dtype, device=x.device
    )
    for expert, (rows, weight) in enumerate(zip(token_of.split(counts), weight_of.split(counts))):
        if len(rows) == 0:
            continue
        y, weight = experts.expert_mlp(x[rows], expert), weight[:, None]
        if accumulate_dtype is not None:
            y, weight = y.to(accumulate_dtype), weight.to(accumulate_dtype)
        out.index_add_(0, rows, (y * weight).to(out.dtype))
    return out


def _routed_read(top_k_index: torch.Tensor, num_experts: int) -> int:
    """T x K expert reads while T x K < E (a repeated expert read again), else each distinct one."""
    tokens, top_k = top_k_index.shape
    if tokens * top_k < num_experts:
        return tokens * top_k
    return int(top_k_index.unique().numel())


class Kernel(NamedTuple):
    """A routing strategy: ``forward(experts, x, top_k_index, top_k_weights) -> [T, H]``, and the
    expert weight sets it reads for a routing (``experts_read(top_k_index, E)``)."""

    forward: Callable
    experts_read: Callable[[torch.Tensor, int], int]


# Every kernel runs on every format; ``moe.swap_experts`` offers each (``<name>_int8`` too) and
# notebook 07 times each, in bf16 and int8.
KERNELS: dict[str, Kernel] = {
    "dense": Kernel(dense, lambda top_k_index, num_experts: num_experts),
    "sparse": Kernel(sparse, _routed_read),
    "gather": Kernel(
        gather,
        lambda index, num_experts: index.shape[1] if index.shape[0] == 1 else num_experts,
    ),
    "grouped": Kernel(grouped, lambda index, num_experts: int(index.unique().numel())),
}
