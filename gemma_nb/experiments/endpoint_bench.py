"""Notebook 07's endpoint benchmark (measured by ``gemma_nb.serving.client_bench``): summary per
concurrency, metrics, figure."""

import pandas as pd

from gemma_nb import plots
from gemma_nb.endpoint import local_server
from gemma_nb.metrics import headline
from gemma_nb.paths import artifacts_dir
from gemma_nb.serving.client_bench import benchmark_endpoint, percentile


def measure_endpoint(
    endpoint: str = "",
    target: str = "cpu",
    model_id: str | None = None,
    runtime: str = "auto",
    **benchmark_kwargs,
) -> pd.DataFrame | None:
    """Notebook 07's run: ``endpoint``, else (cpu, cuda) this project's server on loopback for
    ``model_id`` (``runtime= "deploy"``: the slim deploy of notebook 04's ``04_tiny``); None on
    neuron without an endpoint (serve the port's there)."""
    if endpoint:
        return benchmark_endpoint(endpoint, **benchmark_kwargs)
    if target == "neuron":
        return None
    artifact = ["--artifact", str(artifacts_dir(target) / "04_tiny")] if runtime == "deploy" else []
    with local_server(target, model_id, runtime=runtime, extra_args=artifact) as url:
        return benchmark_endpoint(url, **benchmark_kwargs)


def summarize(requests: pd.DataFrame) -> pd.DataFrame:
    """Per concurrency level: TTFT and ITL percentiles, one client's median decode rate, all tokens
    / wall (``tok_s_total``)."""
    rows = []
    for level, group in requests.groupby("concurrency", sort=True):
        gaps = [g for gaps in group["itl_ms"] for g in gaps]
        rows.append(
            {
                "concurrency": int(level),
                "requests": len(group),
                "ttft_ms_p50": percentile(group["ttft_ms"], 50),
                "ttft_ms_p90": percentile(group["ttft_ms"], 90),
                "itl_ms_p50": percentile(gaps, 50),
                "itl_ms_p90": percentile(gaps, 90),
                "tok_s_per_request": float(group["decode_tok_s"].median()),
                "tok_s_total": float(
                    group["completion_tokens"].sum() / group["level_wall_s"].iloc[0]
                ),
            }
        )
    return pd.DataFrame(rows)


def endpoint_metrics(requests: pd.DataFrame | None, endpoint: str = "") -> tuple[dict, list[dict]]:
    """(metrics, headline rows); the story's 6 tok/s is the claim only for an external ``endpoint``
    (local: tiny checkpoint)."""
    if requests is None:
        return {"measured": False, "endpoint": endpoint or None}, []
    summary = summarize(requests).set_index("concurrency")
    lowest, highest = summary.index.min(), summary.index.max()
    metrics = {
        "measured": True,
        "endpoint": "external" if endpoint else "local gemma_nb serve",
        "requests_per_level": int(summary["requests"].iloc[0]),
        "max_tokens": int(requests["completion_tokens"].max()),
        "by_concurrency": {
            int(c): {k: float(v) for k, v in row.drop("requests").items()}
            for c, row in summary.iterrows()
        },
        "ttft_growth_x": float(
            summary.loc[highest, "ttft_ms_p50"] / summary.loc[lowest, "ttft_ms_p50"]
        ),
        "tok_s_total_growth_x": float(
            summary.loc[highest, "tok_s_total"] / summary.loc[lowest, "tok_s_total"]
        ),
    }
    return metrics, [
        headline("endpoint TTFT p50, 1 client", round(summary.loc[lowest, "ttft_ms_p50"], 1), "ms"),
        headline("endpoint ITL p50, 1 client", round(summary.loc[lowest, "itl_ms_p50"], 2), "ms"),
        headline(
            "endpoint decode speed, 1 client",
            round(summary.loc[lowest, "tok_s_per_request"], 1),
            "tok/s",
            claim="decode_tok_s" if endpoint else None,
        ),
        headline(
            f"endpoint tok/s, {highest} clients together",
            round(summary.loc[highest, "tok_s_total"], 1),
            "tok/s",
        ),
    ]


def plot_benchmark(requests: pd.DataFrame, title: str):
    """Three panels: TTFT and ITL distributions per concurrency level, tok/s against concurrency."""
    fig, (ax_ttft, ax_itl, ax_tok) = plots.subplots(1, 3, figsize=(10, 3.6))
    levels = sorted(requests["concurrency"].unique())
    ttft = [requests.loc[requests["concurrency"] == c, "ttft_ms"].to_numpy() for c in levels]
    itl = [
        [gap for gaps in requests.loc[requests["concurrency"] == c, "itl_ms"] for gap in gaps]
        for c in levels
    ]
    _ = ax_ttft.boxplot(ttft, tick_labels=[str(c) for c in levels])
    _ = ax_ttft.set(xlabel="concurrent requests", ylabel="time to first token (ms)", title="TTFT")
    _ = ax_itl.boxplot(itl, tick_labels=[str(c) for c in levels], showfliers=False)
    _ = ax_itl.set(
        xlabel="concurrent requests",
        ylabel="inter-token latency (ms)",
        title="ITL (outliers hidden)",
    )
    summary = summarize(requests)
    _ = ax_tok.plot(
        summary["concurrency"], summary["tok_s_total"], marker="o", label="all clients together"
    )
    _ = ax_tok.plot(
        summary["concurrency"], summary["tok_s_per_request"], marker="s", label="one client"
    )
    # room for the legend
    top = 1.6 * summary[["tok_s_total", "tok_s_per_request"]].to_numpy().max()
    _ = ax_tok.set(
        xlabel="concurrent requests",
        ylabel="tokens / s",
        title="throughput",
        xticks=levels,
        ylim=(0, top),
    )
    _ = ax_tok.legend(loc="upper left", fontsize=8)
    fig.suptitle(title)
    return fig
