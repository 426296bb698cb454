"""The slim deploy's host-side embedding with Gemma-4's scale, its file, and the check that guards
it (notebooks 05, 06): ``embed_scale`` cast to the weight dtype as the module does, so it equals
``embed_tokens(ids)`` bit for bit."""

import math
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

FILE_FORMAT = "gemma-nb.host-embedding/1"
WEIGHT_KEY = "weight"
SCALE_KEY = "embed_scale"
SCALE_DTYPE_KEY = "embed_scale_dtype"
PROBE_IDS_KEY = "probe_ids"
PROBE_EXPECTED_KEY = "probe_expected"


class EmbeddingCheckError(ValueError):
    """A host embedding does not reproduce the model's ``embed_tokens`` (table, shape or dtype)."""


class EmbeddingScaleError(EmbeddingCheckError):
    """Same table, different output: the scale was dropped, or applied differently from the
    module."""


class EmbeddingFileError(ValueError):
    """An embedding file that is missing, malformed, or not what the caller expected."""


class EmbeddingFileNotFoundError(EmbeddingFileError, FileNotFoundError):
    """The embedding file does not exist (also a FileNotFoundError)."""


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def module_scale(module: nn.Module) -> torch.Tensor:
    """The scale ``module`` multiplies by, as it does: ``embed_scale.to(weight.dtype)`` (1 for a
    plain ``nn.Embedding``)."""
    scale = getattr(module, "embed_scale", None)
    return (
        torch.as_tensor(1.0 if scale is None else scale)
        .detach()
        .to(device="cpu", dtype=module.weight.dtype)
    )


