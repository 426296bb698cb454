"""The decode roofline of notebook 07 and ``python -m gemma_nb plan``: bytes and FLOPs per decode
step, modelled, at any batch, and the tokens/s and $ per million tokens they allow on each
deployment."""

from collections import namedtuple
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import pandas as pd
import seaborn as sns

from gemma_nb.bench import EXPERT_MODES, check_counts
from gemma_nb.hardware import DEVICES, GB, INSTANCES, Device
from gemma_nb.memory import (
    SHIPPED_CONTEXT_LEN,
    RuntimeAllowance,
    Scheme,
    inferred_runtime_allowance,
    model_facts,
    plan,
)
from gemma_nb.plots import reference_line
from gemma_nb.story import CLAIMS

# Groups every decode step reads in full. Embeddings are looked up on the host (one row per token,
# ~5.6 KB: ignored); lm_head is the device copy of the tied table, read in full for the logits.
READ_GROUPS = ("router", "shared_mlp", "attention", "norms", "lm_head", "other")
MATMUL_GROUPS = ("router", "shared_mlp", "attention", "lm_head")

# Decode paths at batch B: "dense" runs all E experts (DenseExperts, NxD's forward_all_experts);
# "sparse" reads each distinct routed expert once per step; "nxd_rule": NxD's
# forward_selective_loading, each token's K experts (B x K reads, repeats included) while B x K / E
# < the threshold, else all experts.
BATCH_PATHS = ("dense", "sparse", "nxd_rule")
# NxD 0.18 modules/moe/model_utils.py DEFAULT_SELECTIVE_LOADING_THRESHOLD (docs/sources.md:
# nxd-source).
SELECTIVE_LOADING_THRESHOLD = 1.0


def expected_distinct_experts(num_experts: int, top_k: int, batch: int) -> float:
    """Distinct experts per layer expected for ``batch`` tokens each routed uniformly to ``top_k``:
    E (1 - (1 - K/E)^B)."""
    check_counts(batch=batch)
    if not num_experts:
        return 0.0
    assert 1 <= top_k <= num_experts, (top_k, num_experts)
    if batch == 1:
        return float(top_k)  # exact: the formula's floating point would round it
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** batch)


def selective_loading(num_experts: int, top_k: int, batch: int) -> bool:
    """NxD's decode rule: selective loading while ``batch * top_k / num_experts`` < the
    threshold."""
    return bool(num_experts) and batch * top_k / num_experts < SELECTIVE_LOADING_THRESHOLD


# One decode step's bytes and FLOPs per rank, split by how each part scales with the batch: the
# non-expert weights (once per step), all E experts, one stream's KV cache read and its one position
# written (in place, as the neuron build does); ``weights_bytes``: resident.
StepCosts = namedtuple(
    "StepCosts",
    "context_len num_experts top_k fixed_bytes experts_bytes kv_bytes_per_stream "
    "kv_write_bytes_per_stream fixed_flops_per_token experts_flops_per_token weights_bytes",
)


def step_costs(
    config, scheme: str | Scheme = "int8_squeeze", tp: int = 1, context_len: int = 0
) -> StepCosts:
    """``StepCosts`` from ``memory.plan``: experts split evenly across ranks (NxD shards their
    intermediate dimension); FLOPs 2 per matrix weight plus attention over the context, over
    ``tp``; the KV cache in the scheme's ``kv_dtype``."""
    facts = model_facts(config)
    the_plan = plan(config, tp, scheme, context_len=context_len)
    table = the_plan.table.set_index("group")
    by_group = {
        group: float(table.loc[group, "bytes_per_rank"])
        for group in (*READ_GROUPS, "experts", "kv_cache")
    }
    # Matrices only: the router's scale vectors and the norms cost ~1 FLOP per element, not 2.
    matmul_params = sum(
        float(rec.numel)
        for rec in facts.records
        if not rec.is_buffer and len(rec.shape) >= 2 and rec.group in MATMUL_GROUPS
    )
    if facts.tied and facts.lm_head_shape is not None:
        matmul_params += float(facts.lm_head_shape[0] * facts.lm_head_shape[1])
    attention_flops = sum(
        4.0 * context_len * layer.q_heads * layer.head_dim for layer in facts.attention_layers
    )
    return StepCosts(
        context_len,
        facts.num_experts,
        facts.top_k,
        fixed_bytes=sum(by_group[group] for group in READ_GROUPS),
        experts_bytes=by_group["experts"],
        kv_bytes_per_stream=by_group["kv_cache"],
        kv_write_bytes_per_stream=plan(config, tp, scheme, context_len=1).bytes("kv_cache"),
        fixed_flops_per_token=(2.0 * matmul_params + attention_flops) / tp,
        experts_flops_per_token=2.0 * float(table.loc["experts", "params"]) / tp,
        weights_bytes=float(the_plan.weights_bytes),
    )


