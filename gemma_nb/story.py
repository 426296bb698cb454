"""What outside sources published (keys of ``docs/sources.md``), each figure with the range it
stands for, and when a computed value agrees with it. Never used as a computed result."""

import math
from collections import namedtuple
from collections.abc import Mapping
from dataclasses import dataclass

import pandas as pd


class UnknownClaim(KeyError, ValueError):
    """A claim key that is not in ``CLAIMS`` (a ``KeyError`` for lookups, a ``ValueError`` for
    arguments)."""

    def __str__(self) -> str:  # KeyError's own str() would quote the message
        return str(self.args[0]) if self.args else ""


@dataclass(frozen=True)
class Claim:
    value: float
    unit: str
    text: str
    source: str
    within: tuple[float, float]  # (low, high): the values this figure stands for, ends included

    @property
    def decimals(self) -> int:
        """Decimals of the figure as written (a quoted range: those of its ends)."""
        low, high = self.within
        return (
            max(0, -math.floor(math.log10((high - low) / 2) + 1e-9))
            if self.is_point
            else _decimals(low, high)
        )

    @property
    def is_point(self) -> bool:
        """A single figure (its range is its own rounding), not a quoted range such as "~3-4 GB"."""
        low, high = self.within
        half = (high - low) / 2
        return (
            math.isclose(half, 10 ** round(math.log10(half)))
            and math.isclose(low + half, self.value)
            and _decimals(self.value) <= round(-math.log10(half))
        )

    def written(self) -> str:
        """The figure as the source wrote it, with its unit: "45.6 GB", "3-4 GB"."""
        low, high = self.within
        number = f"{self.value:.{self.decimals}f}" if self.is_point else f"{low:g}-{high:g}"
        return with_unit(number, self.unit)


CLAIMS: dict[str, Claim] = {
    # 01 memory arithmetic
    "experts_bf16_gb": Claim(
        45.6, "GB", "bf16 routed experts, whole model", "port-review, port-card", (45.5, 45.7)
    ),
    "experts_share_pct": Claim(
        93.0, "%", "experts' share of the weights", "port-review", (92.0, 94.0)
    ),
    "experts_bf16_gb_per_rank": Claim(
        22.8, "GB", "bf16 experts per rank at TP=2", "port-review", (22.7, 22.9)
    ),
    "experts_int8_gb_per_rank": Claim(
        11.4, "GB", "int8 experts per rank at TP=2", "port-review", (11.3, 11.5)
    ),
    "int8_experts_gap_gb": Claim(
        3.5, "GB", "int8-experts build short of HBM by ~3-4 GB", "port-review", (3.0, 4.0)
    ),
    "lm_head_bf16_gb_per_rank": Claim(
        1.48, "GB", "replicated bf16 tied lm_head per rank", "port-review", (1.47, 1.49)
    ),
    "lm_head_int8_sharded_gb_per_rank": Claim(
        0.37, "GB", "int8 lm_head sharded over 2 ranks, per rank", "port-review", (0.36, 0.38)
    ),
    "lm_head_released_gb_per_rank": Claim(
        1.11, "GB", "released per rank by sharding int8 lm_head", "port-review", (1.1, 1.12)
    ),
    "shared_mlp_int8_saving_gb_per_rank": Claim(
        0.27, "GB", "saved per rank by int8 shared MLP", "port-review", (0.26, 0.28)
    ),
    "final_residency_gb_per_rank": Claim(
        12.5, "GB", "final residency per rank, ~12-13 GB", "port-review", (12.0, 13.0)
    ),
    "hbm_per_core_gb": Claim(
        16.0, "GB", "HBM per NeuronCore on inf2", "port-review, inferentia2-arch", (15.0, 17.0)
    ),
    "total_params_b": Claim(
        25.2, "B", "total parameters (model card)", "gemma4-model-card", (25.1, 25.3)
    ),
    "active_params_b": Claim(
        3.8, "B", "active parameters per token (model card)", "gemma4-model-card", (3.7, 3.9)
    ),
    "active_params_port_card_b": Claim(
        3.2,
        "B",
        "active parameters per token (the port's own card, ~3.2B)",
        "port-card",
        (3.1, 3.3),
    ),
    "compile_peak_host_gb": Claim(
        180.0, "GB", "peak host RAM to compile", "port-review", (179.9, 180.1)
    ),
    "compile_minutes": Claim(
        40.0, "min", "compile wall time on inf2.8xlarge + 100 GB swap", "port-review", (39.9, 40.1)
    ),
    "neff_gb": Claim(26.7, "GB", "compiled NEFF size", "port-review", (26.6, 26.8)),
    "compile_swap_gb": Claim(
        100.0, "GB", "swap beside the compile box's RAM", "port-review", (99.9, 100.1)
    ),
    "deploy_swap_gb": Claim(
        40.0, "GB", "swapfile on the serving box for the load peak", "port-card", (39.9, 40.1)
    ),
    "host_embedding_gb": Claim(
        1.48, "GB", "embed_tokens.pt loaded on the host", "port-review", (1.47, 1.49)
    ),
    "neff_load_s": Claim(112.0, "s", "NEFF load time at deploy", "port-review", (111.9, 112.1)),
    "deploy_peak_rss_gb": Claim(
        11.0, "GB", "host RSS peak while deploying", "port-card", (10.9, 11.1)
    ),
    "cold_start_s": Claim(
        490.0, "s", "fresh spot instance to ready", "port-review", (489.9, 490.1)
    ),
    # 06 embedding scale
    "embed_scale": Claim(
        53.0,
        "x",
        "Gemma4TextScaledWordEmbedding scale, sqrt(hidden) ~ 53",
        "port-review",
        (52.0, 54.0),
    ),
    # 07 decode
    "prefill_s": Claim(0.25, "s", "prefill time", "port-card", (0.24, 0.26)),
    "decode_tok_s": Claim(
        6.0, "tok/s", "decode speed of the DenseExperts deploy", "port-card", (5.9, 6.1)
    ),
    "dense_flops_waste_x": Claim(
        16.0, "x", "wasted expert FLOPs, 128 computed vs 8 routed", "port-review", (15.9, 16.1)
    ),
    "answer_500_tokens_s": Claim(
        83.0, "s", "time for a 500-token answer", "port-review", (82.9, 83.1)
    ),
    "nxdi_trn2_tok_s": Claim(
        117.5,
        "tok/s",
        "NxDI contrib port on trn2.48xlarge TP=8 bf16 (TPOT 8.3-8.8 ms)",
        "nxdi-source",
        (117.4, 117.6),
    ),
    "gpt_fast_mixtral_int8_tok_s": Claim(
        97.9, "tok/s", "gpt-fast Mixtral int8 on 1 A100", "gpt-fast", (97.8, 98.0)
    ),
    "llama_cpp_q4_cpu_tok_s": Claim(
        9.25,
        "tok/s",
        "llama.cpp Gemma-4-26B Q4 CPU-only (i5-8500)",
        "llama-cpp-gemma4-cpu",
        (9.24, 9.26),
    ),
}


