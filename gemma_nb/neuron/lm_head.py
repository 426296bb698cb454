"""The port's lm_head (notebooks 03, 04): the tie broken, an int8 ``QuantizedColumnParallel`` over
the vocab, gathered; its int8 weight ``[V, H]`` and fp32 scale ``[V, 1]`` come from the embedding
table. The softcap runs on the host."""

import torch
from torch import nn

from gemma_nb.formats import quantize_int8_per_channel
from gemma_nb.neuron.expert_mlps import import_nxd, int8_kwargs
from gemma_nb.neuron.quantized_dtypes import patch_scale_dequantize

EMBED_KEY = "model.embed_tokens.weight"
HEAD_PREFIX = "lm_head."


def build_lm_head(
    hidden_size: int,
    vocab_size: int,
    dtype: torch.dtype = torch.bfloat16,
    pad: bool = False,
    sdk=None,
) -> nn.Module:
    """The int8 ``QuantizedColumnParallel`` head over the vocab, gathered; built in NxD's parallel
    state."""
    sdk = import_nxd() if sdk is None else sdk
    return sdk.QuantizedColumnParallel(
        input_size=hidden_size,
        output_size=vocab_size,
        gather_output=True,
        pad=pad,
        **int8_kwargs(sdk, dtype),
        scale_dtype=torch.float32,
    )


def trim_padded_logits(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Gathered logits cut back to ``vocab_size`` columns (a ``pad=True`` QuantizedColumnParallel
    leaves them on)."""
    return logits[..., :vocab_size] if logits.shape[-1] != vocab_size else logits


def lm_head_state_dict(embed_weight: torch.Tensor, prefix: str = HEAD_PREFIX) -> dict:
    """The untied head's full checkpoint entries from the embedding table ``[V, H]``: int8 weight
    and fp32 scale."""
    q, scale = quantize_int8_per_channel(embed_weight.detach(), name=EMBED_KEY)
    return {f"{prefix}weight": q, f"{prefix}scale": scale}


def untie_lm_head(state_dict: dict) -> dict:
    """``state_dict`` plus the int8 head's entries made from ``EMBED_KEY`` (a ModelBuilder
    ``checkpoint_loader``'s)."""
    return {
        k: v for k, v in state_dict.items() if not k.startswith(HEAD_PREFIX)
    } | lm_head_state_dict(state_dict[EMBED_KEY])


class HeadOnly(nn.Module):
    """The int8 head alone, registered as ``lm_head`` (checkpoint keys ``lm_head.weight`` /
    ``lm_head.scale``)."""

    def __init__(
        self,
        hidden_size: int,
        vocab_size: int,
        pad: bool = False,
        dtype: torch.dtype = torch.bfloat16,
        sdk=None,
    ):
        super().__init__()
        self.vocab_size = vocab_size
        self.lm_head = build_lm_head(hidden_size, vocab_size, dtype=dtype, pad=pad, sdk=sdk)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return trim_padded_logits(self.lm_head(hidden), self.vocab_size)


def compile_lm_head(embed_weight: torch.Tensor, tp: int = 2, tokens: int = 1):
    """The head alone traced, compiled and loaded on ``tp`` NeuronCores: an NxDModel, ``[1, tokens,
    H]`` -> logits."""
    # the install hint if the SDK is missing, the transformers-5 workaround if it needs one
    sdk = import_nxd()
    from neuronx_distributed import ModelBuilder, shard_checkpoint
    from neuronx_distributed.utils.model_utils import init_on_device

    vocab_size, hidden_size = embed_weight.shape
    pad = vocab_size % tp != 0
    patch_scale_dequantize(sdk.quantization_layers)
    example = torch.zeros(1, tokens, hidden_size, dtype=torch.bfloat16)
    with sdk.NxDParallelState(world_size=tp, tensor_model_parallel_size=tp):
        traced = ModelBuilder(HeadOnly(hidden_size, vocab_size, pad)).trace(
            args=(example,), tag="lm_head"
        )
        nxd_model = traced.compile()
    # force_custom_init_on_device, as ModelBuilder itself builds for sharding: without it NxD hands
    # over to accelerate's init_on_device, which NxD documents as resetting requires_grad (an int8
    # weight cannot)
    with (
        sdk.NxDParallelState(world_size=tp, tensor_model_parallel_size=tp),
        init_on_device(torch.device("meta"), force_custom_init_on_device=True),
    ):
        sharded = shard_checkpoint(
            checkpoint=lm_head_state_dict(embed_weight),
            model=HeadOnly(hidden_size, vocab_size, pad),
        )
    nxd_model.set_weights(sharded)
    nxd_model.to_neuron()
    return nxd_model
