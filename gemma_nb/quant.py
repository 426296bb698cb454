"""Quantized linears and the planner's schemes applied to a loaded Gemma-4 model, measured (notebook
02)."""

import time
from collections.abc import Mapping

import pandas as pd
import torch
from torch import nn

from gemma_nb import formats, memory
from gemma_nb.experts import FloatExperts, QuantizedExperts
from gemma_nb.formats import QuantizedTensor, quantization_error, quantize
from gemma_nb.moe import random_routing
from gemma_nb.targets import one_thread


class Int8Linear(nn.Module):
    """Weight-only int8 ``nn.Linear`` (no bias): ``qweight int8 [out, in]``, ``scale fp32 [out,
    1]``."""

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor):
        super().__init__()
        assert qweight.dtype == torch.int8 and scale.shape == (qweight.shape[0], 1)
        self.out_features, self.in_features = qweight.shape
        self.register_buffer("qweight", qweight)
        self.register_buffer("scale", scale.float())

    @classmethod
    def from_weight(cls, weight: torch.Tensor, name: str = "weight") -> "Int8Linear":
        return cls(*formats.quantize_int8_per_channel(weight, name=name))

    # the same weight, sharing storage
    quantized = property(
        lambda self: QuantizedTensor(
            "int8", self.qweight, self.scale, tuple(self.qweight.shape), name="int8_linear"
        )
    )
    nbytes = property(lambda self: self.quantized.nbytes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return formats.int8_matmul(x, self.qweight, self.scale)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per-channel"


class QuantizedLinear(nn.Module):
    """Bias-free linear on a ``QuantizedTensor``, dequantized to ``x.dtype`` before the matmul
    (NxD's order)."""

    def __init__(self, quantized: QuantizedTensor):
        super().__init__()
        assert len(quantized.shape) == 2, f"{quantized.name!r} has shape {quantized.shape}"
        self._quantized_meta = {}
        formats.register_quantized(self, "weight", quantized)
        self.out_features, self.in_features = quantized.shape

    quantized = property(lambda self: formats.registered_quantized(self, "weight"))
    nbytes = property(lambda self: self.quantized.nbytes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.quantized.dequantize(x.dtype))

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"{self.quantized.fmt}"
        )


def quantized_linear(weight: torch.Tensor, fmt: str, name: str = "weight") -> nn.Module:
    return (
        Int8Linear.from_weight(weight, name)
        if fmt == "int8"
        else QuantizedLinear(quantize(weight, fmt, name=name))
    )


class VocabShardedLinear(nn.Module):
    """A head's rows quantized in ``shards``, one per rank, their outputs concatenated (NxD's
    ``ColumnParallel`` with ``gather_output=True``), in one process."""

    def __init__(self, shards: list[nn.Module]):
        super().__init__()
        self.shards = nn.ModuleList(shards)

    nbytes = property(lambda self: sum(shard.nbytes for shard in self.shards))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([shard(x) for shard in self.shards], dim=-1)


GROUPS = ("experts", "shared_mlp", "attention", "lm_head")
# The linears each layer's shared_mlp and attention groups hold: (submodule, attributes).
_LINEARS = {
    "shared_mlp": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    "attention": ("self_attn", ("q_proj", "k_proj", "v_proj", "o_proj")),
}
_COLUMNS = ["group", "format", "params", "bf16_bytes", "stored_bytes"]


def resolve_scheme(scheme) -> dict[str, str]:
    """A planner scheme (name or ``memory.Scheme``: its formats only) or ``{group: format}`` -> the
    groups to quantize."""
    if isinstance(scheme, (str, memory.Scheme)):
        scheme = memory.get_scheme(scheme).dtypes
    resolved = {group: fmt for group, fmt in scheme.items() if fmt not in (None, "bf16", "fp32")}
    for group, fmt in resolved.items():
        assert group in GROUPS, (
            f"group {group!r} cannot be quantized; quantizable: {', '.join(GROUPS)}"
        )
        formats.get_format(fmt, quantized=True)
    return resolved


