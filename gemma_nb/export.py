"""Compile a Gemma-4 model into two static-shape steps, saved apart from its weights (notebook 04).

The neuron port compiled two graphs with ``ModelBuilder`` — a prefill over a fixed bucket of
tokens and a one-token decode — with the KV cache as device state, the embedding lookup left on
the host, and the weights kept out of the program (``gemma_nb.neuron.build`` has that recipe).
On the cpu target the same shape of artifact is made with ``torch.export``:

- ``DeviceBody`` is the part of the model that runs "on the device": decoder layers, final norm,
  lm_head and softcap. It takes ``inputs_embeds`` (the host embeds the tokens, scale included),
  the start position, the index of the token whose logits to return, the KV cache tensors and
  **the weights, as inputs**. The weights being inputs is what keeps them out of the program:
  the exported graph has no parameters, so ``torch.export.save`` writes only the graph and a few
  small constants (rotary frequencies), and the weights go to a safetensors file of their own
  that the deploy memory-maps. (The other route — lift the parameters and strip them from the
  saved state dict — depends on export internals that change between torch releases.)
- The KV cache tensors are inputs too, updated in place (``index_copy_``), so the prefill and the
  decode program share one cache owned by the caller, like the port's aliased device states.
- The routed experts run through transformers' ``grouped_mm`` implementation: the default
  ``eager`` experts loop over the experts that were hit, which is data-dependent control flow that
  ``torch.export`` cannot trace (docs/sources.md: transformers-gemma4).
- ``StepRunner.generate`` is the greedy loop over the two steps. transformers'
  ``TorchExportableModuleWithStaticCache.generate`` feeds each generated token at position
  ``len(tokens)`` instead of ``len(tokens) - 1`` (one too far), so its output drifts from eager
  decoding after the first token; here the token generated after a prompt of ``n`` tokens is fed
  at position ``n``, and the result equals eager greedy decoding token for token (tested).

Artifact folder (``compile_model``), one file per concern::

    manifest.json               config, shapes, dtypes, files, sizes: what the loader checks against
    prefill.pt2, decode.pt2     the exported programs (graph only, no weights)
    tp0_weights.safetensors     the body's weights (one file per tensor-parallel rank; TP=1 here)
    embed_tokens.safetensors    the host embedding table with its scale (gemma_nb.embedding)

``load_artifact`` checks every file before torch sees it: a missing, truncated or mismatched file
raises ``ArtifactError`` (a ValueError) naming the file and what was expected.

One concern in one module (~700 lines): the exported steps, the runner that drives them and the
artifact format that stores them change together (a new step input is a new manifest field and a
new check). Notebook 04's experiment around it (the size sweep, fits, plots) is
``gemma_nb.experiments.compile_run``.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from gemma_nb.embedding import HostEmbedding
from gemma_nb.metrics import write_json_atomic
from gemma_nb.paths import fresh_dir

FORMAT = "gemma-nb.exported-steps/1"
MANIFEST = "manifest.json"
PROGRAM_FILES = {"prefill": "prefill.pt2", "decode": "decode.pt2"}
HOST_EMBEDDING_FILE = "embed_tokens.safetensors"
HOST_EMBEDDING_KEY = "model.embed_tokens.weight"
PROGRAM_EXTRA = "gemma_nb_program.json"
TRACEABLE_EXPERTS = ("grouped_mm", "batched_mm")
DEFAULT_EXPERTS = "grouped_mm"


def weights_file(rank: int = 0) -> str:
    """The weights file of tensor-parallel rank ``rank`` (NxD names its files the same way)."""
    return f"tp{rank}_weights.safetensors"


class ArtifactError(ValueError):
    """A compiled artifact or weights file that is missing, truncated or does not match."""


class ArtifactNotFoundError(ArtifactError, FileNotFoundError):
    """A file of the artifact does not exist (also a FileNotFoundError)."""


# --------------------------------------------------------------------------------------------
# What runs on the device, and with which weights
# --------------------------------------------------------------------------------------------
def check_exportable_config(config) -> None:
    """Refuse Gemma-4 variants the two-step body does not cover (not the 26B's architecture)."""
    if getattr(config, "hidden_size_per_layer_input", 0):
        raise ValueError(
            f"hidden_size_per_layer_input={config.hidden_size_per_layer_input}: per-layer embeddings need "
            "token ids inside the graph, which this host-embedding body does not take; the 26B has 0"
        )
    if getattr(config, "num_kv_shared_layers", 0):
        raise ValueError(
            f"num_kv_shared_layers={config.num_kv_shared_layers}: KV sharing is not supported by the "
            "static-cache body; the 26B has 0"
        )


def set_traceable_experts(model: nn.Module, implementation: str = DEFAULT_EXPERTS) -> str:
    """Switch ``model``'s routed experts to a ``torch.export``-able implementation; return it.

    Keeps ``grouped_mm``/``batched_mm`` if already set; replaces ``eager`` (the data-dependent
    loop) with ``implementation``. Modules from ``gemma_nb.moe`` are left as they are.
    """
    if implementation not in TRACEABLE_EXPERTS:
        raise ValueError(f"experts implementation {implementation!r} is not one of {', '.join(TRACEABLE_EXPERTS)}")
    current = getattr(model.config, "_experts_implementation", None)
    if current in TRACEABLE_EXPERTS:
        return current
    model.set_experts_implementation(implementation)
    return implementation


def device_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """The tensors the device body reads, by state-dict name: every parameter and persistent
    buffer except the host's embedding table. A tied ``lm_head.weight`` is kept under its own
    name (the device needs it; the host keeps its own copy of the table, as in the port).
    """
    weights: dict[str, torch.Tensor] = {}
    for name, tensor in model.named_parameters(remove_duplicate=False):
        weights[name] = tensor.detach()
    non_persistent = set()
    for module_name, module in model.named_modules():
        for buffer_name in getattr(module, "_non_persistent_buffers_set", ()):
            non_persistent.add(f"{module_name}.{buffer_name}" if module_name else buffer_name)
    for name, tensor in model.named_buffers(remove_duplicate=False):
        if name not in non_persistent:
            weights[name] = tensor.detach()
    weights.pop(HOST_EMBEDDING_KEY, None)
    return weights


def kv_cache_shapes(config, max_cache_len: int, batch_size: int = 1) -> list[tuple[int, ...]]:
    """Shapes of the static KV cache, keys then values per layer: [batch, kv_heads, max_len, head_dim].

    Sliding-window layers get the full ``max_cache_len`` too (a static layer that never rolls),
    and the sliding-window mask keeps their attention exact; ``max_cache_len`` bounds the
    prompt plus the generated tokens.
    """
    shapes = []
    for heads, dim in layer_kv_heads(config):
        shapes += [(batch_size, heads, max_cache_len, dim)] * 2
    return shapes


def layer_kv_heads(config) -> list[tuple[int, int]]:
    """Per layer, (KV heads, head_dim) as transformers builds the cache (sliding and full layers differ)."""
    from transformers.configuration_utils import get_head_shapes

    layers = config.num_hidden_layers
    heads, dims = get_head_shapes(config)
    heads = [heads] * layers if isinstance(heads, int) else list(heads)
    dims = [dims] * layers if isinstance(dims, int) else list(dims)
    return list(zip(heads, dims))


def new_kv_cache(shapes, dtype: torch.dtype) -> list[torch.Tensor]:
    return [torch.zeros(shape, dtype=dtype) for shape in shapes]


def _bound_static_cache(config, kv: list[torch.Tensor], start: torch.Tensor, max_cache_len: int):
    """A transformers ``StaticCache`` whose layers write into the caller's ``kv`` tensors."""
    from transformers.cache_utils import StaticCache, StaticLayer

    cache = StaticCache(config=config, max_cache_len=max_cache_len)
    layers = []
    for keys, values in zip(kv[0::2], kv[1::2]):
        layer = StaticLayer(max_cache_len)
        layer.device = keys.device
        layer.batch_size, layer.num_heads = keys.shape[0], keys.shape[1]
        layer.k_head_dim, layer.v_head_dim = keys.shape[-1], values.shape[-1]
        layer.keys, layer.values = keys, values
        # Each layer advances its own counter in place; a copy keeps the caller's tensor untouched.
        layer.cumulative_length = start.reshape(()).clone()
        layer.is_initialized = True
        layers.append(layer)
    cache.layers = layers
    return cache


class DeviceBody(nn.Module):
    """One step of the model without its embedding: decoder layers, norm, lm_head, softcap.

    forward(weights, kv, inputs_embeds, start, last_index) -> logits [batch, vocab] (fp32)

    - ``weights``: dict name -> tensor, as ``device_weights(model)`` returns;
    - ``kv``: list of cache tensors (``kv_cache_shapes``), written in place at ``start`` ...;
    - ``inputs_embeds`` [batch, S, hidden]: the host's scaled embeddings of S tokens placed at
      positions ``start .. start+S-1``; ``start`` int64 [1];
    - ``last_index`` int64 [1]: which of the S positions' logits to return (the last real token
      of a padded prefill; 0 for a decode step).

    The model is held outside the module tree on purpose, so the exported program owns no weights.
    """

    def __init__(self, model: nn.Module, max_cache_len: int):
        super().__init__()
        check_exportable_config(model.config)
        object.__setattr__(self, "_model", model)
        self.max_cache_len = max_cache_len

    def forward(self, weights, kv, inputs_embeds, start, last_index):
        model = self._model
        cache = _bound_static_cache(model.config, kv, start, self.max_cache_len)
        out = torch.func.functional_call(
            model,
            weights,
            args=(),
            kwargs=dict(inputs_embeds=inputs_embeds, cache=cache, use_cache=True, logits_to_keep=last_index),
            tie_weights=True,
            strict=False,
        )
        return out.logits[:, -1, :].float()


@dataclass
class StepShapes:
    """The static shapes both programs are built for."""

    max_cache_len: int = 128
    prefill_len: int = 32
    batch_size: int = 1

    def __post_init__(self) -> None:
        for key in ("max_cache_len", "prefill_len", "batch_size"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{key}={value!r} must be a positive integer")
        if self.batch_size != 1:
            raise ValueError(f"batch_size={self.batch_size}: the exported steps decode one sequence (batch 1), as the port did")
        if self.prefill_len > self.max_cache_len:
            raise ValueError(
                f"prefill_len={self.prefill_len} exceeds max_cache_len={self.max_cache_len}: "
                "the prefill bucket must fit in the KV cache"
            )


def _example_inputs(model: nn.Module, weights, shapes: StepShapes, tokens: int):
    config = model.config
    dtype = _float_dtype(weights)
    kv = new_kv_cache(kv_cache_shapes(config, shapes.max_cache_len), dtype)
    embeds = torch.zeros(shapes.batch_size, tokens, config.hidden_size, dtype=dtype)
    return (weights, kv, embeds, torch.zeros(1, dtype=torch.long), torch.tensor([tokens - 1]))


def _float_dtype(weights: Mapping[str, torch.Tensor]) -> torch.dtype:
    """The activation dtype: the dtype of the norms and attention weights (int8 tensors excluded)."""
    for name, tensor in weights.items():
        if name.endswith("norm.weight") and tensor.is_floating_point():
            return tensor.dtype
    for tensor in weights.values():
        if tensor.is_floating_point():
            return tensor.dtype
    raise ValueError("no floating-point weight found: expected a Gemma-4 model's parameters")


def export_steps(model: nn.Module, shapes: StepShapes | None = None) -> dict[str, torch.export.ExportedProgram]:
    """``torch.export`` the prefill (``shapes.prefill_len`` tokens) and decode (1 token) steps.

    ``model``: a Gemma-4 causal LM in eval mode; its experts are switched to ``grouped_mm`` if
    they were ``eager``. Returns {"prefill": program, "decode": program}; neither holds weights.
    """
    shapes = shapes or StepShapes()
    set_traceable_experts(model)
    body = DeviceBody(model, shapes.max_cache_len)
    weights = device_weights(model)
    programs = {}
    with torch.no_grad():
        for name, tokens in (("prefill", shapes.prefill_len), ("decode", 1)):
            program = torch.export.export(body, _example_inputs(model, weights, shapes, tokens), strict=False)
            # Export keeps its example inputs (here: every weight) to save them with the program.
            program._example_inputs = None
            programs[name] = program
    return programs


# --------------------------------------------------------------------------------------------
# The greedy loop over the two steps
# --------------------------------------------------------------------------------------------
Step = Callable[..., torch.Tensor]


@dataclass
class StepRunner:
    """Greedy decoding with a prefill step and a decode step that share one KV cache.

    ``prefill`` / ``decode``: callables with ``DeviceBody``'s signature (exported programs'
    ``.module()``, or a ``DeviceBody`` itself); ``embed``: ids [1, S] -> inputs_embeds (the host
    embedding, scale included); ``weights``: dict for the steps; ``kv_shapes``/``dtype``: the cache.
    """

    prefill: Step
    decode: Step
    embed: Callable[[torch.Tensor], torch.Tensor]
    weights: Mapping[str, torch.Tensor]
    kv_shapes: list[tuple[int, ...]]
    dtype: torch.dtype
    shapes: StepShapes
    pad_token_id: int = 0
    step_times_s: list[float] = field(default_factory=list, init=False, repr=False)

    def _check(self, ids: torch.Tensor, max_new_tokens: int) -> None:
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
            raise ValueError(f"max_new_tokens={max_new_tokens!r} must be a non-negative integer")
        if ids.dim() != 2 or ids.shape[0] != 1 or ids.shape[1] == 0:
            raise ValueError(f"input_ids of shape {tuple(ids.shape)}; expected one unpadded prompt [S] or [1, S]")
        prompt = ids.shape[1]
        if prompt > self.shapes.prefill_len:
            raise ValueError(
                f"prompt of {prompt} tokens exceeds the prefill bucket of {self.shapes.prefill_len}: "
                "shorten the prompt or compile with a larger StepShapes(prefill_len=...)"
            )
        if prompt + max_new_tokens - 1 > self.shapes.max_cache_len:
            raise ValueError(
                f"{prompt} prompt + {max_new_tokens} new tokens need {prompt + max_new_tokens - 1} cache slots, "
                f"more than max_cache_len={self.shapes.max_cache_len}: ask for fewer tokens or compile "
                "with a larger StepShapes(max_cache_len=...)"
            )

    @torch.inference_mode()
    def generate(self, input_ids, max_new_tokens: int, eos_token_id: int | None = None) -> torch.Tensor:
        """Prompt plus greedy continuation, LongTensor [1, S + n] (n <= max_new_tokens; stops after eos)."""
        ids = torch.as_tensor(input_ids, dtype=torch.long)
        ids = ids[None] if ids.dim() == 1 else ids
        self._check(ids, max_new_tokens)
        if max_new_tokens == 0:
            return ids
        prompt = ids.shape[1]
        kv = new_kv_cache(self.kv_shapes, self.dtype)
        padded = torch.full((1, self.shapes.prefill_len), self.pad_token_id, dtype=torch.long)
        padded[:, :prompt] = ids
        self.step_times_s = []
        start_time = time.perf_counter()
        # Prefill writes positions 0..prefill_len-1; the padding slots past the prompt are
        # overwritten by the decode steps before any query can attend to them (causal mask).
        logits = self.prefill(self.weights, kv, self.embed(padded), torch.tensor([0]), torch.tensor([prompt - 1]))
        tokens = [int(logits.argmax(-1))]
        self.step_times_s.append(time.perf_counter() - start_time)
        while len(tokens) < max_new_tokens and tokens[-1] != eos_token_id:
            # The token just generated sits at position prompt + len(tokens) - 1 (not one further).
            position = prompt + len(tokens) - 1
            start_time = time.perf_counter()
            logits = self.decode(
                self.weights, kv, self.embed(torch.tensor([[tokens[-1]]])), torch.tensor([position]), torch.tensor([0])
            )
            tokens.append(int(logits.argmax(-1)))
            self.step_times_s.append(time.perf_counter() - start_time)
        return torch.cat([ids, torch.tensor([tokens])], dim=1)


def eager_runner(model: nn.Module, shapes: StepShapes | None = None) -> StepRunner:
    """The same two-step loop with the un-exported ``DeviceBody`` (for comparisons)."""
    shapes = shapes or StepShapes()
    set_traceable_experts(model)
    weights = device_weights(model)
    body = DeviceBody(model, shapes.max_cache_len)
    return StepRunner(
        prefill=body, decode=body, embed=model.get_input_embeddings(), weights=weights,
        kv_shapes=kv_cache_shapes(model.config, shapes.max_cache_len), dtype=_float_dtype(weights),
        shapes=shapes, pad_token_id=model.config.pad_token_id or 0,
    )


def exported_runner(model: nn.Module, programs: Mapping[str, torch.export.ExportedProgram],
                    shapes: StepShapes) -> StepRunner:
    """A runner over freshly exported ``programs`` with ``model``'s own weights and embedding."""
    weights = device_weights(model)
    return StepRunner(
        prefill=programs["prefill"].module(), decode=programs["decode"].module(),
        embed=model.get_input_embeddings(), weights=weights,
        kv_shapes=kv_cache_shapes(model.config, shapes.max_cache_len), dtype=_float_dtype(weights),
        shapes=shapes, pad_token_id=model.config.pad_token_id or 0,
    )


# --------------------------------------------------------------------------------------------
# Saving: the artifact folder
# --------------------------------------------------------------------------------------------
def config_fingerprint(config) -> str:
    """sha256 (first 16 hex digits) of the config's JSON: ties programs and weights to one model."""
    text = config.to_json_string(use_diff=False) if hasattr(config, "to_json_string") else json.dumps(config, sort_keys=True)
    data = json.loads(text)
    for volatile in ("transformers_version", "_name_or_path", "_experts_implementation", "_attn_implementation",
                     "dtype", "torch_dtype", "architectures"):
        data.pop(volatile, None)
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def stored_elements(tensors) -> int:
    """Elements of distinct storages among ``tensors``: a tied table counted once, int8 copies counted."""
    seen: dict[tuple[int, int], int] = {}
    for t in tensors:
        seen[(t.untyped_storage().data_ptr(), t.storage_offset())] = t.numel()
    return sum(seen.values())


def tensor_specs(weights: Mapping[str, torch.Tensor]) -> dict[str, list]:
    """name -> [shape, dtype name] for a dict of tensors."""
    return {name: [list(t.shape), _dtype_name(t.dtype)] for name, t in weights.items()}


@dataclass
class CompileReport:
    """What ``compile_model`` wrote and how long each part took."""

    folder: Path
    export_s: float
    save_s: float
    program_bytes: dict[str, int]
    weights_bytes: int
    host_embedding_bytes: int
    params: int
    config_sha: str
    programs: dict = field(default_factory=dict, repr=False)  # the exported programs, in memory

    def as_dict(self) -> dict:
        return {
            "export_s": self.export_s, "save_s": self.save_s, "params": self.params,
            "program_bytes": sum(self.program_bytes.values()), "weights_bytes": self.weights_bytes,
            "host_embedding_bytes": self.host_embedding_bytes, "config_sha": self.config_sha,
        }


def save_weights(weights: Mapping[str, torch.Tensor], path: str | Path, config_sha: str, rank: int = 0,
                 tp_degree: int = 1) -> Path:
    """Write one rank's device weights as safetensors, tagged with the config they belong to."""
    from safetensors.torch import save_file

    meta = {"format": FORMAT, "config_sha": config_sha, "rank": str(rank), "tp_degree": str(tp_degree)}
    save_file({k: v.contiguous() for k, v in weights.items()}, str(path), metadata=meta)
    return Path(path)


def experts_implementation(model: nn.Module) -> str:
    """What computes the routed experts in ``model``'s steps, as the manifest records it.

    A module that replaced transformers' ``Gemma4TextExperts`` is named by its class (the slim
    deploy's ``Int8Experts``, which reads only the routed experts on a one-token step); transformers'
    own experts by ``config._experts_implementation`` (``grouped_mm``, ``batched_mm``, ``eager``).
    """
    names = {type(m).__name__ for m in model.modules() if type(m).__name__.endswith("Experts")}
    replaced = sorted(names - {"Gemma4TextExperts"})
    if replaced:
        return ", ".join(replaced)
    return str(getattr(model.config, "_experts_implementation", None))


def compile_model(model: nn.Module, folder: str | Path, shapes: StepShapes | None = None,
                  scheme: str | None = None, reference_tokens: dict | None = None) -> CompileReport:
    """Export ``model``'s two steps and write the artifact folder (see the module docstring).

    ``scheme``: the quantization scheme already applied to ``model`` (recorded, not applied).
    ``reference_tokens``: optional {"prompt": [...], "tokens": [...]} the deploy can check against.
    """
    shapes = shapes or StepShapes()
    folder = fresh_dir(folder)  # a partial run hard-links the previous artifacts: never write through one
    config = model.config
    sha = config_fingerprint(config)

    start = time.perf_counter()
    programs = export_steps(model, shapes)
    export_s = time.perf_counter() - start

    start = time.perf_counter()
    weights = device_weights(model)
    save_weights(weights, folder / weights_file(0), sha)
    host = HostEmbedding.from_model(model)
    host.save(folder / HOST_EMBEDDING_FILE)
    program_meta = json.dumps({"format": FORMAT, "config_sha": sha, "weights": tensor_specs(weights)})
    program_bytes = {}
    for name, program in programs.items():
        path = folder / PROGRAM_FILES[name]
        torch.export.save(program, path, extra_files={PROGRAM_EXTRA: program_meta})
        program_bytes[name] = path.stat().st_size
    save_s = time.perf_counter() - start

    manifest = {
        "format": FORMAT,
        "config_sha": sha,
        "config": json.loads(config.to_json_string(use_diff=False)),
        "dtype": _dtype_name(_float_dtype(weights)),
        "scheme": scheme,
        "experts_implementation": experts_implementation(model),
        "shapes": {"max_cache_len": shapes.max_cache_len, "prefill_len": shapes.prefill_len, "batch_size": shapes.batch_size},
        "kv_cache": [list(s) for s in kv_cache_shapes(config, shapes.max_cache_len)],
        "programs": {name: {"file": PROGRAM_FILES[name], "bytes": size} for name, size in program_bytes.items()},
        "weights": {"tp_degree": 1, "files": [weights_file(0)], "bytes": (folder / weights_file(0)).stat().st_size,
                    "tensors": tensor_specs(weights)},
        "host_embedding": {"file": HOST_EMBEDDING_FILE, "shape": list(host.weight.shape),
                           "dtype": _dtype_name(host.weight.dtype), "bytes": (folder / HOST_EMBEDDING_FILE).stat().st_size},
        "reference": reference_tokens,
        "versions": {"torch": torch.__version__, "transformers": _transformers_version()},
    }

    write_json_atomic(folder / MANIFEST, manifest)
    return CompileReport(
        folder=folder, export_s=export_s, save_s=save_s, program_bytes=program_bytes,
        weights_bytes=manifest["weights"]["bytes"], host_embedding_bytes=manifest["host_embedding"]["bytes"],
        params=stored_elements([*weights.values(), host.weight]), config_sha=sha, programs=programs,
    )


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


# --------------------------------------------------------------------------------------------
# Loading: every file checked before torch reads it
# --------------------------------------------------------------------------------------------
def _require(path: Path, what: str) -> Path:
    if not path.is_file():
        raise ArtifactNotFoundError(
            f"{path.name} not found in {path.parent.name}/: expected {what}, written by "
            "gemma_nb.export.compile_model (notebook 04); re-run the compile"
        )
    return path


def read_manifest(folder: str | Path) -> dict:
    """The artifact's manifest.json, checked for its format."""
    path = _require(Path(folder) / MANIFEST, "the artifact manifest (JSON)")
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ArtifactError(f"{path.name} is not valid JSON ({error}); expected the manifest compile_model writes") from error
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise ArtifactError(f"{path.name} has format {found!r}; expected {FORMAT!r}")
    return manifest


def safetensors_header(path: Path) -> tuple[dict[str, list], dict[str, str]]:
    """(name -> [shape, dtype], metadata) of a safetensors file, read with ``safe_open`` (header only).

    ``safe_open`` checks that the header's offsets cover the file exactly, so a truncated file is
    caught here, before any tensor is mapped; its errors are re-raised as ``ArtifactError``.
    """
    size = path.stat().st_size
    if size < 8:
        raise ArtifactError(f"{path.name} is {size} bytes: too short to be a safetensors file (expected an 8-byte header length)")
    try:
        with safe_open(str(path), framework="pt") as handle:
            metadata = handle.metadata() or {}
            specs = {}
            for name in handle.keys():
                tensor = handle.get_slice(name)
                specs[name] = [list(tensor.get_shape()), _SAFETENSORS_DTYPES.get(tensor.get_dtype(), tensor.get_dtype())]
    except SafetensorError as error:
        if "not fully covered" in str(error):
            raise ArtifactError(
                f"{path.name} is truncated: {size} bytes on disk, its header describes more ({error}); "
                "copy or download the file again"
            ) from error
        raise ArtifactError(f"{path.name} is not a readable safetensors file ({error}); expected a safetensors file") from error
    return specs, metadata


_SAFETENSORS_DTYPES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64", "I32": "int32",
    "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
}


def check_tensor_specs(found: Mapping[str, list], expected: Mapping[str, list], file_name: str, expected_from: str) -> None:
    """Raise ArtifactError naming ``file_name`` if its tensor names, shapes or dtypes differ."""
    missing = sorted(set(expected) - set(found))
    extra = sorted(set(found) - set(expected))
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"missing {len(missing)} tensor(s) {missing[:3]}{' ...' if len(missing) > 3 else ''}")
        if extra:
            parts.append(f"unexpected {len(extra)} tensor(s) {extra[:3]}{' ...' if len(extra) > 3 else ''}")
        raise ArtifactError(
            f"{file_name} does not hold the tensors {expected_from} expects: {'; '.join(parts)}. "
            "Were the weights saved from another model? Re-run compile_model for this model"
        )
    for name, spec in expected.items():
        if [list(found[name][0]), found[name][1]] != [list(spec[0]), spec[1]]:
            raise ArtifactError(
                f"{file_name}: tensor {name!r} is {found[name][1]} {tuple(found[name][0])}, "
                f"{expected_from} expects {spec[1]} {tuple(spec[0])}: programs and weights come from different "
                "configs; use the files one compile_model run wrote together"
            )


