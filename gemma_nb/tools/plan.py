"""``python -m gemma_nb plan CONFIG``: will a Hugging Face causal LM fit an inf2, how fast will it
decode, for how much? Notebook 01's memory planner for any ``config.json`` (no weights read): bytes
per rank, each instance's verdict, its decode roofline and $ per million tokens, and host RAM and
disk scaled from the port's measured builds."""

import json
import sys

import torch
from transformers import AutoModel

from gemma_nb import decode_roofline, memory, params
from gemma_nb.cli import DEFAULT_SCHEME, DEFAULT_TP
from gemma_nb.hardware import DEVICES, GB, INSTANCES, GiB, fits, get_instance
from gemma_nb.paths import REPO_ROOT
from gemma_nb.plan_input import PlanInput, mla_notes, quantization_notes, read_raw_config
from gemma_nb.story import CLAIMS

# the last make rehearse's record, committed
REHEARSAL_RECORD = REPO_ROOT / "docs" / "rehearsal.json"
NEURON_DEVICE = "neuroncore_v2"
PORT_BOXES = {"compile": "inf2.8xlarge", "deploy": "inf2.xlarge"}  # where the port ran each step
FITS, MARGINAL, NO_FIT, NOT_LOADABLE = "fits", "marginal", "does not fit", "not loadable"
EXIT_CODES = {FITS: 0, NO_FIT: 1, NOT_LOADABLE: 1, MARGINAL: 3}  # 2: bad input
# Weight formats NxD can load on an inf2 (docs/sources.md: nxd-source); the FP4 schemes cannot.
NXD_FORMATS = ("bf16", "fp32", "int8", "fp8")


def read_config(source) -> PlanInput:
    """The planner's view of a config (a path, or ``read_raw_config``'s result): a multimodal
    one's text model, its towers counted apart; ValueError saying what to pass."""
    raw = (source if hasattr(source, "raw") else read_raw_config(source)).raw
    full = params.load_config(raw)
    text = full.get_text_config()
    params.check_causal_lm_config(text)
    notes = [*mla_notes(text), *quantization_notes(raw)]
    if text is full:
        return PlanInput(text, 0, tuple(notes))
    with torch.device("meta"):  # the towers: vision, audio, projectors
        towers = sum(p.numel() for p in AutoModel.from_config(full).parameters()) - sum(
            p.numel() for p in AutoModel.from_config(text).parameters()
        )
    if towers:
        names = ", ".join(
            key
            for key, value in full.to_dict().items()
            if key.endswith("_config") and key != "text_config" and isinstance(value, dict)
        )
        notes.append(
            f"{names or 'its non-text modules'}: a multimodal config ({type(full).__name__}). "
            f"The plan is its language model ({type(text).__name__}) alone, as a text-only "
            f"deploy loads it; the towers and projector, {towers / 1e9:.3f}B parameters, are "
            "left out of every byte below and counted in params.towers."
        )
    return PlanInput(text, towers, tuple(notes))


def unloadable(scheme: str) -> str | None:
    """Why NxD cannot load ``scheme`` on an inf2 (None: it can)."""
    sch = memory.get_scheme(scheme)
    formats = sorted({sch.dtype(g) for g in memory.GROUPS} - set(NXD_FORMATS))
    if not formats:
        return None
    loadable = ", ".join(NXD_FORMATS)
    return f"NxD loads {loadable} weights on inf2, not {', '.join(formats)} (notebook 02)"


def _bf16_weight_bytes(config) -> int:
    return 2 * memory.param_summary(config)["total_params"]


