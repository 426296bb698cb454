"""The bundled tiny Gemma-4 MoE checkpoints (the 26B-A4B's architecture at toy size, trained on
``corpus``), and random Gemma-4 models of any size up to one full 26B layer (notebooks 04, 05,
07)."""

from pathlib import Path
from typing import Any

import torch
from transformers import Gemma4ForCausalLM, Gemma4TextConfig

from gemma_nb.tiny.corpus import FACTS as FACTS  # re-exported
from gemma_nb.tiny.corpus import fact_prompts as fact_prompts

BUNDLED_ID = "gemma-nb/tiny-gemma4-moe"
CHECKPOINT_DIR = Path(__file__).resolve().parent / "checkpoint"
BUNDLED_TP2_ID = "gemma-nb/tiny-gemma4-moe-tp2"
TP2_CHECKPOINT_DIR = Path(__file__).resolve().parent / "checkpoint_tp2"

SLIDING_PER_FULL = (
    5  # the 26B-A4B's layer pattern: five sliding-window layers, then one global layer
)

# The bundled checkpoint (vocab_size from the corpus tokenizer); intermediate_size = 3 x
# moe_intermediate_size (26B: 3 x 704).
TINY_DIMS: dict[str, Any] = dict(
    hidden_size=128,
    intermediate_size=192,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    global_head_dim=64,
    num_global_key_value_heads=1,
    num_experts=32,
    top_k_experts=2,
    moe_intermediate_size=64,
    sliding_window=64,
    max_position_embeddings=512,
)
# The second bundled checkpoint, whose heads, KV heads and experts split over TP=2 as the 26B's do:
# its head counts (16 query, 8 sliding / 2 global KV heads), its layer pattern, and 32 experts top-2
# (the 26B's 1/16 active ratio).
TP2_DIMS: dict[str, Any] = {
    **TINY_DIMS,
    "num_hidden_layers": 6,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 16,
    "global_head_dim": 32,
    "num_global_key_value_heads": 2,
    "moe_intermediate_size": 32,
}
DIMS = {"tiny": TINY_DIMS, "tp2": TP2_DIMS}
CHECKPOINT_DIRS = {"tiny": CHECKPOINT_DIR, "tp2": TP2_CHECKPOINT_DIR}
BUNDLED_IDS = {BUNDLED_ID: CHECKPOINT_DIR, BUNDLED_TP2_ID: TP2_CHECKPOINT_DIR}

# The switches that make a Gemma4TextConfig a 26B-A4B look-alike (several transformers defaults
# differ: configs/SOURCES.md).
ARCHITECTURE: dict[str, Any] = dict(
    enable_moe_block=True,
    attention_k_eq_v=True,
    tie_word_embeddings=True,
    final_logit_softcapping=30.0,
    hidden_size_per_layer_input=0,
    num_kv_shared_layers=0,
    use_double_wide_mlp=False,
    hidden_activation="gelu_pytorch_tanh",
    rms_norm_eps=1e-6,
    rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        "full_attention": {
            "rope_type": "proportional",
            "partial_rotary_factor": 0.25,
            "rope_theta": 1_000_000.0,
        },
    },
    pad_token_id=0,
    eos_token_id=1,
    bos_token_id=2,
)

DEFAULT_RANDOM_VOCAB = 2048
# popped by Gemma4TextConfig.__post_init__
_GLOBAL_ATTENTION_KEYS = (
    "global_head_dim",
    "num_global_key_value_heads",
)
_LAYER_TYPES = ("sliding_attention", "full_attention")


def default_layer_types(num_hidden_layers: int) -> list[str]:
    """The 26B's pattern (5 sliding, 1 full, repeated), the last layer always full (as transformers
    forces)."""
    return [
        "full_attention"
        if (i + 1) % (SLIDING_PER_FULL + 1) == 0 or i == num_hidden_layers - 1
        else "sliding_attention"
        for i in range(num_hidden_layers)
    ]


def _check_dims(dims: dict[str, Any]) -> None:
    """Refuse what Gemma-4 cannot be (value + fix); fill in the 26B's layer pattern when none is
    given."""
    for key in ("vocab_size", *TINY_DIMS):  # the dimensions, all positive integers
        value = dims.get(key)
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or value < 1
        ):
            raise ValueError(f"{key}={value!r} must be a positive integer")
    layer_types = dims["layer_types"] = (
        list(dims["layer_types"])
        if "layer_types" in dims
        else default_layer_types(dims["num_hidden_layers"])
    )
    if dims["top_k_experts"] > dims["num_experts"]:
        raise ValueError(
            f"top_k_experts={dims['top_k_experts']} exceeds num_experts={dims['num_experts']}: "
            "choose top_k_experts <= num_experts (the 26B routes 8 of 128)"
        )
    heads = dims["num_attention_heads"]
    for key in ("num_key_value_heads", "num_global_key_value_heads"):
        if heads % dims[key]:
            raise ValueError(
                f"num_attention_heads={heads} is not a multiple of {key}={dims[key]}: "
                "grouped-query attention needs whole groups (the 26B has 16 heads, 8 sliding / "
                "2 global KV heads)"
            )
    if len(layer_types) != dims["num_hidden_layers"]:
        raise ValueError(
            f"layer_types has {len(layer_types)} entries but "
            f"num_hidden_layers={dims['num_hidden_layers']}: give one type per layer, or leave "
            "layer_types out for the 26B's 5 sliding : 1 full pattern"
        )
    if bad := [t for t in layer_types if t not in _LAYER_TYPES]:
        raise ValueError(
            f"layer_types contains {bad[0]!r}; expected one of {', '.join(_LAYER_TYPES)}"
        )
    if layer_types[-1] != "full_attention":
        raise ValueError(
            f"the last layer type is {layer_types[-1]!r}; Gemma-4 requires the last layer to be "
            "'full_attention' (transformers would silently change it)"
        )


def random_gemma4_config(**overrides: Any):
    """A ``Gemma4TextConfig`` with the 26B-A4B's architecture at chosen dimensions (default: the
    bundled ones): any of its fields, ``global_head_dim`` and ``num_global_key_value_heads``; by
    default the 26B's layer pattern."""
    if unknown := sorted(
        set(overrides) - set(Gemma4TextConfig.__dataclass_fields__) - set(_GLOBAL_ATTENTION_KEYS)
    ):
        raise ValueError(
            f"unknown Gemma4TextConfig field(s) {', '.join(unknown)}; pass fields of transformers' "
            "Gemma4TextConfig (plus global_head_dim, num_global_key_value_heads)"
        )
    dims: dict[str, Any] = {
        **ARCHITECTURE,
        **TINY_DIMS,
        "vocab_size": DEFAULT_RANDOM_VOCAB,
        **overrides,
    }
    _check_dims(dims)
    return Gemma4TextConfig(**dims)


def random_gemma4_model(
    config,
    seed: int = 0,
    dtype: torch.dtype = torch.bfloat16,
    init_dtype: torch.dtype | None = None,
):
    """A ``Gemma4ForCausalLM`` with deterministic random weights in ``dtype``, eval mode, on the
    cpu, drawn in ``init_dtype`` (default ``dtype``); float64 draws the same weights on every CPU
    (fp32/bf16 normals differ by ISA)."""
    for name, value in (("dtype", dtype), ("init_dtype", init_dtype or dtype)):
        assert isinstance(value, torch.dtype) and value.is_floating_point, (
            f"{name}={value!r} must be a floating torch dtype"
        )
    torch.manual_seed(seed)
    return Gemma4ForCausalLM._from_config(config, dtype=init_dtype or dtype).to(dtype).eval()