def read_program_meta(path: Path) -> dict:
    """The metadata compile_model stored inside an exported program, read without loading it.

    A .pt2 is a zip archive; reading its directory is enough to catch a truncated file.
    """
    import zipfile

    _require(path, f"the exported {path.stem} program (torch.export .pt2)")
    try:
        with zipfile.ZipFile(path) as archive:
            names = [n for n in archive.namelist() if n.endswith(f"/extra/{PROGRAM_EXTRA}")]
            if not names:
                raise ArtifactError(
                    f"{path.name} holds no {PROGRAM_EXTRA}: it is not a program written by compile_model; re-run the compile"
                )
            return json.loads(archive.read(names[0]))
    except (zipfile.BadZipFile, OSError, json.JSONDecodeError, EOFError) as error:
        raise ArtifactError(
            f"{path.name} could not be read as a torch.export program ({type(error).__name__}: {str(error)[:120]}); "
            "the file is truncated or not a .pt2 written by compile_model: re-run the compile"
        ) from error


def load_program(path: Path) -> tuple[torch.export.ExportedProgram, dict]:
    """An exported program and the metadata compile_model stored inside it."""
    meta = read_program_meta(path)
    try:
        program = torch.export.load(path)
    except Exception as error:  # whatever torch raises on a damaged archive member
        raise ArtifactError(
            f"{path.name} could not be read as a torch.export program ({type(error).__name__}: {str(error)[:120]}); "
            "the file is damaged or was written by another torch version: re-run the compile"
        ) from error
    return program, meta