def host_needs(config, model_pt_bytes: int | None = None) -> dict:
    """Host RAM + swap (bytes) each step needs, the port's 26B scaled by this model's bf16 bytes:
    the box the port ran the step on, its nominal RAM plus its swapfile (read as ``fallocate -l
    100G``: GiB, the larger reading), and for the deploy at least what loading needs,
    ``model.pt`` read whole by ``torch.jit.load`` (``model_pt_bytes``, else the device weights)
    beside the port's measured load peak."""
    ratio = _bf16_weight_bytes(config) / _bf16_weight_bytes(memory.load_gemma4_26b_config())
    model_pt = device_weight_bytes(config) if model_pt_bytes is None else model_pt_bytes
    load = model_pt + int(CLAIMS["deploy_peak_rss_gb"].value * GB * ratio)
    recipe = {
        step: int((INSTANCES[box].host_ram_gib + CLAIMS[f"{step}_swap_gb"].value) * GiB * ratio)
        for step, box in PORT_BOXES.items()
    }
    return {
        "bf16_weights_bytes": _bf16_weight_bytes(config),
        "compile_peak_bytes": int(CLAIMS["compile_peak_host_gb"].value * GB * ratio),
        "compile_bytes": recipe["compile"],
        "model_pt_bytes": model_pt,
        "deploy_load_bytes": load,
        "deploy_bytes": max(recipe["deploy"], load),
        "host_embedding_bytes": 2 * config.vocab_size * config.hidden_size,
        "basis": "the port's boxes and swapfiles, and its peaks, scaled by bf16 weight bytes",
    }


def device_weight_bytes(config, tp: int = DEFAULT_TP, scheme: str = DEFAULT_SCHEME) -> int:
    """Bytes of weights on all NeuronCores together: what a compiled artifact holds."""
    return tp * memory.plan(config, tp, scheme).weights_bytes


def rehearsal_record() -> dict | None:  # None where make rehearse left none
    return json.loads(REHEARSAL_RECORD.read_text()) if REHEARSAL_RECORD.is_file() else None


def disk_needs(config, record: dict) -> dict:
    """Disk (bytes) for the compile box and the serving box: ``record``'s builds
    (``rehearsal.json``) scaled to ``config``, ``model.pt`` and the compiler workdir by the device
    weight bytes, the embedding file by its table."""
    scale, checkpoint = record["scale"], _bf16_weight_bytes(config)
    device = device_weight_bytes(config) / scale["device_weight_bytes"]
    factor = {
        "model.pt": device,
        "embed_tokens.safetensors": 2
        * config.vocab_size
        * config.hidden_size
        / scale["embedding_table_bytes"],
    }
    builds = {
        name: {
            "artifact_bytes": int(
                sum(size * factor.get(file, 1) for file, size in b["artifact_files_bytes"].items())
            ),
            "compiler_workdir_bytes": int(b["compiler_workdir_bytes"] * device),
        }
        for name, b in record["builds"].items()
    }
    return {
        "builds": builds,
        "checkpoint_bytes": checkpoint,
        "compile_disk_bytes": checkpoint
        + sum(b["artifact_bytes"] + b["compiler_workdir_bytes"] for b in builds.values()),
        "serve_disk_bytes": sum(b["artifact_bytes"] for b in builds.values()),
        "basis": f"make rehearse's builds of {record['model_id']} ({', '.join(builds)}) on disk, "
        "scaled by device weight bytes and the embedding table",
    }


def param_counts(config, towers_params: int = 0) -> dict:
    """Total and active parameters (as the model cards count them), with and without the input
    embedding table."""
    summary = memory.param_summary(config)
    table = summary["embeddings_params"] + summary["per_layer_embeddings_params"]
    return {
        "total": summary["total_params"],
        "total_excl_input_embedding": summary["total_params"] - table,
        "active": summary["active_params"],
        "active_excl_input_embedding": summary["active_params"] - table,
        "towers": int(towers_params),
        "total_with_towers": summary["total_params"] + int(towers_params),
        "num_experts": summary["num_experts"],
        "top_k": summary["top_k"],
        "tied_lm_head": summary["tied"],
    }


def judge(fit, allowance: memory.RuntimeAllowance) -> tuple[str, int | None]:
    """(verdict, headroom bytes with the allowance's low end) for a ``hardware.fits`` result at its
    high end."""
    if fit.headroom_bytes is None:
        return NO_FIT, None
    if_low = fit.headroom_bytes + allowance.high_bytes - allowance.low_bytes
    if fit.headroom_bytes >= 0:
        return FITS, if_low
    # The window is open at its low end: a plan with no room there fails, as the int8-experts build
    # did.
    return (MARGINAL if allowance.is_window and if_low > 0 else NO_FIT), if_low


def _speeds(costs, deployment, batch: int | None) -> dict | None:
    """Per experts mode, the roofline's tok/s (whole box), tok/s per stream, $ per 10^6 tokens at
    ``batch``."""
    if not batch:
        return None
    speeds = {
        mode: decode_roofline.step_speed(costs, deployment, batch, mode)
        for mode in decode_roofline.EXPERT_MODES
    }
    keys = ("tok_s", "tok_s_per_stream", "usd_per_m_tokens", "step_ms", "bound")
    return {
        "batch": batch,
        **{mode: {key: speed[key] for key in keys} for mode, speed in speeds.items()},
    }


