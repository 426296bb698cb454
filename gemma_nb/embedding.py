"""The host-side embedding of the slim deploy, with Gemma-4's scale, and the check that guards it.

Gemma-4's ``Gemma4TextScaledWordEmbedding`` returns ``embedding(ids) * embed_scale.to(weight.dtype)``
with ``embed_scale = sqrt(hidden_size)`` (53.066 for the 26B's 2816), and the model's forward does
*not* rescale ``inputs_embeds`` (docs/sources.md: transformers-gemma4). A deploy that looks tokens up on the host and feeds
``inputs_embeds`` must therefore apply that scale itself, and apply it the way the module does:

- no scale at all (the story's first deploy: a plain ``nn.Embedding``) makes every embedding
  ~sqrt(H) times too small, and the answers degenerate;
- ``lookup(ids) * math.sqrt(H)`` is right in fp32 but not in bf16: torch multiplies a bf16 tensor by
  a Python float at fp32 precision (53.066) and rounds the product, while the module first rounds
  the scale to bf16 (53.0) and then multiplies. A share of the products (about a quarter at
  hidden 2816) then differ by one bf16 ulp;
- ``HostEmbedding`` takes the module's own ``embed_scale`` and casts it to the weight dtype exactly
  as the module does, so its output equals ``embed_tokens(ids)`` bit for bit.

``HostEmbedding.verify_against(module)`` checks that equality on a probe batch and raises
``EmbeddingScaleError`` (a ``ValueError``) with what scale was expected and found otherwise.

The embedding file the deploy loads (``HostEmbedding.save`` / ``from_file``) is a safetensors file
holding ``weight`` [vocab, hidden] with the scale as applied in its metadata (``embed_scale``,
``embed_scale_dtype``), plus the source model's own output for 256 probe ids (``probe_ids``,
``probe_expected``) that ``from_file`` re-checks bit for bit, with no model on the host. The port
shipped a bare ``embed_tokens.pt`` whose scale lived only in the deploy script, which is how it got
lost.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

FILE_FORMAT = "gemma-nb.host-embedding/1"
WEIGHT_KEY = "weight"
SCALE_KEY = "embed_scale"
SCALE_DTYPE_KEY = "embed_scale_dtype"
PROBE_IDS_KEY = "probe_ids"
PROBE_EXPECTED_KEY = "probe_expected"
HOST_PATHS = ("unscaled", "math_sqrt", "module_scale")
DEFAULT_PROBE_TOKENS = 256


class EmbeddingCheckError(ValueError):
    """A host embedding does not reproduce the model's ``embed_tokens`` (table, shape or dtype)."""


class EmbeddingScaleError(EmbeddingCheckError):
    """Same table, different output: the scale was dropped, or applied differently from the module."""


class EmbeddingFileError(ValueError):
    """An embedding file that is missing, malformed, or not what the caller expected."""


class EmbeddingFileNotFoundError(EmbeddingFileError, FileNotFoundError):
    """The embedding file does not exist (also a FileNotFoundError)."""


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def module_scale(module: nn.Module) -> torch.Tensor:
    """The scale ``module`` multiplies by, as it does: ``embed_scale.to(weight.dtype)`` (0-d tensor).

    A plain ``nn.Embedding`` (no ``embed_scale``) has scale 1 in its weight dtype.
    """
    weight = module.weight
    scale = getattr(module, "embed_scale", None)
    if scale is None:
        return torch.ones((), dtype=weight.dtype)
    return torch.as_tensor(scale).detach().to(device="cpu", dtype=weight.dtype)


