"""Swapping the routed experts of a loaded Gemma-4 model, and inputs to compare them (notebook
07)."""

import contextlib
import copy

import pandas as pd
import torch
from torch import nn
from transformers.models.gemma4.modeling_gemma4 import Gemma4TextExperts

from gemma_nb.experts import KERNELS, FloatExperts, Int8Experts, as_parameter
from gemma_nb.targets import one_thread

IMPLEMENTATIONS = ("transformers", *KERNELS, *(f"{name}_int8" for name in KERNELS))


def default_sparse_kernel(device: str | torch.device) -> str:
    """The kernel that reads only the routed experts: ``"gather"`` on cuda (each ``.item()`` of
    ``"sparse"`` would be a host sync), else ``"sparse"``."""
    return "gather" if torch.device(device).type == "cuda" else "sparse"


def experts_modules(model: nn.Module) -> list[tuple[nn.Module, str, nn.Module]]:
    """Every routed-experts module of ``model`` as ``(parent, attribute, module)``."""
    children = ((parent, getattr(parent, "experts", None)) for parent in model.modules())
    return [
        (parent, "experts", child)
        for parent, child in children
        if isinstance(child, nn.Module)
        and hasattr(child, "gate_up_proj")
        and hasattr(child, "down_proj")
    ]


def make_experts(
    source: nn.Module, impl: str, config=None, experts_implementation: str | None = None, **options
) -> nn.Module:
    """A new experts module of kind ``impl`` (``IMPLEMENTATIONS``) on ``source``'s float weights,
    shared. ``transformers`` needs the model's text config (``experts_implementation=`` its kernel);
    ``options`` go to ``Int8Experts`` (``matmul=``)."""
    assert impl in IMPLEMENTATIONS, (
        f"experts implementation {impl!r} is not one of {', '.join(IMPLEMENTATIONS)}"
    )
    assert source.gate_up_proj.dtype.is_floating_point, (
        f"the experts are already {type(source).__name__} with int8 weights: reload the model"
    )
    if impl != "transformers":
        kernel = impl.removesuffix("_int8")
        if impl.endswith("_int8"):
            return Int8Experts.from_experts(source, kernel, **options)
        return FloatExperts.from_experts(source, kernel, **options)
    assert config is not None and not options, (
        f"impl 'transformers' needs the model's text config and takes no {set(options)}"
    )
    if experts_implementation is not None:
        # A private copy: the model's config (shared by every layer) keeps its own choice.
        config = copy.deepcopy(config)
        config._experts_implementation = experts_implementation
    with torch.device("meta"):
        module = Gemma4TextExperts(config)
    module.gate_up_proj, module.down_proj = (
        as_parameter(source.gate_up_proj),
        as_parameter(source.down_proj),
    )
    module.act_fn = source.act_fn
    return module


def swap_experts(model: nn.Module, impl: str, **options) -> nn.Module:
    """Every MoE layer's experts swapped in place (returns ``model``): free, reversible among float
    kinds; ``*_int8``: one-way."""
    found = experts_modules(model)
    assert found, f"{type(model).__name__} has no routed-experts modules"
    config = model.config.get_text_config() if hasattr(model, "config") else None
    for parent, name, module in found:
        setattr(parent, name, make_experts(module, impl, config=config, **options))
    return model


def random_experts(
    config,
    seed: int = 0,
    dtype: torch.dtype = torch.bfloat16,
    device: str = "cpu",
    per_expert: bool = False,
):
    """One layer's ``Gemma4TextExperts`` with deterministic N(0, 0.02) weights drawn in ``dtype`` on
    ``device``; ``per_expert``: drawn expert by expert on one thread (~3x faster at full size, other
    numbers)."""
    with torch.device("meta"):
        module = Gemma4TextExperts(config)
    generator = torch.Generator(device=device).manual_seed(seed)
    with one_thread() if per_expert else contextlib.nullcontext():
        for name in ("gate_up_proj", "down_proj"):
            weight = torch.empty(getattr(module, name).shape, dtype=dtype, device=device)
            for part in weight.unbind() if per_expert else (weight,):
                part.normal_(0.0, 0.02, generator=generator)
            setattr(module, name, nn.Parameter(weight, requires_grad=False))
    return module


def random_routing(
    num_tokens: int, num_experts: int, top_k: int, seed: int = 0, device: str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(top_k_index [T, K] int64, top_k_weights [T, K] fp32)``: K distinct experts per token,
    weights sum to 1."""
    assert 1 <= top_k <= num_experts, (
        f"top_k={top_k} must be between 1 and num_experts={num_experts}"
    )
    scores = torch.rand(num_tokens, num_experts, generator=torch.Generator().manual_seed(seed))
    weights, index = torch.softmax(scores * 4.0, dim=-1).topk(top_k, dim=-1)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    return index.to(device), weights.to(device)


def compare_outputs(
    modules: dict,
    reference: str,
    hidden_states: torch.Tensor,
    routes: list[tuple[torch.Tensor, torch.Tensor]],
):
    """Each module's largest distance from ``modules[reference]``'s output over ``routes``.
    ``bf16_ulps``: that distance in bf16 rounding steps (2^-8) of the largest reference element."""
    assert reference in modules, f"reference {reference!r} is not one of {', '.join(modules)}"
    with torch.inference_mode():
        wanted = [modules[reference](hidden_states, *route).float() for route in routes]
        ref_max = max(float(w.abs().max()) for w in wanted)
        rows = []
        for name, module in modules.items():
            diff = max(
                float((module(hidden_states, *route).float() - want).abs().max())
                for route, want in zip(routes, wanted)
            )
            rows.append(
                {
                    "candidate": name,
                    "max_abs_diff": diff,
                    "ref_max_abs": ref_max,
                    "bf16_ulps": diff / (ref_max * 2.0**-8) if ref_max else float("nan"),
                }
            )
    return pd.DataFrame(rows).set_index("candidate")