def _instance_row(the_plan, costs, inst, scheme: str, tp: int, budget: str, allowance) -> dict:
    """The verdict on ``inst``; its decode: the roofline at batch 1 and the largest batch, ``cores
    // tp`` replicas."""
    fit, decode = fits(the_plan, inst, budget), None
    verdict, if_low = judge(fit, allowance)
    if tp <= inst.neuron_cores:
        deployment = decode_roofline.Deployment(
            inst.name,
            NEURON_DEVICE,
            tp,
            scheme,
            inst.usd_per_hour,
            replicas=inst.neuron_cores // tp,
        )
        limits = decode_roofline.batch_limits(
            costs, deployment, allowance, inst.budget_bytes(budget)
        )
        largest, largest_if_low = limits["largest_batch"], limits["largest_batch_if_low"]
        batches = {
            "batch_1": 1,
            "at_largest_batch": largest,
            "at_largest_batch_if_low": largest_if_low,
        }
        decode = {
            "replicas": deployment.replicas,
            "largest_batch": largest,
            "largest_batch_if_low": largest_if_low,
            **{key: _speeds(costs, deployment, batch) for key, batch in batches.items()},
        }
    return {
        "instance": fit.instance,
        "neuron_cores": fit.neuron_cores,
        "fits": verdict == FITS,
        "verdict": verdict,
        "used_gb": fit.used_bytes / GB,
        "budget_gb": fit.budget_bytes / GB,
        "headroom_gb": fit.headroom_gb,
        "headroom_gb_if_low": None if if_low is None else if_low / GB,
        "replicas": fit.replicas,
        "host_ram_gb": inst.host_ram_bytes / GB,
        "usd_per_hour": fit.usd_per_hour,
        "reason": fit.reason,
        "decode": decode,
    }


def _decode_basis(costs, rows: list[dict]) -> dict:
    batches = sorted(
        {1}
        | {
            row["decode"][key]
            for row in rows
            if row["decode"]
            for key in ("largest_batch", "largest_batch_if_low")
            if row["decode"][key]
        }
    )
    device = DEVICES[NEURON_DEVICE]
    return {
        "device": NEURON_DEVICE,
        "bandwidth_gb_s_per_core": device.bandwidth_bytes_s / GB,
        "bf16_tflops_per_core": device.bf16_flops / 1e12,
        "context_len": costs.context_len,
        "num_experts": costs.num_experts,
        "top_k": costs.top_k,
        "kv_gb_per_stream_per_rank": costs.kv_bytes_per_stream / GB,
        "expected_distinct_experts": {
            str(b): decode_roofline.expected_distinct_experts(costs.num_experts, costs.top_k, b)
            for b in batches
        },
        "measured_tok_s": CLAIMS["decode_tok_s"].value,
        "measured": "the port's 26B with dense experts on inf2.xlarge, batch 1 (its write-up)",
        "basis": "upper bounds, from a bandwidth roofline: a step reads the non-expert weights "
        "once, the routed experts in full (dense) or their expected distinct count (sparse), and "
        "every stream's KV cache; no faster than max(bytes / bandwidth, FLOPs / bf16 peak) per "
        "NeuronCore",
    }