def batch_step(costs: StepCosts, batch: int, path: str) -> dict:
    """Bytes and FLOPs per rank of one step of ``batch`` streams on ``path``, expert sets read per
    layer and run per token."""
    check_counts(batch=batch)
    assert path in BATCH_PATHS, f"decode path {path!r} is not one of {', '.join(BATCH_PATHS)}"
    experts, top_k = costs.num_experts, costs.top_k
    if not experts:
        read = computed = 0.0
    elif path == "dense" or (path == "nxd_rule" and not selective_loading(experts, top_k, batch)):
        read, computed = float(experts), float(experts)
    elif path == "sparse":
        read, computed = expected_distinct_experts(experts, top_k, batch), float(top_k)
    else:
        read, computed = float(batch * top_k), float(top_k)
    share = (lambda n: n / experts) if experts else (lambda n: 0.0)
    return {
        "batch": batch,
        "path": path,
        "experts_read": read,
        "experts_computed_per_token": computed,
        "bytes": costs.fixed_bytes
        + costs.experts_bytes * share(read)
        + (costs.kv_bytes_per_stream + costs.kv_write_bytes_per_stream) * batch,
        "flops": batch
        * (costs.fixed_flops_per_token + costs.experts_flops_per_token * share(computed)),
    }


@dataclass(frozen=True)
class Deployment:
    """The model served on ``ranks`` devices (a ``DEVICES`` key or a ``Device``), tensor-parallel,
    in ``replicas`` data-parallel copies; ``usd_per_hour`` defaults to the device's price x ranks x
    replicas."""

    name: str
    device: str | Device
    ranks: int
    scheme: str | Scheme  # a ``memory.SCHEMES`` name, or a Scheme (its ``kv_dtype`` too)
    usd_per_hour: float | None = None
    replicas: int = 1

    def resolved_device(self) -> Device:
        return self.device if isinstance(self.device, Device) else DEVICES[self.device]

    def price(self) -> float | None:
        if self.usd_per_hour is not None:
            return self.usd_per_hour
        per_device = self.resolved_device().usd_per_hour
        return None if per_device is None else per_device * self.ranks * self.replicas


DEPLOYMENTS: tuple[Deployment, ...] = (
    Deployment(
        "inf2.xlarge, int8 squeeze, TP=2",
        "neuroncore_v2",
        2,
        "int8_squeeze",
        INSTANCES["inf2.xlarge"].usd_per_hour,
    ),
    Deployment(
        "inf2.xlarge, bf16, TP=2", "neuroncore_v2", 2, "bf16", INSTANCES["inf2.xlarge"].usd_per_hour
    ),
    Deployment("TPU v6e x1, int8 squeeze", "tpu_v6e_chip", 1, "int8_squeeze"),
    Deployment("TPU v6e x2, bf16, TP=2", "tpu_v6e_chip", 2, "bf16"),
    Deployment("H200 x1, bf16", "h200", 1, "bf16"),
    Deployment("H200 x1, int8 squeeze", "h200", 1, "int8_squeeze"),
)


def usd_per_million_tokens(usd_per_hour: float | None, tok_s: float) -> float | None:
    """$ per 10^6 tokens for a box costing ``usd_per_hour`` that decodes ``tok_s`` tokens/s in
    all."""
    return None if usd_per_hour is None or tok_s <= 0 else usd_per_hour / (tok_s * 3600.0) * 1e6


