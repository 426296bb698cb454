"""The port's compile (notebook 04): transformers' Gemma-4 with NxD's int8 TP layers, traced by
ModelBuilder v1. The host embeds and softcaps; the KV cache is aliased device state.
``NeuronGemma4(parallel=False)``: the graph at TP=1. ``python -m gemma_nb.neuron.build BUILD_JSON``
compiles one build in its own process (``runs.compile_builds``) and prints its record."""

import json
import sys
import time
from dataclasses import asdict, dataclass
from importlib.metadata import distributions
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import Gemma4ForCausalLM

from gemma_nb.export import check_exportable_config, layer_kv_heads
from gemma_nb.formats import quantize_int8_per_channel
from gemma_nb.neuron.build_folder import DECODE_PATHS, MODEL_FILE, finish_artifact
from gemma_nb.neuron.checkpoint import read_hf_state, text_config
from gemma_nb.neuron.expert_mlps import (
    NeuronDenseExperts,
    NeuronSparseExperts,
    experts_checkpoint,
    int8_kwargs,
)
from gemma_nb.neuron.lm_head import build_lm_head, lm_head_state_dict
from gemma_nb.neuron.quantized_dtypes import patch_scale_dequantize
from gemma_nb.neuron.sdk import import_sdk
from gemma_nb.paths import fresh_dir
from gemma_nb.peak_rss import HostMemorySampler

# Both builds: NxD's default --auto-cast=none (the router's softmax, the int8 scales and the
# all-reduce stay fp32), so notebook 07's dense/sparse ratio is the experts' alone. The port
# compiled its dense build with --auto-cast all --auto-cast-type bf16; notebook 05 measures what
# that does to the router.
COMPILER_ARGS = "--model-type transformer --auto-cast=none -O1"
# bf16's most negative finite value: fp32's min rounds to -inf in bf16, and a fully masked row's
# softmax is NaN.
MASK_MIN = torch.finfo(torch.bfloat16).min
KV_STATE_PREFIXES = ("k_cache.", "v_cache.")
CONVERTED_FILE = "checkpoint_int8.safetensors"  # in NeuronBuildConfig.scratch_dir()
KV_DTYPES = ("float32", "bfloat16")
RECORDED_VERSIONS = ("neuronx-cc", "torch-neuronx", "neuronx-distributed", "torch", "transformers")


@dataclass
class NeuronBuildConfig:
    """What one compile is built for; recorded next to the artifact."""

    model_dir: str
    output_dir: str
    tp_degree: int = 2
    max_len: int = 512  # static KV cache length
    bucket: int = 128  # prefill bucket
    compiler_args: str = COMPILER_ARGS
    compiler_workdir: str = ""  # default: <output_dir>/compiler_workdir/nxd
    dtype: str = "bfloat16"
    decode_experts: str = "dense"  # the decode graph beside the dense prefill
    kv_dtype: str = "float32"  # the KV state's: the port's float32, or NxD Inference's bfloat16

    def __post_init__(self) -> None:
        assert self.kv_dtype in KV_DTYPES, f"kv_dtype={self.kv_dtype!r} is not one of {KV_DTYPES}"
        if self.decode_experts not in DECODE_PATHS:
            raise ValueError(
                f"decode_experts={self.decode_experts!r} is not one of {', '.join(DECODE_PATHS)}: "
                "one artifact per decode path (compile twice for both)"
            )
        self.compiler_workdir = self.compiler_workdir or str(self.scratch_dir() / "nxd")
        assert 1 <= self.tp_degree and self.bucket <= self.max_len, (
            f"tp_degree={self.tp_degree}, bucket={self.bucket}, max_len={self.max_len}"
        )

    # what only the compile box keeps: NxD's workdir, the int8 checkpoint (rsync leaves it behind)
    def scratch_dir(self) -> Path:
        return Path(self.output_dir) / "compiler_workdir"

    def graph_keys(self) -> dict[str, str]:  # ModelBuilder key -> experts module of that graph
        return {"prefill": "dense", f"decode_{self.decode_experts}": self.decode_experts}

    # the graph a prefill (S = bucket) and a decode (S = 1) reach
    def routed_graphs(self) -> dict[str, str]:
        return {"prefill": "prefill", "decode": f"decode_{self.decode_experts}"}