def plan_report(
    config,
    scheme: str = DEFAULT_SCHEME,
    tp: int = DEFAULT_TP,
    context_len: int = memory.SHIPPED_CONTEXT_LEN,
    instance: str | None = None,
    budget: str = "spec",
    name: str = "",
    allowance: memory.RuntimeAllowance | None = None,
    notes=(),
    towers_params: int = 0,
) -> dict:
    """The plan as a dict with the keys the README lists (``--json``), judged on ``instance``
    (default: the cheapest that fits)."""
    if instance is not None:
        get_instance(instance)
    allowance = allowance or memory.inferred_runtime_allowance()
    the_plan = memory.plan(
        config, tp, scheme, context_len, runtime_allowance_bytes=allowance.high_bytes
    )
    costs = decode_roofline.step_costs(config, scheme, tp, context_len)
    rows = [
        _instance_row(the_plan, costs, inst, scheme, tp, budget, allowance)
        for inst in INSTANCES.values()
    ]
    if why_not := unloadable(scheme):  # whatever the bytes, the box cannot run it
        for row in rows:
            row.update(fits=False, verdict=NOT_LOADABLE, reason=why_not)
    fitting = sorted((row for row in rows if row["fits"]), key=lambda row: row["usd_per_hour"])
    marginal = min(
        (row for row in rows if row["verdict"] == MARGINAL),
        key=lambda row: row["usd_per_hour"],
        default=None,
    )
    chosen = (
        next(row for row in rows if row["instance"] == instance)
        if instance
        else (fitting or [marginal])[0]
    ) or {}
    return {
        "config": name,
        "model_class": the_plan.model_class,
        "scheme": the_plan.scheme.name,
        "tp": tp,
        "context_len": context_len,
        "budget": budget,
        "instance": chosen.get("instance"),
        "fits": bool(chosen.get("fits")),
        "verdict": chosen.get("verdict", NOT_LOADABLE if why_not else NO_FIT),
        "total_bytes_per_rank": the_plan.total_bytes,
        "total_gb_per_rank": the_plan.total_gb,
        "budget_gb_per_core": chosen.get("budget_gb"),
        "headroom_gb": chosen.get("headroom_gb"),
        "headroom_gb_if_low": chosen.get("headroom_gb_if_low"),
        "groups": _groups(the_plan),
        "params": param_counts(config, towers_params),
        "notes": list(notes),
        "kv_cache_gb_per_rank": the_plan.gb("kv_cache"),
        "runtime_allowance_gb": allowance.high_bytes / GB,
        "runtime_allowance": {
            "low_gb": allowance.low_bytes / GB,
            "high_gb": allowance.high_bytes / GB,
            "source": allowance.source,
        },
        "host": host_needs(config),
        "decode": _decode_basis(costs, rows),
        "instances": rows,
        "cheapest_fit": (
            {"instance": fitting[0]["instance"], "usd_per_hour": fitting[0]["usd_per_hour"]}
            if fitting
            else None
        ),
        "advice": None if fitting else advice(config, scheme, tp, context_len, budget, allowance),
    }


def _groups(the_plan) -> dict:
    """Each weight group's dtype, placement, parameters and bytes (per rank, on the host)."""
    columns = ["dtype", "placement", "params", "bytes_per_rank", "gb_per_rank", "host_bytes"]
    return the_plan.table.set_index("group")[columns].to_dict("index")


def advice(config, scheme: str, tp: int, context_len: int, budget: str, allowance) -> str:
    """When nothing fits: the cheapest other (TP, scheme) NxD can load that fits an inf2, or why
    none does."""
    most_cores = max(inst.neuron_cores for inst in INSTANCES.values())
    degrees = memory.valid_tp_degrees(config, most_cores)
    schemes = [name for name in memory.SCHEMES if unloadable(name) is None]
    options = []
    for degree, name in ((d, n) for d in degrees for n in schemes if (d, n) != (tp, scheme)):
        the_plan = memory.plan(
            config, degree, name, context_len, runtime_allowance_bytes=allowance.high_bytes
        )
        changed = (("--tp", degree, tp), ("--scheme", name, scheme))
        flags = " ".join(f"{flag} {new}" for flag, new, old in changed if new != old)
        options += [
            (inst.usd_per_hour, name != scheme, degree, flags, inst.name)
            for inst in INSTANCES.values()
            if judge(fits(the_plan, inst, budget), allowance)[0] == FITS
        ]
    if options:
        usd, _, _, flags, instance = min(options)
        return f"Try {flags}: it fits {instance} (${usd:.4f}/h), the cheapest change that does."
    lightest = min(
        schemes,
        key=lambda name: (
            memory.plan(config, degrees[-1], name, context_len).total_bytes,
            name != DEFAULT_SCHEME,
        ),
    )
    need = memory.plan(
        config, degrees[-1], lightest, context_len, runtime_allowance_bytes=allowance.high_bytes
    ).total_gb
    biggest = max(INSTANCES.values(), key=lambda inst: inst.neuron_cores)
    room = biggest.neuron_cores * (biggest.budget_bytes(budget) - allowance.high_bytes)
    whole = memory.plan(config, 1, lightest, context_len, runtime_allowance_bytes=0).total_bytes
    split = [
        d
        for d in range(degrees[-1] + 1, most_cores + 1)
        if params.tp_problem(config, d, whole_experts=False) is None
    ]
    return (
        f"No inf2 holds it: TP is at most {degrees[-1]} (what its heads, KV heads and experts "
        f"allow on {most_cores} NeuronCores), where the lightest scheme NxD loads, {lightest}, "
        f"needs {need:.2f} GB per core against "
        f"{get_instance('inf2.xlarge').budget_bytes(budget) / GB:.2f} GB."
        + (
            " That is the limit of this port's sharding, not of the hardware: it keeps each "
            f"expert whole on one rank, so TP must divide num_experts; {biggest.name}'s "
            f"{biggest.neuron_cores} NeuronCores hold {room / GB:.0f} GB besides the runtime and "
            f"the whole model in {lightest} is {whole / GB:.0f} GB, so a port that splits each "
            f"expert across ranks could fit it at TP={split[-1]}."
            if split and whole <= room
            else ""
        )
    )


