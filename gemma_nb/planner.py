"""``python -m gemma_nb plan CONFIG``: will this Hugging Face causal LM fit an inf2, at what TP, for how much?

Notebook 01's memory planner (``gemma_nb.memory``) for any causal-LM ``config.json`` (a file or a
model folder; no weights are read): the model is built on the meta device, every parameter is
classified into a group (routed experts, router, dense/shared MLP, attention, norms, embedding,
lm_head, ...), and a placement scheme (``memory.SCHEMES``: dtype per group, what TP shards, where
the embedding and lm_head live) gives the bytes per rank; plus the KV cache for a context length
and the runtime allowance. Each instance of the catalog (``gemma_nb.hardware``) is checked at the
TP degree, one rank per NeuronCore, with its on-demand $/h; the cheapest that fits is named.

Host RAM for the two steps, from the same config: the compile and the deploy peaks the port
measured for the 26B (``gemma_nb.story``: 180 GB and 11 GB) scaled by this model's bf16 weight
bytes over the 26B's. A scaling of two measurements, not a measurement: ``preflight`` compares the
box against it. Disk for the two boxes (:func:`disk_needs`): what ``make rehearse`` measured on disk
for the bundled TP=2 checkpoint's two builds (``docs/rehearsal.json``), scaled to this model by its
device weight bytes and its embedding table. ``--json`` prints ``plan_report``'s dict, whose keys
are stable.
"""

from __future__ import annotations

import json
from pathlib import Path

from gemma_nb import memory
from gemma_nb.hardware import GB, INSTANCES, fits, get_instance
from gemma_nb.paths import REPO_ROOT
from gemma_nb.story import CLAIMS

REHEARSAL_RECORD = REPO_ROOT / "docs" / "rehearsal.json"  # the last make rehearse's record, committed

DEFAULT_TP = 2
DEFAULT_SCHEME = "int8_squeeze"
JSON_KEYS = ("config", "model_class", "scheme", "tp", "context_len", "budget", "instance", "fits",
             "total_bytes_per_rank", "total_gb_per_rank", "budget_gb_per_core", "headroom_gb", "groups",
             "kv_cache_gb_per_rank", "runtime_allowance_gb", "host", "instances", "cheapest_fit")


def config_path(path: str | Path) -> Path:
    """``path`` itself if it is a file, else ``path/config.json``; ValueError saying what to pass."""
    path = Path(path)
    candidate = path / "config.json" if path.is_dir() else path
    if not candidate.is_file():
        raise ValueError(f"no config file at {str(path)!r}: pass a config.json or a model folder holding one "
                         "(no weights needed; e.g. gemma_nb/configs/gemma4_26b_a4b.json)")
    return candidate