def step_inputs(
    embeds: torch.Tensor,
    positions: list[int],
    max_len: int,
    sliding_window: int,
    last_index: int | None = None,
) -> tuple[torch.Tensor, ...]:
    """The graph's inputs for ``embeds`` [1, S, H] at ``positions``: (embeds, position_ids int32
    [1, S], full and sliding additive masks [1, 1, S, MAX], last_index [1] int32)."""
    tokens = embeds.shape[1]
    assert len(positions) == tokens and max(positions) < max_len, (positions, tokens, max_len)
    # int32, as NxD Inference traces: no native int64
    pos = torch.tensor(positions, dtype=torch.int32)
    slots = torch.arange(max_len)
    visible = slots[None, :] <= pos[:, None]  # [S, MAX]
    in_window = slots[None, :] > pos[:, None] - sliding_window
    full = torch.where(visible, 0.0, MASK_MIN)[None, None]
    sliding = torch.where(visible & in_window, 0.0, MASK_MIN)[None, None]
    last = torch.tensor([tokens - 1 if last_index is None else last_index], dtype=torch.int32)
    return embeds.float(), pos[None], full, sliding, last


def write_positions(cache: torch.Tensor, new: torch.Tensor, position_ids) -> torch.Tensor:
    """``cache`` [1, h, MAX, d] with ``new`` [1, h, S, d] written at ``position_ids`` [1, S]: XLA
    lowers it to a scatter of S slots, done in place when the result aliases ``cache`` (NxD
    Inference updates its cache the same way), so a decode step writes one slot, not the cache."""
    return cache.index_copy(2, position_ids[0].long(), new.to(cache.dtype))


class PositionCache:
    """The cache transformers' attention calls: each layer's K/V (fresh lists of the states) with
    the step's positions written (``write_positions``)."""

    is_compileable = False

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor], position_ids):
        self.keys, self.values, self.position_ids = keys, values, position_ids

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        for states, new in ((self.keys, key_states), (self.values, value_states)):
            states[layer_idx] = write_positions(states[layer_idx], new, self.position_ids)
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        return keys.to(key_states.dtype), values.to(value_states.dtype)


