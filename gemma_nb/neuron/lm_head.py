"""The port's lm_head on Inferentia2: NxD column-parallel over the vocab, int8, gathered (SDK 2.31).

Not run on an inf2 here: written for neuronx-distributed 0.19 (Neuron SDK 2.31); the signatures
were read in neuronx-distributed 0.18, the newest public source (aws-neuron/neuronx-distributed:
``quantization/quantization_layers.py``, ``parallel_layers/layers.py``,
``quantization/quantization_config.py``). Nothing from the SDK is imported at module import time;
:func:`build_lm_head` imports it and raises ``TargetError`` with the install hint when it is
missing, or builds from ``sdk=gemma_nb.rehearsal.standins.cpu_sdk()``, the cpu stand-ins (notebook
05's TP=2 emulation runs it so). The CPU twin, run for real under torch.distributed gloo, is
``gemma_nb.experiments.lm_head_sharding.VocabParallelLMHead``.

What the port did (docs/sources.md: port-recipe): the tie is broken. The host keeps ``embed_tokens.weight`` (bf16,
1.48 GB) for the lookup; the traced graph gets an lm_head built as

    QuantizedColumnParallel(input_size=H, output_size=V, bias=False, gather_output=True,
                            dtype=torch.bfloat16, quantized_dtype=QuantizedDtype.INT8,
                            quantization_type=QuantizationType.PER_CHANNEL_SYMMETRIC,
                            quantization_per_channel_axis=0)

whose checkpoint entries come from the *embedding* table: ``lm_head.weight`` int8 ``[V, H]`` and
``lm_head.scale`` fp32 ``[V, 1]`` (NxD's names: ``QuantizedParallelLinearLayerStateDictAdaptor``
reads ``<prefix>weight`` and ``<prefix>scale``). The weight is partitioned on dim 0 and, because
the per-channel axis equals the partition dim, so is the scale: ModelBuilder gives rank r rows
``[r V/tp, (r+1) V/tp)`` of both. The forward upcasts the int8 rows to bf16, matmuls, multiplies
the output by the scale (``scale_dequantize``) and all-gathers the logits over the TP group. The
final softcap ``30 tanh(x/30)`` runs on the host after the gather
(``gemma_nb.experiments.lm_head_sharding.softcap_logits``).

Padding (vocab not divisible by tp; 262144 is, at TP=2): both layers take ``pad=True`` and pad the
state dict in ``preshard_hook``. ``ColumnParallelLinear`` narrows the gathered output back to V;
``QuantizedColumnParallel`` (as read in the source) does *not*, so its padded logits come back as
zeros and could win an argmax over negative logits: :func:`trim_padded_logits` cuts them off.
"""

from __future__ import annotations

import torch
from torch import nn

from gemma_nb.formats import quantize_int8_per_channel
from gemma_nb.neuron.moe import import_nxd
from gemma_nb.neuron.quant import patch_scale_dequantize
from gemma_nb.targets import NEURON_HELP, TargetError

# transformers' Gemma4ForCausalLM names the tied table this; the traced graph calls its head lm_head.
EMBED_KEY = "model.embed_tokens.weight"
HEAD_PREFIX = "lm_head."


def lm_head_kwargs(hidden_size: int, vocab_size: int, quantized: bool = True, dtype: torch.dtype = torch.bfloat16,
                   pad: bool = False) -> dict:
    """The constructor arguments of the port's head, NxD enums named as strings (printable without the SDK).

    int8: ``QuantizedColumnParallel`` per-channel symmetric on axis 0 with fp32 scales; bf16:
    ``ColumnParallelLinear``. Both column-parallel over the vocab, ``gather_output=True``, no bias.
    """
    kwargs = dict(input_size=hidden_size, output_size=vocab_size, bias=False, gather_output=True, dtype=dtype, pad=pad)
    if quantized:
        kwargs.update(
            quantized_dtype="QuantizedDtype.INT8",
            quantization_type="QuantizationType.PER_CHANNEL_SYMMETRIC",
            quantization_per_channel_axis=0,
            scale_dtype=torch.float32,
        )
    return kwargs


def build_lm_head(hidden_size: int, vocab_size: int, quantized: bool = True, dtype: torch.dtype = torch.bfloat16,
                  pad: bool = False, tensor_model_parallel_group=None, sdk=None) -> nn.Module:
    """The port's lm_head for the traced graph: int8 ``QuantizedColumnParallel`` or bf16 ``ColumnParallelLinear``.

    Arguments as :func:`lm_head_kwargs`. ``sdk``: None imports neuronx-distributed
    (``TargetError`` with the install hint if missing); ``gemma_nb.rehearsal.standins.cpu_sdk()`` gives
    the cpu stand-ins. Call it where NxD's tensor-parallel state exists (inside a ModelBuilder
    trace, after ``parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)``, or in
    a stand-in ``model_parallel``) and register it as ``lm_head`` so :func:`untie_lm_head`'s keys
    match. With ``pad=True`` pass its output through :func:`trim_padded_logits`.
    """
    sdk = import_nxd() if sdk is None else sdk
    kwargs = lm_head_kwargs(hidden_size, vocab_size, quantized=quantized, dtype=dtype, pad=pad)
    kwargs["tensor_model_parallel_group"] = tensor_model_parallel_group
    if not quantized:
        return sdk.ColumnParallelLinear(**kwargs)
    kwargs["quantized_dtype"] = sdk.QuantizedDtype.INT8
    kwargs["quantization_type"] = sdk.QuantizationType.PER_CHANNEL_SYMMETRIC
    return sdk.QuantizedColumnParallel(**kwargs)