def check_weights_file(path: Path, expected: Mapping[str, list], config_sha: str, expected_from: str) -> None:
    """Check a weights file's header (not its data) against the expected tensors and config."""
    _require(path, "the device weights (safetensors)")
    found, metadata = safetensors_header(path)
    sha = metadata.get("config_sha")
    if sha is not None and sha != config_sha:
        raise ArtifactError(
            f"{path.name} was saved for config {sha}, but {expected_from} was compiled for config {config_sha}: "
            "programs and weights come from different models; use the files one compile_model run wrote together"
        )
    check_tensor_specs(found, expected, path.name, expected_from)


def open_weights(path: Path, names) -> dict[str, torch.Tensor]:
    """Memory-map the tensors ``names`` of a (checked) weights file.

    safetensors maps the file: tensors are views of the page cache, read from disk only when
    touched, so opening costs no host memory until the weights are used.
    """
    with safe_open(str(path), framework="pt") as handle:
        return {name: handle.get_tensor(name) for name in names}


@dataclass
class Artifact:
    """A loaded artifact: programs, memory-mapped weights, and the manifest they were checked against."""

    folder: Path
    manifest: dict
    programs: dict[str, torch.export.ExportedProgram]
    weights: dict[str, torch.Tensor]

    @property
    def shapes(self) -> StepShapes:
        return StepShapes(**self.manifest["shapes"])

    @property
    def dtype(self) -> torch.dtype:
        return getattr(torch, self.manifest["dtype"])

    def config(self):
        from transformers import Gemma4TextConfig

        return Gemma4TextConfig.from_dict(self.manifest["config"])

    def runner(self, embed: Callable[[torch.Tensor], torch.Tensor]) -> StepRunner:
        return StepRunner(
            prefill=self.programs["prefill"].module(), decode=self.programs["decode"].module(), embed=embed,
            weights=self.weights, kv_shapes=[tuple(s) for s in self.manifest["kv_cache"]], dtype=self.dtype,
            shapes=self.shapes, pad_token_id=self.manifest["config"].get("pad_token_id") or 0,
        )


