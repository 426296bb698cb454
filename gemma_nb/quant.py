"""Quantized linears and the planner's schemes applied to a loaded Gemma-4 model, measured (notebook 02)."""

from __future__ import annotations

import math
import time
from collections.abc import Mapping

import pandas as pd
import torch
from torch import nn
from transformers.models.gemma4.modeling_gemma4 import Gemma4TextExperts

from gemma_nb import memory
from gemma_nb.experts import QuantizedExperts, SparseExperts
from gemma_nb.formats import (
    QUANTIZED_FORMATS,
    QuantizedTensor,
    int8_matmul,
    quantization_error,
    quantize,
    register_quantized,
    registered_quantized,
    weight_format,
)
from gemma_nb.moe import random_routing
from gemma_nb.targets import torch_threads

FORMATS = QUANTIZED_FORMATS


class Int8Linear(nn.Module):
    """Weight-only int8 ``nn.Linear`` (no bias): ``qweight int8 [out, in]``, ``scale fp32 [out, 1]``."""

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor):
        super().__init__()
        assert qweight.dtype == torch.int8 and scale.shape == (qweight.shape[0], 1)
        self.out_features, self.in_features = qweight.shape
        self.register_buffer("qweight", qweight)
        self.register_buffer("scale", scale.float())

    @classmethod
    def from_weight(cls, weight: torch.Tensor, name: str = "weight") -> Int8Linear:
        """Same numbers as :func:`quantize_int8_per_channel`, computed in bounded-memory chunks."""
        assert weight.dim() == 2, f"{name!r} has shape {tuple(weight.shape)}"
        quantized = quantize(weight, "int8", name=name)
        return cls(quantized.data, quantized.scale)

    @classmethod
    def from_linear(cls, linear: nn.Linear, name: str = "linear") -> Int8Linear:
        assert getattr(linear, "bias", None) is None, f"{name!r} has a bias"
        return cls.from_weight(linear.weight, name=f"{name}.weight")

    @property
    def nbytes(self) -> int:
        return self.qweight.numel() * self.qweight.element_size() + self.scale.numel() * self.scale.element_size()

    @property
    def quantized(self) -> QuantizedTensor:
        """The same weight as an int8 ``QuantizedTensor``, sharing storage."""
        return QuantizedTensor("int8", self.qweight, self.scale, tuple(self.qweight.shape), name="int8_linear")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return int8_matmul(x, self.qweight, self.scale)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per-channel"


class QuantizedLinear(nn.Module):
    """Bias-free linear on a ``QuantizedTensor``, dequantized to ``x.dtype`` before the matmul (NxD's order)."""

    def __init__(self, quantized: QuantizedTensor):
        super().__init__()
        assert len(quantized.shape) == 2, f"{quantized.name!r} has shape {quantized.shape}"
        self._quantized_meta = {}
        register_quantized(self, "weight", quantized)
        self.out_features, self.in_features = quantized.shape

    @property
    def quantized(self) -> QuantizedTensor:
        return registered_quantized(self, "weight")

    @property
    def nbytes(self) -> int:
        return self.quantized.nbytes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.quantized.dequantize(x.dtype))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.quantized.fmt}"


def quantized_linear(weight: torch.Tensor, fmt: str, name: str = "weight") -> nn.Module:
    """An :class:`Int8Linear` (``fmt == "int8"``) or a :class:`QuantizedLinear` for ``weight [out, in]``."""
    if fmt == "int8":
        return Int8Linear.from_weight(weight, name=name)
    return QuantizedLinear(quantize(weight, fmt, name=name))


GROUPS = ("experts", "shared_mlp", "attention", "lm_head")


def resolve_scheme(scheme) -> dict[str, str]:
    """A planner scheme (name or ``memory.Scheme``: its formats only) or ``{group: format}`` -> the groups to quantize."""
    if isinstance(scheme, (str, memory.Scheme)):
        scheme = memory.get_scheme(scheme).dtypes
    resolved = {}
    for group, fmt in scheme.items():
        if fmt in (None, "bf16", "fp32"):
            continue
        assert group in GROUPS, f"group {group!r} cannot be quantized; quantizable: {', '.join(GROUPS)}"
        weight_format(fmt)
        resolved[group] = fmt
    return resolved


