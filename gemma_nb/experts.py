"""Gemma-4's routed experts: dense or sparse, bf16, int8 or any quantized format (notebooks 02, 05,
07). Each is a drop-in for transformers' ``Gemma4TextExperts``: ``forward(hidden_states [T, H],
top_k_index [T, K], top_k_weights [T, K]) -> [T, H]`` on ``gate_up_proj [E, 2I, H]`` and ``down_proj
[E, H, I]``."""

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

# Tokens per chunk in DenseExperts: bounds the [E, T, H] temporary to ~46 MB at full size.
DENSE_TOKEN_CHUNK = 32
# Experts upcast at once by the vectorised int8 dense path (a float copy of all of them would be 4x
# the layer).
EXPERT_CHUNK = 16
# torch._weight_int8pack_mm's AVX-512 kernel reads K 16 at a time, aligned, no tail (else wrong
# numbers or a crash).
INT8PACK_K_MULTIPLE = 16
INT8PACK_ALIGN_BYTES = 32


def _is_tracing() -> bool:
    return torch.compiler.is_compiling() or torch.compiler.is_exporting()


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
    if not _is_tracing() and top_k_index.device.type == "cpu" and top_k_index.numel():
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


def int8pack_usable(x: torch.Tensor, q: torch.Tensor) -> bool:
    """Whether ``torch._weight_int8pack_mm(x, q, scales)`` is safe and fast: cpu bf16 ``x [M, K]``,
    contiguous, 32-byte aligned, K % 16 == 0 (fp32 and fp16 take a scalar loop on x86, so they fall
    back too)."""
    return (
        x.device.type == "cpu"
        and x.dtype == torch.bfloat16
        and x.dim() == 2
        and x.shape[1] % INT8PACK_K_MULTIPLE == 0
        and x.is_contiguous()
        and q.is_contiguous()
        and x.storage_offset() * x.element_size() % INT8PACK_ALIGN_BYTES == 0
        and (_is_tracing() or x.data_ptr() % INT8PACK_ALIGN_BYTES == 0)
    )


def int8_linear(
    x: torch.Tensor, q: torch.Tensor, kernel_scale: torch.Tensor | None, scale: torch.Tensor
) -> torch.Tensor:
    """``x [M, K] @ (q [N, K] * scale [N, 1]).T`` in ``x.dtype``: fused on the cpu where usable,
    given ``kernel_scale [N]``."""
    if kernel_scale is not None and int8pack_usable(x, q):
        return torch._weight_int8pack_mm(x, q, kernel_scale)
    return int8_matmul(x, q, scale)


def gated(gate_up: torch.Tensor, act_fn: Callable, dim: int = -1) -> torch.Tensor:
    """``act_fn(gate) * up`` for ``gate_up`` holding gate then up along ``dim`` (transformers'
    order)."""
    gate, up = gate_up.chunk(2, dim=dim)
    return act_fn(gate) * up


def as_parameter(tensor: torch.Tensor) -> nn.Parameter:
    return tensor if isinstance(tensor, nn.Parameter) else nn.Parameter(tensor, requires_grad=False)