def trim_padded_logits(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Gathered logits cut back to ``vocab_size`` columns (a ``pad=True`` QuantizedColumnParallel leaves them on)."""
    return logits[..., :vocab_size] if logits.shape[-1] != vocab_size else logits


def lm_head_state_dict(embed_weight: torch.Tensor, quantized: bool = True, prefix: str = HEAD_PREFIX) -> dict:
    """Checkpoint entries for the untied head, made from the tied embedding table ``[V, H]``.

    int8: ``{prefix}weight`` int8 ``[V, H]`` and ``{prefix}scale`` fp32 ``[V, 1]`` from
    ``gemma_nb.formats.quantize_int8_per_channel`` (the port's quantizer: absmax(row)/127, floor
    1e-8, round, clamp to +-127). bf16: ``{prefix}weight`` as bf16. Full, unsharded tensors:
    ModelBuilder's sharding splits both along dim 0 per rank. Pure torch, runs anywhere.
    """
    if embed_weight.dim() != 2:
        raise ValueError(f"embed_weight must be [vocab, hidden]; got shape {tuple(embed_weight.shape)}")
    if not quantized:
        return {f"{prefix}weight": embed_weight.detach().to(torch.bfloat16)}
    q, scale = quantize_int8_per_channel(embed_weight.detach(), axis=0, name=EMBED_KEY)
    return {f"{prefix}weight": q, f"{prefix}scale": scale}


def untie_lm_head(state_dict: dict, quantized: bool = True, embed_key: str = EMBED_KEY,
                  prefix: str = HEAD_PREFIX) -> dict:
    """A ModelBuilder checkpoint: ``state_dict`` plus the head entries made from ``embed_key``.

    Use inside the ``checkpoint_loader`` given to ``ModelBuilder(..., checkpoint_loader=fn)``. The
    embedding itself is left in the dict for the caller to drop (the port kept it only on the host,
    saved separately as ``embed_tokens.pt``), and any tied ``lm_head.weight`` is replaced.
    """
    if embed_key not in state_dict:
        found = [k for k in state_dict if k.endswith("embed_tokens.weight")]
        raise ValueError(
            f"state dict has no {embed_key!r} to build the lm_head from"
            + (f"; found {found[0]!r}: pass embed_key={found[0]!r}" if found else "; pass the tied embedding's key as embed_key")
        )
    out = {k: v for k, v in state_dict.items() if not k.startswith(prefix)}
    out.update(lm_head_state_dict(state_dict[embed_key], quantized=quantized, prefix=prefix))
    return out


class _HeadOnly(nn.Module):
    """Just the head, registered as ``lm_head`` so the checkpoint keys are ``lm_head.weight`` / ``lm_head.scale``."""

    def __init__(self, hidden_size: int, vocab_size: int, quantized: bool, pad: bool):
        super().__init__()
        self.vocab_size = vocab_size
        self.lm_head = build_lm_head(hidden_size, vocab_size, quantized=quantized, pad=pad)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return trim_padded_logits(self.lm_head(hidden), self.vocab_size)


def compile_lm_head(embed_weight: torch.Tensor, tp: int = 2, quantized: bool = True, tokens: int = 1,
                    compiler_workdir: str | None = None):
    """Trace, compile and load the head alone on ``tp`` NeuronCores (ModelBuilder v2); return the NxDModel.

    NOT RUN HERE. The flow of NxD's own ``test_e2e_model_builder_v2_flow.py``: build the module
    under ``NxDParallelState(world_size=tp, tensor_model_parallel_size=tp)``, trace it for hidden
    states ``[1, tokens, H]`` bf16 and compile; build it again on the meta device to
    ``shard_checkpoint`` the untied int8 entries (:func:`lm_head_state_dict`); ``set_weights``,
    ``to_neuron``. Call the result with bf16 hidden states ``[1, tokens, H]``; it returns the
    gathered logits ``[1, tokens, V]`` (softcap them on the host).
    """
    try:
        from neuronx_distributed import ModelBuilder, NxDParallelState, shard_checkpoint
        from neuronx_distributed.quantization import quantization_layers
        from neuronx_distributed.utils.model_utils import init_on_device
    except ImportError as error:
        raise TargetError(f"cannot import neuronx_distributed ({error}): {NEURON_HELP}") from None

    vocab_size, hidden_size = embed_weight.shape
    pad = vocab_size % tp != 0
    patch_scale_dequantize(quantization_layers)
    example = torch.zeros(1, tokens, hidden_size, dtype=torch.bfloat16)
    with NxDParallelState(world_size=tp, tensor_model_parallel_size=tp):
        traced = ModelBuilder(_HeadOnly(hidden_size, vocab_size, quantized, pad)).trace(args=(example,), tag="lm_head")
        nxd_model = traced.compile(compiler_workdir=compiler_workdir)
    # force_custom_init_on_device, as ModelBuilder itself builds for sharding: without it NxD hands over to
    # accelerate's init_on_device, which NxD documents as resetting requires_grad (an int8 weight cannot)
    with (NxDParallelState(world_size=tp, tensor_model_parallel_size=tp),
          init_on_device(torch.device("meta"), force_custom_init_on_device=True)):
        sharded = shard_checkpoint(checkpoint=lm_head_state_dict(embed_weight, quantized=quantized),
                                   model=_HeadOnly(hidden_size, vocab_size, quantized, pad))
    nxd_model.set_weights(sharded)
    nxd_model.to_neuron()
    return nxd_model