class NeuronGemma4(nn.Module):
    """transformers' Gemma-4 with the port's swaps (``parallel=True``: NxD layers from ``sdk``) and
    an aliased KV state: (embeds, position_ids, full_mask, sliding_mask, last_index) -> (logits
    [1, 1, V] before softcap, *new K, *new V)."""

    def __init__(
        self,
        config,
        build: NeuronBuildConfig,
        parallel: bool = True,
        sdk=None,
        experts: str = "dense",
    ):
        super().__init__()
        assert experts in DECODE_PATHS, experts
        check_exportable_config(config)
        config = config.__class__.from_dict(config.to_dict())
        config.final_logit_softcapping = None  # applied on the host, after the vocab gather
        config._attn_implementation = "eager"
        tp = build.tp_degree if parallel else 1
        dtype = getattr(torch, build.dtype)
        if parallel:
            # on the meta device: the layers swapped for NxD ones are never allocated whole on the
            # host
            with torch.device("meta"):
                self.lm = Gemma4ForCausalLM(config).to(dtype)
            _swap_in_nxd_layers(self.lm, config, tp, dtype, sdk, experts)
            _materialize(self.lm, config)
        else:
            assert experts == "dense", "parallel=False keeps transformers' own experts"
            self.lm = Gemma4ForCausalLM._from_config(config, dtype=dtype)
        # no table and no forward: the host embeds, the graph takes inputs_embeds
        self.lm.model.embed_tokens = nn.Module()
        self.lm.eval()
        # per layer, one rank's KV state: [1, kv_heads / TP, max_len, head_dim]
        heads = layer_kv_heads(config)
        assert all(h % tp == 0 for h, _ in heads), f"KV heads do not split over tp_degree={tp}"
        shapes = [(1, h // tp, build.max_len, d) for h, d in heads]
        kv_dtype = getattr(torch, build.kv_dtype)
        self.k_cache = nn.ParameterList(
            [nn.Parameter(torch.zeros(s, dtype=kv_dtype), requires_grad=False) for s in shapes]
        )
        self.v_cache = nn.ParameterList(
            [nn.Parameter(torch.zeros(s, dtype=kv_dtype), requires_grad=False) for s in shapes]
        )

    def input_output_aliases(self) -> dict:
        """State tensor -> output index: logits are output 0, then every K, then every V."""
        return {p: 1 + i for i, p in enumerate([*self.k_cache, *self.v_cache])}

    def forward(self, embeds, position_ids, full_mask, sliding_mask, last_index):
        cache = PositionCache(list(self.k_cache), list(self.v_cache), position_ids)
        dtype = next(p for n, p in self.lm.named_parameters() if n.endswith("norm.weight")).dtype
        masks = {"full_attention": full_mask.to(dtype), "sliding_attention": sliding_mask.to(dtype)}
        out = self.lm(
            inputs_embeds=embeds.to(dtype),
            position_ids=position_ids,
            cache=cache,
            use_cache=True,
            attention_mask=masks,
            logits_to_keep=last_index,
        )
        return (out.logits.float(), *cache.keys, *cache.values)

    def load_state(self, state_dict: dict) -> None:
        """Load a plain (TP=1, unquantized) state dict into the cpu variant, buffers included."""
        state_dict = {k: v for k, v in state_dict.items() if not k.startswith("model.embed_tokens")}
        missing, unexpected = self.lm.load_state_dict(state_dict, strict=False)
        assert not missing and not unexpected, (missing[:3], unexpected[:3])


def _materialize(lm: nn.Module, config) -> None:
    """Give untagged meta tensors cpu storage (NxD's tagged ones stay for sharding); rebuild the
    rotary tables."""
    for module in lm.modules():
        for registry in (module._parameters, module._buffers):
            for name, tensor in list(registry.items()):
                if tensor is None or not tensor.is_meta or hasattr(tensor, "tensor_model_parallel"):
                    continue
                fresh = torch.empty(tensor.shape, dtype=tensor.dtype)
                if registry is module._parameters:
                    fresh = type(tensor)(fresh, requires_grad=False)
                    fresh.__dict__.update(tensor.__dict__)
                registry[name] = fresh
    lm.model.rotary_emb = type(lm.model.rotary_emb)(config)


def _swap_in_nxd_layers(lm: nn.Module, config, tp: int, dtype, sdk, experts: str) -> None:
    """Replace attention, shared MLP, experts and lm_head of ``lm`` by their NxD forms (in
    place)."""
    patch_scale_dequantize(sdk.quantization_layers)  # the experts' input is 2-D [T, H]
    experts_cls = NeuronDenseExperts if experts == "dense" else NeuronSparseExperts
    int8 = int8_kwargs(sdk, dtype)
    for layer in lm.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for name in ("q_proj", "k_proj", "v_proj"):
            if (old := getattr(attn, name, None)) is not None:
                setattr(
                    attn,
                    name,
                    sdk.ColumnParallelLinear(
                        old.in_features,
                        old.out_features,
                        bias=False,
                        gather_output=False,
                        dtype=dtype,
                    ),
                )
        attn.o_proj = sdk.RowParallelLinear(
            attn.o_proj.in_features,
            attn.o_proj.out_features,
            bias=False,
            input_is_parallel=True,
            dtype=dtype,
        )
        for name in ("gate_proj", "up_proj"):
            old = getattr(mlp, name)
            setattr(
                mlp,
                name,
                sdk.QuantizedColumnParallel(
                    old.in_features, old.out_features, gather_output=False, **int8
                ),
            )
        mlp.down_proj = sdk.QuantizedRowParallel(
            mlp.down_proj.in_features, mlp.down_proj.out_features, input_is_parallel=True, **int8
        )
        layer.experts = experts_cls(
            config.num_experts,
            config.hidden_size,
            config.moe_intermediate_size,
            tp,
            dtype=dtype,
            sdk=sdk,
            activation=config.hidden_activation,
        )
    lm.lm_head = build_lm_head(
        config.hidden_size, config.vocab_size, dtype=dtype, pad=config.vocab_size % tp != 0, sdk=sdk
    )


def convert_checkpoint(hf_state: dict, config, dtype=torch.bfloat16) -> dict:
    """The checkpoint ModelBuilder shards for ``NeuronGemma4``, any TP (keys ``lm.*``): MLP,
    experts, int8 lm_head, no embed."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in hf_state.items():
        if (
            name.startswith("model.embed_tokens")
            or name.startswith("lm_head")
            or ".experts." in name
        ):
            continue
        if ".mlp." in name and name.endswith("_proj.weight"):
            prefix = f"lm.{name.removesuffix('.weight')}"
            q, scale = quantize_int8_per_channel(tensor, name=prefix)
            out.update({f"{prefix}.weight": q, f"{prefix}.scale": scale})
            continue
        out[f"lm.{name}"] = tensor.to(dtype) if tensor.is_floating_point() else tensor
    for index in range(config.num_hidden_layers):
        base = f"model.layers.{index}.experts"
        out.update(
            experts_checkpoint(
                hf_state[f"{base}.gate_up_proj"],
                hf_state[f"{base}.down_proj"],
                prefix=f"lm.{base}.",
            )
        )
    out.update(lm_head_state_dict(hf_state["model.embed_tokens.weight"], prefix="lm.lm_head."))
    return out


def fill_layer_scalars(module: NeuronGemma4, scalars: dict) -> None:
    """Copy the ``layer_scalar`` buffers (which ModelBuilder does not load) from ``scalars`` into
    ``module``."""
    for name, buffer in module.lm.named_buffers():
        if name.endswith("layer_scalar"):
            if name not in scalars:
                raise ValueError(
                    f"the checkpoint has no {name}: expected a Gemma-4 checkpoint with layer "
                    "scalars"
                )
            buffer.copy_(scalars[name])


def example_inputs(config, build: NeuronBuildConfig, tokens: int) -> tuple[torch.Tensor, ...]:
    return step_inputs(
        torch.zeros(1, tokens, config.hidden_size),
        list(range(tokens)),
        build.max_len,
        config.sliding_window,
    )


def checkpoint_loader(build: NeuronBuildConfig, config):
    """ModelBuilder's loader: the first pass converts the checkpoint (``convert_checkpoint``) and
    writes it, int8, to the build's scratch folder; every later pass maps that file instead of
    reading and quantizing the whole checkpoint again."""
    path = build.scratch_dir() / CONVERTED_FILE

    def load() -> dict:
        if path.is_file():
            return load_file(str(path))  # memory-mapped: file pages, not the process's own
        state = convert_checkpoint(read_hf_state(build.model_dir), config)
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file({name: tensor.contiguous() for name, tensor in state.items()}, str(path))
        return state

    return load


def model_builder(build: NeuronBuildConfig, config, graphs: dict[str, str], sdk):
    """A ModelBuilder, one instance per graph (key -> experts), and the first instance (the module
    ModelBuilder shards against); weights are read only when it shards."""
    scalars = read_hf_state(build.model_dir, only=lambda name: name.endswith("layer_scalar"))

    class GemmaInstance(sdk.BaseModelInstance):
        def __init__(self, experts: str):
            super().__init__(module_cls=None, input_output_aliases={})
            self.experts = experts

        def load_module(self):
            self.module = NeuronGemma4(config, build, parallel=True, sdk=sdk, experts=self.experts)
            fill_layer_scalars(self.module, scalars)
            self.input_output_aliases = [self.module.input_output_aliases()]

    builder = sdk.ModelBuilder(
        router=None,
        tp_degree=build.tp_degree,
        compiler_workdir=build.compiler_workdir,
        checkpoint_loader=checkpoint_loader(build, config),
    )
    instances = {key: GemmaInstance(experts) for key, experts in graphs.items()}
    for key, instance in instances.items():
        tokens = build.bucket if key == "prefill" else 1
        builder.add(
            key,
            instance,
            [example_inputs(config, build, tokens)],
            compiler_args=build.compiler_args,
        )
    return builder, next(iter(instances.values()))


def check_shards(module: nn.Module, shards: list[dict]) -> None:
    """Every parameter ``module`` declares (its KV state aside), by its own name, in every rank's
    shard: ModelBuilder drops a key the module does not name and skips a missing unquantized
    weight, which would surface only after the compile."""
    names = [n for n, _ in module.named_parameters() if not n.startswith(KV_STATE_PREFIXES)]
    missing = [(rank, n) for rank, shard in enumerate(shards) for n in names if n not in shard]
    if missing:
        raise ValueError(
            f"the rank-{missing[0][0]} shard has no {missing[0][1]!r} ({len(missing)} of the "
            f"{len(names) * len(shards)} parameters missing): the checkpoint lacks it or names it "
            "otherwise. Compile a Gemma-4 checkpoint folder as the hub ships it (transformers' "
            "model.language_model.* names), which convert_checkpoint maps to the module's"
        )


def compile_neuron(build: NeuronBuildConfig, sample_interval_s: float = 1.0) -> dict:
    """Convert, shard-check, trace, compile and save the graphs into a fresh artifact folder; return
    the build record. One build per process: ``runs.compile_builds``."""
    sdk = import_sdk()
    config = text_config(build.model_dir)
    out_dir = fresh_dir(build.output_dir)
    graphs = build.graph_keys()
    builder, first = model_builder(build, config, graphs, sdk)
    started = time.perf_counter()
    # a checkpoint that does not fit the module fails now, not after neuronx-cc
    shards = builder.shard_checkpoint()  # sets first.module: the module it sharded against
    check_shards(first.module, shards)
    del shards
    shard_check_s = time.perf_counter() - started
    with HostMemorySampler(interval_s=sample_interval_s) as sampler:
        traced = builder.trace(initialize_model_weights=True)
        artifact = out_dir / MODEL_FILE
        torch.jit.save(traced, str(artifact))
    workdir, scratch = Path(build.compiler_workdir), build.scratch_dir()
    neffs = {
        str(p.relative_to(workdir)): p.stat().st_size
        for p in sorted(workdir.rglob("*.neff"))
        if p.is_file()
    }
    record = {
        "build": asdict(build),
        "sdk": sdk_label(sdk),
        "graphs": graphs,
        "routed_graphs": build.routed_graphs(),
        "shard_check_s": shard_check_s,
        "compile_s": sampler.wall_s,
        "peak_host_rss_bytes": sampler.peak_rss_bytes,
        "peak_host_hwm_bytes": sampler.peak_hwm_bytes,
        "neff_files": neffs,
        "neff_bytes": sum(neffs.values()),
        "compiler_workdir_bytes": sum(p.stat().st_size for p in scratch.rglob("*") if p.is_file()),
        "artifact": MODEL_FILE,
        "artifact_bytes": artifact.stat().st_size,
        "versions": package_versions(RECORDED_VERSIONS),
    }
    finish_artifact(build.model_dir, out_dir, record)
    return record


def sdk_label(sdk) -> str:
    return (
        "emulated SDK (gemma_nb.rehearsal, not the Neuron SDK)"
        if getattr(sdk, "emulated", False)
        else "Neuron SDK"
    )


# None where not installed; the first found, as importlib.metadata.version
def package_versions(packages) -> dict:
    return {
        package: next((dist.version for dist in distributions(name=package)), None)
        for package in packages
    }


if __name__ == "__main__":
    print(json.dumps(compile_neuron(NeuronBuildConfig(**json.loads(sys.argv[1])))))