def _as_scale(scale: float | torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``scale`` rounded to ``dtype`` the way the module rounds it: a Python float through float32
    first."""
    if isinstance(scale, torch.Tensor):
        if scale.numel() != 1:
            raise ValueError(
                f"scale must be a single number, got a tensor of shape {tuple(scale.shape)}"
            )
        return scale.detach().reshape(()).to(device="cpu", dtype=dtype)
    if (
        isinstance(scale, bool)
        or not isinstance(scale, (int, float))
        or not math.isfinite(scale)
        or scale <= 0
    ):
        raise ValueError(
            f"scale={scale!r} must be a positive finite number (Gemma-4: sqrt(hidden_size))"
        )
    return torch.tensor(float(scale), dtype=torch.float32).to(dtype)


def default_probe_ids(vocab_size: int, count: int = 256) -> torch.Tensor:
    """``count`` token ids spread evenly over the vocabulary, first and last included: [1,
    count]."""
    count = max(1, min(count, vocab_size))
    return torch.linspace(0, vocab_size - 1, count).round().long().unique().unsqueeze(0)


class HostEmbedding(nn.Module):
    """Token ids -> ``weight[ids] * scale``, the scale rounded to the weight dtype like the
    module's. ``probe_ids`` / ``probe_expected`` (the model's output for a few ids) are saved with
    the table and re-checked by ``from_file``, so a deploy with no model on the host checks it
    too."""

    def __init__(self, weight: torch.Tensor, scale: float | torch.Tensor):
        super().__init__()
        assert weight.ndim == 2 and weight.is_floating_point(), (
            f"weight must be a 2-D float tensor, got {tuple(weight.shape)}"
        )
        self.register_buffer("weight", weight.detach(), persistent=False)
        self.register_buffer(
            "scale", _as_scale(scale, weight.dtype).to(weight.device), persistent=False
        )
        self.probe_ids: torch.Tensor | None = None
        self.probe_expected: torch.Tensor | None = None

    @classmethod
    def from_model(cls, model: nn.Module) -> "HostEmbedding":
        """The host embedding of a Gemma-4 causal LM (or its embedding module), checked bit for bit
        against it."""
        module = model if isinstance(model, nn.Embedding) else model.get_input_embeddings()
        if getattr(module, "embed_scale", None) is None:
            raise EmbeddingCheckError(
                f"{type(module).__name__} has no embed_scale: expected Gemma-4's "
                "Gemma4TextScaledWordEmbedding (model.get_input_embeddings()); a plain "
                "nn.Embedding carries no scale to copy"
            )
        host = cls(module.weight, module_scale(module))
        # bit for bit on the default probe ids, so its outputs there are the model's
        host.verify_against(module)
        host.probe_ids = default_probe_ids(module.weight.shape[0])
        host.probe_expected = host(host.probe_ids).cpu()
        return host

    @classmethod
    def from_file(
        cls,
        path: str | Path,
        scale: float | torch.Tensor | None = None,
        dtype: torch.dtype | None = None,
        shape: tuple[int, int] | None = None,
    ) -> "HostEmbedding":
        """Load a file ``save`` wrote; refuse another ``dtype`` / ``shape`` than expected, re-check
        the probe. ``scale`` is needed only for a file without scale metadata (both present: they
        must agree)."""
        path = Path(path)
        tensors, metadata = _read_embedding_file(path)
        weight = tensors[WEIGHT_KEY]
        _check_table(path.name, weight, dtype, shape)
        host = cls(weight, _file_scale(path.name, metadata, weight.dtype, scale))
        if PROBE_IDS_KEY in tensors:
            host.probe_ids, host.probe_expected = (
                tensors[PROBE_IDS_KEY],
                tensors[PROBE_EXPECTED_KEY],
            )
            found = host(host.probe_ids)
            if found.shape != host.probe_expected.shape or not torch.equal(
                found, host.probe_expected
            ):
                raise EmbeddingScaleError(
                    f"embedding file {path.name!r}: its table and scale do not reproduce the "
                    "source model's probe outputs stored beside them. "
                    + _diagnosis(
                        host.probe_expected,
                        found,
                        F.embedding(host.probe_ids, weight),
                        host.scale,
                        host.scale,
                    )
                )
        return host

    def save(self, path: str | Path) -> Path:
        """Write ``weight``, the scale (as applied, in the weight dtype) and any probe to
        safetensors."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        metadata = {
            "format": FILE_FORMAT,
            SCALE_KEY: repr(self.scale.item()),
            SCALE_DTYPE_KEY: dtype_name(self.weight.dtype),
            "vocab_size": str(self.weight.shape[0]),
            "hidden_size": str(self.weight.shape[1]),
        }
        tensors = {WEIGHT_KEY: self.weight.contiguous()}
        if self.probe_ids is not None:
            tensors |= {
                PROBE_IDS_KEY: self.probe_ids.contiguous(),
                PROBE_EXPECTED_KEY: self.probe_expected.contiguous(),
            }
        save_file(tensors, str(path), metadata=metadata)
        return path

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids.to(self.weight.device), self.weight) * self.scale

    def verify_against(self, module: nn.Module) -> None:
        verify_host_path(self, module, found_scale=self.scale)

    def extra_repr(self) -> str:
        vocab, hidden = self.weight.shape
        return (
            f"vocab={vocab}, hidden={hidden}, scale={self.scale.item()!r}, "
            f"dtype={dtype_name(self.weight.dtype)}"
        )