def _quantize_group(model: nn.Module, layers, group: str, fmt: str, head_tp: int):
    """Every module of ``group`` replaced by its quantized twin; yields (parameters, stored bytes)
    each."""
    if group == "lm_head":
        head = model.get_output_embeddings()
        assert isinstance(head, nn.Linear), f"lm_head is {type(head).__name__}, already replaced"
        parts = head.weight.detach().split(-(-head.weight.shape[0] // head_tp))
        shards = [quantized_linear(part, fmt, "lm_head.weight") for part in parts]
        # a new quantized table, one shard per rank; the tied float table stays with embed_tokens
        model.lm_head = shards[0] if head_tp == 1 else VocabShardedLinear(shards)
        model.config.tie_word_embeddings = False
        yield head.weight.numel(), model.lm_head.nbytes
        return
    for layer_name, layer in layers:
        if group == "experts":
            experts = getattr(layer, "experts", None)
            assert hasattr(experts, "gate_up_proj"), (
                f"{layer_name} has no stacked experts (enable_moe_block=True)"
            )
            layer.experts = new = QuantizedExperts.from_experts(
                experts, fmt, name=f"{layer_name}.experts"
            )
            yield experts.gate_up_proj.numel() + experts.down_proj.numel(), new.weight_bytes
            continue
        sub, attrs = _LINEARS[group]
        parent = getattr(layer, sub)
        for attr in attrs:
            linear, name = getattr(parent, attr, None), f"{layer_name}.{sub}.{attr}"
            if isinstance(linear, nn.Linear):
                assert linear.bias is None, f"{name} has a bias"
                setattr(
                    parent,
                    attr,
                    new := quantized_linear(linear.weight.detach(), fmt, f"{name}.weight"),
                )
                yield linear.weight.numel(), new.nbytes


@torch.no_grad()
def apply_scheme(model: nn.Module, scheme: str | Mapping[str, str], tp: int = 1):
    """Quantize a loaded Gemma-4 model in place, group by group; one report row per group.
    ``lm_head`` gets its own quantized copy (the tie is broken; ``embed_tokens`` keeps the float
    table), split over ``tp`` ranks where the scheme shards it."""
    groups = resolve_scheme(scheme)
    sharded = not isinstance(scheme, Mapping) and memory.get_scheme(scheme).lm_head_sharded
    layers = [
        (n, m) for n, m in model.named_modules() if type(m).__name__ == "Gemma4TextDecoderLayer"
    ]
    assert layers, f"{type(model).__name__} has no Gemma4TextDecoderLayer"
    rows = []
    for group, fmt in groups.items():
        params = stored = 0
        for count, nbytes in _quantize_group(model, layers, group, fmt, tp if sharded else 1):
            params, stored = params + count, stored + nbytes
        rows.append(dict(zip(_COLUMNS, (group, fmt, params, 2 * params, stored))))
    return pd.DataFrame(rows, columns=_COLUMNS)


@torch.no_grad()
def full_size_experts_check(
    experts: nn.Module,
    formats=("int8", "mxfp4", "nvfp4"),
    tokens: int = 4,
    top_k: int = 8,
    seed: int = 0,
):
    """One layer's experts quantized to each format: (table of stored vs planner bytes and errors,
    seconds per format to quantize and to dequantize the layer, the latter timed on the routed
    forward, each expert it reaches dequantized). A row per (format, tensor) plus a ``layer`` row:
    the output's relative error on ``tokens`` routed tokens."""
    with one_thread():
        dtype = experts.gate_up_proj.dtype
        hidden = torch.randn(
            tokens, experts.gate_up_proj.shape[-1], generator=torch.Generator().manual_seed(seed)
        ).to(dtype)
        index, weights = random_routing(tokens, experts.gate_up_proj.shape[0], top_k, seed=seed)
        # transformers' eager loop on the float weights: what QuantizedExperts computes, unquantized
        reference_experts = FloatExperts.from_experts(experts, "grouped")
        reference_experts.accumulate_dtype = None
        reference = reference_experts(hidden, index, weights.to(dtype)).float()
        rows, seconds = [], {}
        for fmt in formats:
            start = time.perf_counter()
            quantized = QuantizedExperts.from_experts(experts, fmt, name="experts")
            seconds[fmt] = {"quantize_s": time.perf_counter() - start}
            for tensor_name, tensor in (
                ("gate_up_proj", quantized.gate_up),
                ("down_proj", quantized.down),
            ):
                rows.append(
                    {
                        "format": fmt,
                        "tensor": tensor_name,
                        "shape": "x".join(map(str, tensor.shape)),
                        "stored_bytes": tensor.nbytes,
                        "planner_bytes": memory.tensor_bytes(tensor.shape, fmt),
                        "rel_error_expert0": quantization_error(
                            getattr(experts, tensor_name)[0], tensor[0]
                        )["rel_error"],
                    }
                )
            start = time.perf_counter()
            output = quantized(hidden, index, weights.to(dtype)).float()
            reached = index.unique().numel() / experts.gate_up_proj.shape[0]
            seconds[fmt]["dequantize_s"] = (time.perf_counter() - start) / reached
            rows.append(
                {
                    "format": fmt,
                    "tensor": "layer",
                    "shape": "",
                    "stored_bytes": quantized.weight_bytes,
                    "planner_bytes": sum(
                        memory.tensor_bytes(t.shape, fmt)
                        for t in (quantized.gate_up, quantized.down)
                    ),
                    "rel_error_output": float((output - reference).norm() / reference.norm()),
                }
            )
            del quantized
        table = pd.DataFrame(rows)
        table.insert(5, "equal", table["stored_bytes"] == table["planner_bytes"])
        return table, pd.DataFrame(seconds).T.rename_axis("format")
