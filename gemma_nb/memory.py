"""Per-rank byte plans of a causal LM and their fit per NeuronCore (notebook 01, ``python -m
gemma_nb plan``). The parameter inventory is ``gemma_nb.params``' (``inventory`` and
``param_summary``, which the notebooks read, importable from here too)."""

import functools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

import pandas as pd

from gemma_nb import params
from gemma_nb.formats import PLAIN_DTYPES, get_format, tensor_bytes
from gemma_nb.hardware import GB, INSTANCES, GiB, fits, get_instance
from gemma_nb.params import (
    GROUPS,
    PLAN_ROWS,
    kv_cache_bytes,
    load_gemma4_26b_config,
    model_facts,
    valid_tp_degrees,
)
from gemma_nb.params import inventory as inventory
from gemma_nb.params import param_summary as param_summary

# The Neuron runtime's floor per core (Neuron docs, "Neuron device memory"): 96 MiB micro-code plus
# one 512 MiB scratchpad page; a real NEFF often takes several pages plus I/O and collectives
# buffers.
DEFAULT_RUNTIME_ALLOWANCE_BYTES = (96 + 512) * 2**20

SHIPPED_CONTEXT_LEN = (
    512  # the port's compiled MAX / bucket 512 / 128 (docs/sources.md: port-recipe)
)


@dataclass(frozen=True)
class Scheme:
    """A placement: dtype per group (else ``default_dtype``, also for a quantized group's vectors),
    what TP shards. Embeddings are looked up on the host (0 HBM); a tied head on the device is its
    own copy."""

    name: str
    description: str = ""
    dtypes: Mapping[str, str] = field(default_factory=dict, hash=False)
    default_dtype: str = "bf16"
    sharded: frozenset[str] = frozenset(params.SHARDABLE_GROUPS)
    lm_head_sharded: bool = False
    kv_dtype: str = "fp32"
    runtime_allowance_bytes: int = DEFAULT_RUNTIME_ALLOWANCE_BYTES

    def __post_init__(self):
        object.__setattr__(self, "dtypes", dict(self.dtypes))
        object.__setattr__(self, "sharded", frozenset(self.sharded))
        for group, dtype in self.dtypes.items():
            assert group in GROUPS, f"group {group!r} is not one of {', '.join(GROUPS)}"
            get_format(dtype)
        params.check_plain(self.default_dtype, f"scheme {self.name!r} default")
        params.check_plain(self.kv_dtype, f"scheme {self.name!r} KV cache")
        assert self.sharded <= set(params.SHARDABLE_GROUPS), (
            f"cannot shard {sorted(self.sharded - set(params.SHARDABLE_GROUPS))}"
        )
        assert self.runtime_allowance_bytes >= 0, (
            f"runtime_allowance_bytes={self.runtime_allowance_bytes} must be >= 0"
        )

    def dtype(self, group: str) -> str:
        return self.dtypes.get(group, self.default_dtype)


SCHEMES: dict[str, Scheme] = {
    s.name: s
    for s in (
        Scheme("bf16", "everything bf16; lm_head replicated on each rank (the naive TP=2 port)"),
        Scheme(
            "int8_experts",
            "int8 experts, rest bf16, lm_head replicated bf16 (the story's first attempt)",
            {"experts": "int8"},
        ),
        Scheme(
            "int8_experts_lm_head",
            "int8 experts + lm_head int8 sharded across ranks; shared MLP bf16",
            {"experts": "int8", "lm_head": "int8"},
            lm_head_sharded=True,
        ),
        Scheme(
            "int8_experts_shared_mlp",
            "int8 experts and shared dense MLP; lm_head replicated bf16",
            {"experts": "int8", "shared_mlp": "int8"},
        ),
        Scheme(
            "int8_squeeze",
            "int8 experts + shared MLP + lm_head sharded int8 (the shipped build)",
            {"experts": "int8", "shared_mlp": "int8", "lm_head": "int8"},
            lm_head_sharded=True,
        ),
        Scheme(
            "fp8_experts",
            "fp8 e4m3 experts (per-channel), rest bf16, lm_head replicated bf16",
            {"experts": "fp8"},
        ),
        Scheme(
            "mxfp4_experts",
            "MXFP4 experts, rest bf16, lm_head replicated bf16 (not loadable on NxD)",
            {"experts": "mxfp4"},
        ),
        Scheme(
            "nvfp4_experts",
            "NVFP4 experts, rest bf16, lm_head replicated bf16 (not loadable on NxD)",
            {"experts": "nvfp4"},
        ),
    )
}