def _read_embedding_file(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    name, allowed = (
        path.name,
        ([WEIGHT_KEY], sorted([WEIGHT_KEY, PROBE_IDS_KEY, PROBE_EXPECTED_KEY])),
    )
    if not path.is_file():
        raise EmbeddingFileNotFoundError(
            f"embedding file {name!r} not found (looked in {path.parent.name or '.'}/): "
            "write it with HostEmbedding.from_model(model).save(path)"
        )
    try:
        with safe_open(str(path), framework="pt") as handle:
            metadata, keys = handle.metadata() or {}, sorted(handle.keys())
            tensors = {key: handle.get_tensor(key) for key in keys} if keys in allowed else None
    except (SafetensorError, OSError, ValueError) as error:
        raise EmbeddingFileError(
            f"embedding file {name!r} is not a readable safetensors file ({error}); expected the "
            "file HostEmbedding.save writes. A torch .pt table (like the port's "
            "embed_tokens.pt) carries no scale: load it with torch.load(..., weights_only=True) "
            "and save HostEmbedding(weight, scale)"
        ) from error
    if tensors is None:
        raise EmbeddingFileError(
            f"embedding file {name!r} holds tensors {keys}; expected one named {WEIGHT_KEY!r} "
            f"[vocab, hidden] (plus optionally {PROBE_IDS_KEY!r} and {PROBE_EXPECTED_KEY!r}) as "
            "written by HostEmbedding.save"
        )
    return tensors, metadata


def _check_table(name: str, weight: torch.Tensor, dtype: torch.dtype | None, shape) -> None:
    what, want = f"embedding file {name!r}: {WEIGHT_KEY!r}", dtype_name(dtype)
    if weight.ndim != 2 or not weight.is_floating_point():
        raise EmbeddingFileError(
            f"{what} is {dtype_name(weight.dtype)} of shape {tuple(weight.shape)}; "
            "expected a 2-D float table [vocab, hidden]"
        )
    if shape is not None and tuple(weight.shape) != tuple(shape):
        raise EmbeddingFileError(
            f"{what} has shape {tuple(weight.shape)}, expected {tuple(shape)} "
            "(vocab_size, hidden_size): was it saved from another model?"
        )
    if dtype is not None and weight.dtype != dtype:
        raise EmbeddingFileError(
            f"{what} is {dtype_name(weight.dtype)}, expected {want}; save the table from a model "
            f"in {want} (the scale is rounded in the weight dtype, so casting after loading "
            "would not match the module)"
        )


def _file_scale(name: str, metadata: dict[str, str], dtype: torch.dtype, scale) -> torch.Tensor:
    """The scale stored in the file's metadata, reconciled with a ``scale=`` argument."""
    stored = metadata.get(SCALE_KEY)
    if stored is None:
        if scale is None:
            raise EmbeddingFileError(
                f"embedding file {name!r} has no {SCALE_KEY!r} in its metadata and no scale= was "
                "given; expected the scale Gemma-4's embedding multiplies by "
                "(sqrt(hidden_size)): re-save with HostEmbedding.save, or pass "
                "scale=model.get_input_embeddings().embed_scale"
            )
        return _as_scale(scale, dtype)
    if (stored_dtype := metadata.get(SCALE_DTYPE_KEY)) != dtype_name(dtype):
        raise EmbeddingFileError(
            f"embedding file {name!r}: {SCALE_DTYPE_KEY}={stored_dtype!r} in metadata, expected "
            f"{dtype_name(dtype)!r} (the weight's dtype); the file was not written by "
            "HostEmbedding.save"
        )
    try:
        stored_scale = _as_scale(float(stored), dtype)
    except ValueError as error:
        raise EmbeddingFileError(
            f"embedding file {name!r}: {SCALE_KEY}={stored!r} in metadata is not a positive number"
        ) from error
    if scale is not None and not torch.equal(_as_scale(scale, dtype), stored_scale):
        raise EmbeddingScaleError(
            f"embedding file {name!r} stores {SCALE_KEY}={stored_scale.item()!r} but "
            f"scale={_as_scale(scale, dtype).item()!r} was given ({dtype_name(dtype)}); drop "
            "scale= to use the file's"
        )
    return stored_scale


def verify_host_path(
    host: Callable[[torch.Tensor], torch.Tensor],
    module: nn.Module,
    found_scale: torch.Tensor | None = None,
):
    """Raise unless ``host(ids)`` equals the model's ``module(ids)`` bit for bit on the default
    probe ids. ``EmbeddingScaleError`` names the scale expected and found (``found_scale``, else
    estimated from norms)."""
    weight = module.weight
    probe_ids = default_probe_ids(weight.shape[0])
    with torch.no_grad():
        expected = module(probe_ids.to(weight.device)).cpu()
        found = host(probe_ids).cpu()
        if found.shape != expected.shape or found.dtype != expected.dtype:
            raise EmbeddingCheckError(
                f"host embedding gives {dtype_name(found.dtype)} {tuple(found.shape)} for the "
                f"probe ids, the model's {type(module).__name__} gives "
                f"{dtype_name(expected.dtype)} {tuple(expected.shape)}; build the host table "
                "from the same model in the same dtype"
            )
        if not torch.equal(found, expected):
            raw = F.embedding(probe_ids.to(weight.device), weight).cpu()
            raise EmbeddingScaleError(
                f"host embedding does not reproduce {type(module).__name__}(ids) bit for bit on "
                f"{probe_ids.numel()} probe ids: "
                + _diagnosis(expected, found, raw, module_scale(module), found_scale)
            )


def _diagnosis(expected, found, raw, expected_scale, found_scale) -> str:
    """Which scale was expected and found, how far apart the outputs are, and what that looks
    like."""
    dtype, hidden = dtype_name(expected.dtype), expected.shape[-1]
    expected32, found32, raw32 = expected.float(), found.float(), raw.float()
    max_abs = (expected32 - found32).abs().max().item()
    differ_pct = 100.0 * (expected != found).float().mean().item()
    ratio = (expected32.norm() / found32.norm()).item() if found32.norm() > 0 else math.inf
    effective = (found32.norm() / raw32.norm()).item() if raw32.norm() > 0 else math.nan
    found_text = (
        f"{found_scale.item()!r} ({dtype})"
        if found_scale is not None
        else f"~{effective:.6g} (effective)"
    )
    ulp = unit_in_last_place(expected_scale).item()
    lines = [
        f"expected scale {expected_scale.item()!r} (the module's embed_scale cast to {dtype}), "
        f"found {found_text}; max |Δ| = {max_abs:.4g}, {differ_pct:.1f}% of elements differ, "
        f"norm ratio model/host = {ratio:.6g}."
    ]
    if abs(ratio - math.sqrt(hidden)) < 0.02 * math.sqrt(hidden):
        lines.append(f"Looks unscaled: the ratio ≈ sqrt(hidden_size) = {math.sqrt(hidden):.4f}.")
    elif found_scale is None and abs(effective - expected_scale.item()) <= ulp:
        lines.append(
            f"The scale is right to within one {dtype} ulp ({ulp:g}) but applied differently: "
            f"probably math.sqrt({hidden}) = {math.sqrt(hidden):.6f} as a Python float, which "
            "torch applies at float32 precision, while the module first rounds it to "
            f"{expected_scale.item()!r} in {dtype}."
        )
    elif found_scale is not None and torch.equal(found_scale.cpu(), expected_scale):
        lines.append("Same scale, different output: the table itself differs from the model's.")
    return " ".join(
        lines
        + [
            "Fix: build the host path with gemma_nb.embedding.HostEmbedding.from_model(model) "
            "(or from_file)."
        ]
    )


def unit_in_last_place(value: torch.Tensor) -> torch.Tensor:
    """The spacing of ``value``'s dtype at ``|value|`` (one unit in the last place)."""
    magnitude = value.abs()
    return torch.nextafter(magnitude, torch.full_like(magnitude, math.inf)) - magnitude


def host_embedding_for(skeleton: nn.Module, path: Path):
    """The host table from ``path``, its scale checked against the skeleton's (a meta buffer:
    rebuilt as its constructor does)."""
    module = skeleton.get_input_embeddings()
    return HostEmbedding.from_file(
        path, scale=torch.tensor(module.scalar_embed_scale), shape=tuple(module.weight.shape)
    )