def check_artifact(folder: str | Path) -> dict:
    """Check an artifact folder without loading it; return its manifest.

    Each failure is an ``ArtifactError`` naming the file: manifest missing or of another format;
    a program missing, truncated, compiled for another config or expecting other weights; the
    weights file missing, truncated, saved for another config, or with other tensor names,
    shapes or dtypes than the programs take.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise ArtifactNotFoundError(
            f"artifact folder {folder.name}/ not found: expected the folder compile_model writes "
            "(notebook 04 writes it under artifacts/); run the compile first"
        )
    manifest = read_manifest(folder)
    sha = manifest["config_sha"]
    expected = manifest["weights"]["tensors"]
    for entry in manifest["programs"].values():
        meta = read_program_meta(folder / entry["file"])
        if meta.get("config_sha") != sha:
            raise ArtifactError(
                f"{entry['file']} was compiled for config {meta.get('config_sha')}, {MANIFEST} describes config {sha}: "
                "the folder mixes files of two compile runs; re-run compile_model into an empty folder"
            )
        check_tensor_specs(meta["weights"], expected, entry["file"], MANIFEST)
    files = manifest["weights"]["files"]
    if len(files) != 1:
        raise ArtifactError(f"{MANIFEST} lists {len(files)} weight files; the cpu loader reads one (TP=1)")
    check_weights_file(folder / files[0], expected, sha, f"{PROGRAM_FILES['decode']} / {MANIFEST}")
    return manifest


def load_artifact(folder: str | Path) -> Artifact:
    """Check (``check_artifact``), then load the programs and memory-map the weights."""
    folder = Path(folder)
    manifest = check_artifact(folder)
    programs = {name: load_program(folder / entry["file"])[0] for name, entry in manifest["programs"].items()}
    weights = open_weights(folder / manifest["weights"]["files"][0], manifest["weights"]["tensors"])
    return Artifact(folder=folder, manifest=manifest, programs=programs, weights=weights)


def host_embedding_path(folder: str | Path) -> Path:
    return _require(Path(folder) / HOST_EMBEDDING_FILE, "the host embedding table with its scale (safetensors)")
