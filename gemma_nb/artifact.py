"""The cpu target's compiled artifact (notebook 04), written by ``gemma_nb.export.compile_model``:
its files, the checks ``load_artifact`` makes before torch reads them (``ArtifactError`` names a
missing, truncated or bad one), the greedy loop."""

import hashlib
import json
import zipfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from transformers import Gemma4TextConfig
from transformers.configuration_utils import get_head_shapes

from gemma_nb.embedding import dtype_name

FORMAT = "gemma-nb.exported-steps/2"
MANIFEST = "manifest.json"
PROGRAM_FILES = {"prefill": "prefill.pt2", "decode": "decode.pt2"}
HOST_EMBEDDING_FILE = "embed_tokens.safetensors"
HOST_EMBEDDING_KEY = "model.embed_tokens.weight"
PROGRAM_EXTRA = "gemma_nb_program.json"
WEIGHTS_FILE = "tp0_weights.safetensors"  # named as NxD names rank 0's file


class ArtifactError(ValueError):
    """A compiled artifact (cpu or neuron) or one of its files that is missing, truncated, of
    another format or does not match."""


class ArtifactNotFoundError(ArtifactError, FileNotFoundError):
    """A file of the artifact does not exist (also a FileNotFoundError)."""


def layer_kv_heads(config) -> list[tuple[int, int]]:
    """Per layer, (KV heads, head_dim) as transformers builds the cache (sliding and full layers
    differ)."""
    heads, dims = (
        [v] * config.num_hidden_layers if isinstance(v, int) else list(v)
        for v in get_head_shapes(config)
    )
    return list(zip(heads, dims))


def kv_cache_shapes(config, max_cache_len: int) -> list[tuple[int, ...]]:
    """Keys then values per layer, ``[1, kv_heads, max_len, head_dim]``; sliding layers get the full
    length."""
    return [
        (1, heads, max_cache_len, dim) for heads, dim in layer_kv_heads(config) for _ in range(2)
    ]


def new_kv_cache(shapes, dtype: torch.dtype) -> list[torch.Tensor]:
    return [torch.zeros(shape, dtype=dtype) for shape in shapes]


@dataclass
class StepShapes:
    """The static shapes both programs are built for; they decode one sequence."""

    max_cache_len: int = 128
    prefill_len: int = 32

    def __post_init__(self) -> None:
        for key, value in vars(self).items():
            assert isinstance(value, int) and not isinstance(value, bool) and value >= 1, (
                f"{key}={value!r}"
            )
        assert self.prefill_len <= self.max_cache_len, (
            f"prefill_len={self.prefill_len} > max_cache_len"
        )


Step = Callable[..., torch.Tensor]


@dataclass
class StepRunner:
    """Greedy decoding with a prefill step and a decode step that share one KV cache. ``prefill`` /
    ``decode`` take ``export.DeviceBody``'s arguments; ``embed``: ids [1, S] -> inputs_embeds."""

    prefill: Step
    decode: Step
    embed: Callable[[torch.Tensor], torch.Tensor]
    weights: Mapping[str, torch.Tensor]
    kv_shapes: list[tuple[int, ...]]
    dtype: torch.dtype
    shapes: StepShapes
    pad_token_id: int = 0

    @torch.inference_mode()
    def generate(
        self, input_ids, max_new_tokens: int, eos_token_id: int | None = None
    ) -> torch.Tensor:
        """Prompt plus greedy continuation, LongTensor [1, S + n] (n <= max_new_tokens; stops after
        eos)."""
        ids = torch.as_tensor(input_ids, dtype=torch.long)
        ids = ids[None] if ids.dim() == 1 else ids
        if (
            isinstance(max_new_tokens, bool)
            or not isinstance(max_new_tokens, int)
            or max_new_tokens < 0
        ):
            raise ValueError(f"max_new_tokens={max_new_tokens!r} must be a non-negative integer")
        if ids.dim() != 2 or ids.shape[0] != 1 or ids.shape[1] == 0:
            raise ValueError(
                f"input_ids of shape {tuple(ids.shape)}; expected one unpadded prompt [S] or [1, S]"
            )
        prompt = ids.shape[1]
        if prompt > self.shapes.prefill_len:
            raise ValueError(
                f"prompt of {prompt} tokens exceeds the prefill bucket of "
                f"{self.shapes.prefill_len}: shorten the prompt or compile with a larger "
                "StepShapes(prefill_len=...)"
            )
        if prompt + max_new_tokens - 1 > self.shapes.max_cache_len:
            raise ValueError(
                f"{prompt} prompt + {max_new_tokens} new tokens need "
                f"{prompt + max_new_tokens - 1} cache slots, more than "
                f"max_cache_len={self.shapes.max_cache_len}: ask for fewer tokens or compile "
                "with a larger StepShapes(max_cache_len=...)"
            )
        if max_new_tokens == 0:
            return ids
        kv = new_kv_cache(self.kv_shapes, self.dtype)
        padded = torch.nn.functional.pad(
            ids, (0, self.shapes.prefill_len - prompt), value=self.pad_token_id
        )
        # The padding slots past the prompt are overwritten by decode steps before any query attends
        # to them.
        logits = self.prefill(
            self.weights, kv, self.embed(padded), torch.tensor([0]), torch.tensor([prompt - 1])
        )
        tokens = [int(logits.argmax(-1))]
        while len(tokens) < max_new_tokens and tokens[-1] != eos_token_id:
            # The token just generated sits at position prompt + len(tokens) - 1 (transformers'
            # recipe feeds it one further).
            logits = self.decode(
                self.weights,
                kv,
                self.embed(torch.tensor([[tokens[-1]]])),
                torch.tensor([prompt + len(tokens) - 1]),
                torch.tensor([0]),
            )
            tokens.append(int(logits.argmax(-1)))
        return torch.cat([ids, torch.tensor([tokens])], dim=1)