def _format_header(report: dict) -> list[str]:
    params, allowance = report["params"], report["runtime_allowance"]
    lines = [
        f"{report['config'] or report['model_class']}: {report['model_class']}, scheme "
        f"{report['scheme']}, TP={report['tp']}, {report['context_len']}-token KV cache (GB = "
        "10^9 bytes)",
        f"parameters: {params['total'] / 1e9:.3f}B total "
        f"({params['total_excl_input_embedding'] / 1e9:.3f}B without the input embedding), "
        f"{params['active'] / 1e9:.3f}B active per token "
        f"({params['active_excl_input_embedding'] / 1e9:.3f}B without it)"
        + (f"; towers left out: {params['towers'] / 1e9:.3f}B" if params["towers"] else ""),
    ]
    lines.append(
        f"runtime allowance per NeuronCore: {allowance['low_gb']:.2f}-{allowance['high_gb']:.2f} "
        f"GB, {allowance['source']}; totals use {allowance['high_gb']:.2f} (--runtime-allowance "
        "GB sets one)"
        if allowance["low_gb"] != allowance["high_gb"]
        else f"runtime allowance per NeuronCore: {allowance['high_gb']:.2f} GB "
        f"({allowance['source']})"
    )
    lines += [
        *(f"note: {note}" for note in report["notes"]),
        "",
        f"  {'group':<22}{'dtype':<7}{'placement':<12}{'GB per rank':>12}",
    ]
    for group, row in report["groups"].items():
        if row["bytes_per_rank"] or row["host_bytes"]:
            where = (
                f"{row['gb_per_rank']:12.3f}" if row["placement"] != "host" else f"{'(host)':>12}"
            )
            lines.append(f"  {group:<22}{row['dtype']:<7}{row['placement']:<12}{where}")
    lines += [
        f"  {'total':<41}{report['total_gb_per_rank']:12.3f}",
        "",
        f"  {'instance':<15}{'cores':>6}  {'verdict':<13}{'headroom GB':>16}{'$/h':>9}",
    ]
    for row in report["instances"]:
        headroom = "-" if row["headroom_gb"] is None else f"{row['headroom_gb']:+.2f}"
        if (
            row["headroom_gb_if_low"] is not None
            and row["headroom_gb_if_low"] != row["headroom_gb"]
        ):
            headroom += f" to {row['headroom_gb_if_low']:+.2f}"
        lines.append(
            f"  {row['instance']:<15}{row['neuron_cores']:>6}  {row['verdict']:<13}{headroom:>16}"
            f"{row['usd_per_hour']:>9.4f}"
        )
    return [*lines, ""]