def _as_scale(scale: float | torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``scale`` rounded to ``dtype`` the way the module rounds it.

    The module holds ``torch.tensor(sqrt(H))`` (a float32 buffer) and casts it to the weight dtype
    in forward; a Python float therefore goes through float32 first, never straight to bf16.
    """
    if isinstance(scale, torch.Tensor):
        if scale.numel() != 1:
            raise ValueError(f"scale must be a single number, got a tensor of shape {tuple(scale.shape)}")
        return scale.detach().reshape(()).to(device="cpu", dtype=dtype)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale={scale!r} must be a positive finite number (Gemma-4: sqrt(hidden_size))")
    return torch.tensor(float(scale), dtype=torch.float32).to(dtype)


def default_probe_ids(vocab_size: int, count: int = DEFAULT_PROBE_TOKENS) -> torch.Tensor:
    """``count`` token ids spread evenly over the vocabulary, first and last included: [1, count]."""
    count = max(1, min(count, vocab_size))
    return torch.linspace(0, vocab_size - 1, count).round().long().unique().unsqueeze(0)


class HostEmbedding(nn.Module):
    """Token ids -> ``weight[ids] * scale``, the scale held in the weight dtype like the module's.

    ``weight`` [vocab, hidden] (any float dtype; shared, not copied); ``scale`` a float or 0-d tensor,
    rounded to the weight dtype through float32 exactly as ``Gemma4TextScaledWordEmbedding`` does.
    Output: [..., hidden] in the weight dtype, on the weight's device.

    ``probe_ids`` / ``probe_expected``: set by ``from_model`` (the model's own output for a few ids),
    saved with the table, and re-checked by ``from_file``, so a deploy with no model on the host
    (meta device) still checks its embedding bit for bit at load.
    """

    def __init__(self, weight: torch.Tensor, scale: float | torch.Tensor):
        super().__init__()
        if not isinstance(weight, torch.Tensor) or weight.ndim != 2 or not weight.is_floating_point():
            shape = tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__
            raise ValueError(f"weight must be a 2-D float tensor [vocab, hidden], got {shape}")
        self.register_buffer("weight", weight.detach(), persistent=False)
        self.register_buffer("scale", _as_scale(scale, weight.dtype).to(weight.device), persistent=False)
        self.probe_ids: torch.Tensor | None = None
        self.probe_expected: torch.Tensor | None = None

    @classmethod
    def from_model(cls, model: nn.Module) -> "HostEmbedding":
        """The host embedding of ``model`` (a Gemma-4 causal LM, or its embedding module itself).

        Uses the module's own table and its ``embed_scale`` cast to the weight dtype, never a
        recomputed ``math.sqrt(hidden_size)``; checked bit for bit against the module on probe ids.
        """
        module = model if isinstance(model, nn.Embedding) else model.get_input_embeddings()
        if getattr(module, "embed_scale", None) is None:
            raise EmbeddingCheckError(
                f"{type(module).__name__} has no embed_scale: expected Gemma-4's Gemma4TextScaledWordEmbedding "
                "(model.get_input_embeddings()); a plain nn.Embedding carries no scale to copy"
            )
        host = cls(module.weight, module_scale(module))
        host.verify_against(module)
        host.probe_ids = default_probe_ids(module.weight.shape[0])
        with torch.no_grad():
            host.probe_expected = module(host.probe_ids.to(module.weight.device)).cpu()
        return host

    @classmethod
    def from_file(
        cls,
        path: str | Path,
        scale: float | torch.Tensor | None = None,
        dtype: torch.dtype | None = None,
        shape: tuple[int, int] | None = None,
    ) -> "HostEmbedding":
        """Load an embedding file written by ``save`` (safetensors: ``weight`` + scale in metadata).

        ``scale``: only needed for a file without scale metadata; if both are present they must
        agree in the weight dtype. ``dtype`` / ``shape``: what the caller expects the table to be
        (e.g. torch.bfloat16, (262144, 2816)); a file holding anything else is refused rather than
        cast, because the scale's rounding depends on the dtype. If the file carries the source
        model's probe outputs, they are re-checked bit for bit. Raises ``EmbeddingFileError``
        (or ``EmbeddingScaleError``) naming the file and what was expected.
        """
        path = Path(path)
        tensors, metadata = _read_embedding_file(path)
        weight = tensors[WEIGHT_KEY]
        _check_table(path.name, weight, dtype, shape)
        host = cls(weight, _file_scale(path.name, metadata, weight.dtype, scale))
        if PROBE_IDS_KEY in tensors:
            host.probe_ids, host.probe_expected = tensors[PROBE_IDS_KEY], tensors[PROBE_EXPECTED_KEY]
            found = host(host.probe_ids)
            if found.shape != host.probe_expected.shape or not torch.equal(found, host.probe_expected):
                raise EmbeddingScaleError(
                    f"embedding file {path.name!r}: its table and scale do not reproduce the source model's "
                    f"probe outputs stored beside them. " + _diagnosis(
                        host.probe_expected, found, F.embedding(host.probe_ids, weight), host.scale, host.scale)
                )
        return host

    def save(self, path: str | Path) -> Path:
        """Write ``weight``, the scale (as applied, in the weight dtype) and any probe to safetensors."""
        from safetensors.torch import save_file

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        metadata = {
            "format": FILE_FORMAT,
            SCALE_KEY: repr(self.scale.item()),
            SCALE_DTYPE_KEY: _dtype_name(self.weight.dtype),
            "vocab_size": str(self.weight.shape[0]),
            "hidden_size": str(self.weight.shape[1]),
        }
        tensors = {WEIGHT_KEY: self.weight.contiguous()}
        if self.probe_ids is not None:
            tensors[PROBE_IDS_KEY] = self.probe_ids.contiguous()
            tensors[PROBE_EXPECTED_KEY] = self.probe_expected.contiguous()
        save_file(tensors, str(path), metadata=metadata)
        return path

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids.to(self.weight.device), self.weight) * self.scale

    def verify_against(self, module: nn.Module, probe_ids: torch.Tensor | None = None) -> None:
        """Raise ``EmbeddingCheckError`` unless ``self(ids)`` equals ``module(ids)`` bit for bit.

        ``module``: the model's ``get_input_embeddings()``. A module on the meta device (the slim
        deploy's weightless structure) has no table to compare: then only shape, dtype and scale
        are checked (``embed_scale`` is a buffer, which ``accelerate.init_empty_weights`` leaves real).
        """
        if module.weight.is_meta:
            _verify_scale_only(self, module)
            return
        verify_host_path(self, module, probe_ids, found_scale=self.scale)

    def extra_repr(self) -> str:
        vocab, hidden = self.weight.shape
        return f"vocab={vocab}, hidden={hidden}, scale={self.scale.item()!r}, dtype={_dtype_name(self.weight.dtype)}"


def _read_embedding_file(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors and metadata of an embedding file, or an EmbeddingFileError naming it."""
    from safetensors import SafetensorError, safe_open

    name = path.name
    if not path.is_file():
        raise EmbeddingFileNotFoundError(
            f"embedding file {name!r} not found (looked in {path.parent.name or '.'}/): "
            "write it with HostEmbedding.from_model(model).save(path)"
        )
    try:
        with safe_open(str(path), framework="pt") as handle:
            metadata = handle.metadata() or {}
            keys = sorted(handle.keys())
            if keys not in ([WEIGHT_KEY], sorted([WEIGHT_KEY, PROBE_IDS_KEY, PROBE_EXPECTED_KEY])):
                raise EmbeddingFileError(
                    f"embedding file {name!r} holds tensors {keys}; expected one named {WEIGHT_KEY!r} "
                    f"[vocab, hidden] (plus optionally {PROBE_IDS_KEY!r} and {PROBE_EXPECTED_KEY!r}) "
                    "as written by HostEmbedding.save"
                )
            tensors = {key: handle.get_tensor(key) for key in keys}
    except (SafetensorError, OSError, ValueError) as error:
        if isinstance(error, EmbeddingFileError):
            raise
        raise EmbeddingFileError(
            f"embedding file {name!r} is not a readable safetensors file ({error}); expected the file "
            "HostEmbedding.save writes. A torch .pt table (like the port's embed_tokens.pt) carries no "
            "scale: load it with torch.load(..., weights_only=True) and save HostEmbedding(weight, scale)"
        ) from error
    return tensors, metadata


def _check_table(name: str, weight: torch.Tensor, dtype: torch.dtype | None, shape) -> None:
    if weight.ndim != 2 or not weight.is_floating_point():
        raise EmbeddingFileError(
            f"embedding file {name!r}: {WEIGHT_KEY!r} is {_dtype_name(weight.dtype)} of shape "
            f"{tuple(weight.shape)}; expected a 2-D float table [vocab, hidden]"
        )
    if shape is not None and tuple(weight.shape) != tuple(shape):
        raise EmbeddingFileError(
            f"embedding file {name!r}: {WEIGHT_KEY!r} has shape {tuple(weight.shape)}, expected "
            f"{tuple(shape)} (vocab_size, hidden_size): was it saved from another model?"
        )
    if dtype is not None and weight.dtype != dtype:
        raise EmbeddingFileError(
            f"embedding file {name!r}: {WEIGHT_KEY!r} is {_dtype_name(weight.dtype)}, expected "
            f"{_dtype_name(dtype)}; save the table from a model in {_dtype_name(dtype)} (the scale is "
            "rounded in the weight dtype, so casting after loading would not match the module)"
        )


def _file_scale(name: str, metadata: dict[str, str], dtype: torch.dtype, scale) -> torch.Tensor:
    """The scale stored in the file's metadata, reconciled with a ``scale=`` argument."""
    stored = metadata.get(SCALE_KEY)
    if stored is None:
        if scale is None:
            raise EmbeddingFileError(
                f"embedding file {name!r} has no {SCALE_KEY!r} in its metadata and no scale= was given; "
                "expected the scale Gemma-4's embedding multiplies by (sqrt(hidden_size)): re-save with "
                "HostEmbedding.save, or pass scale=model.get_input_embeddings().embed_scale"
            )
        return _as_scale(scale, dtype)
    stored_dtype = metadata.get(SCALE_DTYPE_KEY)
    if stored_dtype != _dtype_name(dtype):
        raise EmbeddingFileError(
            f"embedding file {name!r}: {SCALE_DTYPE_KEY}={stored_dtype!r} in metadata, expected "
            f"{_dtype_name(dtype)!r} (the weight's dtype); the file was not written by HostEmbedding.save"
        )
    try:
        stored_scale = _as_scale(float(stored), dtype)
    except ValueError as error:
        raise EmbeddingFileError(
            f"embedding file {name!r}: {SCALE_KEY}={stored!r} in metadata is not a positive number"
        ) from error
    if scale is not None and not torch.equal(_as_scale(scale, dtype), stored_scale):
        raise EmbeddingScaleError(
            f"embedding file {name!r} stores {SCALE_KEY}={stored_scale.item()!r} but scale="
            f"{_as_scale(scale, dtype).item()!r} was given ({_dtype_name(dtype)}); drop scale= to use the file's"
        )
    return stored_scale


def _verify_scale_only(host: HostEmbedding, module: nn.Module) -> None:
    weight = module.weight
    if getattr(module, "embed_scale", None) is not None and module.embed_scale.is_meta:
        raise EmbeddingCheckError(
            f"the model's {type(module).__name__}.embed_scale is on the meta device, so there is no scale to "
            "check against: build the structure with accelerate.init_empty_weights() (include_buffers=False, "
            "its default) so buffers stay real; the file's own probe was already checked by from_file"
        )
    if tuple(host.weight.shape) != tuple(weight.shape) or host.weight.dtype != weight.dtype:
        raise EmbeddingCheckError(
            f"host embedding is {_dtype_name(host.weight.dtype)} {tuple(host.weight.shape)}, the model's "
            f"{type(module).__name__} is {_dtype_name(weight.dtype)} {tuple(weight.shape)}; "
            "save the host table from the same model in the same dtype"
        )
    expected = module_scale(module)
    if not torch.equal(host.scale.cpu(), expected):
        hidden = weight.shape[1]
        raise EmbeddingScaleError(
            f"host embedding scale {host.scale.item()!r} differs from the model's embed_scale cast to "
            f"{_dtype_name(weight.dtype)}, {expected.item()!r} (sqrt(hidden_size={hidden}) = {math.sqrt(hidden):.6f})"
            + ("; looks unscaled." if host.scale.item() == 1.0 else ".")
            + " Fix: build the host path with gemma_nb.embedding.HostEmbedding.from_model(model) (or from_file)."
        )


class UnscaledLookup(nn.Module):
    """The story's first host path: a plain lookup, no scale (the bug)."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.register_buffer("weight", weight.detach(), persistent=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids.to(self.weight.device), self.weight)


class PythonFloatScaledLookup(nn.Module):
    """``lookup(ids) * math.sqrt(hidden_size)``: right in fp32, one ulp off in bf16.

    torch multiplies a low-precision tensor by a Python float at float32 precision and rounds the
    product, whereas the module rounds the scale to the weight dtype first (bf16: 53.066 -> 53.0).
    """

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.register_buffer("weight", weight.detach(), persistent=False)
        self.scale = math.sqrt(weight.shape[1])

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids.to(self.weight.device), self.weight) * self.scale


def host_path(model: nn.Module, name: str) -> nn.Module:
    """One of HOST_PATHS built from ``model``'s embedding table: ids -> inputs_embeds."""
    weight = model.get_input_embeddings().weight
    if name == "unscaled":
        return UnscaledLookup(weight)
    if name == "math_sqrt":
        return PythonFloatScaledLookup(weight)
    if name == "module_scale":
        return HostEmbedding.from_model(model)
    raise ValueError(f"host path {name!r} is not one of {', '.join(HOST_PATHS)}")


def verify_host_path(
    host: Callable[[torch.Tensor], torch.Tensor],
    module: nn.Module,
    probe_ids: torch.Tensor | None = None,
    found_scale: torch.Tensor | None = None,
) -> None:
    """Raise unless ``host(ids)`` equals the model's ``module(ids)`` bit for bit on ``probe_ids``.

    ``module``: the model's embedding (``model.get_input_embeddings()``). ``probe_ids`` default to
    256 ids spread over the vocabulary. ``found_scale``: the host's scale if it has one (else it is
    estimated from norms). ``EmbeddingScaleError`` says which scale was expected and which found,
    the max |Δ| and the ratio of norms (≈ sqrt(hidden) means "unscaled").
    """
    weight = module.weight
    if probe_ids is None:
        probe_ids = default_probe_ids(weight.shape[0])
    with torch.no_grad():
        expected = module(probe_ids.to(weight.device)).cpu()
        found = host(probe_ids).cpu()
        if found.shape != expected.shape or found.dtype != expected.dtype:
            raise EmbeddingCheckError(
                f"host embedding gives {_dtype_name(found.dtype)} {tuple(found.shape)} for the probe ids, "
                f"the model's {type(module).__name__} gives {_dtype_name(expected.dtype)} {tuple(expected.shape)}; "
                "build the host table from the same model in the same dtype"
            )
        if torch.equal(found, expected):
            return
        raw = F.embedding(probe_ids.to(weight.device), weight).cpu()
        raise EmbeddingScaleError(
            f"host embedding does not reproduce {type(module).__name__}(ids) bit for bit on {probe_ids.numel()} "
            "probe ids: " + _diagnosis(expected, found, raw, module_scale(module), found_scale)
        )


def _diagnosis(expected, found, raw, expected_scale, found_scale) -> str:
    """Which scale was expected and found, how far apart the outputs are, and what that looks like."""
    dtype = _dtype_name(expected.dtype)
    hidden = expected.shape[-1]
    expected32, found32, raw32 = expected.float(), found.float(), raw.float()
    max_abs = (expected32 - found32).abs().max().item()
    differ_pct = 100.0 * (expected != found).float().mean().item()
    ratio = (expected32.norm() / found32.norm()).item() if found32.norm() > 0 else math.inf
    effective = (found32.norm() / raw32.norm()).item() if raw32.norm() > 0 else math.nan
    found_text = f"{found_scale.item()!r} ({dtype})" if found_scale is not None else f"~{effective:.6g} (effective)"
    lines = [
        f"expected scale {expected_scale.item()!r} (the module's embed_scale cast to {dtype}), found {found_text}; "
        f"max |Δ| = {max_abs:.4g}, {differ_pct:.1f}% of elements differ, norm ratio model/host = {ratio:.6g}."
    ]
    if abs(ratio - math.sqrt(hidden)) < 0.02 * math.sqrt(hidden):
        lines.append(f"Looks unscaled: the ratio ≈ sqrt(hidden_size) = {math.sqrt(hidden):.4f}.")
    elif found_scale is None and abs(effective - expected_scale.item()) <= _ulp(expected_scale).item():
        lines.append(
            f"The scale is right to within one {dtype} ulp ({_ulp(expected_scale).item():g}) but applied differently: "
            f"probably math.sqrt({hidden}) = {math.sqrt(hidden):.6f} as a Python float, which torch applies at "
            f"float32 precision, while the module first rounds it to {expected_scale.item()!r} in {dtype}."
        )
    elif found_scale is not None and torch.equal(found_scale.cpu(), expected_scale):
        lines.append("Same scale, different output: the table itself differs from the model's.")
    lines.append("Fix: build the host path with gemma_nb.embedding.HostEmbedding.from_model(model) (or from_file).")
    return " ".join(lines)


def _ulp(value: torch.Tensor) -> torch.Tensor:
    """The spacing of ``value``'s dtype at ``|value|`` (one unit in the last place)."""
    magnitude = value.abs()
    return torch.nextafter(magnitude, torch.full_like(magnitude, math.inf)) - magnitude


class HostEmbeddedLM(nn.Module):
    """The model as the slim deploy runs it: ids -> ``host`` on the cpu -> ``model(inputs_embeds=...)``.

    ``model``'s own ``embed_tokens`` is never called, exactly as in the deploy where the embedding
    lives on the host and the compiled graph starts at the decoder. Forward takes ``input_ids``
    ([batch, seq]) plus any keyword the model takes (attention_mask, cache, ...) and returns the
    model's output, so scoring code can treat it like the model fed ``input_ids``.
    """

    def __init__(self, model: nn.Module, host: Callable[[torch.Tensor], torch.Tensor]):
        super().__init__()
        self.model = model
        self.host = host

    @property
    def config(self):
        return self.model.config

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    def get_input_embeddings(self) -> nn.Module:
        return self.model.get_input_embeddings()

    def forward(self, input_ids: torch.Tensor, **kwargs):
        inputs_embeds = self.host(input_ids).to(self.model.device)
        if getattr(self.model.config, "hidden_size_per_layer_input", 0) and "per_layer_inputs" not in kwargs:
            # Per-layer embeddings (not in the 26B) are looked up from ids; the model would otherwise
            # try to recover ids by inverting embed_tokens, which fails for any host path but the exact one.
            kwargs["per_layer_inputs"] = self.model.model.get_per_layer_inputs(input_ids.to(self.model.device))
        return self.model(inputs_embeds=inputs_embeds, **kwargs)


def host_path_model(model: nn.Module, name: str) -> HostEmbeddedLM:
    """``model`` run from the inputs_embeds that host path ``name`` (one of HOST_PATHS) produces."""
    return HostEmbeddedLM(model, host_path(model, name))


def scale_rounding(hidden_size: int, dtype: torch.dtype = torch.bfloat16) -> dict:
    """How sqrt(hidden_size) survives the module's float32 buffer and its cast to ``dtype``.

    Returns dtype, sqrt_exact (float64), scale_float32 (the buffer), scale_in_dtype (what the
    module multiplies by), ulp (the spacing of ``dtype`` at that value) and the rounding error
    in absolute terms, in ulps and in percent.
    """
    exact = math.sqrt(hidden_size)
    buffer = torch.tensor(exact, dtype=torch.float32)
    cast = buffer.to(dtype)
    ulp = _ulp(cast).item()
    return {
        "hidden_size": hidden_size,
        "dtype": _dtype_name(dtype),
        "sqrt_exact": exact,
        "scale_float32": buffer.item(),
        "scale_in_dtype": cast.item(),
        "ulp": ulp,
        "rounding_error": cast.item() - exact,
        "rounding_error_ulps": (cast.item() - exact) / ulp,
        "rounding_error_pct": 100.0 * (cast.item() - exact) / exact,
    }


def host_path_elementwise(model: nn.Module, host: Callable[[torch.Tensor], torch.Tensor],
                          probe_ids: torch.Tensor | None = None) -> dict:
    """How ``host(ids)`` differs from ``embed_tokens(ids)`` element by element on ``probe_ids``.

    Returns the share of elements that differ (%), the largest difference in units of the
    reference element's ulp, the max |Δ| and the norm ratio reference/host.
    """
    module = model.get_input_embeddings()
    if probe_ids is None:
        probe_ids = default_probe_ids(module.weight.shape[0])
    with torch.no_grad():
        reference = module(probe_ids.to(module.weight.device)).cpu()
        candidate = host(probe_ids).cpu()
    delta = (candidate.double() - reference.double()).abs()
    ulps = delta / _ulp(reference).double().clamp_min(torch.finfo(reference.dtype).tiny)
    return {
        "differ_pct": 100.0 * (candidate != reference).double().mean().item(),
        "max_diff_ulps": ulps.max().item(),
        "max_abs_diff": delta.max().item(),
        "norm_ratio": (reference.double().norm() / candidate.double().norm()).item(),
    }


def self_check_table(model: nn.Module) -> "pd.DataFrame":
    """Run the load-time self-check on each of HOST_PATHS: path, dtype, bit_exact, error, message."""
    import pandas as pd

    module = model.get_input_embeddings()
    rows = []
    for name in HOST_PATHS:
        try:
            verify_host_path(host_path(model, name), module)
            error = None
        except EmbeddingCheckError as caught:
            error = caught
        rows.append({"path": name, "dtype": _dtype_name(module.weight.dtype), "bit_exact": error is None,
                     "error": type(error).__name__ if error else "", "message": str(error) if error else ""})
    return pd.DataFrame(rows)


def host_path_numerics(model: nn.Module, batches) -> "pd.DataFrame":
    """Each of HOST_PATHS on ``model``: embedding differences and next-token agreement, no tokenizer.

    ``batches``: token id batches ([B, S] LongTensor or a list of them) fed to the reference
    (``model`` on ``input_ids``) and to each host path. Columns: path, dtype, norm_ratio,
    differ_pct, max_diff_ulps, max_abs_diff (embeddings), top1_agreement, kl_mean (nats),
    max_logit_diff.
    """
    import pandas as pd

    from gemma_nb import evaluate

    reference_logits = _ReferenceLogits(model)
    rows = []
    for name in HOST_PATHS:
        host = host_path(model, name)
        logits = evaluate.compare_logits(reference_logits, HostEmbeddedLM(model, host), batches)
        rows.append({"path": name, "dtype": _dtype_name(model.get_input_embeddings().weight.dtype),
                     **host_path_elementwise(model, host),
                     "top1_agreement": logits["top1_agreement"], "kl_mean": logits["kl_mean"],
                     "max_logit_diff": logits["max_abs_diff"]})
    return pd.DataFrame(rows)


class _ReferenceLogits:
    """``model(input_ids).logits`` computed once per id batch: every host path compares against it."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.cache: dict = {}

    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        key = (tuple(input_ids.shape), input_ids.cpu().numpy().tobytes())
        if key not in self.cache:
            self.cache[key] = self.model(input_ids=input_ids.to(self.model.device), use_cache=False).logits
        return self.cache[key]


def compare_host_paths(model: nn.Module, tokenizer, prompt: str = "The capital of France is",
                       steps: int = 8, facts=None, batches=None) -> "pd.DataFrame":
    """Each of HOST_PATHS against ``model`` fed ``input_ids`` (the reference): one row per path.

    The first row is the reference itself. Columns: path, dtype, greedy (greedy continuation of
    ``prompt``, ``steps`` tokens), greedy_match, first_divergent_step (None when it matches),
    fact_recall (0-1, over ``facts``, default the whole corpus), top1_agreement and kl_mean
    (nats) and max_logit_diff over ``batches`` (default: the sentences of ``facts``), norm_ratio
    (||embed_tokens(ids)|| / ||host(ids)||), differ_pct (share of embedding elements not
    bit-equal to the module's) and max_diff_ulps (in units of the module output's ulp).
    """
    import pandas as pd

    from gemma_nb import evaluate

    if facts is None:
        from gemma_nb.tiny import FACTS as facts
    facts = list(facts)
    if batches is None:
        batches = evaluate.prompt_batches(tokenizer, [fact.sentence for fact in facts])
    dtype = _dtype_name(model.get_input_embeddings().weight.dtype)
    reference_logits = _ReferenceLogits(model)
    prompt_ids = torch.tensor([tokenizer(prompt).input_ids])
    reference_tokens = evaluate.greedy_generate(model, prompt_ids, steps)[0, prompt_ids.shape[1]:].tolist()
    rows = [{
        "path": "reference (input_ids)", "dtype": dtype, "greedy": tokenizer.decode(reference_tokens),
        "greedy_match": True, "first_divergent_step": None,
        "fact_recall": evaluate.fact_recall(model, tokenizer, facts)[0],
        "top1_agreement": 1.0, "kl_mean": 0.0, "max_logit_diff": 0.0, "norm_ratio": 1.0, "differ_pct": 0.0,
        "max_diff_ulps": 0.0,
    }]
    for name in HOST_PATHS:
        host = host_path(model, name)
        candidate = HostEmbeddedLM(model, host)
        tokens = evaluate.greedy_generate(candidate, prompt_ids, steps)[0, prompt_ids.shape[1]:].tolist()
        first = next((i for i, (r, c) in enumerate(zip(reference_tokens, tokens)) if r != c), None)
        logits = evaluate.compare_logits(reference_logits, candidate, batches)
        elementwise = host_path_elementwise(model, host)
        rows.append({
            "path": name,
            "dtype": dtype,
            "greedy": tokenizer.decode(tokens),
            "greedy_match": first is None,
            "first_divergent_step": first,
            "fact_recall": evaluate.fact_recall(candidate, tokenizer, facts)[0],
            "top1_agreement": logits["top1_agreement"],
            "kl_mean": logits["kl_mean"],
            "max_logit_diff": logits["max_abs_diff"],
            "norm_ratio": elementwise["norm_ratio"],
            "differ_pct": elementwise["differ_pct"],
            "max_diff_ulps": elementwise["max_diff_ulps"],
        })
    return pd.DataFrame(rows)


def plot_host_paths(table: "pd.DataFrame", axes, hidden_size: int) -> None:
    """Three panels from ``compare_host_paths`` rows (all dtypes): fact recall, top-1 agreement, norm ratio.

    ``axes``: three matplotlib axes. The norm ratio is drawn on a log scale with sqrt(hidden_size)
    as a reference line: an unscaled path sits on it, a correct one at 1.
    """
    import seaborn as sns

    from gemma_nb.plots import reference_line

    data = table.assign(fact_recall_pct=100 * table["fact_recall"], top1_pct=100 * table["top1_agreement"])
    panels = [("fact_recall_pct", "fact recall (%)"), ("top1_pct", "top-1 agreement (%)"),
              ("norm_ratio", "norm ratio, module / host (x)")]
    for index, (ax, (column, label)) in enumerate(zip(axes, panels)):
        sns.barplot(data=data, x="path", y=column, hue="dtype", ax=ax, legend=index == 0)
        ax.set_xlabel("")
        ax.set_ylabel(label)
        ax.tick_params(axis="x", labelrotation=30)
        for tick in ax.get_xticklabels():
            tick.set_horizontalalignment("right")
    axes[2].set_yscale("log")
    # headroom above sqrt(H), where the unscaled bars end, for the reference line's label
    axes[2].set_ylim(top=4 * math.sqrt(hidden_size))
    reference_line(axes[2], math.sqrt(hidden_size), f"sqrt({hidden_size}) = {math.sqrt(hidden_size):.2f}")


__all__ = [
    "HOST_PATHS", "HostEmbedding", "UnscaledLookup", "PythonFloatScaledLookup", "HostEmbeddedLM",
    "EmbeddingCheckError", "EmbeddingScaleError", "EmbeddingFileError", "EmbeddingFileNotFoundError",
    "module_scale", "default_probe_ids", "host_path", "host_path_model", "verify_host_path",
    "scale_rounding", "host_path_elementwise", "host_path_numerics", "self_check_table",
    "compare_host_paths", "plot_host_paths",
]
