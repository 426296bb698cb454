"""Compile a Gemma-4 model into two static-shape steps (notebook 04): ``DeviceBody`` takes the
weights and the KV cache as inputs, so the ``torch.export`` programs hold none; ``compile_model``
writes the weights beside them (see ``artifact``)."""

import json
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import transformers
from torch import nn
from transformers.cache_utils import StaticCache, StaticLayer

from gemma_nb import artifact
from gemma_nb.artifact import (
    StepRunner,
    StepShapes,
    config_fingerprint,
    kv_cache_shapes,
    new_kv_cache,
)
from gemma_nb.artifact import check_artifact as check_artifact
from gemma_nb.artifact import host_embedding_path as host_embedding_path
from gemma_nb.artifact import layer_kv_heads as layer_kv_heads
from gemma_nb.artifact import load_artifact as load_artifact
from gemma_nb.embedding import HostEmbedding, dtype_name
from gemma_nb.metrics import write_json_atomic
from gemma_nb.paths import fresh_dir


def check_exportable_config(config) -> None:
    """Refuse Gemma-4 variants the two-step body does not cover (not the 26B's architecture)."""
    if getattr(config, "hidden_size_per_layer_input", 0):
        raise ValueError(
            f"hidden_size_per_layer_input={config.hidden_size_per_layer_input}: per-layer "
            "embeddings need token ids inside the graph, which this host-embedding body does "
            "not take; the 26B has 0"
        )
    if getattr(config, "num_kv_shared_layers", 0):
        raise ValueError(
            f"num_kv_shared_layers={config.num_kv_shared_layers}: KV sharing is not supported by "
            "the static-cache body; the 26B has 0"
        )


def set_traceable_experts(model: nn.Module) -> str:
    """Switch transformers' ``eager`` experts (a data-dependent loop) to ``grouped_mm``, unless
    already traceable; return it."""
    # what torch.export traces
    if getattr(model.config, "_experts_implementation", None) not in (
        "grouped_mm",
        "batched_mm",
    ):
        model.set_experts_implementation("grouped_mm")
    return model.config._experts_implementation


def device_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """The state dict (parameters, persistent buffers) without the host's embedding table; a tied
    lm_head keeps its name."""
    weights = dict(model.state_dict())  # torch.export's input spec tells a dict from an OrderedDict
    weights.pop(artifact.HOST_EMBEDDING_KEY, None)
    return weights


def _bound_static_cache(config, kv: list[torch.Tensor], start: torch.Tensor, max_cache_len: int):
    """A transformers ``StaticCache`` whose layers write into the caller's ``kv`` tensors."""
    cache = StaticCache(config=config, max_cache_len=max_cache_len)
    cache.layers = []
    for keys, values in zip(kv[0::2], kv[1::2]):
        layer = StaticLayer(max_cache_len)
        layer.device = keys.device
        layer.batch_size, layer.num_heads = keys.shape[0], keys.shape[1]
        layer.k_head_dim, layer.v_head_dim = keys.shape[-1], values.shape[-1]
        layer.keys, layer.values = keys, values
        # Each layer advances its own counter in place; a copy keeps the caller's tensor untouched.
        layer.cumulative_length = start.reshape(()).clone()
        layer.is_initialized = True
        cache.layers.append(layer)
    return cache


class DeviceBody(nn.Module):
    """One step without the embedding: ``forward(weights, kv, inputs_embeds, start, last_index) ->
    logits`` fp32. ``kv`` is written in place from ``start``; the model is held outside the module
    tree, so a program owns no weights."""

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
            tie_weights=True,
            strict=False,
            kwargs=dict(
                inputs_embeds=inputs_embeds, cache=cache, use_cache=True, logits_to_keep=last_index
            ),
        )
        return out.logits[:, -1, :].float()


def _float_dtype(weights: Mapping[str, torch.Tensor]) -> torch.dtype:
    """The activation dtype: the norms' (int8 tensors excluded)."""
    floats = [
        (name, tensor.dtype) for name, tensor in weights.items() if tensor.is_floating_point()
    ]
    assert floats, "no floating-point weight: expected a Gemma-4 model's parameters"
    return next((dtype for name, dtype in floats if name.endswith("norm.weight")), floats[0][1])


def export_steps(
    model: nn.Module, shapes: StepShapes | None = None
) -> dict[str, torch.export.ExportedProgram]:
    """``torch.export`` the prefill (``shapes.prefill_len`` tokens) and decode (1 token) steps;
    neither holds weights."""
    shapes = shapes or StepShapes()
    set_traceable_experts(model)
    body = DeviceBody(model, shapes.max_cache_len)
    weights = device_weights(model)
    dtype = _float_dtype(weights)
    programs = {}
    with torch.no_grad():
        for name, tokens in (("prefill", shapes.prefill_len), ("decode", 1)):
            kv = new_kv_cache(kv_cache_shapes(model.config, shapes.max_cache_len), dtype)
            embeds = torch.zeros(1, tokens, model.config.hidden_size, dtype=dtype)
            inputs = (
                weights,
                kv,
                embeds,
                torch.zeros(1, dtype=torch.long),
                torch.tensor([tokens - 1]),
            )
            program = programs[name] = torch.export.export(body, inputs, strict=False)
            # Export keeps its example inputs (here: every weight) to save them with the program.
            program._example_inputs = None
    return programs