class RoutedExperts(nn.Module):
    """The experts' weights and one expert's MLP; each subclass is one strategy over them.
    ``weights``: ``"float"`` (shared), ``"int8"`` (fp32 scales ``[E, out, 1]``, made here or given
    as ``scales=``) or ``"quantized"``. ``int8_kernel``: ``"fused"`` (torch._weight_int8pack_mm on
    the cpu) or ``"upcast"`` (each weight copied to the activation dtype)."""

    def __init__(
        self,
        gate_up_proj,
        down_proj,
        act_fn: Callable,
        int8: bool = False,
        compute_dtype: torch.dtype | None = None,
        int8_kernel: str = "fused",
        scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    ):
        super().__init__()
        assert int8_kernel in ("fused", "upcast"), (
            f"int8_kernel {int8_kernel!r} is not one of fused, upcast"
        )
        self.fused = int8_kernel == "fused"
        self.num_experts, two_inter, self.hidden_dim = gate_up_proj.shape
        self.intermediate_dim = two_inter // 2
        assert tuple(down_proj.shape) == (
            self.num_experts,
            self.hidden_dim,
            self.intermediate_dim,
        ), (
            f"down_proj {tuple(down_proj.shape)} does not fit gate_up_proj "
            f"{tuple(gate_up_proj.shape)}"
        )
        self.act_fn, self.int8, self.compute_dtype = act_fn, bool(int8), compute_dtype
        if isinstance(gate_up_proj, QuantizedTensor):
            self.weights, self._quantized_meta = "quantized", {}
            register_quantized(self, "gate_up", gate_up_proj)
            register_quantized(self, "down", down_proj)
        elif self.int8:
            self.weights = "int8"
            self._init_int8(gate_up_proj, down_proj, scales, compute_dtype)
        else:
            self.weights = "float"
            assert gate_up_proj.dtype.is_floating_point, (
                f"{gate_up_proj.dtype} weights need int8=True and scales="
            )
            self.gate_up_proj, self.down_proj = as_parameter(gate_up_proj), as_parameter(down_proj)

    def _init_int8(self, gate_up_proj, down_proj, scales, compute_dtype) -> None:
        if scales is None:
            assert gate_up_proj.dtype.is_floating_point, (
                "int8 weights need scales=(gate_up_scale, down_scale)"
            )
            dtype = compute_dtype or gate_up_proj.dtype
            pair = [
                quantize(w.detach(), "int8", name=n)
                for w, n in ((gate_up_proj, "gate_up_proj"), (down_proj, "down_proj"))
            ]
            weights, scales = [q.data for q in pair], [q.scale for q in pair]
        else:
            dtype, weights = compute_dtype or torch.bfloat16, (gate_up_proj, down_proj)
            assert gate_up_proj.dtype == down_proj.dtype == torch.int8
            assert all(s.shape == (*q.shape[:2], 1) for q, s in zip(weights, scales))
        for prefix, q, s in zip(("gate_up", "down"), weights, scales):
            self.register_buffer(f"{prefix}_proj", q)
            self.register_buffer(f"{prefix}_scale", s.float())
            # the fused cpu kernel wants 1-D scales in the activation dtype: derived, not saved
            if self.fused:
                self.register_buffer(
                    f"{prefix}_kernel_scale", s[..., 0].to(dtype), persistent=False
                )
        self.compute_dtype = dtype

    @classmethod
    def from_experts(cls, experts: nn.Module, int8: bool = False, **options):
        """Built on another experts module's float tensors (shared when float, quantized when
        ``int8``)."""
        assert getattr(experts, "weights", "float") == "float", (
            f"{type(experts).__name__} already holds quantized weights"
        )
        return cls(experts.gate_up_proj, experts.down_proj, experts.act_fn, int8=int8, **options)

    @classmethod
    def sharing(cls, other: "RoutedExperts", **options):
        """A ``cls`` on exactly ``other``'s weights (float, int8 or quantized): no copy, no
        re-quantization."""
        if other.weights == "quantized":
            return cls(other.gate_up, other.down, other.act_fn, **options)
        if other.int8:
            options = {
                "int8": True,
                "scales": (other.gate_up_scale, other.down_scale),
                "compute_dtype": other.compute_dtype,
                **options,
            }
        return cls(other.gate_up_proj, other.down_proj, other.act_fn, **options)

    # QuantizedTensor, as are down's
    gate_up = property(lambda self: registered_quantized(self, "gate_up"))
    down = property(lambda self: registered_quantized(self, "down"))

    fmt = property(
        lambda self: (
            self.gate_up.fmt
            if self.weights == "quantized"
            else "int8"
            if self.int8
            else str(self.gate_up_proj.dtype).removeprefix("torch.")
        )
    )

    # Stored bytes of all experts' weights, scales included: the state dict's (derived kernel scales
    # are not saved).
    weight_bytes = property(
        lambda self: sum(t.numel() * t.element_size() for t in self.state_dict().values())
    )

    def float_weights(self, dtype: torch.dtype, expert=None) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up, down) of one ``expert`` or of all stacked; quantized ones dequantized to
        ``dtype``."""
        quantized = self.weights == "quantized"
        pair = (self.gate_up, self.down) if quantized else (self.gate_up_proj, self.down_proj)
        pair = pair if expert is None else tuple(w[expert] for w in pair)
        return tuple(w.dequantize(dtype) for w in pair) if quantized else pair

    def expert_mlp(self, x: torch.Tensor, expert: int | torch.SymInt) -> torch.Tensor:
        """One expert on ``x [M, H]``: ``down(act(gate) * up)``, reading only that expert's
        weights."""
        if not self.int8:
            gate_up, down = self.float_weights(x.dtype, expert)
            return F.linear(gated(F.linear(x, gate_up), self.act_fn), down)
        gate_up_ks, down_ks = (
            (self.gate_up_kernel_scale[expert], self.down_kernel_scale[expert])
            if self.fused
            else (None, None)
        )
        gate_up = int8_linear(x, self.gate_up_proj[expert], gate_up_ks, self.gate_up_scale[expert])
        return int8_linear(
            gated(gate_up, self.act_fn), self.down_proj[expert], down_ks, self.down_scale[expert]
        )

    def _gather_upcast(self, x, top_k_index, top_k_weights):
        """The routed int8 experts gathered, upcast and batched (static shapes); ``[T, H]`` fp32,
        summed in fp32."""
        dtype = x.dtype
        # [T, K, 2I, 1]
        hidden = torch.matmul(self.gate_up_proj[top_k_index].to(dtype), x[:, None, :, None])
        # [T, K, I, 1]
        hidden = gated(
            scale_rows(hidden, self.gate_up_scale[top_k_index], dtype), self.act_fn, dim=2
        )
        out = scale_rows(
            torch.matmul(self.down_proj[top_k_index].to(dtype), hidden),
            self.down_scale[top_k_index],
            torch.float32,
        )
        return (top_k_weights[..., None].float() * out[..., 0]).sum(1)

    def _dense_upcast(self, x, router_weights):
        """Every int8 expert on every token, ``EXPERT_CHUNK`` upcast at a time, weighted by
        ``router_weights [T, E]``."""
        dtype, tokens, two_inter = x.dtype, x.shape[0], 2 * self.intermediate_dim
        out = torch.zeros(tokens, self.hidden_dim, dtype=torch.float32, device=x.device)
        for first in range(0, self.num_experts, EXPERT_CHUNK):
            chunk = slice(first, min(first + EXPERT_CHUNK, self.num_experts))
            experts = chunk.stop - chunk.start
            hidden = x @ self.gate_up_proj[chunk].reshape(experts * two_inter, -1).to(dtype).T
            hidden = scale_rows(hidden, self.gate_up_scale[chunk].reshape(1, -1), dtype)
            # [e, T, I]
            hidden = gated(hidden.reshape(tokens, experts, two_inter), self.act_fn).transpose(0, 1)
            partial = torch.bmm(hidden, self.down_proj[chunk].to(dtype).transpose(1, 2)).float()
            partial = partial * self.down_scale[chunk].transpose(1, 2)  # [e, T, H]
            out += (partial * router_weights[:, chunk].T[:, :, None]).sum(0)
        return out

    def _inputs(self, hidden_states, top_k_index, top_k_weights):
        check_routing(hidden_states, top_k_index, top_k_weights, self.num_experts, self.hidden_dim)
        dtype = (
            None
            if self.weights == "quantized"
            else self.compute_dtype
            if self.int8
            else self.gate_up_proj.dtype
        )
        return hidden_states if dtype in (None, hidden_states.dtype) else hidden_states.to(dtype)

    def extra_repr(self) -> str:
        weights = "int8 per-channel + fp32 scales" if self.weights == "int8" else self.fmt
        return (
            f"num_experts={self.num_experts}, hidden={self.hidden_dim}, "
            f"intermediate={self.intermediate_dim}, weights={weights}"
        )


class DenseExperts(RoutedExperts):
    """All E experts for every token, weighted by dense ``[T, E]`` router weights (the port's op):
    static shapes."""

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        x = self._inputs(hidden_states, top_k_index, top_k_weights)
        weights = dense_router_weights(top_k_index, top_k_weights, self.num_experts)  # [T, E]
        chunks = [
            self._chunk(x[s : s + DENSE_TOKEN_CHUNK], weights[s : s + DENSE_TOKEN_CHUNK])
            for s in range(0, x.shape[0], DENSE_TOKEN_CHUNK)
        ]
        return (chunks[0] if len(chunks) == 1 else torch.cat(chunks)).to(hidden_states.dtype)

    def _chunk(self, x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        if self.int8 and not self.fused:
            return self._dense_upcast(x, weights)
        tokens, experts, inter = x.shape[0], self.num_experts, self.intermediate_dim
        if self.int8:
            gate_up = int8_linear(
                x,
                self.gate_up_proj.view(experts * 2 * inter, self.hidden_dim),
                self.gate_up_kernel_scale.view(-1),
                self.gate_up_scale.view(-1, 1),
            )
        else:
            gate_up_proj, down_proj = self.float_weights(x.dtype)
            gate_up = F.linear(x, gate_up_proj.reshape(experts * 2 * inter, self.hidden_dim))
        # [E, T, I]
        hidden = (
            gated(gate_up.view(tokens, experts, 2 * inter), self.act_fn)
            .transpose(0, 1)
            .contiguous()
        )
        if self.int8:
            # [E, T, H]
            per_expert = torch.stack(
                [
                    int8_linear(
                        hidden[e], self.down_proj[e], self.down_kernel_scale[e], self.down_scale[e]
                    )
                    for e in range(experts)
                ]
            )
        else:
            per_expert = torch.bmm(hidden, down_proj.transpose(1, 2))  # [E, T, H]
        return (per_expert.float() * weights.t()[:, :, None]).sum(dim=0)


class SparseExperts(RoutedExperts):
    """Only the routed experts' weights (``K / E`` of DenseExperts' traffic). Decode (``T * K <
    E``): a static loop over (token, expert) pairs, ``selection="view"`` reading each in place,
    ``"gather"`` copying the K first. Else grouped (eager)."""

    def __init__(self, gate_up_proj, down_proj, act_fn, selection: str = "view", **options):
        super().__init__(gate_up_proj, down_proj, act_fn, **options)
        assert selection in ("view", "gather"), (
            f"selection {selection!r} is not one of view, gather"
        )
        assert selection != "gather" or self.weights != "quantized", (
            f"selection 'gather' needs float or int8 weights, not {self.fmt}"
        )
        self.selection = selection

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        x = self._inputs(hidden_states, top_k_index, top_k_weights)
        if top_k_index.numel() >= self.num_experts:
            out = self.grouped(x, top_k_index, top_k_weights)
        elif self.selection == "gather":
            out = self._decode_gather(x, top_k_index, top_k_weights)
        else:
            out = self._decode(
                x,
                top_k_weights,
                lambda token, t, k: self.expert_mlp(token, self._expert_id(top_k_index, t, k)),
            )
        return out.to(hidden_states.dtype)

    def experts_read(self, top_k_index: torch.Tensor) -> int:
        """Expert weight sets a forward reads: T x K on the decode path, each distinct expert once
        when grouped."""
        tokens, top_k = top_k_index.shape
        return (
            tokens * top_k
            if tokens * top_k < self.num_experts
            else int(top_k_index.unique().numel())
        )

    def _expert_id(self, top_k_index: torch.Tensor, t: int, k: int):
        expert = top_k_index[t, k].item()
        torch._check(expert >= 0)
        torch._check(expert < self.num_experts)
        return expert

    @staticmethod
    def _decode(x, top_k_weights, mlp):
        """Each token's K expert outputs ``mlp(token [1, H], t, k)``, weighted and summed in fp32:
        ``[T, H]``."""
        rows = []
        for t in range(x.shape[0]):
            token = x[t : t + 1]
            outputs = torch.cat([mlp(token, t, k) for k in range(top_k_weights.shape[1])])  # [K, H]
            rows.append(top_k_weights[t : t + 1].float() @ outputs.float())  # [1, H]
        return rows[0] if len(rows) == 1 else torch.cat(rows)

    def _decode_gather(self, x, top_k_index, top_k_weights):
        if self.int8 and not self.fused:
            return self._gather_upcast(x, top_k_index, top_k_weights)
        # [T, K, 2I, H]: a copy of the K experts' weights
        gate_up_w = self.gate_up_proj[top_k_index]
        down_w = self.down_proj[top_k_index]  # [T, K, H, I]
        if self.int8:
            gate_up_s, gate_up_ks = (
                self.gate_up_scale[top_k_index],
                self.gate_up_kernel_scale[top_k_index],
            )
            down_s, down_ks = self.down_scale[top_k_index], self.down_kernel_scale[top_k_index]
            return self._decode(
                x,
                top_k_weights,
                lambda token, t, k: int8_linear(
                    gated(
                        int8_linear(token, gate_up_w[t, k], gate_up_ks[t, k], gate_up_s[t, k]),
                        self.act_fn,
                    ),
                    down_w[t, k],
                    down_ks[t, k],
                    down_s[t, k],
                ),
            )
        # [T, K, I]
        hidden = gated(torch.matmul(gate_up_w, x[:, None, :, None]).squeeze(-1), self.act_fn)
        outputs = torch.matmul(down_w, hidden[..., None]).squeeze(-1)  # [T, K, H]
        return (outputs.float() * top_k_weights.float()[..., None]).sum(dim=1)

    def grouped(self, x, top_k_index, top_k_weights, accumulate_dtype: torch.dtype = torch.float32):
        """Each routed expert once on its tokens; ``accumulate_dtype=None``: summed in ``x.dtype``,
        transformers' eager loop."""
        tokens, top_k = top_k_index.shape
        flat_experts = top_k_index.reshape(-1)
        order = torch.argsort(flat_experts, stable=True)
        token_of, weight_of = order // top_k, top_k_weights.reshape(-1)[order]
        counts = torch.bincount(flat_experts, minlength=self.num_experts).tolist()
        out = torch.zeros(
            tokens, self.hidden_dim, dtype=accumulate_dtype or x.dtype, device=x.device
        )
        for expert, (rows, weight) in enumerate(
            zip(token_of.split(counts), weight_of.split(counts))
        ):
            if len(rows) == 0:
                continue
            y, weight = self.expert_mlp(x[rows], expert), weight[:, None]
            if accumulate_dtype is not None:
                y, weight = y.to(accumulate_dtype), weight.to(accumulate_dtype)
            out.index_add_(0, rows, (y * weight).to(out.dtype))
        return out