def config_fingerprint(config) -> str:
    """sha256 (first 16 hex digits) of the config's JSON: ties programs and weights to one model."""
    data = json.loads(config.to_json_string(use_diff=False))
    for volatile in (
        "transformers_version",
        "_name_or_path",
        "_experts_implementation",
        "_attn_implementation",
        "dtype",
        "torch_dtype",
        "architectures",
    ):
        data.pop(volatile, None)
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


# name -> [shape, dtype name]
def tensor_specs(weights: Mapping[str, torch.Tensor]) -> dict[str, list]:
    return {name: [list(t.shape), dtype_name(t.dtype)] for name, t in weights.items()}


def save_weights(weights: Mapping[str, torch.Tensor], path: str | Path, config_sha: str) -> Path:
    """Write the device weights (one rank, TP=1) as safetensors, tagged with the config they belong
    to."""
    meta = {"format": FORMAT, "config_sha": config_sha, "rank": "0", "tp_degree": "1"}
    save_file({k: v.contiguous() for k, v in weights.items()}, str(path), metadata=meta)
    return Path(path)


def _require(path: Path, what: str) -> Path:
    if not path.is_file():
        raise ArtifactNotFoundError(
            f"{path.name} not found in {path.parent.name}/: expected {what}, written by "
            "gemma_nb.export.compile_model (notebook 04); re-run the compile"
        )
    return path


_SAFETENSORS_DTYPES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
}


def check_tensor_specs(
    found: Mapping[str, list], expected: Mapping[str, list], file_name: str, expected_from: str
) -> None:
    """ArtifactError naming ``file_name`` if its tensor names, shapes or dtypes differ."""
    missing = sorted(set(expected) - set(found))
    extra = sorted(set(found) - set(expected))
    if missing or extra:
        parts = [
            f"{what} {len(names)} tensor(s) {names[:3]}{' ...' if len(names) > 3 else ''}"
            for what, names in (("missing", missing), ("unexpected", extra))
            if names
        ]
        raise ArtifactError(
            f"{file_name} does not hold the tensors {expected_from} expects: {'; '.join(parts)}. "
            "Were the weights saved from another model? Re-run compile_model for this model"
        )
    for name, spec in expected.items():
        if [list(found[name][0]), found[name][1]] != [list(spec[0]), spec[1]]:
            raise ArtifactError(
                f"{file_name}: tensor {name!r} is {found[name][1]} {tuple(found[name][0])}, "
                f"{expected_from} expects {spec[1]} {tuple(spec[0])}: programs and weights come "
                "from different configs; use the files one compile_model run wrote together"
            )


def _unreadable(path: Path, error: BaseException, why: str) -> ArtifactError:
    return ArtifactError(
        f"{path.name} could not be read as a torch.export program ({type(error).__name__}: "
        f"{str(error)[:120]}); the file is {why}: re-run the compile"
    )


def read_program_meta(path: Path) -> dict:
    """The metadata compile_model stored inside an exported program, read from its zip directory
    only."""
    _require(path, f"the exported {path.stem} program (torch.export .pt2)")
    try:
        with zipfile.ZipFile(path) as archive:
            names = [n for n in archive.namelist() if n.endswith(f"/extra/{PROGRAM_EXTRA}")]
            if not names:
                raise ArtifactError(
                    f"{path.name} holds no {PROGRAM_EXTRA}: it is not a program written by "
                    "compile_model; re-run the compile"
                )
            return json.loads(archive.read(names[0]))
    except (zipfile.BadZipFile, OSError, json.JSONDecodeError, EOFError) as error:
        raise _unreadable(
            path, error, "truncated or not a .pt2 written by compile_model"
        ) from error