def _decimals(*values: float) -> int:
    """The decimals ``repr`` writes the most precise of ``values`` with (3.0 -> 0, 0.37 -> 2)."""
    return max(len(repr(float(v)).split(".")[1].rstrip("0")) for v in values)


def with_unit(number: str, unit: str) -> str:
    """``number`` and ``unit`` as a reader writes them: "45.6 GB", "93%", "53x"."""
    return f"{number}{unit}" if unit in ("%", "x") else f"{number} {unit}".strip()


# A computed figure that bounds the claim from below: shown as "≥ value"; holds if at most the
# claim.
LowerBound = namedtuple("LowerBound", "value")


def claims_table(computed: Mapping[str, float | LowerBound]):
    """The story's figures beside this run's (claim key -> value or ``LowerBound``): computed with
    one decimal more than the claim (two more than a quoted range), diff in % for a single figure
    only, and whether it holds."""
    rows = []
    for key, value in computed.items():
        claim = get_claim(key)
        bound = isinstance(value, LowerBound)
        number = float(value.value if bound else value)
        shown = with_unit(
            f"{number:,.{claim.decimals + (1 if claim.is_point else 2)}f}", claim.unit
        )
        diff = (
            ""
            if bound or not claim.is_point
            else f"{100.0 * (number - claim.value) / claim.value:+.2f}%"
        )
        rows.append(
            {
                "figure": claim.text,
                "claimed": claim.written(),
                "computed": f"≥ {shown}" if bound else shown,
                "diff": diff,
                "holds": number <= claim.within[1] if bound else agrees_with_claim(key, number),
                "source": claim.source,
            }
        )
    return pd.DataFrame(rows, columns=["figure", "claimed", "computed", "diff", "holds", "source"])


def get_claim(key: str) -> Claim:
    if key not in CLAIMS:
        raise UnknownClaim(
            f"claim {key!r} is not in gemma_nb.story.CLAIMS; pass one of its keys "
            f"(e.g. {next(iter(CLAIMS))!r}) or add the claim there with its source and range"
        )
    return CLAIMS[key]


def agrees_with_claim(key: str, computed: float) -> bool:
    low, high = get_claim(key).within
    return low <= float(computed) <= high