def get_scheme(scheme: str | Scheme) -> Scheme:
    if isinstance(scheme, Scheme):
        return scheme
    if scheme not in SCHEMES:
        raise ValueError(
            f"scheme {scheme!r} is not one of {', '.join(SCHEMES)}; or build a Scheme(...)"
        )
    return SCHEMES[scheme]


def _record_bytes(rec: params.ParamRecord, sch: Scheme, tp: int) -> int:
    """Bytes of the slice of ``rec`` one rank holds when its group is sharded ``tp`` ways (vectors:
    a plain dtype)."""
    dtype = sch.dtype(rec.group)
    shape = list(rec.shape)
    if tp > 1 and rec.split != "none" and shape:
        axis = {"experts": 0, "kv": 0, "out": -2 if len(shape) >= 2 else 0, "in": -1}[rec.split]
        shape[axis] = (
            params.kv_heads_per_rank(rec.kv_heads, tp) * rec.head_dim
            if rec.split == "kv"
            else -(-shape[axis] // tp)
        )
    use = (
        dtype
        if (len(shape) >= 2 and not rec.is_buffer) or dtype in PLAIN_DTYPES
        else sch.default_dtype
    )
    return tensor_bytes(tuple(shape), use)


class Plan(NamedTuple):
    """Bytes per rank for one (model, TP degree, scheme, context). ``table``: one row per group."""

    model_class: str
    scheme: Scheme
    tp: int
    context_len: int
    batch: int
    table: Any  # pandas DataFrame

    total_bytes = property(lambda self: int(self.table["bytes_per_rank"].sum()))
    total_gb = property(lambda self: self.total_bytes / GB)

    def bytes(self, group: str) -> int:
        """Bytes per rank of one row (a group, ``kv_cache`` or ``runtime_allowance``)."""
        assert group in PLAN_ROWS, f"group {group!r} is not one of {', '.join(PLAN_ROWS)}"
        return int(self.table.set_index("group").loc[group, "bytes_per_rank"])

    def gb(self, group: str) -> float:
        return self.bytes(group) / GB

    # no KV cache, no runtime allowance
    weights_bytes = property(lambda self: sum(self.bytes(g) for g in GROUPS))


def plan(
    config,
    tp: int = 2,
    scheme: str | Scheme = "int8_squeeze",
    context_len: int = SHIPPED_CONTEXT_LEN,
    batch: int = 1,
    runtime_allowance_bytes: int | None = None,
) -> Plan:
    """Bytes per rank per group for ``scheme`` at TP ``tp``, then KV cache and runtime allowance;
    ``host_bytes``: on the host."""
    sch = get_scheme(scheme)
    # checks context_len, batch and tp first
    kv_bytes = kv_cache_bytes(config, tp, context_len, batch, sch.kv_dtype)
    facts = model_facts(config)
    if runtime_allowance_bytes is not None:
        sch = replace(sch, runtime_allowance_bytes=int(runtime_allowance_bytes))
    default = sch.runtime_allowance_bytes == DEFAULT_RUNTIME_ALLOWANCE_BYTES
    table = pd.DataFrame(
        _group_rows(facts, sch, tp)
        + [
            {
                "group": "kv_cache",
                "dtype": sch.kv_dtype,
                "placement": "sharded" if tp > 1 else "replicated",
                "params": 0,
                "bytes_per_rank": kv_bytes,
                "host_bytes": 0,
                "detail": f"K and V, {context_len} tokens x batch {batch}",
            },
            {
                "group": "runtime_allowance",
                "dtype": "-",
                "placement": "per rank",
                "params": 0,
                "bytes_per_rank": int(sch.runtime_allowance_bytes),
                "host_bytes": 0,
                "detail": (
                    "default floor: 96 MiB micro-code + one 512 MiB scratchpad page"
                    if default
                    else "allowance for runtime buffers (set by caller)"
                ),
            },
        ]
    )
    table.insert(
        table.columns.get_loc("bytes_per_rank") + 1, "gb_per_rank", table["bytes_per_rank"] / GB
    )
    return Plan(facts.model_class, sch, tp, context_len, batch, table)


def _group_rows(facts, sch: Scheme, tp: int) -> list[dict]:
    """One row per weight group: whole-model ``params``, HBM bytes of one rank, host bytes,
    placement and a detail."""
    # Scheme never shards lm_head by name
    sharded = sch.sharded | {"lm_head"} if sch.lm_head_sharded else sch.sharded
    on_host = ("embeddings", "per_layer_embeddings")
    counts, device, host = ({g: 0 for g in GROUPS} for _ in range(3))
    for rec in facts.records:
        if not rec.is_buffer:
            counts[rec.group] += rec.numel
        ranks = 1 if rec.group in on_host or rec.group not in sharded else tp
        (host if rec.group in on_host else device)[rec.group] += _record_bytes(rec, sch, ranks)
    head_detail = ""
    if facts.tied and facts.lm_head_shape is not None:
        head = params.ParamRecord(
            "lm_head.weight (tied copy)", "lm_head", facts.lm_head_shape, "out"
        )
        device["lm_head"] += _record_bytes(head, sch, tp if sch.lm_head_sharded else 1)
        head_detail = "tied: a device copy of the embedding table; "
    details = dict.fromkeys(on_host, "looked up on the host; 0 HBM")
    details["lm_head"] = head_detail + (
        "vocab-parallel" if sch.lm_head_sharded else "full copy per rank"
    )
    return [
        {
            "group": g,
            "dtype": sch.dtype(g),
            "placement": "host"
            if g in on_host
            else "sharded"
            if g in sharded and tp > 1
            else "replicated",
            "params": counts[g],
            "bytes_per_rank": device[g],
            "host_bytes": host[g],
            "detail": details.get(g, ""),
        }
        for g in GROUPS
    ]


def plans_table(plans: Iterable[Plan]):
    """GB per rank, one row per plan row plus ``total``, one column per scheme."""
    table = pd.DataFrame({p.scheme.name: p.table.set_index("group")["gb_per_rank"] for p in plans})
    table.loc["total"] = table.sum()
    table.index.name = "gb_per_rank"
    return table


def allowance_window(
    config,
    failing: str | Scheme = "int8_experts",
    fitting: str | Scheme = "int8_squeeze",
    tp: int = 2,
    context_len: int = SHIPPED_CONTEXT_LEN,
    budget_bytes: int = 16 * GiB,
    short_by_bytes: int | None = None,
) -> dict:
    """The allowances (``min_to_fail < a <= max_to_fit``) with which ``failing`` overflows and
    ``fitting`` fits a core. ``short_by_bytes``: the allowance that leaves ``failing`` short by that
    much, and ``fitting``'s overflow then."""
    failing_static = plan(config, tp, failing, context_len, runtime_allowance_bytes=0).total_bytes
    fitting_static = plan(config, tp, fitting, context_len, runtime_allowance_bytes=0).total_bytes
    budget = int(budget_bytes)
    window = {
        "budget_bytes": budget,
        "failing_static_bytes": failing_static,
        "fitting_static_bytes": fitting_static,
        "min_to_fail_bytes": budget - failing_static,
        "max_to_fit_bytes": budget - fitting_static,
    }
    if short_by_bytes is not None:
        allowance = budget + int(short_by_bytes) - failing_static
        window |= {
            "allowance_if_short_by_bytes": allowance,
            "fitting_overflow_then_bytes": fitting_static + allowance - budget,
        }
    return window


class RuntimeAllowance(NamedTuple):
    """The runtime's HBM per NeuronCore besides weights and KV cache: ``low < allowance <= high``,
    or one value."""

    low_bytes: int
    high_bytes: int
    source: str
    is_window = property(lambda self: self.low_bytes != self.high_bytes)


@functools.cache
def inferred_runtime_allowance() -> RuntimeAllowance:
    """The allowance window in which the port's int8-experts build fails and its int8 squeeze fits
    (notebook 01)."""
    # the port's schemes, TP=2, 512 tokens, a 16 GiB core
    window = allowance_window(load_gemma4_26b_config())
    return RuntimeAllowance(
        window["min_to_fail_bytes"],
        window["max_to_fit_bytes"],
        "inferred from the port's failed int8-experts and fitting int8-squeeze builds (notebook "
        "01)",
    )


def fit_table(
    config,
    schemes: Iterable[str | Scheme] = tuple(SCHEMES),
    instances: Iterable[str] = tuple(INSTANCES),
    context_len: int = SHIPPED_CONTEXT_LEN,
    budget: str = "spec",
):
    """Instance x scheme: headroom per NeuronCore at the largest valid TP each instance allows."""
    rows = []
    for name in instances:
        inst = get_instance(name)
        degree = max(valid_tp_degrees(config, inst.neuron_cores))
        for scheme in schemes:
            fit = fits(plan(config, degree, scheme, context_len), inst, budget)
            rows.append(
                {
                    "instance": inst.name,
                    "scheme": get_scheme(scheme).name,
                    "tp": degree,
                    "used_gb": fit.used_bytes / GB,
                    "budget_gb": fit.budget_bytes / GB,
                    "headroom_gb": fit.headroom_gb,
                    "fits": fit.fits,
                    "usd_per_hour": inst.usd_per_hour,
                }
            )
    return pd.DataFrame(rows)
