"""What the source write-ups claimed, with where each figure comes from.

These are the only literal result figures in the project. Notebooks compute their own values and
show them beside these with ``compare``; nothing here is ever used as a computed result.
``Claim.source`` names one or more keys (comma-separated) of ``docs/sources.md``, which says what
each source is and where to read it: e.g. ``port-review`` (a review of the port's write-up),
``port-card`` (the port's model card), ``inferentia2-arch`` (AWS Neuron docs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping


@dataclass(frozen=True)
class Claim:
    value: float
    unit: str
    text: str
    source: str


CLAIMS: dict[str, Claim] = {
    # 01 memory arithmetic
    "experts_bf16_gb": Claim(45.6, "GB", "bf16 routed experts, whole model", "port-review, port-card"),
    "experts_share_pct": Claim(93.0, "%", "experts' share of the weights", "port-review"),
    "experts_bf16_gb_per_rank": Claim(22.8, "GB", "bf16 experts per rank at TP=2", "port-review"),
    "experts_int8_gb_per_rank": Claim(11.4, "GB", "int8 experts per rank at TP=2", "port-review"),
    "int8_experts_gap_gb": Claim(3.5, "GB", "int8-experts build short of HBM by ~3-4 GB", "port-review"),
    "int8_experts_non_expert_gb": Claim(3.5, "GB", "the ~3-4 GB gap read as what else besides the experts sits in HBM per rank", "port-review"),
    "lm_head_bf16_gb_per_rank": Claim(1.48, "GB", "replicated bf16 tied lm_head per rank", "port-review"),
    "lm_head_int8_sharded_gb_per_rank": Claim(0.37, "GB", "int8 lm_head sharded over 2 ranks, per rank", "port-review"),
    "lm_head_released_gb_per_rank": Claim(1.11, "GB", "released per rank by sharding int8 lm_head", "port-review"),
    "shared_mlp_int8_saving_gb_per_rank": Claim(0.27, "GB", "saved per rank by int8 shared MLP", "port-review"),
    "final_residency_gb_per_rank": Claim(12.5, "GB", "final residency per rank, ~12-13 GB", "port-review"),
    "hbm_per_core_gb": Claim(16.0, "GB", "HBM per NeuronCore on inf2", "port-review, inferentia2-arch"),
    "total_params_b": Claim(25.2, "B", "total parameters (model card)", "gemma4-model-card"),
    "active_params_b": Claim(3.8, "B", "active parameters per token (model card)", "gemma4-model-card"),
    "active_params_port_card_b": Claim(3.2, "B", "active parameters per token (the port's own card, ~3.2B)", "port-card"),
    "experts_share_all_weights_pct": Claim(90.51, "%", "routed experts' share of all weights (meta-device count)", "meta-device-count"),
    "kv_cache_bytes_per_token_per_rank": Claim(112640.0, "B", "bf16 KV cache per token per rank at TP=2", "meta-device-count"),
    # 04/05 compile and deploy
    "compile_peak_host_gb": Claim(180.0, "GB", "peak host RAM to compile", "port-review"),
    "compile_minutes": Claim(40.0, "min", "compile wall time on inf2.8xlarge + 100 GB swap", "port-review"),
    "neff_gb": Claim(26.7, "GB", "compiled NEFF size", "port-review"),
    "host_embedding_gb": Claim(1.48, "GB", "embed_tokens.pt loaded on the host", "port-review"),
    "neff_load_s": Claim(112.0, "s", "NEFF load time at deploy", "port-review"),
    "deploy_peak_rss_gb": Claim(11.0, "GB", "host RSS peak while deploying", "port-card"),
    "cold_start_s": Claim(490.0, "s", "fresh spot instance to ready", "port-review"),
    # 06 embedding scale
    "embed_scale": Claim(53.0, "x", "Gemma4TextScaledWordEmbedding scale, sqrt(hidden) ~ 53", "port-review"),
    # 07 decode
    "prefill_s": Claim(0.25, "s", "prefill time", "port-card"),
    "decode_tok_s": Claim(6.0, "tok/s", "decode speed of the DenseExperts deploy", "port-card"),
    "dense_flops_waste_x": Claim(16.0, "x", "wasted expert FLOPs, 128 computed vs 8 routed", "port-review"),
    "answer_500_tokens_s": Claim(83.0, "s", "time for a 500-token answer", "port-review"),
    "dense_roofline_tok_s": Claim(33.0, "tok/s", "DenseExperts bandwidth roofline on inf2.xlarge", "inf2-roofline"),
    "sparse_roofline_tok_s": Claim(178.0, "tok/s", "top-8 gather bandwidth roofline on inf2.xlarge", "inf2-roofline"),
    "dense_gb_per_token": Claim(26.4, "GB", "bytes read per token by DenseExperts (int8 experts/MLP/head, bf16 attention)", "inf2-roofline"),
    "sparse_gb_per_token": Claim(4.9, "GB", "bytes read per token with a top-8 gather", "inf2-roofline"),
    "dense_gflop_per_token": Claim(46.0, "GFLOP", "compute per token, DenseExperts", "inf2-roofline"),
    "upcast_hypothesis_gb_per_token": Claim(118.0, "GB", "HYPOTHESIS: traffic per token if int8 experts are upcast to a bf16 copy each step", "inf2-roofline"),
    "upcast_hypothesis_tok_s": Claim(7.5, "tok/s", "HYPOTHESIS: decode speed under that upcast traffic", "inf2-roofline"),
    "cpu_read_gb_s": Claim(24.0, "GB/s", "read bandwidth of the 2-core reference box", "reference-box"),
    "cpu_layer_dense_bf16_ms": Claim(96.0, "ms", "one full-size MoE layer, all 128 experts, bf16, 1 token", "reference-box"),
    "cpu_layer_grouped_mm_bf16_ms": Claim(7.8, "ms", "one full-size MoE layer, transformers grouped_mm, bf16, 1 token", "reference-box"),
    "nxdi_trn2_tok_s": Claim(117.5, "tok/s", "NxDI contrib port on trn2.48xlarge TP=8 bf16 (TPOT 8.3-8.8 ms)", "nxdi-source"),
    "gpt_fast_mixtral_int8_tok_s": Claim(97.9, "tok/s", "gpt-fast Mixtral int8 on 1 A100", "gpt-fast"),
    "llama_cpp_q4_cpu_tok_s": Claim(9.25, "tok/s", "llama.cpp Gemma-4-26B Q4 CPU-only (i5-8500)", "llama-cpp-gemma4-cpu"),
}


def source_keys(claim: Claim) -> list[str]:
    """The ``docs/sources.md`` keys a claim names."""
    return [key.strip() for key in claim.source.split(",") if key.strip()]


def compare(computed: Mapping[str, float], claims: Mapping[str, Claim] | None = None):
    """A table of claimed vs computed figures: claim, claimed, computed, unit, diff, diff %.

    ``computed`` maps claim keys to the values this run computed. An unknown key is an error:
    a claim needs a source before it can be compared.
    """
    import pandas as pd

    claims = CLAIMS if claims is None else claims
    rows = []
    for key, value in computed.items():
        if key not in claims:
            raise KeyError(f"claim {key!r} is not in gemma_nb.story.CLAIMS; add it there with its source")
        claim = claims[key]
        diff = float(value) - claim.value
        rows.append(
            {
                "claim": claim.text,
                "claimed": claim.value,
                "computed": float(value),
                "unit": claim.unit,
                "diff": diff,
                "diff_pct": 100.0 * diff / claim.value if claim.value else float("nan"),
                "source": claim.source,
            }
        )
    return pd.DataFrame(rows, columns=["claim", "claimed", "computed", "unit", "diff", "diff_pct", "source"])