def _decoder_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    layers = [(n, m) for n, m in model.named_modules() if type(m).__name__ == "Gemma4TextDecoderLayer"]
    assert layers, f"{type(model).__name__} has no Gemma4TextDecoderLayer"
    return layers


def _linear_targets(layers, group: str) -> list[tuple[nn.Module, str, str]]:
    """(parent module, attribute, dotted name) of every nn.Linear in ``group``."""
    sub, attrs = {"shared_mlp": ("mlp", ("gate_proj", "up_proj", "down_proj")),
                  "attention": ("self_attn", ("q_proj", "k_proj", "v_proj", "o_proj"))}[group]
    targets = []
    for layer_name, layer in layers:
        parent = getattr(layer, sub)
        for attr in attrs:
            if isinstance(getattr(parent, attr, None), nn.Linear):
                targets.append((parent, attr, f"{layer_name}.{sub}.{attr}"))
    return targets


def _row(group, fmt, params, stored_bytes, errors) -> dict:
    """One report row; ``errors`` is None when the errors were not measured (NaN columns)."""
    if errors is None:
        rel_error = max_abs_error = float("nan")
    else:
        diff_sq = sum(e["rel_error"] ** 2 * e["ref_sq"] for e in errors)
        ref_sq = sum(e["ref_sq"] for e in errors)
        rel_error = math.sqrt(diff_sq / ref_sq) if ref_sq > 0 else 0.0
        max_abs_error = max((e["max_abs_error"] for e in errors), default=0.0)
    return {"group": group, "format": fmt, "params": params, "bf16_bytes": 2 * params, "stored_bytes": stored_bytes,
            "rel_error": rel_error, "max_abs_error": max_abs_error}


def _error(weight: torch.Tensor, quantized: QuantizedTensor) -> dict[str, float]:
    err = quantization_error(weight, quantized)
    err["ref_sq"] = float(weight.float().square().sum())
    return err


def _quantize_experts(layers, fmt: str):
    """Every layer's ``Gemma4TextExperts`` -> ``QuantizedExperts``; yields ((weight, quantized) pairs, stored bytes)."""
    for layer_name, layer in layers:
        experts = getattr(layer, "experts", None)
        assert hasattr(experts, "gate_up_proj"), f"{layer_name} has no stacked experts (enable_moe_block=True)"
        quantized = QuantizedExperts.from_experts(experts, fmt, name=f"{layer_name}.experts")
        layer.experts = quantized
        yield ((experts.gate_up_proj, quantized.gate_up), (experts.down_proj, quantized.down)), quantized.nbytes


def _quantize_linears(model, layers, group: str, fmt: str):
    """Every linear of ``group`` -> ``Int8Linear`` / ``QuantizedLinear``; yields as ``_quantize_experts``."""
    if group == "lm_head":
        head = model.get_output_embeddings()
        assert isinstance(head, nn.Linear), f"lm_head is {type(head).__name__}, already replaced"
        # a new quantized table; the tied float table stays with embed_tokens
        replacement = quantized_linear(head.weight.detach(), fmt, "lm_head.weight")
        model.lm_head = replacement
        model.config.tie_word_embeddings = False
        yield ((head.weight.detach(), replacement.quantized),), replacement.nbytes
        return
    for parent, attr, name in _linear_targets(layers, group):
        linear = getattr(parent, attr)
        assert linear.bias is None, f"{name} has a bias"
        replacement = quantized_linear(linear.weight.detach(), fmt, f"{name}.weight")
        setattr(parent, attr, replacement)
        yield ((linear.weight, replacement.quantized),), replacement.nbytes


