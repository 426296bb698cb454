"""The port's compile on Inferentia2: NxD ModelBuilder (v1) at TP=2 with the int8 squeeze (SDK 2.31).

Not run on an inf2 here. The SDK parts are written for neuronx-distributed 0.19 / torch-neuronx 2.9
(Neuron SDK 2.31); their contracts were read in neuronx-distributed 0.18, the newest public source
(aws-neuron/neuronx-distributed: ``trace/model_builder.py``: ``ModelBuilder(router, tp_degree,
checkpoint_loader, ..., compiler_workdir=...)``, ``.add(key, model_instance, example_inputs,
compiler_args)``, ``.shard_checkpoint()``, ``.trace(initialize_model_weights=True)``,
``BaseModelInstance(module_cls, input_output_aliases)``; ``trace/trace.py``: ``shard_children``;
``quantization/quantization_layers.py``; ``parallel_layers/layers.py``). Nothing from the SDK is
imported at module import time; ``compile_neuron`` imports it and raises ``TargetError`` with the
install hint when it is missing. ``gemma_nb.rehearsal`` holds cpu stand-ins of those NxD pieces
and an emulation of the SDK surface this module calls, so the module below is also built, sharded,
traced and run at TP=2 on the cpu; that proves this code, not the SDK.

The recipe (docs/sources.md: port-recipe), as the traced module ``NeuronGemma4`` builds it:

- transformers' own ``Gemma4ForCausalLM`` is traced, with submodules swapped in place:
  ``embed_tokens`` -> nothing (the host embeds, scale included: ``gemma_nb.embedding``);
  q/k/v ``ColumnParallelLinear(gather_output=False)``, o ``RowParallelLinear(input_is_parallel=True)``
  (at TP=2 the sliding layers' 8 KV heads become 4 per rank, the global layers' 2 become 1);
  shared MLP gate/up ``QuantizedColumnParallel``, down ``QuantizedRowParallel`` (int8 per channel);
  routed experts ``gemma_nb.neuron.moe``'s dense module (every expert every token: the port's op)
  or its selective-loading sparse module, both on NxD's expert-fused int8 layers, expert-major;
  lm_head ``QuantizedColumnParallel(gather_output=True)`` made from the embedding table
  (``gemma_nb.neuron.lm_head``). Router and norms stay, replicated; the final softcap runs on the host.
  NxD's ``scale_dequantize`` is patched once (``gemma_nb.neuron.quant.patch_scale_dequantize``): an
  out-of-place multiply that also takes a 2-D input, which NxD's own in-place version cannot.
- the KV cache is per-layer fp32 state ``[1, kv_heads/TP, MAX, head_dim]``, updated with a one-hot
  scatter and returned as aliased outputs (``input_output_aliases``), so it stays on the device;
- inputs: fp32 embeddings ``[1, S, H]``, int32 positions ``[1, S]`` (as NxD Inference traces them),
  the one-hot ``[1, 1, MAX, S]``, full and sliding additive masks ``[1, 1, S, MAX]`` (finite in bf16:
  ``MASK_MIN``), and the int32 index of the token whose logits to return; S = the prefill bucket, or
  1 for decode.
- one artifact per decode path (``NeuronBuildConfig.decode_experts``): a dense prefill graph and a
  dense (the port's) or sparse (the fix) decode graph, sharing one set of sharded weights.
  ModelBuilder routes a call by its input shapes and both decode graphs take the same shapes, so
  one artifact could never reach two decode graphs.

``NeuronGemma4(config, build, parallel=False)`` runs the same module with transformers' own layers
at TP=1 on the cpu, and ``tests/test_deploy.py`` checks it decodes exactly like the eager model.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from gemma_nb.export import check_exportable_config, layer_kv_heads
from gemma_nb.formats import quantize_int8_per_channel
from gemma_nb.neuron.artifact import finish_artifact
from gemma_nb.neuron.checkpoint import read_hf_state, read_layer_scalars, text_config
from gemma_nb.neuron.lm_head import build_lm_head, lm_head_state_dict
from gemma_nb.neuron.moe import NeuronDenseExperts, NeuronSparseExperts, experts_checkpoint, int8_kwargs
from gemma_nb.neuron.quant import patch_scale_dequantize
from gemma_nb.neuron.sdk import import_sdk
from gemma_nb.paths import fresh_dir

# The dense build keeps the port's flags (transformer model type, everything auto-cast to bf16, -O1), so
# notebook 07 compares the port's build with the fix. The sparse build takes NxD's own default,
# --auto-cast=none (ModelBuilder warns about any other value): the module is already bf16 where it may
# be, and keeps in fp32 what --auto-cast all would cast to bf16: the router's softmax and top-k, the int8
# scale multiply and the experts' all-reduce.
COMPILER_ARGS = {"dense": "--model-type transformer --auto-cast all --auto-cast-type bf16 -O1",
                 "sparse": "--model-type transformer --auto-cast=none -O1"}
ARTIFACT_NAME = "model.pt"
BUILD_RECORD = "build_record.json"
# The masks' "minus infinity": bf16's most negative finite value. fp32's (-3.40e38) rounds to -inf in
# bf16 (the graph casts the fp32 mask inputs to bf16), after which a fully masked row's softmax is NaN;
# NxD's default --enable-saturate-infinity is not among the port's flags.
MASK_MIN = torch.finfo(torch.bfloat16).min
EXPERT_MODES = ("dense", "sparse")
DECODE_EXPERTS = EXPERT_MODES


@dataclass
class NeuronBuildConfig:
    """What one compile is built for; everything recorded next to the artifact."""

    model_dir: str
    output_dir: str
    tp_degree: int = 2
    max_len: int = 512           # static KV cache length (the shipped build: 512)
    bucket: int = 128            # prefill bucket (the shipped build: 128)
    compiler_args: str = ""      # default: COMPILER_ARGS[decode_experts]
    compiler_workdir: str = ""   # default: <output_dir>/compiler_workdir
    dtype: str = "bfloat16"
    decode_experts: str = "dense"  # the decode graph next to the dense prefill: dense (the port's) or sparse

    def __post_init__(self) -> None:
        if self.decode_experts not in DECODE_EXPERTS:
            raise ValueError(f"decode_experts={self.decode_experts!r} is not one of {', '.join(DECODE_EXPERTS)}: "
                             "one artifact per decode path (compile twice for both)")
        if not self.compiler_workdir:
            self.compiler_workdir = str(Path(self.output_dir) / "compiler_workdir")
        self.compiler_args = self.compiler_args or COMPILER_ARGS[self.decode_experts]
        if self.bucket > self.max_len:
            raise ValueError(f"bucket={self.bucket} exceeds max_len={self.max_len}: the prefill must fit the KV cache")
        if self.tp_degree < 1:
            raise ValueError(f"tp_degree={self.tp_degree} must be >= 1 (the port used 2, one rank per NeuronCore)")

    def graph_keys(self) -> dict[str, str]:
        """ModelBuilder key -> experts module of that graph: prefill is dense; decode as ``decode_experts``."""
        return {"prefill": "dense", f"decode_{self.decode_experts}": self.decode_experts}

    def routed_graphs(self) -> dict[str, str]:
        """Which graph ``model(*inputs)`` reaches for a prefill and for a decode step.

        ModelBuilder's NxDModel routes a call by its input shapes (``input_shape_map`` in NxD
        0.18's ``trace/model_builder.py``: one entry per shape, the last graph added wins); the
        prefill (S = bucket) and the decode (S = 1) differ, so each is reached.
        """
        return {"prefill": "prefill", "decode": f"decode_{self.decode_experts}"}


# --------------------------------------------------------------------------------------------
# Graph inputs and the one-hot KV cache: plain torch, run on the cpu in the tests
# --------------------------------------------------------------------------------------------
def step_inputs(embeds: torch.Tensor, positions: list[int], max_len: int, sliding_window: int,
                last_index: int | None = None) -> tuple[torch.Tensor, ...]:
    """The traced graph's inputs for ``S`` tokens at ``positions`` (host side).

    ``embeds`` [1, S, H] (the host embedding, scaled), ``positions`` S ints (a padded prefill's
    padding gets the positions after the prompt). Returns (embeds fp32, position_ids [1, S] int32,
    one_hot [1, 1, max_len, S] fp32, full_mask and sliding_mask [1, 1, S, max_len] additive fp32,
    last_index [1] int32). Query at position p sees cache slots <= p; the sliding mask also drops
    slots more than ``sliding_window - 1`` behind p. Integer inputs are int32, as NxD Inference
    traces its position ids: the NeuronCore has no native int64.
    """
    tokens = embeds.shape[1]
    if len(positions) != tokens:
        raise ValueError(f"{len(positions)} positions for {tokens} embedded tokens; give one position per token")
    if max(positions) >= max_len:
        raise ValueError(f"position {max(positions)} is outside the {max_len}-slot KV cache")
    pos = torch.tensor(positions, dtype=torch.int32)
    one_hot = torch.zeros(1, 1, max_len, tokens, dtype=torch.float32)
    one_hot[0, 0, pos, torch.arange(tokens)] = 1.0
    slots = torch.arange(max_len)
    visible = slots[None, :] <= pos[:, None]  # [S, MAX]
    in_window = slots[None, :] > pos[:, None] - sliding_window
    full = torch.where(visible, 0.0, MASK_MIN)[None, None]
    sliding = torch.where(visible & in_window, 0.0, MASK_MIN)[None, None]
    last = torch.tensor([tokens - 1 if last_index is None else last_index], dtype=torch.int32)
    return embeds.float(), pos[None], one_hot, full, sliding, last


def onehot_update(cache: torch.Tensor, new: torch.Tensor, one_hot: torch.Tensor) -> torch.Tensor:
    """``cache`` [1, h, MAX, d] with ``new`` [1, h, S, d] written at the one-hot's slots [1, 1, MAX, S].

    A matmul and a blend instead of an indexed write: static shapes, no scatter, which is what the
    port compiled. Slots the one-hot does not touch keep their values.
    """
    written = one_hot.sum(dim=-1, keepdim=True)  # [1, 1, MAX, 1]: 1 where a token lands
    return cache * (1.0 - written) + torch.matmul(one_hot, new.to(cache.dtype))


class OneHotCache:
    """The cache object transformers' attention calls: writes each layer's K/V with ``onehot_update``.

    ``update`` returns the whole updated cache (every slot; masks hide the unused ones) and keeps
    the new tensors, which the traced module returns as outputs aliased to its state.
    """

    is_compileable = False

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor], one_hot: torch.Tensor):
        self.keys, self.values, self.one_hot = keys, values, one_hot
        self.new_keys: list[torch.Tensor | None] = [None] * len(keys)
        self.new_values: list[torch.Tensor | None] = [None] * len(values)

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        keys = onehot_update(self.keys[layer_idx], key_states, self.one_hot)
        values = onehot_update(self.values[layer_idx], value_states, self.one_hot)
        self.new_keys[layer_idx], self.new_values[layer_idx] = keys, values
        return keys.to(key_states.dtype), values.to(value_states.dtype)


def kv_state_shapes(config, max_len: int, tp_degree: int) -> list[tuple[int, int, int, int]]:
    """Per layer, the KV state one rank holds: [1, kv_heads / TP, max_len, head_dim]."""
    shapes = []
    for h, d in layer_kv_heads(config):
        if h % tp_degree:
            raise ValueError(f"{h} KV heads do not split over tp_degree={tp_degree}")
        shapes.append((1, h // tp_degree, max_len, d))
    return shapes


# --------------------------------------------------------------------------------------------
# The traced module
# --------------------------------------------------------------------------------------------
class _NoEmbedding(nn.Module):
    """Stands where ``embed_tokens`` was: the graph starts at the decoder (the host embeds)."""

    def forward(self, input_ids):
        raise RuntimeError("the traced graph takes inputs_embeds; token ids are embedded on the host")


class NeuronGemma4(nn.Module):
    """transformers' Gemma-4 with the port's swaps, a one-hot KV state, host-side embedding and softcap.

    ``parallel=True`` swaps in the NxD layers: ``sdk=None`` imports neuronx-distributed (inside a
    ModelBuilder trace; in ``make rehearse``, the emulated SDK); ``sdk=gemma_nb.rehearsal.standins.cpu_sdk()``
    uses the cpu stand-ins, built inside ``standins.model_parallel(tp, rank, group)``. ``parallel=False`` keeps transformers'
    layers at TP=1 (runs anywhere: the cpu check). ``experts``: ``"dense"`` (every expert, the
    port's op; prefill) or ``"sparse"`` (selective loading; decode): same parameters either way.
    forward(embeds, position_ids, one_hot, full_mask, sliding_mask, last_index)
    -> (logits [1, 1, V] before softcap, *new K states, *new V states).
    """

    def __init__(self, config, build: NeuronBuildConfig, parallel: bool = True, sdk=None, experts: str = "dense"):
        super().__init__()
        from transformers import Gemma4ForCausalLM

        if experts not in EXPERT_MODES:
            raise ValueError(f"experts={experts!r} is not one of {', '.join(EXPERT_MODES)}")
        check_exportable_config(config)
        config = config.__class__.from_dict(config.to_dict())
        config.final_logit_softcapping = None  # applied on the host, after the vocab gather
        config._attn_implementation = "eager"
        self.build, self.experts = build, experts
        tp = build.tp_degree if parallel else 1
        dtype = getattr(torch, build.dtype)
        if parallel:
            sdk = _import_sdk() if sdk is None else sdk
            # Structure on the meta device: the layers swapped for NxD ones (each rank's shard) are
            # never allocated whole on the host; what stays (norms, router) is materialised after.
            with torch.device("meta"):
                self.lm = Gemma4ForCausalLM(config).to(dtype)
            self.lm.model.embed_tokens = _NoEmbedding()
            _swap_in_nxd_layers(self.lm, config, tp, dtype, sdk, experts)
            _materialize(self.lm, config)
        else:
            if experts != "dense":
                raise ValueError("parallel=False keeps transformers' own experts; experts='sparse' needs parallel=True")
            self.lm = Gemma4ForCausalLM._from_config(config, dtype=dtype)
            self.lm.model.embed_tokens = _NoEmbedding()
        self.lm.eval()
        shapes = kv_state_shapes(config, build.max_len, tp)
        self.k_cache = nn.ParameterList([nn.Parameter(torch.zeros(s), requires_grad=False) for s in shapes])
        self.v_cache = nn.ParameterList([nn.Parameter(torch.zeros(s), requires_grad=False) for s in shapes])

    def input_output_aliases(self) -> dict:
        """State tensor -> output index: logits are output 0, then every K, then every V."""
        layers = len(self.k_cache)
        aliases = {p: 1 + i for i, p in enumerate(self.k_cache)}
        aliases.update({p: 1 + layers + i for i, p in enumerate(self.v_cache)})
        return aliases

    def forward(self, embeds, position_ids, one_hot, full_mask, sliding_mask, last_index):
        cache = OneHotCache(list(self.k_cache), list(self.v_cache), one_hot)
        dtype = next(p for n, p in self.lm.named_parameters() if n.endswith("norm.weight")).dtype
        out = self.lm(
            inputs_embeds=embeds.to(dtype), position_ids=position_ids, cache=cache, use_cache=True,
            attention_mask={"full_attention": full_mask.to(dtype), "sliding_attention": sliding_mask.to(dtype)},
            logits_to_keep=last_index,
        )
        return (out.logits.float(), *cache.new_keys, *cache.new_values)

    def load_state(self, state_dict: dict) -> None:
        """Load a plain (TP=1, unquantized) state dict into the cpu variant, buffers included."""
        state_dict = {k: v for k, v in state_dict.items() if not k.startswith("model.embed_tokens")}
        missing, unexpected = self.lm.load_state_dict(state_dict, strict=False)
        if missing or unexpected:
            raise ValueError(f"state dict does not fit the module: missing {missing[:3]}, unexpected {unexpected[:3]}")


KV_STATE_PREFIXES = ("k_cache.", "v_cache.")


def _materialize(lm: nn.Module, config) -> None:
    """Give the tensors of the transformers skeleton that are still on the meta device real
    (uninitialised) cpu storage, in their own dtype, their attributes kept; rebuild the rotary tables.

    NxD layers' parameters (tagged ``tensor_model_parallel``) are left exactly as NxD made them:
    on meta inside ModelBuilder's sharding pass (``init_on_device(meta)``), where the tags decide
    how each rank's slice is cut and the fp32 ``scale`` dtype decides the cast. Turning them into
    plain parameters made ModelBuilder keep whole tensors and fail with "expected shape ... but
    found ..." after the compile. Values arrive with the checkpoint (parameters) or
    ``build_module`` (the ``layer_scalar`` buffers).
    """
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


def host_logits(outputs, config) -> torch.Tensor:
    """The graph's first output, gathered, cut to the vocab and softcapped on the host: [1, V] fp32."""
    logits = outputs[0] if isinstance(outputs, (tuple, list)) else outputs
    logits = logits[:, -1, : config.vocab_size].float()
    cap = config.final_logit_softcapping
    return logits if cap is None else torch.tanh(logits / cap) * cap


def _import_sdk():
    """The SDK namespace (NxD layers, mappings, ModelBuilder): ``gemma_nb.neuron.sdk.import_sdk``."""
    return import_sdk()


def _swap_in_nxd_layers(lm: nn.Module, config, tp: int, dtype, sdk, experts: str) -> None:
    """Replace attention, shared MLP, experts and lm_head of ``lm`` by their NxD forms (in place)."""
    patch_scale_dequantize(sdk.quantization_layers)  # the experts' input is 2-D [T, H]
    experts_cls = NeuronDenseExperts if experts == "dense" else NeuronSparseExperts
    for layer in lm.model.layers:
        attn = layer.self_attn
        for name in ("q_proj", "k_proj", "v_proj"):
            old = getattr(attn, name, None)
            if old is not None:
                setattr(attn, name, sdk.ColumnParallelLinear(old.in_features, old.out_features, bias=False,
                                                             gather_output=False, dtype=dtype))
        attn.o_proj = sdk.RowParallelLinear(attn.o_proj.in_features, attn.o_proj.out_features, bias=False,
                                            input_is_parallel=True, dtype=dtype)
        mlp = layer.mlp
        for name in ("gate_proj", "up_proj"):
            old = getattr(mlp, name)
            setattr(mlp, name, sdk.QuantizedColumnParallel(old.in_features, old.out_features, gather_output=False,
                                                           **int8_kwargs(sdk, dtype)))
        mlp.down_proj = sdk.QuantizedRowParallel(mlp.down_proj.in_features, mlp.down_proj.out_features,
                                                 input_is_parallel=True, **int8_kwargs(sdk, dtype))
        layer.experts = experts_cls(config.num_experts, config.hidden_size, config.moe_intermediate_size, tp,
                                    dtype=dtype, sdk=sdk, activation=config.hidden_activation)
    lm.lm_head = build_lm_head(config.hidden_size, config.vocab_size, quantized=True, dtype=dtype,
                               pad=config.vocab_size % tp != 0, sdk=sdk)


# --------------------------------------------------------------------------------------------
# The checkpoint ModelBuilder shards: HF weights -> the traced module's names, int8 where squeezed
# --------------------------------------------------------------------------------------------
def _quantized(prefix: str, weight: torch.Tensor) -> dict:
    q, scale = quantize_int8_per_channel(weight, axis=0, name=prefix)
    return {f"{prefix}.weight": q, f"{prefix}.scale": scale}


def convert_checkpoint(hf_state: dict, config, tp: int, dtype=torch.bfloat16) -> dict:
    """A full (unsharded) checkpoint for ``NeuronGemma4``: names prefixed ``lm.``, squeezed to int8.

    - shared MLP gate/up/down and the lm_head (from the tied embedding): int8 + fp32 row scales;
    - experts: ``gemma_nb.neuron.moe.experts_checkpoint``: NxD's expert-major int8 layout, the same
      for every TP degree and for the dense and the sparse graph;
    - the embedding is dropped (host side); ``layer_scalar`` buffers are kept (ModelBuilder loads
      parameters only: ``build_module`` copies them into the module by hand, as the port did).
    ``tp`` is checked against the experts' intermediate size (every rank holds an equal slice).
    """
    if config.moe_intermediate_size % tp:
        raise ValueError(f"moe_intermediate_size={config.moe_intermediate_size} is not divisible by tp={tp}")
    out: dict[str, torch.Tensor] = {}
    for name, tensor in hf_state.items():
        if name.startswith("model.embed_tokens") or name.startswith("lm_head") or ".experts." in name:
            continue
        if ".mlp." in name and name.endswith("_proj.weight"):
            out.update(_quantized(f"lm.{name.removesuffix('.weight')}", tensor))
            continue
        out[f"lm.{name}"] = tensor.to(dtype) if tensor.is_floating_point() else tensor
    for index in range(config.num_hidden_layers):
        base = f"model.layers.{index}.experts"
        out.update(experts_checkpoint(hf_state[f"{base}.gate_up_proj"], hf_state[f"{base}.down_proj"],
                                      prefix=f"lm.{base}."))
    out.update(lm_head_state_dict(hf_state["model.embed_tokens.weight"], quantized=True, prefix="lm.lm_head."))
    return out


def fill_layer_scalars(module: NeuronGemma4, scalars: dict) -> None:
    """Copy the ``layer_scalar`` buffers (which ModelBuilder does not load) into ``module``.

    ``scalars``: the checkpoint's tensors by ``Gemma4ForCausalLM`` name (``read_layer_scalars``, or
    the whole HF state); every layer's must be there.
    """
    for name, buffer in module.lm.named_buffers():
        if name.endswith("layer_scalar"):
            if name not in scalars:
                raise ValueError(f"the checkpoint has no {name}: expected a Gemma-4 checkpoint with layer scalars")
            buffer.copy_(scalars[name])


# --------------------------------------------------------------------------------------------
# The compile
# --------------------------------------------------------------------------------------------
def example_inputs(config, build: NeuronBuildConfig, tokens: int) -> tuple[torch.Tensor, ...]:
    embeds = torch.zeros(1, tokens, config.hidden_size)
    return step_inputs(embeds, list(range(tokens)), build.max_len, config.sliding_window)


def build_module(config, build: NeuronBuildConfig, scalars: dict, experts: str = "dense", sdk=None):
    """(module, aliases) for ModelBuilder: the NxD module with its layer_scalar buffers filled from ``scalars``."""
    module = NeuronGemma4(config, build, parallel=True, sdk=sdk, experts=experts)
    fill_layer_scalars(module, scalars)
    return module, module.input_output_aliases()


def model_builder(build: NeuronBuildConfig, config, graphs: dict[str, str], sdk):
    """A ModelBuilder at ``build.tp_degree`` with one model instance per graph (``graphs``: key ->
    experts strategy), each traced with its own token count (the bucket for prefill, 1 for decode).

    ModelBuilder calls each instance's ``load_module`` once per graph and again for the sharding
    pass; the layer scalars they need are read from the checkpoint once, here (a few numbers), while
    the weights are read only by ``checkpoint_loader``, when ModelBuilder shards them.
    """
    scalars = read_layer_scalars(build.model_dir)

    class GemmaInstance(sdk.BaseModelInstance):
        def __init__(self, experts: str):
            super().__init__(module_cls=None, input_output_aliases={})
            self.experts = experts

        def load_module(self):
            self.module, aliases = build_module(config, build, scalars, experts=self.experts)
            self.input_output_aliases = [aliases]

    def checkpoint_loader():
        return convert_checkpoint(read_hf_state(build.model_dir), config, build.tp_degree)

    builder = sdk.ModelBuilder(router=None, tp_degree=build.tp_degree, checkpoint_loader=checkpoint_loader,
                               compiler_workdir=build.compiler_workdir)
    for key, experts in graphs.items():
        tokens = build.bucket if key == "prefill" else 1
        builder.add(key, GemmaInstance(experts), [example_inputs(config, build, tokens)],
                    compiler_args=build.compiler_args)
    return builder


def _files(folder: Path, pattern: str = "*") -> dict[str, int]:
    return {str(p.relative_to(folder)): p.stat().st_size for p in sorted(folder.rglob(pattern)) if p.is_file()}


def compile_neuron(build: NeuronBuildConfig, sample_interval_s: float = 1.0) -> dict:
    """Shard-check, trace, compile and save the graphs; return (and write) the build record.

    Graphs (``build.graph_keys()``): ``prefill`` (dense experts, S = bucket) and ``decode_dense``
    or ``decode_sparse`` (S = 1), one ModelBuilder artifact sharing one set of sharded weights.
    ``builder.shard_checkpoint()`` runs first, so a checkpoint that does not fit the module fails in
    seconds, not after the compile. The artifact folder is written afresh (an older one is removed
    first, so no file of a previous run is written through). Records the graphs, the shard check's
    time, the compiler workdir and flags, NEFF files and sizes, the saved artifact's size, the
    compile wall time, the peak host RSS of this process *and its children* (neuronx-cc runs as
    subprocesses: ``gemma_nb.peak_rss``), the versions and whether the SDK was the emulated one. The
    artifact is ``torch.jit.save`` of what ``trace(initialize_model_weights=True)`` returns (weights
    included, as the port shipped it).
    """
    import time

    # here, not at the top: the xla environment (.venv-xla) imports this module and has no psutil
    from gemma_nb.peak_rss import HostMemorySampler

    sdk = _import_sdk()
    config = text_config(build.model_dir)
    out_dir = fresh_dir(build.output_dir)
    graphs = build.graph_keys()
    builder = model_builder(build, config, graphs, sdk)
    started = time.perf_counter()
    builder.shard_checkpoint()  # raises "expected shape ... but found ..." now, not after neuronx-cc
    shard_check_s = time.perf_counter() - started
    with HostMemorySampler(interval_s=sample_interval_s) as sampler:
        traced = builder.trace(initialize_model_weights=True)
        artifact = out_dir / ARTIFACT_NAME
        torch.jit.save(traced, str(artifact))
    # trace(initialize_model_weights=True) left the weights on this box's NeuronCores: give them back,
    # or the next build compiled in this process (the other decode path) cannot load its own
    del traced
    sdk.close_runtime()
    workdir = Path(build.compiler_workdir)
    neffs = _files(workdir, "*.neff")
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
        "compiler_workdir_bytes": sum(_files(workdir).values()),
        "artifact": ARTIFACT_NAME,
        "artifact_bytes": artifact.stat().st_size,
        "versions": _sdk_versions(),
    }
    (out_dir / BUILD_RECORD).write_text(json.dumps(record, indent=2))

    finish_artifact(build.model_dir, out_dir, record)
    return record


def sdk_label(sdk) -> str:
    """``"Neuron SDK"``, or ``"emulated SDK (...)"`` when the namespace comes from ``make rehearse``'s emulation."""
    return "emulated SDK (gemma_nb.rehearsal, not the Neuron SDK)" if getattr(sdk, "emulated", False) else "Neuron SDK"


def _sdk_versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for package in ("neuronx-cc", "torch-neuronx", "neuronx-distributed", "torch", "transformers"):
        try:
            found[package] = version(package)
        except PackageNotFoundError:
            found[package] = None
    return found


__all__ = [
    "COMPILER_ARGS", "NeuronBuildConfig", "step_inputs", "onehot_update", "OneHotCache", "kv_state_shapes",
    "NeuronGemma4", "host_logits", "convert_checkpoint", "read_hf_state", "compile_neuron", "sdk_label",
    "fill_layer_scalars", "MASK_MIN", "EXPERT_MODES", "DECODE_EXPERTS", "KV_STATE_PREFIXES",
]