def load_any_config(path: str | Path):
    """The causal-LM text config of a ``config.json`` (file or folder). Multimodal: its text model.

    Refuses, with the fix, a file that is not JSON, has no ``model_type``, or is not a causal LM.
    """
    file = config_path(path)
    try:
        raw = json.loads(file.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{file.name} is not JSON ({error}): pass a Hugging Face config.json") from None
    config = memory.load_config(raw)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if text is not config:
        config = text  # a multimodal checkpoint (e.g. the hub's Gemma-4): plan its language model
    memory.check_causal_lm_config(config)
    return config


def _bf16_weight_bytes(config) -> int:
    return 2 * memory.param_summary(config)["total_params"]


def host_needs(config) -> dict:
    """Host RAM (bytes) the compile and the deploy of ``config`` need, scaled from the port's 26B peaks.

    ``compile_bytes`` = the story's 180 GB compile peak x (this model's bf16 bytes / the 26B's);
    ``deploy_bytes`` likewise from the 11 GB deploy peak; ``host_embedding_bytes`` the bf16 table
    the slim deploy keeps on the host.
    """
    reference = _bf16_weight_bytes(memory.load_gemma4_26b_config())
    ratio = _bf16_weight_bytes(config) / reference
    return {
        "bf16_weights_bytes": _bf16_weight_bytes(config),
        "compile_bytes": int(CLAIMS["compile_peak_host_gb"].value * GB * ratio),
        "deploy_bytes": int(CLAIMS["deploy_peak_rss_gb"].value * GB * ratio),
        "host_embedding_bytes": 2 * config.vocab_size * config.hidden_size,
        "basis": "the port's measured 26B figures (compile peak 180 GB, deploy peak 11 GB) scaled by bf16 weight bytes",
    }


def device_weight_bytes(config, tp: int = DEFAULT_TP, scheme: str = DEFAULT_SCHEME) -> int:
    """Bytes of weights on all NeuronCores together (every rank's shard): what a compiled artifact holds."""
    table = memory.plan(config, tp, scheme).table.set_index("group")
    weights = table.drop(index=[g for g in ("kv_cache", "runtime_allowance") if g in table.index])
    return tp * int(weights["bytes_per_rank"].sum())


def rehearsal_record(path: Path | str = REHEARSAL_RECORD) -> dict | None:
    """``make rehearse``'s record (``rehearsal.json``), or None where there is none."""
    path = Path(path)
    return json.loads(path.read_text()) if path.is_file() else None


def disk_needs(config, record: dict) -> dict:
    """Disk (bytes) for the compile box and the serving box, from a rehearsal's measured builds.

    ``record``: ``rehearsal.json`` (``make rehearse``: both builds of the bundled TP=2 checkpoint,
    their artifact files and compiler workdir on disk, and that checkpoint's device weight and
    embedding table bytes). Each build is scaled to ``config``: ``model.pt`` and the compiler workdir
    (the sharded weights) by the device weight bytes, the host embedding file by the embedding table
    (bf16 from the hub), the small files as measured. Returns ``builds`` (per decode path: ``artifact_bytes``,
    ``compiler_workdir_bytes``), ``checkpoint_bytes`` (the text weights in bf16),
    ``compile_disk_bytes`` (checkpoint + every build and its workdir) and ``serve_disk_bytes``
    (every build's artifact folder, the workdir left behind).
    """
    scale = record["scale"]
    device = device_weight_bytes(config) / scale["device_weight_bytes"]
    embedding = 2 * config.vocab_size * config.hidden_size / scale["embedding_table_bytes"]
    builds = {}
    for name, build in record["builds"].items():
        files = build["artifact_files_bytes"]
        scaled = sum(size * (device if file == "model.pt" else embedding if file == "embed_tokens.safetensors" else 1)
                     for file, size in files.items())
        builds[name] = {"artifact_bytes": int(scaled), "compiler_workdir_bytes": int(build["compiler_workdir_bytes"] * device)}
    checkpoint = _bf16_weight_bytes(config)
    return {
        "builds": builds,
        "checkpoint_bytes": checkpoint,
        "compile_disk_bytes": checkpoint + sum(b["artifact_bytes"] + b["compiler_workdir_bytes"] for b in builds.values()),
        "serve_disk_bytes": sum(b["artifact_bytes"] for b in builds.values()),
        "basis": f"make rehearse's builds of {record['model_id']} ({', '.join(builds)}) on disk, scaled by "
                 "device weight bytes and the embedding table",
    }


def plan_report(config, scheme: str = DEFAULT_SCHEME, tp: int = DEFAULT_TP, context_len: int = memory.SHIPPED_CONTEXT_LEN,
                instance: str | None = None, budget: str = "spec", name: str = "") -> dict:
    """The plan as a dict with the keys in ``JSON_KEYS`` (bytes, and GB = 10^9 bytes).

    ``instance``: judge this one; default the cheapest instance that fits (``None`` if none does).
    Raises ValueError naming the fix for an unknown scheme or instance, or a TP the heads, KV heads
    or experts do not divide.
    """
    if instance is not None:
        get_instance(instance)
    memory.get_scheme(scheme)
    plan = memory.plan(config, tp, scheme, context_len)
    table = plan.table.set_index("group")
    rows = [fits(plan, inst, budget) for inst in INSTANCES.values()]
    fitting = sorted((f for f in rows if f.fits), key=lambda f: f.usd_per_hour)
    cheapest = fitting[0] if fitting else None
    chosen = next(f for f in rows if f.instance == instance) if instance else cheapest
    groups = {
        group: {"dtype": row["dtype"], "placement": row["placement"], "params": int(row["params"]),
                "bytes_per_rank": int(row["bytes_per_rank"]), "gb_per_rank": row["bytes_per_rank"] / GB,
                "host_bytes": int(row["host_bytes"])}
        for group, row in table.iterrows()
    }
    return {
        "config": name,
        "model_class": plan.model_class,
        "scheme": plan.scheme.name,
        "tp": tp,
        "context_len": context_len,
        "budget": budget,
        "instance": chosen.instance if chosen else None,
        "fits": bool(chosen.fits) if chosen else False,
        "total_bytes_per_rank": plan.total_bytes,
        "total_gb_per_rank": plan.total_gb,
        "budget_gb_per_core": chosen.budget_bytes / GB if chosen else None,
        "headroom_gb": chosen.headroom_gb if chosen else None,
        "groups": groups,
        "kv_cache_gb_per_rank": plan.gb("kv_cache"),
        "runtime_allowance_gb": plan.gb("runtime_allowance"),
        "host": host_needs(config),
        "instances": [
            {"instance": f.instance, "neuron_cores": f.neuron_cores, "fits": f.fits, "used_gb": f.used_bytes / GB,
             "budget_gb": f.budget_bytes / GB, "headroom_gb": f.headroom_gb, "replicas": f.replicas,
             "host_ram_gb": get_instance(f.instance).host_ram_bytes / GB, "usd_per_hour": f.usd_per_hour,
             "reason": f.reason}
            for f in rows
        ],
        "cheapest_fit": ({"instance": cheapest.instance, "usd_per_hour": cheapest.usd_per_hour} if cheapest else None),
    }


def format_report(report: dict) -> str:
    """The plan as text: groups per rank, instances, verdict, host RAM per step."""
    lines = [f"{report['config'] or report['model_class']}: {report['model_class']}, scheme {report['scheme']}, "
             f"TP={report['tp']}, {report['context_len']}-token KV cache (GB = 10^9 bytes)", ""]
    lines.append(f"  {'group':<22}{'dtype':<7}{'placement':<12}{'GB per rank':>12}")
    for group, row in report["groups"].items():
        if row["bytes_per_rank"] or row["host_bytes"]:
            where = f"{row['gb_per_rank']:12.3f}" if row["placement"] != "host" else f"{'(host)':>12}"
            lines.append(f"  {group:<22}{row['dtype']:<7}{row['placement']:<12}{where}")
    lines.append(f"  {'total':<41}{report['total_gb_per_rank']:12.3f}")
    lines += ["", f"  {'instance':<15}{'cores':>6}{'fits':>6}{'headroom GB':>13}{'$/h':>9}"]
    for row in report["instances"]:
        headroom = "-" if row["headroom_gb"] is None else f"{row['headroom_gb']:+.2f}"
        lines.append(f"  {row['instance']:<15}{row['neuron_cores']:>6}{'yes' if row['fits'] else 'no':>6}"
                     f"{headroom:>13}{row['usd_per_hour']:>9.4f}")
    lines.append("")
    if report["instance"] is None:
        lines.append(f"does not fit any instance at TP={report['tp']}: try a larger TP (--tp), an int8 scheme "
                     "(--scheme int8_squeeze) or a shorter context (--context)")
    else:
        verdict = "fits" if report["fits"] else "does NOT fit"
        lines.append(f"{verdict} {report['instance']} ({report['budget_gb_per_core']:.2f} GB per NeuronCore, "
                     f"headroom {report['headroom_gb']:+.2f} GB)")
    if report["cheapest_fit"]:
        cheapest = report["cheapest_fit"]
        lines.append(f"cheapest that fits: {cheapest['instance']} at ${cheapest['usd_per_hour']:.4f}/h")
    host = report["host"]
    lines.append(f"host RAM, scaled from the port's 26B peaks: compile ~{host['compile_bytes'] / GB:.1f} GB, "
                 f"deploy ~{host['deploy_bytes'] / GB:.1f} GB (host embedding {host['host_embedding_bytes'] / GB:.2f} GB)")
    return "\n".join(lines)


def add_arguments(parser) -> None:
    parser.add_argument("config", help="a Hugging Face config.json, or a model folder holding one (no weights)")
    parser.add_argument("--instance", default=None, help=f"judge this instance: {', '.join(INSTANCES)} "
                                                         "(default: the cheapest that fits)")
    parser.add_argument("--scheme", default=DEFAULT_SCHEME, help=f"one of {', '.join(memory.SCHEMES)} (default {DEFAULT_SCHEME})")
    parser.add_argument("--tp", type=int, default=DEFAULT_TP, help=f"tensor-parallel degree, ranks = NeuronCores (default {DEFAULT_TP})")
    parser.add_argument("--context", type=int, default=memory.SHIPPED_CONTEXT_LEN,
                        help=f"KV-cache length in tokens (default {memory.SHIPPED_CONTEXT_LEN}, the port's)")
    parser.add_argument("--budget", default="spec", choices=("spec", "story"),
                        help="HBM per core: spec = 16 GiB (AWS), story = 16 GB (the write-up)")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON (stable keys)")


def main(args) -> int:
    """``python -m gemma_nb plan``; exit 0 if the plan fits the judged instance, 1 if not, 2 on bad input."""
    import sys

    try:
        config = load_any_config(args.config)
        report = plan_report(config, args.scheme, args.tp, args.context, args.instance, args.budget,
                             name=Path(args.config).name)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0 if report["fits"] else 1