@torch.no_grad()
def apply_scheme(model: nn.Module, scheme: str | Mapping[str, str], measure_error: bool = True):
    """Quantize a loaded Gemma-4 model in place, group by group; one report row per group.

    ``lm_head`` gets its own quantized copy (the tie is broken; ``embed_tokens`` keeps the float table).
    ``rel_error`` (Frobenius, whole group) and ``max_abs_error`` are NaN with ``measure_error=False``.
    """
    groups = resolve_scheme(scheme)
    layers = _decoder_layers(model)
    rows = []
    for group, fmt in groups.items():
        params = stored = 0
        errors = [] if measure_error else None
        if group == "experts":
            replaced = _quantize_experts(layers, fmt)
        else:
            replaced = _quantize_linears(model, layers, group, fmt)
        for pairs, nbytes in replaced:
            stored += nbytes
            for weight, quantized in pairs:
                params += weight.numel()
                if measure_error:
                    errors.append(_error(weight, quantized))
        rows.append(_row(group, fmt, params, stored, errors))
    return pd.DataFrame(rows, columns=["group", "format", "params", "bf16_bytes", "stored_bytes",
                                       "rel_error", "max_abs_error"])


@torch.no_grad()
def full_size_experts_check(experts: nn.Module, formats=("int8", "mxfp4", "nvfp4"), tokens: int = 4,
                            top_k: int = 8, seed: int = 0):
    """One layer's experts quantized to each format: (table of stored vs planner bytes and errors, seconds per format). A row per
    (format, tensor) plus a ``layer`` row: the output's relative error on ``tokens`` routed tokens."""
    with torch_threads(1):
        generator = torch.Generator().manual_seed(seed)
        dtype = experts.gate_up_proj.dtype
        hidden = torch.randn(tokens, experts.gate_up_proj.shape[-1], generator=generator).to(dtype)
        index, weights = random_routing(tokens, experts.gate_up_proj.shape[0], top_k, seed=seed)
        # transformers' eager loop on the float weights: what QuantizedExperts computes, unquantized
        float_experts = SparseExperts.from_experts(experts)
        reference = float_experts.grouped(hidden, index, weights.to(dtype), accumulate_dtype=None).float()
        rows, seconds = [], {}
        for fmt in formats:
            weight_format(fmt)
            start = time.perf_counter()
            quantized = QuantizedExperts.from_experts(experts, fmt, name="experts")
            seconds[fmt] = time.perf_counter() - start
            for tensor_name, tensor in (("gate_up_proj", quantized.gate_up), ("down_proj", quantized.down)):
                weight = getattr(experts, tensor_name)
                rows.append({
                    "format": fmt, "tensor": tensor_name, "shape": "x".join(map(str, tensor.shape)),
                    "stored_bytes": tensor.nbytes, "planner_bytes": memory.tensor_bytes(tensor.shape, fmt),
                    "rel_error_expert0": quantization_error(weight[0], tensor[0])["rel_error"],
                })
            output = quantized(hidden, index, weights.to(dtype)).float()
            rows.append({
                "format": fmt, "tensor": "layer", "shape": "",
                "stored_bytes": quantized.nbytes,
                "planner_bytes": sum(memory.tensor_bytes(t.shape, fmt) for t in (quantized.gate_up, quantized.down)),
                "rel_error_output": float((output - reference).norm() / reference.norm()),
            })
            del quantized
        table = pd.DataFrame(rows)
        table.insert(5, "equal", table["stored_bytes"] == table["planner_bytes"])
        return table, seconds


def random_experts_fast(config, seed: int = 0, std: float = 0.02, dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    """A ``Gemma4TextExperts`` with N(0, std) weights drawn in ``dtype`` expert by expert on one thread (~3x faster
    than ``moe.random_experts``, other numbers)."""
    with torch.device("meta"):
        module = Gemma4TextExperts(config)
    generator = torch.Generator().manual_seed(seed)
    with torch_threads(1):
        for name in ("gate_up_proj", "down_proj"):
            weight = torch.empty(getattr(module, name).shape, dtype=dtype)
            for e in range(weight.shape[0]):
                weight[e].normal_(0.0, std, generator=generator)
            setattr(module, name, nn.Parameter(weight, requires_grad=False))
    return module
