"""Notebook 07's decode beyond one stream: one full-size MoE layer timed at batch B, routed
uniformly or by the bundled checkpoint's own router, and where dense overtakes sparse, measured and
predicted."""

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import pandas as pd
import torch

from gemma_nb import bench, moe
from gemma_nb.decode_roofline import expected_distinct_experts, selective_loading
from gemma_nb.evaluate import greedy_generate, length_batches


@dataclass(frozen=True)
class RealRouting:
    """Decode-step tokens' routing: ``index``/``weights [N, L, K]``, ``prompt [N]`` (which prompt
    each continues)."""

    index: torch.Tensor
    weights: torch.Tensor
    prompt: torch.Tensor
    num_experts: int

    def sample(self, batch: int, generator: torch.Generator) -> torch.Tensor:
        """Row numbers of ``batch`` tokens from ``batch`` different prompts (B streams, one token
        each)."""
        numbers = self.prompt.unique()
        if batch > len(numbers):
            raise ValueError(
                f"batch {batch} needs {batch} different prompts; the routing holds {len(numbers)}"
            )
        chosen = numbers[torch.randperm(len(numbers), generator=generator)[:batch]]
        rows = [torch.nonzero(self.prompt == p).flatten() for p in chosen.tolist()]
        return torch.stack(
            [r[torch.randint(len(r), (1,), generator=generator)] for r in rows]
        ).flatten()


@torch.inference_mode()
def capture_real_routing(
    model, tokenizer, prompts: Sequence[str], new_tokens: int = 3
) -> RealRouting:
    """Every layer's router choices for ``new_tokens`` greedy tokens fed back after each prompt
    (batched by length)."""
    found = moe.experts_modules(model)
    assert found, f"{type(model).__name__} has no routed experts to record"
    seen: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in found]
    hooks = [
        module.register_forward_pre_hook(
            lambda _m, args, n=n: seen[n].append((args[1].clone(), args[2].clone()))
        )
        for n, (_, _, module) in enumerate(found)
    ]
    token_lists = [tokenizer(text).input_ids for text in prompts]
    index, weights, prompt = [], [], []
    try:
        for numbers, batch in length_batches(token_lists):
            length = batch.shape[1]
            ids = greedy_generate(model, batch, new_tokens + 1)
            for calls in seen:
                calls.clear()
            model(input_ids=ids[:, : length + new_tokens], use_cache=False)
            shape = (len(numbers), length + new_tokens, -1)
            # per layer: [P, n, K] x 2
            fed_back = [tuple(t.reshape(shape)[:, length:] for t in calls[0]) for calls in seen]
            index.append(torch.stack([f[0] for f in fed_back], dim=2).flatten(0, 1))
            weights.append(torch.stack([f[1] for f in fed_back], dim=2).flatten(0, 1))
            prompt.append(torch.tensor(numbers).repeat_interleave(new_tokens))
    finally:
        for hook in hooks:
            hook.remove()
    return RealRouting(
        torch.cat(index), torch.cat(weights).float(), torch.cat(prompt), found[0][2].num_experts
    )


