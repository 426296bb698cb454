"""Notebook 01 (memory arithmetic): the write-up's memory figures computed from the planner
(``gemma_nb.memory``), its plans drawn, and its "~3-4 GB short" set against what the plans allow."""

from collections.abc import Mapping, Sequence

import matplotlib.pyplot as plt
import pandas as pd
import seaborn as sns

from gemma_nb.formats import tensor_bytes
from gemma_nb.hardware import GB, get_instance
from gemma_nb.memory import (
    PLAN_ROWS,
    SHIPPED_CONTEXT_LEN,
    Plan,
    allowance_window,
    kv_cache_bytes,
    param_summary,
    plan,
)
from gemma_nb.story import get_claim


def plot_plans(plans: Sequence[Plan], ax, budgets: Mapping[str, float] | None = None) -> None:
    """Stacked bars of GB per rank per group, one per plan, total inside the top; ``budgets``: label
    -> GB lines."""
    long = pd.concat([p.table.assign(scheme=p.scheme.name) for p in plans], ignore_index=True)
    long = long[long["bytes_per_rank"] > 0]
    order = [g for g in PLAN_ROWS if g in set(long["group"])]
    sns.histplot(
        data=long,
        x="scheme",
        weights="gb_per_rank",
        hue="group",
        hue_order=order,
        multiple="stack",
        discrete=True,
        shrink=0.75,
        ax=ax,
        palette="colorblind",
        linewidth=0.5,
        edgecolor="white",
        alpha=0.9,
    )
    for x, p in enumerate(plans):
        ax.annotate(
            f"{p.total_gb:.1f}",
            xy=(x, p.total_gb),
            xytext=(0, -3),
            textcoords="offset points",
            ha="center",
            va="top",
            fontsize=9,
            color="white",
        )
    ax.set(
        xlabel=f"scheme (TP={plans[0].tp}, {plans[0].context_len}-token KV cache)",
        ylabel="HBM per rank (GB)",
    )
    plt.setp(ax.get_xticklabels(), rotation=25, horizontalalignment="right")
    lines = [
        ax.axhline(value, color="0.2", linestyle=style, linewidth=1.2, label=label)
        for (label, value), style in zip((budgets or {}).items(), ("--", ":", "-."))
    ]
    # seaborn's legend (the groups) replaced by one outside the axes that adds the budget lines
    groups = ax.get_legend()
    ax.legend(
        handles=[*groups.legend_handles, *lines],
        labels=[*(text.get_text() for text in groups.get_texts()), *(budgets or {})],
        loc="upper left",
        bbox_to_anchor=(1.01, 1.0),
        frameon=False,
        fontsize=9,
    )


def plot_fit_heatmap(table, ax, value: str = "headroom_gb") -> None:
    """Instance x scheme heatmap of headroom per NeuronCore (GB); rows: instance, TP degree,
    on-demand USD/hour."""
    labelled = table.assign(
        row=[
            f"{i}  TP={t}  USD {p:.2f}/h"
            for i, t, p in zip(table["instance"], table["tp"], table["usd_per_hour"])
        ]
    )
    grid = labelled.pivot(index="row", columns="scheme", values=value)
    grid = grid.loc[list(dict.fromkeys(labelled["row"])), list(dict.fromkeys(labelled["scheme"]))]
    limit = float(abs(grid).max().max()) or 1.0
    sns.heatmap(
        grid,
        annot=True,
        fmt="+.1f",
        cmap="RdYlGn",
        center=0.0,
        vmin=-limit,
        vmax=limit,
        cbar_kws={"label": "headroom (GB)"},
        ax=ax,
        linewidths=0.5,
    )
    ax.set(xlabel="scheme", ylabel="")
    plt.setp(ax.get_xticklabels(), rotation=25, horizontalalignment="right")