def _format_decode(report: dict) -> list[str]:
    basis = report["decode"]
    lines = [
        f"  decode, bandwidth roofline per box ({basis['bandwidth_gb_s_per_core']:.0f} GB/s per "
        f"NeuronCore, {basis['context_len']}-token KV cache per stream): upper bounds on tok/s "
        "(all streams), lower bounds on $ per million tokens",
        f"  measured, for scale: {basis['measured_tok_s']:g} tok/s, {basis['measured']}",
        f"  {'instance':<15}{'streams':>9}{'dense tok/s':>13}{'$/M':>8}"
        f"{'sparse tok/s':>14}{'$/M':>8}",
    ]
    starred = False
    for row in report["instances"]:
        decode = row["decode"]
        if decode is None or row["verdict"] in (NO_FIT, NOT_LOADABLE):
            lines.append(f"  {row['instance']:<15}{'-':>9}  {row['verdict']}: {row['reason']}")
            continue
        shown = set()
        for key, mark in (
            ("batch_1", ""),
            ("at_largest_batch", ""),
            ("at_largest_batch_if_low", "*"),
        ):
            speeds = decode[key]
            if speeds is None or speeds["batch"] in shown:
                continue
            shown.add(speeds["batch"])
            starred = starred or bool(mark)
            usd = {
                mode: "-"
                if speeds[mode]["usd_per_m_tokens"] is None
                else f"{speeds[mode]['usd_per_m_tokens']:.2f}"
                for mode in ("dense", "sparse")
            }
            cells = "".join(
                f"{speeds[mode]['tok_s']:>{13 + (mode == 'sparse')}.1f}{usd[mode]:>8}"
                for mode in usd
            )
            streams = f"{speeds['batch'] * decode['replicas']}{mark}"
            lines.append(f"  {row['instance'] if key == 'batch_1' else '':<15}{streams:>9}{cells}")
    if starred:
        lines.append("  * only if the runtime takes the low end of its allowance")
    if basis["num_experts"]:
        distinct = ", ".join(
            f"B={b}: {d:.1f}" for b, d in basis["expected_distinct_experts"].items()
        )
        lines.append(
            f"  expected distinct experts per layer ({basis['num_experts']} experts, "
            f"top-{basis['top_k']}): {distinct}"
        )
    return [*lines, ""]


def _format_verdict(report: dict) -> list[str]:
    lines = []
    if report["instance"] is None:
        verdict = "not loadable on" if report["verdict"] == NOT_LOADABLE else "does not fit"
        lines.append(f"{verdict} any instance at TP={report['tp']}. {report['advice']}")
    else:
        row = next(r for r in report["instances"] if r["instance"] == report["instance"])
        words = {FITS: "fits", MARGINAL: "MARGINAL on", NO_FIT: "does NOT fit"}
        words = words.get(row["verdict"], "NOT loadable on")
        if row["headroom_gb"] is None or row["verdict"] == NOT_LOADABLE:
            lines.append(f"{words} {row['instance']}: {row['reason']}")
        else:
            lines.append(
                f"{words} {row['instance']} ({row['budget_gb']:.2f} GB per NeuronCore, headroom "
                f"{row['headroom_gb']:+.2f} GB"
                + (
                    f", {row['headroom_gb_if_low']:+.2f} GB if the runtime takes the window's least"
                    if row["verdict"] == MARGINAL
                    else ""
                )
                + ")"
            )
    if cheapest := report["cheapest_fit"]:
        lines.append(
            f"cheapest that fits: {cheapest['instance']} at ${cheapest['usd_per_hour']:.4f}/h"
        )
    elif report["instance"] is not None:
        lines.append(f"nothing fits. {report['advice']}")
    host = report["host"]
    lines.append(
        f"host RAM + swap, the port's boxes scaled: compile {host['compile_bytes'] / GiB:.1f} GiB, "
        f"deploy {host['deploy_bytes'] / GiB:.1f} GiB (host embedding "
        f"{host['host_embedding_bytes'] / GB:.2f} GB)"
    )
    return lines


def main(args) -> int:
    """``args`` as ``cli`` parsed them (the config already read and its counts checked)."""
    gb = args.runtime_allowance  # GB (10^9 bytes) per NeuronCore
    allowance = None if gb is None else memory.RuntimeAllowance(int(gb * GB), int(gb * GB), "given")
    try:
        source = read_config(args.config)
        report = plan_report(
            source.config,
            args.scheme,
            args.tp,
            memory.SHIPPED_CONTEXT_LEN if args.context is None else args.context,
            args.instance,
            args.budget,
            name=args.config.name,
            allowance=allowance,
            notes=source.notes,
            towers_params=source.towers_params,
        )
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(
        json.dumps(report, indent=2)
        if args.json
        else "\n".join([*_format_header(report), *_format_decode(report), *_format_verdict(report)])
    )
    return EXIT_CODES[report["verdict"]]