def step_speed(costs: StepCosts, deployment: Deployment, batch: int, path: str) -> dict:
    """One decode step of ``batch`` streams per replica: ``step_ms`` = max(bytes / bandwidth, FLOPs
    / bf16 peak), tokens/s (all replicas, and per stream) and $ per 10^6 tokens."""
    device = deployment.resolved_device()
    assert device.bandwidth_bytes_s, f"device {device.name!r} has no bandwidth figure"
    step = batch_step(costs, batch, path)
    memory_ms = 1000.0 * step["bytes"] / device.bandwidth_bytes_s
    compute_ms = 1000.0 * step["flops"] / device.bf16_flops if device.bf16_flops else 0.0
    step_ms = max(memory_ms, compute_ms)
    tok_s = deployment.replicas * batch * 1000.0 / step_ms
    price = deployment.price()
    return {
        **step,
        "memory_ms": memory_ms,
        "compute_ms": compute_ms,
        "step_ms": step_ms,
        "bound": "memory" if memory_ms >= compute_ms else "compute",
        "tok_s": tok_s,
        "tok_s_per_stream": 1000.0 / step_ms,
        "usd_per_hour": price,
        "usd_per_m_tokens": usd_per_million_tokens(price, tok_s),
    }


def roofline(
    config, deployments: Sequence[Deployment] = DEPLOYMENTS, context_len: int = SHIPPED_CONTEXT_LEN
) -> pd.DataFrame:
    """Predicted batch-1 decode speed (an upper bound) on each deployment, dense vs sparse experts,
    reading a ``context_len`` KV cache; ``fits``: weights + KV within the device memory."""
    rows = []
    for deployment in deployments:
        device = deployment.resolved_device()
        costs = step_costs(config, deployment.scheme, deployment.ranks, context_len)
        for mode in EXPERT_MODES:
            speed = step_speed(costs, deployment, 1, mode)
            resident = costs.weights_bytes + costs.kv_bytes_per_stream
            rows.append(
                {
                    "deployment": deployment.name,
                    "device": device.name,
                    "ranks": deployment.ranks,
                    "scheme": getattr(deployment.scheme, "name", deployment.scheme),
                    "experts": mode,
                    "gb_per_token": speed["bytes"] / GB,
                    "kv_read_gb_per_token": costs.kv_bytes_per_stream / GB,
                    "kv_written_mb_per_token": costs.kv_write_bytes_per_stream / 1e6,
                    "gflop_per_token": speed["flops"] / 1e9,
                    **{key: speed[key] for key in ("memory_ms", "compute_ms", "bound", "tok_s")},
                    "fits": None
                    if device.hbm_bytes is None
                    else bool(resident <= device.hbm_bytes),
                    "usd_per_hour": speed["usd_per_hour"],
                    "usd_per_m_tokens": speed["usd_per_m_tokens"],
                }
            )
    return pd.DataFrame(rows)