def full_size_routes(
    real: RealRouting, rows: torch.Tensor, num_experts: int, top_k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens ``rows`` as one E-expert top-K layer's routes: id = layer x E_tiny + expert, weights /
    layers (sum to 1)."""
    layers, tiny_k = real.index.shape[1:]
    assert layers * real.num_experts == num_experts and layers * tiny_k == top_k, (
        f"{layers} layers x {real.num_experts} experts, top-{tiny_k}, do not make one "
        f"{num_experts}-expert top-{top_k} layer"
    )
    offset = (torch.arange(layers) * real.num_experts)[None, :, None]
    index = (real.index[rows] + offset).reshape(len(rows), top_k)
    return index.long(), (real.weights[rows] / layers).reshape(len(rows), top_k)


def uniform_routes(
    batch: int, count: int, num_experts: int, top_k: int, seed: int = 0
) -> list[tuple[torch.Tensor, ...]]:
    """``count`` routings of ``batch`` tokens, each token's top-k uniformly at random
    (``moe.random_routing``)."""
    return [
        moe.random_routing(batch, num_experts, top_k, seed=seed * 10_000 + batch * 100 + i)
        for i in range(count)
    ]


def real_routes(
    real: RealRouting, batch: int, count: int, num_experts: int, top_k: int
) -> list[tuple[torch.Tensor, ...]]:
    """``count`` routings of ``batch`` real tokens from different prompts, on the full-size layer's
    ids."""
    generator = torch.Generator().manual_seed(batch)
    return [
        full_size_routes(real, real.sample(batch, generator), num_experts, top_k)
        for _ in range(count)
    ]


def distinct_table(real: RealRouting, batches: Sequence[int], draws: int = 200) -> pd.DataFrame:
    """Distinct experts per layer for B tokens (and on the 26B layer's ids): formula, ``draws``
    uniform and real routings."""
    experts, top_k = real.num_experts, real.index.shape[2]
    generator = torch.Generator().manual_seed(0)
    rows = []
    for batch in batches:
        uniform = [
            moe.random_routing(batch, experts, top_k, seed=batch * 1_000 + d)[0].unique().numel()
            for d in range(draws)
        ]
        real_counts = [
            _distinct_per_layer(real.index[real.sample(batch, generator)], experts).mean()
            for _ in range(draws)
        ]
        formula = expected_distinct_experts(experts, top_k, batch)
        rows.append(
            {
                "batch": batch,
                "formula": formula,
                "uniform": sum(uniform) / draws,
                "real": float(torch.stack(real_counts).mean()),
                "real_vs_uniform": float(torch.stack(real_counts).mean()) / formula,
            }
        )
    table = pd.DataFrame(rows).set_index("batch")
    return table.assign(
        **{f"{c}_full_size": table[c] * real.index.shape[1] for c in ("formula", "uniform", "real")}
    )


def _distinct_per_layer(index: torch.Tensor, num_experts: int) -> torch.Tensor:
    """``index [B, L, K]`` -> distinct experts per layer ``[L]`` (float)."""
    hit = torch.zeros(index.shape[1], num_experts, dtype=torch.bool)
    return (
        hit.scatter_(1, index.permute(1, 0, 2).reshape(index.shape[1], -1).long(), True)
        .sum(dim=1)
        .float()
    )


def time_batch_sweep(
    layers: Mapping[str, torch.nn.Module],
    routes: Mapping[str, Callable[[int, int], list]],
    hidden_size: int,
    batches: Sequence[int],
    steps_at_batch_1: int = 8,
    device: str = "cpu",
) -> pd.DataFrame:
    """p50 step time of every layer (``"dense bf16"``: path, dtype) at every batch
    (``steps_at_batch_1 // batch`` steps) for each routing source (``fn(batch, count)``), with the
    expert weight sets read; dense under uniform routing only."""
    rows = []
    for batch in batches[:2] if bench.smoke_timing() else batches:
        steps = max(1, steps_at_batch_1 // batch)  # a dense step at B = 64 takes seconds
        warmup = 1 if steps > 1 else 0
        x = (
            torch.randn(batch, hidden_size, generator=torch.Generator().manual_seed(batch))
            .to(torch.bfloat16)
            .to(device)
        )
        by_source = {source: make(batch, steps + warmup) for source, make in routes.items()}
        candidates, read = {}, {}
        for source, chosen in by_source.items():
            for name, module in layers.items():
                if name.startswith("dense") and source != "uniform":
                    continue
                key = f"{name} | {source}"
                candidates[key] = bench.layer_steps(
                    {key: module}, x, [(i.to(device), w.to(device)) for i, w in chosen]
                )[key]
                timed = chosen[warmup:]
                read[key] = (
                    sum(module.experts_read(index) for index, _ in timed) / len(timed),
                    sum(index.unique().numel() for index, _ in timed) / steps,
                )
        timings = bench.time_steps(candidates, steps=steps, repeats=1, warmup=warmup, device=device)
        for key in candidates:
            name, source = key.split(" | ")
            rows.append(
                {
                    "batch": batch,
                    "source": source,
                    "layer": name,
                    "path": name.split()[0],
                    "dtype": name.split()[-1],
                    "p50_ms": timings.p50_ms(key),
                    "min_ms": timings.min_ms(key),
                    "steps": steps,
                    "experts_read": read[key][0],
                    "distinct_experts": read[key][1],
                }
            )
    return pd.DataFrame(rows)


def batch_table(
    sweep: pd.DataFrame, expert_bytes: Mapping[str, int], bandwidth_bytes_s: float
) -> pd.DataFrame:
    """Per source, dtype and batch, dense and sparse: experts and bytes read (``expert_bytes``:
    dtype -> one expert's), p50, bandwidth floor, tokens/s; dense untimed under a source reuses
    uniform's."""
    rows = []
    for (source, dtype, batch), group in sweep.groupby(["source", "dtype", "batch"], sort=False):
        by_path = group.set_index("path")
        if "dense" not in by_path.index:
            uniform = sweep[
                (sweep["source"] == "uniform")
                & (sweep["dtype"] == dtype)
                & (sweep["batch"] == batch)
            ]
            by_path = pd.concat([by_path, uniform.set_index("path").loc[["dense"]]])
        row = {
            "source": source,
            "dtype": dtype,
            "batch": batch,
            "distinct_experts": by_path.loc["sparse", "distinct_experts"],
        }
        for path in ("dense", "sparse"):
            read, p50 = by_path.loc[path, "experts_read"], by_path.loc[path, "p50_ms"]
            nbytes = read * expert_bytes[dtype]
            floor = bench.floor_ms(nbytes, bandwidth_bytes_s)
            row.update(
                {
                    f"{path}_experts_read": read,
                    f"{path}_gb": nbytes / 1e9,
                    f"{path}_floor_ms": floor,
                    f"{path}_p50_ms": p50,
                    f"{path}_tok_s": 1000.0 * batch / p50,
                    f"{path}_x_floor": p50 / floor,
                }
            )
        row["sparse_vs_dense_x"] = row["dense_p50_ms"] / row["sparse_p50_ms"]
        rows.append(row)
    return pd.DataFrame(rows)


def first_batch(batches: Sequence[int], condition: Sequence[bool]) -> int | None:
    return next((b for b, ok in zip(batches, condition) if ok), None)


def crossovers(table: pd.DataFrame, num_experts: int, top_k: int) -> dict:
    """The first B where dense is no slower than sparse: measured (dtype, source), predicted from
    bytes, and NxD's rule."""
    batches = sorted(table["batch"].unique().tolist())
    measured = {
        dtype: {
            source: first_batch(
                group["batch"].tolist(), (group["dense_p50_ms"] <= group["sparse_p50_ms"]).tolist()
            )
            for source, group in by_dtype.sort_values("batch").groupby("source", sort=False)
        }
        for dtype, by_dtype in table.groupby("dtype", sort=False)
    }
    uniform = table[table["source"] == "uniform"].drop_duplicates("batch").sort_values("batch")
    return {
        "measured": measured,
        "batches": batches,
        "bytes_this_sparse": first_batch(
            uniform["batch"].tolist(),
            (uniform["dense_experts_read"] <= uniform["sparse_experts_read"]).tolist(),
        ),
        "bytes_selective_loading": first_batch(
            batches, [num_experts <= b * top_k for b in batches]
        ),
        "nxd_rule": first_batch(
            batches, [not selective_loading(num_experts, top_k, b) for b in batches]
        ),
    }


def verdict_table(table: pd.DataFrame, cross: Mapping, distinct: pd.DataFrame) -> pd.DataFrame:
    """This run's findings about batch decode, each computed from the tables: finding, value,
    basis."""
    largest = max(cross["batches"])
    said = lambda b: f"B = {b}" if b is not None else f"none up to B = {largest}"  # noqa: E731
    rows = [
        (
            f"dense no slower than sparse ({dtype}, {source} routing), measured",
            said(b),
            "p50 step times, this cpu",
        )
        for dtype, by_source in cross["measured"].items()
        for source, b in by_source.items()
    ]
    rows += [
        (
            "the same, predicted from bytes for this sparse path",
            said(cross["bytes_this_sparse"]),
            "each distinct expert read once from B x K = E on",
        ),
        (
            "the same, predicted from bytes for per-token selective loading",
            said(cross["bytes_selective_loading"]),
            "B x K expert reads per step (NxD's forward_selective_loading)",
        ),
        ("NxD's rule switches to all experts at", said(cross["nxd_rule"]), "B x K / E >= 1.0"),
    ]
    for dtype in table["dtype"].unique():
        ratios = table[(table["source"] == "uniform") & (table["dtype"] == dtype)].set_index(
            "batch"
        )["sparse_vs_dense_x"]
        rows.append(
            (
                f"sparse's lead over dense ({dtype}), B = {ratios.index[0]} -> {ratios.index[-1]}",
                f"{ratios.iloc[0]:.1f}x -> {ratios.iloc[-1]:.1f}x",
                "dense p50 / sparse p50, uniform routing",
            )
        )
    for dtype, group in table[table["source"] == "uniform"].groupby("dtype"):
        group = group.set_index("batch")
        rows.append(
            (
                f"dense {dtype} step, B = {group.index[-1]} vs B = {group.index[0]}",
                f"{group['dense_p50_ms'].iloc[-1] / group['dense_p50_ms'].iloc[0]:.1f}x",
                "same bytes read; the extra time is compute",
            )
        )
    for batch in (16, largest):
        if batch in distinct.index:
            rows.append(
                (
                    f"distinct experts at B = {batch}, real router vs uniform",
                    f"{distinct.loc[batch, 'real_vs_uniform']:.2f}x",
                    "bundled checkpoint, fact prompts",
                )
            )
    return pd.DataFrame(rows, columns=["finding", "value", "basis"])


def cost_table(summary: pd.DataFrame, deployment: str) -> pd.DataFrame:
    """``deployment``'s tokens/s and $ per million tokens for one stream and for the most that
    fit."""
    rows = summary[summary["deployment"] == deployment].set_index("path")
    assert not rows.empty, f"deployment {deployment!r} is not in the summary"
    cases = {
        "one stream": ("b1", 1),
        "all that fit, runtime takes the most": ("at_largest", rows.iloc[0]["largest_batch"]),
        "all that fit, runtime takes the least": ("if_low", rows.iloc[0]["largest_batch_if_low"]),
    }
    table = pd.DataFrame(
        [
            {
                ("", "streams"): streams,
                **{
                    (path, what): row[f"{what}_{suffix}"]
                    for path, row in rows.iterrows()
                    for what in ("tok_s", "usd_per_m")
                },
            }
            for suffix, streams in cases.values()
        ],
        index=list(cases),
    )
    table.columns = pd.MultiIndex.from_tuples(table.columns)
    return table.rename_axis(deployment)


def _batch_axis(ax, batches, label: str) -> None:
    ax.set_xscale("log", base=2)
    ticks = sorted({int(b) for b in batches})
    ax.set(xticks=ticks, xticklabels=[str(b) for b in ticks], xlabel=label)


def plot_distinct(distinct: pd.DataFrame, ax, num_experts: int) -> None:
    """Distinct experts per step on the 26B layer's ids vs batch: formula, uniform draws, real
    router."""
    _ = ax.plot(
        distinct.index, distinct["formula_full_size"], color="0.3", label="E (1 - (1 - K/E)^B)"
    )
    for column, style, color, label in (
        ("uniform_full_size", "o", "#0173b2", "uniform routing (drawn)"),
        ("real_full_size", "s-", "#de8f05", "bundled checkpoint's router"),
    ):
        _ = ax.plot(distinct.index, distinct[column], style, color=color, label=label)
    _ = ax.axhline(num_experts, color="0.6", linestyle=":", linewidth=1)
    _batch_axis(ax, distinct.index, "batch B (streams per decode step, log scale)")
    # room for the legend
    ax.set(ylabel=f"distinct experts per layer (of {num_experts})", ylim=(0, 1.4 * num_experts))
    ax.legend(loc="upper left", fontsize=8)


def plot_layer_sweep(table: pd.DataFrame, ax, source: str = "uniform") -> None:
    """One full-size layer on this machine: measured tokens/s (points) and bandwidth ceiling
    (dashed) vs batch."""
    colors = {
        "dense bf16": "#0173b2",
        "sparse bf16": "#de8f05",
        "dense int8": "#029e73",
        "sparse int8": "#d55e00",
    }
    rows = table[table["source"] == source]
    for name, color in colors.items():
        path, dtype = name.split()
        group = rows[rows["dtype"] == dtype].sort_values("batch")
        _ = ax.plot(
            group["batch"],
            group[f"{path}_tok_s"],
            "o-",
            color=color,
            label=f"{path} {dtype}, measured",
        )
        _ = ax.plot(
            group["batch"],
            1000.0 * group["batch"] / group[f"{path}_floor_ms"],
            "--",
            color=color,
            linewidth=1,
        )
    _batch_axis(ax, rows["batch"], "batch B (tokens per layer step, log scale)")
    ax.set(yscale="log", ylabel="layer tokens/s (log; dashed: bandwidth ceiling)")
    ax.set_ylim(top=ax.get_ylim()[1] * 30)  # a decade and more above the data for the legend
    ax.legend(loc="upper left", fontsize=8, ncols=2)


def plot_batch_roofline(
    rows: pd.DataFrame, ax, metric: str, limits: Mapping, reference: float, reference_label: str
) -> None:
    """One deployment's ``metric`` vs batch per path, shaded where the KV cache fits only if the
    runtime takes little or never."""
    labels = {
        "dense": "all experts (DenseExperts)",
        "sparse": "each distinct routed expert once",
        "nxd_rule": "NxD's rule: selective loading, all experts from B x K = E",
    }
    for path, group in rows.groupby("path", sort=False):
        group = group.sort_values("batch")
        _ = ax.plot(group["batch"], group[metric], marker=".", label=labels[path])
    top = rows["batch"].max()
    low, high = limits["largest_batch_if_low"], limits["largest_batch"]
    if high is not None and high < top and (low is None or low > high):
        _ = ax.axvspan(
            high + 0.5,
            min(low + 0.5, top) if low is not None else top,
            color="0.85",
            alpha=0.6,
            linewidth=0,
            label="KV cache fits only if the runtime takes little",
        )
    if low is not None and low < top:
        _ = ax.axvspan(
            low + 0.5, top, color="0.6", alpha=0.35, linewidth=0, label="KV cache does not fit"
        )
    _ = ax.axhline(reference, color="0.25", linestyle="--", linewidth=1.2, label=reference_label)
    _batch_axis(ax, rows["batch"], "batch B (streams, log scale)")
    ax.set(
        yscale="log",
        ylabel={
            "tok_s": "tokens/s, all streams (log)",
            "usd_per_m_tokens": "$ per million tokens (log)",
        }[metric],
    )


def batch_metrics(table: pd.DataFrame, cross: Mapping, distinct: pd.DataFrame) -> dict:
    """The ``batch`` section of notebook 07's metrics: per source, dtype and batch, and the
    crossovers."""
    columns = (
        "distinct_experts",
        "dense_experts_read",
        "sparse_experts_read",
        "dense_gb",
        "sparse_gb",
        "dense_floor_ms",
        "sparse_floor_ms",
        "dense_p50_ms",
        "sparse_p50_ms",
        "dense_tok_s",
        "sparse_tok_s",
    )
    by_source = {
        source: {
            dtype: [
                {"batch": int(row["batch"]), **{c: float(row[c]) for c in columns}}
                for _, row in group.sort_values("batch").iterrows()
            ]
            for dtype, group in rows.groupby("dtype", sort=False)
        }
        for source, rows in table.groupby("source", sort=False)
    }
    return {
        "batches": cross["batches"],
        "by_source": by_source,
        "distinct_experts": {
            int(b): {k: float(v) for k, v in row.items()} for b, row in distinct.iterrows()
        },
        "crossover_measured": cross["measured"],
        "crossover_predicted": {
            key: cross[key] for key in ("bytes_this_sparse", "bytes_selective_loading", "nxd_rule")
        },
    }


def roofline_metrics(summary: pd.DataFrame) -> dict:
    """The ``batch_roofline`` section: per deployment, the largest batches and per path tok/s and
    $/M."""
    out = {}
    for deployment, rows in summary.groupby("deployment", sort=False):
        first = rows.iloc[0]
        out[deployment] = {
            key: None if pd.isna(first[key]) else int(first[key])
            for key in ("largest_batch", "largest_batch_if_low")
        }
        out[deployment].update(
            {key: float(first[key]) for key in ("kv_gb_per_stream", "runtime_allowance_gb")}
        )
        out[deployment]["paths"] = {
            row["path"]: {
                key: (None if pd.isna(row[key]) else float(row[key]))
                for key in row.index
                if key.startswith(("tok_s", "usd_per_m"))
            }
            for _, row in rows.iterrows()
        }
    return out