def load_program(path: Path) -> tuple[torch.export.ExportedProgram, dict]:
    meta = read_program_meta(path)
    try:
        return torch.export.load(path), meta
    except Exception as error:  # whatever torch raises on a damaged archive member
        raise _unreadable(path, error, "damaged or was written by another torch version") from error


def check_weights_file(
    path: Path, expected: Mapping[str, list], config_sha: str, expected_from: str
) -> None:
    """Check a weights file's header (not its data) against the expected tensors and config."""
    _require(path, "the device weights (safetensors)")
    size = path.stat().st_size
    if size < 8:
        raise ArtifactError(
            f"{path.name} is {size} bytes: too short to be a safetensors file (expected an "
            "8-byte header length)"
        )
    try:
        with safe_open(str(path), framework="pt") as handle:
            metadata = handle.metadata() or {}
            slices = {name: handle.get_slice(name) for name in handle.keys()}
            found = {
                name: [list(s.get_shape()), _SAFETENSORS_DTYPES.get(s.get_dtype(), s.get_dtype())]
                for name, s in slices.items()
            }
    except SafetensorError as error:
        if "not fully covered" in str(error):
            raise ArtifactError(
                f"{path.name} is truncated: {size} bytes on disk, its header describes more "
                f"({error}); copy or download the file again"
            ) from error
        raise ArtifactError(
            f"{path.name} is not a readable safetensors file ({error}); expected a safetensors file"
        ) from error
    sha = metadata.get("config_sha")
    if sha is not None and sha != config_sha:
        raise ArtifactError(
            f"{path.name} was saved for config {sha}, but {expected_from} was compiled for "
            f"config {config_sha}: programs and weights come from different models; use the "
            "files one compile_model run wrote together"
        )
    check_tensor_specs(found, expected, path.name, expected_from)


@dataclass
class Artifact:
    """A loaded artifact: programs, memory-mapped weights, and the manifest they were checked
    against."""

    manifest: dict
    programs: dict[str, torch.export.ExportedProgram]
    weights: dict[str, torch.Tensor]

    def config(self):
        return Gemma4TextConfig.from_dict(self.manifest["config"])

    def runner(self, embed: Callable[[torch.Tensor], torch.Tensor]) -> StepRunner:
        return StepRunner(
            prefill=self.programs["prefill"].module(),
            decode=self.programs["decode"].module(),
            embed=embed,
            weights=self.weights,
            kv_shapes=[tuple(s) for s in self.manifest["kv_cache"]],
            dtype=getattr(torch, self.manifest["dtype"]),
            shapes=StepShapes(**self.manifest["shapes"]),
            pad_token_id=self.manifest["config"].get("pad_token_id") or 0,
        )


def check_artifact(folder: str | Path) -> dict:
    """Check an artifact folder without loading it (manifest, programs, weights header); return its
    manifest."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ArtifactNotFoundError(
            f"artifact folder {folder.name}/ not found: expected the folder compile_model writes "
            "(notebook 04 writes it under artifacts/); run the compile first"
        )
    path = _require(folder / MANIFEST, "the artifact manifest (JSON)")
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ArtifactError(
            f"{path.name} is not valid JSON ({error}); expected the manifest compile_model writes"
        ) from error
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise ArtifactError(f"{path.name} has format {found!r}; expected {FORMAT!r}")
    sha = manifest["config_sha"]
    expected = manifest["weights"]["tensors"]
    for entry in manifest["programs"].values():
        meta = read_program_meta(folder / entry["file"])
        if meta.get("config_sha") != sha:
            raise ArtifactError(
                f"{entry['file']} was compiled for config {meta.get('config_sha')}, {MANIFEST} "
                f"describes config {sha}: the folder mixes files of two compile runs; re-run "
                "compile_model into an empty folder"
            )
        check_tensor_specs(meta["weights"], expected, entry["file"], MANIFEST)
    files = manifest["weights"]["files"]
    if len(files) != 1:
        raise ArtifactError(
            f"{MANIFEST} lists {len(files)} weight files; the cpu loader reads one (TP=1)"
        )
    check_weights_file(folder / files[0], expected, sha, f"{PROGRAM_FILES['decode']} / {MANIFEST}")
    return manifest


def load_artifact(folder: str | Path) -> Artifact:
    folder = Path(folder)
    manifest = check_artifact(folder)
    programs = {
        name: load_program(folder / entry["file"])[0]
        for name, entry in manifest["programs"].items()
    }
    # memory-mapped: read from disk only when touched
    with safe_open(str(folder / manifest["weights"]["files"][0]), framework="pt") as handle:
        weights = {name: handle.get_tensor(name) for name in manifest["weights"]["tensors"]}
    return Artifact(manifest=manifest, programs=programs, weights=weights)


def host_embedding_path(folder: str | Path) -> Path:
    return _require(
        Path(folder) / HOST_EMBEDDING_FILE, "the host embedding table with its scale (safetensors)"
    )