class QuantizedExperts(SparseExperts):
    """Experts on ``QuantizedTensor`` weights, run as transformers' eager loop (each expert
    dequantized just before use)."""

    @classmethod
    def from_experts(
        cls, experts: nn.Module, fmt: str, name: str = "experts"
    ) -> "QuantizedExperts":
        """``experts``' float weights quantized to ``fmt`` (one of
        ``gemma_nb.formats.QUANTIZED_FORMATS``)."""
        gate_up, down = (
            quantize(getattr(experts, w), fmt, name=f"{name}.{w}")
            for w in ("gate_up_proj", "down_proj")
        )
        return cls(gate_up, down, experts.act_fn)

    def forward(self, hidden_states, top_k_index, top_k_weights):
        x = self._inputs(hidden_states, top_k_index, top_k_weights)
        return self.grouped(x, top_k_index, top_k_weights, accumulate_dtype=None)


class Int8Experts(RoutedExperts):
    """int8 experts the slim deploy exports (notebook 05): gathered for one token, dense otherwise
    (no per-expert loop)."""

    @classmethod
    def from_quantized(cls, experts: RoutedExperts) -> "Int8Experts":
        """Built on int8 ``QuantizedExperts`` (as ``apply_scheme`` makes): its tensors, not a
        copy."""
        assert experts.fmt == "int8", (
            f"experts quantized to {experts.fmt!r}; Int8Experts takes int8"
        )
        return cls(
            experts.gate_up_data,
            experts.down_data,
            experts.act_fn,
            int8=True,
            int8_kernel="upcast",
            scales=(experts.gate_up_scale, experts.down_scale),
        )

    def forward(self, hidden_states, top_k_index, top_k_weights):
        check_routing(hidden_states, top_k_index, top_k_weights, self.num_experts, self.hidden_dim)
        if hidden_states.shape[0] == 1:
            out = self._gather_upcast(hidden_states, top_k_index, top_k_weights)
        else:
            out = self._dense_upcast(
                hidden_states, dense_router_weights(top_k_index, top_k_weights, self.num_experts)
            )
        return out.to(hidden_states.dtype)


# The expert kernels ``moe.swap_experts`` and the benchmarks offer, each also as ``<name>_int8``.
KERNELS: dict[str, type[RoutedExperts]] = {"dense": DenseExperts, "sparse": SparseExperts}