def story_figures(config, tp: int = 2, context_len: int = SHIPPED_CONTEXT_LEN) -> dict[str, float]:
    """Every memory figure of the write-up from ``config`` (GB = 10^9 bytes; per rank from ``plan``
    at ``tp``, on an inf2.xlarge), keyed by the ``gemma_nb.story`` claim it answers;
    ``experts_share_pct``: of the non-embedding weights."""
    summary, host = param_summary(config), get_instance("inf2.xlarge")
    bf16, int8_experts, squeeze = (
        plan(config, tp, scheme, context_len) for scheme in ("bf16", "int8_experts", "int8_squeeze")
    )
    experts_int8 = int8_experts.bytes("experts")
    return {
        "total_params_b": summary["total_params"] / 1e9,
        "active_params_b": summary["active_params"] / 1e9,
        "active_params_port_card_b": summary["active_params_excl_embeddings"] / 1e9,
        "experts_bf16_gb": tensor_bytes(summary["experts_params"], "bf16") / GB,
        "experts_share_pct": summary["experts_share_non_embedding_pct"],
        "experts_share_all_weights_pct": summary["experts_share_pct"],
        "experts_bf16_gb_per_rank": bf16.gb("experts"),
        "experts_int8_gb_per_rank": experts_int8 / GB,
        "int8_experts_gap_gb": (int8_experts.total_bytes - host.budget_bytes("story")) / GB,
        "int8_experts_non_expert_gb": (int8_experts.total_bytes - experts_int8) / GB,
        "lm_head_bf16_gb_per_rank": int8_experts.gb("lm_head"),
        "lm_head_int8_sharded_gb_per_rank": squeeze.gb("lm_head"),
        "lm_head_released_gb_per_rank": (int8_experts.bytes("lm_head") - squeeze.bytes("lm_head"))
        / GB,
        "shared_mlp_int8_saving_gb_per_rank": (
            int8_experts.bytes("shared_mlp") - squeeze.bytes("shared_mlp")
        )
        / GB,
        "final_residency_gb_per_rank": (squeeze.total_bytes - squeeze.bytes("runtime_allowance"))
        / GB,
        "hbm_per_core_gb": host.hbm_per_core_bytes / GB,
        "host_embedding_gb": squeeze.table.set_index("group").loc["embeddings", "host_bytes"] / GB,
        "kv_cache_bytes_per_token_per_rank": float(kv_cache_bytes(config, tp, 1, dtype="bf16")),
    }


def gap_readings(config, tp: int = 2, context_len: int = SHIPPED_CONTEXT_LEN):
    """The write-up's "~3-4 GB short" read three ways for the inf2.xlarge's int8-experts build: GB
    per rank, in the claim?"""
    failing, host = plan(config, tp, "int8_experts", context_len), get_instance("inf2.xlarge")
    rows = [
        (
            "what the build holds in HBM per rank besides its experts",
            (failing.total_bytes - failing.bytes("experts")) / GB,
        ),
        (
            "how far the build overflows the story's 16 GB core",
            (failing.total_bytes - host.budget_bytes("story")) / GB,
        ),
        (
            "how far the build overflows a 16 GiB core (AWS)",
            (failing.total_bytes - host.budget_bytes("spec")) / GB,
        ),
    ]
    low, high = get_claim("int8_experts_gap_gb").within
    return pd.DataFrame(
        [
            {"reading": text, "computed_gb": gb, "inside_claim": low <= gb <= high}
            for text, gb in rows
        ]
    )


def allowance_table(
    config, tp: int = 2, context_len: int = SHIPPED_CONTEXT_LEN, words: bool = True
):
    """``memory.allowance_window`` in GB for the story's 16 GB and the 16 GiB core, "short by" the
    claim's middle; rows in words, or with ``words=False`` the window's keys and columns ``story``,
    ``spec``."""
    host, claim = get_instance("inf2.xlarge"), get_claim("int8_experts_gap_gb")
    budgets = {"story": "16 GB core (the story)", "spec": "16 GiB core (AWS)"}
    columns = {
        (label if words else name): host.budget_bytes(name) for name, label in budgets.items()
    }
    windows = {
        label: allowance_window(
            config,
            "int8_experts",
            "int8_squeeze",
            tp,
            context_len,
            budget_bytes=budget,
            short_by_bytes=int(claim.value * GB),
        )
        for label, budget in columns.items()
    }
    table = pd.DataFrame(
        {
            label: {k.replace("_bytes", "_gb"): v / GB for k, v in window.items()}
            for label, window in windows.items()
        }
    )
    if not words:
        return table
    return table.rename(
        index={
            "budget_gb": "HBM per core",
            "failing_static_gb": "int8_experts: weights + KV cache",
            "fitting_static_gb": "int8_squeeze: weights + KV cache",
            "min_to_fail_gb": "int8_experts fails above this runtime allowance",
            "max_to_fit_gb": "int8_squeeze fits up to this runtime allowance",
            "allowance_if_short_by_gb": "runtime allowance for int8_experts to be short by "
            f"{claim.value:g} GB",
            "fitting_overflow_then_gb": "int8_squeeze's overflow under that allowance",
        }
    )
