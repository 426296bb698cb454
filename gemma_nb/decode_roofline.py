"""The decode roofline of notebook 07 (decode benchmark): bytes and FLOPs per token, modelled.

``gemma_nb.bench`` measures; this module models, batch 1 decode: ``decode_traffic(config, scheme,
experts)`` counts the bytes every decode step must read (per rank) and its FLOPs, from
``gemma_nb.memory.plan``; ``roofline`` turns them into tokens/s and $ per million tokens over
``DEPLOYMENTS`` (devices from ``gemma_nb.hardware``). A step can be no faster than
``max(bytes / bandwidth, FLOPs / peak)``. ``story_decode`` puts the story's figures beside the
model's, ``context_sensitivity`` moves the KV cache, ``hypotheses_table`` weighs the explanations
of the measured 6 tok/s.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import pandas as pd
import seaborn as sns

from gemma_nb.bench import EXPERT_MODES, check_experts_mode
from gemma_nb.hardware import DEVICES, GB, INSTANCES, Device
from gemma_nb.memory import SHIPPED_CONTEXT_LEN, model_facts, plan
from gemma_nb.plots import reference_line
from gemma_nb.story import CLAIMS

# Groups every decode step reads in full. Embeddings are looked up on the host (one row per token,
# ~5.6 KB: ignored); lm_head is the device copy of the tied table, read in full for the logits.
READ_GROUPS = ("router", "shared_mlp", "attention", "norms", "lm_head", "other")
MATMUL_GROUPS = ("router", "shared_mlp", "attention", "lm_head")


def decode_traffic(config, scheme: str = "int8_squeeze", experts: str = "dense", tp: int = 1,
                   context_len: int = 0) -> dict:
    """Bytes each rank reads and FLOPs it computes to decode one token (batch 1).

    Bytes come from ``gemma_nb.memory.plan(config, tp, scheme, context_len)``: every group a step
    uses in full (attention, shared MLP, router, norms, lm_head), the routed experts in full
    (``dense``) or ``top_k / E`` of them (``sparse``; assumes each expert is split across ranks,
    as NxD Inference shards the intermediate dimension, so the 8 routed experts load every rank
    evenly), plus the KV cache of ``context_len`` tokens. FLOPs: 2 per weight of every matrix used,
    plus attention over the context (4 x context x heads x head_dim per layer), divided by ``tp``.
    """
    check_experts_mode(experts)
    facts = model_facts(config)
    the_plan = plan(config, tp, scheme, context_len=context_len)
    table = the_plan.table.set_index("group")
    fraction = facts.top_k / facts.num_experts if experts == "sparse" else 1.0
    by_group = {group: float(table.loc[group, "bytes_per_rank"]) for group in READ_GROUPS}
    by_group["experts"] = float(table.loc["experts", "bytes_per_rank"]) * fraction
    by_group["kv_cache"] = float(table.loc["kv_cache", "bytes_per_rank"])
    # Matrices only: the router's scale vectors and the norms cost ~1 FLOP per element, not 2.
    matmul_params = sum(float(rec.numel) for rec in facts.records
                        if not rec.is_buffer and len(rec.shape) >= 2 and rec.group in MATMUL_GROUPS)
    if facts.tied and facts.lm_head_shape is not None:
        matmul_params += float(facts.lm_head_shape[0] * facts.lm_head_shape[1])
    matmul_params += float(table.loc["experts", "params"]) * fraction
    attention_flops = sum(4.0 * context_len * layer.q_heads * layer.head_dim for layer in facts.attention_layers)
    return {
        "scheme": the_plan.scheme.name,
        "experts": experts,
        "tp": tp,
        "context_len": context_len,
        "bytes_per_token": sum(by_group.values()),
        "flops_per_token": (2.0 * matmul_params + attention_flops) / tp,
        "weights_bytes_per_rank": float(the_plan.weights_bytes),
        "bytes_by_group": by_group,
    }


@dataclass(frozen=True)
class Deployment:
    """The 26B served on ``ranks`` devices of one kind, tensor-parallel, with one weight scheme.

    ``device``: a key of ``gemma_nb.hardware.DEVICES`` or a ``Device`` (e.g. ``measured_cpu``).
    ``usd_per_hour``: for the whole deployment; ``None`` = the device's $/h x ranks (``None`` if unknown).
    """

    name: str
    device: str | Device
    ranks: int
    scheme: str
    usd_per_hour: float | None = None

    def resolved_device(self) -> Device:
        if isinstance(self.device, Device):
            return self.device
        if self.device not in DEVICES:
            raise ValueError(f"device {self.device!r} is not in gemma_nb.hardware.DEVICES ({', '.join(DEVICES)})")
        return DEVICES[self.device]

    def price(self) -> float | None:
        if self.usd_per_hour is not None:
            return self.usd_per_hour
        per_device = self.resolved_device().usd_per_hour
        return None if per_device is None else per_device * self.ranks


STORY_INSTANCE = "inf2.xlarge"
DEPLOYMENTS: tuple[Deployment, ...] = (
    Deployment("inf2.xlarge, int8 squeeze, TP=2", "neuroncore_v2", 2, "int8_squeeze",
               INSTANCES["inf2.xlarge"].usd_per_hour),
    Deployment("inf2.xlarge, bf16, TP=2", "neuroncore_v2", 2, "bf16", INSTANCES["inf2.xlarge"].usd_per_hour),
    Deployment("TPU v6e x1, int8 squeeze", "tpu_v6e_chip", 1, "int8_squeeze"),
    Deployment("TPU v6e x2, bf16, TP=2", "tpu_v6e_chip", 2, "bf16"),
    Deployment("H200 x1, bf16", "h200", 1, "bf16"),
    Deployment("H200 x1, int8 squeeze", "h200", 1, "int8_squeeze"),
)


def usd_per_million_tokens(usd_per_hour: float | None, tok_s: float) -> float | None:
    """$ per 10^6 tokens for one stream decoding at ``tok_s`` on a box costing ``usd_per_hour``."""
    if usd_per_hour is None or not tok_s or tok_s <= 0:
        return None
    return usd_per_hour / (tok_s * 3600.0) * 1e6


def roofline(config, deployments: Sequence[Deployment] = DEPLOYMENTS, experts: Sequence[str] = EXPERT_MODES,
             context_len: int = SHIPPED_CONTEXT_LEN) -> pd.DataFrame:
    """Predicted batch-1 decode speed of ``config`` on each deployment, dense vs sparse experts.

    Every step also reads the KV cache of ``context_len`` tokens (default: the port's static
    512-token cache, in each scheme's KV dtype, fp32 for the port's builds).

    Per row: ``gb_per_token`` (per rank), ``gflop_per_token`` (per rank), ``memory_ms`` =
    bytes / bandwidth, ``compute_ms`` = FLOPs / bf16 peak (int8 weights are upcast to bf16 for the
    matmul, as NxD does), ``bound`` (the larger), ``tok_s`` = 1000 / max(...), ``fits`` (weights +
    KV per rank within the device memory), ``usd_per_hour``, ``usd_per_m_tokens``. An upper bound:
    real steps add kernel launches, collectives and the host loop.
    """
    rows = []
    for deployment in deployments:
        device = deployment.resolved_device()
        if not device.bandwidth_bytes_s:
            raise ValueError(f"device {device.name!r} has no bandwidth figure; measure it (hardware.measured_cpu)")
        for mode in experts:
            traffic = decode_traffic(config, deployment.scheme, mode, deployment.ranks, context_len)
            memory_ms = 1000.0 * traffic["bytes_per_token"] / device.bandwidth_bytes_s
            compute_ms = 1000.0 * traffic["flops_per_token"] / device.bf16_flops if device.bf16_flops else 0.0
            tok_s = 1000.0 / max(memory_ms, compute_ms)
            resident = traffic["weights_bytes_per_rank"] + traffic["bytes_by_group"]["kv_cache"]
            price = deployment.price()
            rows.append({
                "deployment": deployment.name, "device": device.name, "ranks": deployment.ranks,
                "scheme": deployment.scheme, "experts": mode,
                "gb_per_token": traffic["bytes_per_token"] / GB,
                "gflop_per_token": traffic["flops_per_token"] / 1e9,
                "memory_ms": memory_ms, "compute_ms": compute_ms,
                "bound": "memory" if memory_ms >= compute_ms else "compute",
                "tok_s": tok_s,
                "fits": None if device.hbm_bytes is None else bool(resident <= device.hbm_bytes),
                "usd_per_hour": price, "usd_per_m_tokens": usd_per_million_tokens(price, tok_s),
            })
    return pd.DataFrame(rows)


def story_decode(config, measured_tok_s: float | None = None, tp: int = 2, scheme: str = "int8_squeeze",
                 device: str = "neuroncore_v2", context_len: int = SHIPPED_CONTEXT_LEN) -> dict:
    """The story's decode figures on inf2.xlarge, computed, with the hypotheses for its 6 tok/s.

    Each step reads the weights it uses plus the KV cache of ``context_len`` tokens (default the
    port's static 512-token fp32 cache, which a static graph reads in full whatever the prompt's
    length; ``kv_gb_per_token`` says how much). Returns per-chip bytes (both ranks) and tok/s: ``dense_gb_per_token`` / ``dense_tok_s`` (the
    DenseExperts roofline), ``sparse_*`` (top-k gather), ``upcast_gb_per_token`` /
    ``upcast_tok_s`` (HYPOTHESIS: each step the int8 experts are upcast to a bf16 copy in HBM and
    read again: 1 + 2 + 2 bytes per expert weight), ``compute_bound_tok_s`` (FLOPs / peak: what
    "compute-bound" would allow), ``expert_flops_waste_x`` (E / K), ``answer_500_tokens_s`` at each
    rate, and $ per million tokens at the measured rate (``measured_tok_s``, default the story's
    claim) and at the rooflines.
    """
    facts = model_facts(config)
    bandwidth = DEVICES[device].bandwidth_bytes_s
    peak = DEVICES[device].bf16_flops
    dense = decode_traffic(config, scheme, "dense", tp, context_len)
    sparse = decode_traffic(config, scheme, "sparse", tp, context_len)
    # The int8 experts are still read once; the bf16 copy is written, then read by the matmul.
    experts_bf16 = float(plan(config, tp, "bf16", context_len=0).bytes("experts"))
    upcast = dense["bytes_per_token"] + 2 * experts_bf16
    measured = CLAIMS["decode_tok_s"].value if measured_tok_s is None else measured_tok_s
    price = INSTANCES[STORY_INSTANCE].usd_per_hour
    out = {
        "context_len": context_len,
        "kv_gb_per_token": tp * dense["bytes_by_group"]["kv_cache"] / GB,
        "dense_gb_per_token": tp * dense["bytes_per_token"] / GB,
        "sparse_gb_per_token": tp * sparse["bytes_per_token"] / GB,
        "upcast_gb_per_token": tp * upcast / GB,
        "dense_gflop_per_token": tp * dense["flops_per_token"] / 1e9,
        "dense_expert_gflop_per_token": 2.0 * float(plan(config, tp, scheme, context_len=0).table
                                                    .set_index("group").loc["experts", "params"]) / 1e9,
        "sparse_gflop_per_token": tp * sparse["flops_per_token"] / 1e9,
        "dense_tok_s": bandwidth / dense["bytes_per_token"],
        "sparse_tok_s": bandwidth / sparse["bytes_per_token"],
        "upcast_tok_s": bandwidth / upcast,
        "compute_bound_tok_s": peak / dense["flops_per_token"],
        "measured_tok_s": measured,
        "expert_flops_waste_x": facts.num_experts / facts.top_k,
        "usd_per_hour": price,
    }
    out["utilisation_at_measured_pct"] = 100.0 * measured / out["compute_bound_tok_s"]
    for key in ("dense", "sparse", "upcast", "measured"):
        rate = out[f"{key}_tok_s"]
        out[f"{key}_answer_500_tokens_s"] = 500.0 / rate
        out[f"{key}_usd_per_m_tokens"] = usd_per_million_tokens(price, rate)
    return out


def context_sensitivity(config, context_lens: Sequence[int], **story_kwargs) -> pd.DataFrame:
    """``story_decode`` at each KV-cache length: how much the roofline depends on the context.

    One row per ``context_len``: ``kv_gb_per_token`` (per chip), ``dense_tok_s``, ``sparse_tok_s``
    and their ratio ``sparse_vs_dense_x``. The cache grows with every token while the weights stay,
    so the sparse path, which reads fewer weight bytes, loses a larger share of its speed to it.
    """
    if not context_lens:
        raise ValueError("context_lens is empty: give the KV-cache lengths to evaluate, e.g. (0, 512, 4096)")
    bad = [n for n in context_lens if int(n) != n or n < 0]
    if bad:
        raise ValueError(f"context_lens {bad} must be whole numbers of tokens >= 0")
    rows = []
    for context_len in context_lens:
        story = story_decode(config, context_len=int(context_len), **story_kwargs)
        rows.append({"context_len": int(context_len), "kv_gb_per_token": story["kv_gb_per_token"],
                     "dense_tok_s": story["dense_tok_s"], "sparse_tok_s": story["sparse_tok_s"],
                     "sparse_vs_dense_x": story["sparse_tok_s"] / story["dense_tok_s"]})
    return pd.DataFrame(rows)


def plot_context_sensitivity(table: pd.DataFrame, ax, marked_context_len: int | None = None) -> None:
    """Predicted tokens/s against the KV-cache length, dense vs sparse experts (log x axis)."""
    for column, label in (("dense_tok_s", "DenseExperts"), ("sparse_tok_s", "sparse top-k")):
        ax.plot(table["context_len"].clip(lower=1), table[column], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("KV-cache length read per step (tokens, log scale; 0 drawn at 1)")
    ax.set_ylabel("tokens/s, bandwidth roofline")
    ax.legend(loc="upper right", fontsize=9)
    if marked_context_len is not None:
        reference_line(ax, max(marked_context_len, 1), f"this run: {marked_context_len} tokens", axis="x")


def hypotheses_table(story: Mapping[str, float]) -> pd.DataFrame:
    """What could make the DenseExperts deploy decode at the measured rate: one row per explanation.

    ``status`` says which rows are measured, computed bounds, or hypotheses (not verified on an inf2).
    """
    measured = story["measured_tok_s"]
    rows = [
        ("measured by the port (seed)", "claim", None, measured),
        ("bandwidth roofline, DenseExperts: every int8 expert read once per token", "computed bound",
         story["dense_gb_per_token"], story["dense_tok_s"]),
        ("HYPOTHESIS: int8 experts upcast to a bf16 copy in HBM, then read (1+2+2 B per weight)", "hypothesis",
         story["upcast_gb_per_token"], story["upcast_tok_s"]),
        ("HYPOTHESIS: compute-bound (model card's words) at full bf16 peak", "hypothesis",
         None, story["compute_bound_tok_s"]),
        ("bandwidth roofline, sparse top-k gather", "computed bound", story["sparse_gb_per_token"],
         story["sparse_tok_s"]),
    ]
    table = pd.DataFrame(rows, columns=["explanation", "status", "gb_per_token", "tok_s"])
    table["x_measured"] = table["tok_s"] / measured
    return table




def plot_usd_per_m(table: pd.DataFrame, ax, reference_usd: float | None = None, reference_label: str = "") -> None:
    """Horizontal bars: predicted $ per million tokens per deployment, dense vs sparse experts (log scale)."""
    priced = table.dropna(subset=["usd_per_m_tokens"])
    sns.barplot(data=priced, y="deployment", x="usd_per_m_tokens", hue="experts", ax=ax, palette="colorblind")
    for container in ax.containers:
        ax.bar_label(container, fmt="$%.2f", fontsize=9, padding=2)
    ax.set_xlabel("$ per million tokens (one stream, batch 1, at the bandwidth roofline)")
    ax.set_ylabel("")
    _reference_in_legend(ax, reference_usd, reference_label)


def plot_roofline_tok_s(table: pd.DataFrame, ax, reference_tok_s: float | None = None, reference_label: str = "") -> None:
    """Horizontal bars: predicted tokens/s per deployment, dense vs sparse experts (log scale)."""
    sns.barplot(data=table, y="deployment", x="tok_s", hue="experts", ax=ax, palette="colorblind")
    for container in ax.containers:  # two significant figures below 10 tok/s: 0.3 is not "0"
        ax.bar_label(container, fmt=lambda tok_s: f"{tok_s:.2g}" if tok_s < 10 else f"{tok_s:.0f}", fontsize=9, padding=2)
    ax.set_xscale("log")
    ax.set_xlabel("tokens/s, batch 1, bandwidth roofline (log scale)")
    ax.set_ylabel("")
    _reference_in_legend(ax, reference_tok_s, reference_label)


def _reference_in_legend(ax, value: float | None, label: str) -> None:
    """A dashed vertical line at the story's figure, named in the legend (a label on the line would sit on the bars).

    The legend goes outside the axes, on the right: inside, it would cover the longest bars' labels.
    """
    if value is not None:
        ax.axvline(value, color="0.25", linestyle="--", linewidth=1.2, label=label)
    ax.legend(title="experts", loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=9)