def _runner(model: nn.Module, prefill, decode, shapes: StepShapes) -> StepRunner:
    weights = device_weights(model)
    return StepRunner(
        prefill=prefill,
        decode=decode,
        embed=model.get_input_embeddings(),
        weights=weights,
        kv_shapes=kv_cache_shapes(model.config, shapes.max_cache_len),
        dtype=_float_dtype(weights),
        shapes=shapes,
        pad_token_id=model.config.pad_token_id or 0,
    )


def exported_runner(
    model: nn.Module, programs: Mapping[str, torch.export.ExportedProgram], shapes: StepShapes
) -> StepRunner:
    """A runner over freshly exported ``programs`` with ``model``'s own weights and embedding."""
    return _runner(model, programs["prefill"].module(), programs["decode"].module(), shapes)


@dataclass
class CompileReport:
    """What ``compile_model`` wrote and how long each part took."""

    folder: Path
    export_s: float
    save_s: float
    program_bytes: dict[str, int]
    weights_bytes: int
    host_embedding_bytes: int
    params: int  # elements of distinct storages: a tied table counted once, int8 copies counted
    config_sha: str
    programs: dict = field(default_factory=dict, repr=False)  # the exported programs, in memory

    def as_dict(self) -> dict:
        return {
            "export_s": self.export_s,
            "save_s": self.save_s,
            "params": self.params,
            "program_bytes": sum(self.program_bytes.values()),
            "weights_bytes": self.weights_bytes,
            "host_embedding_bytes": self.host_embedding_bytes,
            "config_sha": self.config_sha,
        }


def experts_implementation(model: nn.Module) -> str:
    """What computes the routed experts: a replacing module's class, else transformers'
    ``_experts_implementation``."""
    names = {type(m).__name__ for m in model.modules() if type(m).__name__.endswith("Experts")}
    replaced = sorted(names - {"Gemma4TextExperts"})
    return (
        ", ".join(replaced)
        if replaced
        else str(getattr(model.config, "_experts_implementation", None))
    )


def _manifest(
    model, folder: Path, shapes: StepShapes, weights, host, program_bytes, sha, scheme, reference
) -> dict:
    config = model.config
    return {
        "format": artifact.FORMAT,
        "config_sha": sha,
        "config": json.loads(config.to_json_string(use_diff=False)),
        "dtype": dtype_name(_float_dtype(weights)),
        "scheme": scheme,
        "experts_implementation": experts_implementation(model),
        "shapes": asdict(shapes),
        "kv_cache": [list(s) for s in kv_cache_shapes(config, shapes.max_cache_len)],
        "programs": {
            name: {"file": artifact.PROGRAM_FILES[name], "bytes": size}
            for name, size in program_bytes.items()
        },
        "weights": {
            "tp_degree": 1,
            "files": [artifact.WEIGHTS_FILE],
            "bytes": (folder / artifact.WEIGHTS_FILE).stat().st_size,
            "tensors": artifact.tensor_specs(weights),
        },
        "host_embedding": {
            "file": artifact.HOST_EMBEDDING_FILE,
            "shape": list(host.weight.shape),
            "dtype": dtype_name(host.weight.dtype),
            "bytes": (folder / artifact.HOST_EMBEDDING_FILE).stat().st_size,
        },
        "reference": reference,
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
    }


def compile_model(
    model: nn.Module,
    folder: str | Path,
    shapes: StepShapes | None = None,
    scheme: str | None = None,
    reference_tokens: dict | None = None,
) -> CompileReport:
    """Export ``model``'s two steps and write the artifact folder: manifest, programs, weights, host
    embedding. ``scheme``: the quantization already applied (recorded); ``reference_tokens``:
    {"prompt", "tokens"} to check."""
    shapes = shapes or StepShapes()
    # a partial run hard-links the previous artifacts: never write through one
    folder = fresh_dir(folder)
    sha = config_fingerprint(model.config)
    start = time.perf_counter()
    programs = export_steps(model, shapes)
    export_s = time.perf_counter() - start
    start = time.perf_counter()
    weights = device_weights(model)
    artifact.save_weights(weights, folder / artifact.WEIGHTS_FILE, sha)
    host = HostEmbedding.from_model(model)
    host.save(folder / artifact.HOST_EMBEDDING_FILE)
    program_meta = json.dumps(
        {"format": artifact.FORMAT, "config_sha": sha, "weights": artifact.tensor_specs(weights)}
    )
    program_bytes = {}
    for name, program in programs.items():
        path = folder / artifact.PROGRAM_FILES[name]
        torch.export.save(program, path, extra_files={artifact.PROGRAM_EXTRA: program_meta})
        program_bytes[name] = path.stat().st_size
    save_s = time.perf_counter() - start
    manifest = _manifest(
        model, folder, shapes, weights, host, program_bytes, sha, scheme, reference_tokens
    )
    write_json_atomic(folder / artifact.MANIFEST, manifest)
    return CompileReport(
        folder=folder,
        export_s=export_s,
        save_s=save_s,
        program_bytes=program_bytes,
        weights_bytes=manifest["weights"]["bytes"],
        host_embedding_bytes=manifest["host_embedding"]["bytes"],
        params=sum(
            {
                (t.untyped_storage().data_ptr(), t.storage_offset()): t.numel()
                for t in [*weights.values(), host.weight]
            }.values()
        ),
        config_sha=sha,
        programs=programs,
    )