def largest_batch(costs: StepCosts, hbm_bytes_per_rank: int, allowance_bytes: int) -> int | None:
    """Most streams whose KV cache fits per rank beside the weights and ``allowance_bytes``; None
    without a KV cache."""
    free = int(hbm_bytes_per_rank) - int(costs.weights_bytes) - int(allowance_bytes)
    kv = int(costs.kv_bytes_per_stream)
    return (None if free >= 0 else 0) if kv == 0 else max(0, free // kv)


def batch_limits(
    costs: StepCosts,
    deployment: Deployment,
    allowance: RuntimeAllowance | None = None,
    hbm_bytes_per_rank: int | None = None,
) -> dict:
    """``largest_batch`` with the most the runtime may take, ``largest_batch_if_low`` with the
    least; ``allowance`` defaults to notebook 01's inferred window on a NeuronCore, none
    elsewhere."""
    device = deployment.resolved_device()
    if allowance is None:
        neuron = device.name in ("neuroncore_v2", "inferentia2_chip")
        allowance = (
            inferred_runtime_allowance()
            if neuron
            else RuntimeAllowance(0, 0, "none modelled for this device")
        )
    hbm = device.hbm_bytes if hbm_bytes_per_rank is None else hbm_bytes_per_rank
    assert hbm is not None, f"device {device.name!r} has no memory figure"
    return {
        "kv_gb_per_stream": costs.kv_bytes_per_stream / GB,
        "runtime_allowance_gb": allowance.high_bytes / GB,
        "largest_batch": largest_batch(costs, hbm, allowance.high_bytes),
        "largest_batch_if_low": largest_batch(costs, hbm, allowance.low_bytes),
    }


def batch_roofline(
    config,
    deployments: Sequence[Deployment] = DEPLOYMENTS,
    batches: Sequence[int] = (1, 2, 4, 8, 16, 32, 64),
    context_len: int = SHIPPED_CONTEXT_LEN,
) -> pd.DataFrame:
    """``step_speed`` per deployment, decode path and batch, and whether it fits at either allowance
    end (``batch_limits``)."""
    rows = []
    for deployment in deployments:
        costs = step_costs(config, deployment.scheme, deployment.ranks, context_len)
        limits = batch_limits(costs, deployment)
        for path in BATCH_PATHS:
            for batch in batches:
                speed = step_speed(costs, deployment, int(batch), path)
                rows.append(
                    {
                        "deployment": deployment.name,
                        **speed,
                        "gb_per_step": speed["bytes"] / GB,
                        "fits": limits["largest_batch"] is None or batch <= limits["largest_batch"],
                        "fits_if_low": limits["largest_batch_if_low"] is None
                        or batch <= limits["largest_batch_if_low"],
                    }
                )
    return pd.DataFrame(rows)


def batch_summary(
    config, deployments: Sequence[Deployment] = DEPLOYMENTS, context_len: int = SHIPPED_CONTEXT_LEN
) -> pd.DataFrame:
    """Per deployment and path: tok/s and $ per 10^6 tokens at batch 1 and at the most that fit
    (either allowance end) or NaN."""
    rows = []
    for deployment in deployments:
        costs = step_costs(config, deployment.scheme, deployment.ranks, context_len)
        limits = batch_limits(costs, deployment)
        for path in BATCH_PATHS:
            row = {"deployment": deployment.name, "path": path, **limits}
            for suffix, batch in (
                ("b1", 1),
                ("at_largest", limits["largest_batch"]),
                ("if_low", limits["largest_batch_if_low"]),
            ):
                speed = step_speed(costs, deployment, batch, path) if batch else {}
                row[f"tok_s_{suffix}"] = speed.get("tok_s", float("nan"))
                row[f"usd_per_m_{suffix}"] = speed.get("usd_per_m_tokens", float("nan"))
            rows.append(row)
    return pd.DataFrame(rows)


def story_decode(config, context_len: int = SHIPPED_CONTEXT_LEN) -> dict:
    """The story's decode figures on inf2.xlarge (int8 squeeze, TP=2), per chip: dense, sparse and
    upcast (HYPOTHESIS: int8 experts upcast to a bf16 copy in HBM, 1+2+2 B per weight) rooflines,
    compute bound, time and $ at each, the claimed rate."""
    tp, device = 2, DEVICES["neuroncore_v2"]
    costs = step_costs(config, "int8_squeeze", tp, context_len)
    dense, sparse = (batch_step(costs, 1, path) for path in ("dense", "sparse"))
    bandwidth, peak = device.bandwidth_bytes_s, device.bf16_flops
    # The int8 experts are still read once; the bf16 copy is written, then read by the matmul.
    upcast = dense["bytes"] + 2 * float(plan(config, tp, "bf16", context_len=0).bytes("experts"))
    measured = CLAIMS["decode_tok_s"].value
    price = INSTANCES["inf2.xlarge"].usd_per_hour
    out = {
        "context_len": context_len,
        "kv_gb_per_token": tp * costs.kv_bytes_per_stream / GB,
        "dense_gb_per_token": tp * dense["bytes"] / GB,
        "sparse_gb_per_token": tp * sparse["bytes"] / GB,
        "upcast_gb_per_token": tp * upcast / GB,
        "dense_gflop_per_token": tp * dense["flops"] / 1e9,
        "dense_expert_gflop_per_token": tp * costs.experts_flops_per_token / 1e9,
        "sparse_gflop_per_token": tp * sparse["flops"] / 1e9,
        "dense_tok_s": bandwidth / dense["bytes"],
        "sparse_tok_s": bandwidth / sparse["bytes"],
        "upcast_tok_s": bandwidth / upcast,
        "compute_bound_tok_s": peak / dense["flops"],
        "measured_tok_s": measured,
        "expert_flops_waste_x": costs.num_experts / costs.top_k,
        "usd_per_hour": price,
    }
    out["utilisation_at_measured_pct"] = 100.0 * measured / out["compute_bound_tok_s"]
    for key in ("dense", "sparse", "upcast", "measured"):
        rate = out[f"{key}_tok_s"]
        out[f"{key}_answer_500_tokens_s"] = 500.0 / rate
        out[f"{key}_usd_per_m_tokens"] = usd_per_million_tokens(price, rate)
    return out


def context_sensitivity(config, context_lens: Sequence[int]) -> pd.DataFrame:
    """``story_decode``'s dense and sparse tok/s at each KV-cache length, and their ratio."""
    assert context_lens, (
        "context_lens is empty: give the KV-cache lengths to evaluate, e.g. (0, 512, 4096)"
    )
    assert all(int(n) == n >= 0 for n in context_lens), (
        f"context_lens {list(context_lens)} must be whole numbers >= 0"
    )
    stories = [story_decode(config, context_len=int(n)) for n in context_lens]
    return pd.DataFrame(
        [
            {
                **{
                    key: s[key]
                    for key in ("context_len", "kv_gb_per_token", "dense_tok_s", "sparse_tok_s")
                },
                "sparse_vs_dense_x": s["sparse_tok_s"] / s["dense_tok_s"],
            }
            for s in stories
        ]
    )


def plot_context_sensitivity(table: pd.DataFrame, ax, marked_context_len: int) -> None:
    """Predicted tokens/s against the KV-cache length, dense vs sparse experts (log x axis)."""
    for column, label in (("dense_tok_s", "DenseExperts"), ("sparse_tok_s", "sparse top-k")):
        ax.plot(table["context_len"].clip(lower=1), table[column], marker="o", label=label)
    ax.set_xscale("log", base=2)
    # room for the labels
    ax.set(
        xlabel="KV-cache length read per step (tokens, log scale; 0 drawn at 1)",
        ylabel="tokens/s, bandwidth roofline",
        ylim=(0, 1.8 * table[["dense_tok_s", "sparse_tok_s"]].to_numpy().max()),
    )
    ax.legend(loc="upper right", fontsize=9)
    reference_line(
        ax, max(marked_context_len, 1), f"this run: {marked_context_len} tokens", axis="x"
    )


def hypotheses_table(story: Mapping[str, float]) -> pd.DataFrame:
    """What could make the DenseExperts deploy decode at the measured rate: one row per explanation
    and its ``status``."""
    measured = story["measured_tok_s"]
    rows = [
        ("measured by the port (its model card)", "claim", None, measured),
        (
            "bandwidth roofline, DenseExperts: every int8 expert read once per token",
            "computed bound",
            story["dense_gb_per_token"],
            story["dense_tok_s"],
        ),
        (
            "HYPOTHESIS: int8 experts upcast to a bf16 copy in HBM, then read (1+2+2 B per weight)",
            "hypothesis",
            story["upcast_gb_per_token"],
            story["upcast_tok_s"],
        ),
        (
            "HYPOTHESIS: compute-bound (model card's words) at full bf16 peak",
            "hypothesis",
            None,
            story["compute_bound_tok_s"],
        ),
        (
            "bandwidth roofline, sparse top-k gather",
            "computed bound",
            story["sparse_gb_per_token"],
            story["sparse_tok_s"],
        ),
    ]
    table = pd.DataFrame(rows, columns=["explanation", "status", "gb_per_token", "tok_s"])
    table["x_measured"] = table["tok_s"] / measured
    return table


# Notebook 07's deployment bars per column: axis label, bar label format, log scale (0.3 tok/s is
# not "0").
DEPLOYMENT_AXES = {
    "tok_s": (
        "tokens/s, batch 1, bandwidth roofline (log scale)",
        lambda tok_s: f"{tok_s:.2g}" if tok_s < 10 else f"{tok_s:.0f}",
        True,
    ),
    "usd_per_m_tokens": (
        "$ per million tokens (one stream, batch 1, at the bandwidth roofline)",
        "$%.2f",
        False,
    ),
}


def plot_deployments(table: pd.DataFrame, ax, x: str, reference: float, label: str) -> None:
    """Horizontal bars of ``x`` (a key of ``DEPLOYMENT_AXES``) per deployment with a value, dense
    vs sparse experts, and a dashed line at the story's figure, named in the legend outside."""
    xlabel, fmt, log = DEPLOYMENT_AXES[x]
    sns.barplot(
        data=table.dropna(subset=[x]),
        y="deployment",
        x=x,
        hue="experts",
        ax=ax,
        palette="colorblind",
    )
    for container in ax.containers:
        ax.bar_label(container, fmt=fmt, fontsize=9, padding=2)
    ax.set(xscale="log" if log else "linear", xlabel=xlabel, ylabel="")
    ax.axvline(reference, color="0.25", linestyle="--", linewidth=1.2, label=label)
    ax.legend(title="experts", loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=9)
