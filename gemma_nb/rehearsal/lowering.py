"""The neuron graphs lowered to XLA on the cpu, at the Neuron SDK 2.31's own torch (torch-xla 2.9).

torch-neuronx 2.9 traces through torch-xla 2.9: ModelBuilder runs the module on the XLA device,
takes the HLO of its outputs and hands it to neuronx-cc. The same torch-xla runs on the cpu
(``PJRT_DEVICE=CPU``), so everything up to the HLO can be checked without an Inferentia machine:
that each graph ModelBuilder would trace lowers to **one** XLA graph per step, with no aten op that
falls back to the cpu (``aten::*`` counters in ``torch_xla.debug.metrics``) and no device-to-host
transfer (``TransferFromDeviceTime``) while the step is traced and run, and that its logits equal the
same module run eagerly. What it cannot check: that neuronx-cc accepts the HLO, the NEFF, HBM fit
and speed (only an inf2 can).

This module needs the second environment ``.venv-xla`` (torch 2.9.0, torch-xla 2.9.0,
``envs/xla/requirements.txt``; ``make xla``) for :func:`lower_step` and the graph runs; the text
helpers (:func:`hlo_counts`, :func:`aten_fallbacks`, :func:`tolerance`) and
:func:`run_in_xla_env` are plain Python and run in the main environment, where notebook 04 calls
the check as a subprocess. From the command line, in ``.venv-xla``:

    PJRT_DEVICE=CPU .venv-xla/bin/python -m gemma_nb.rehearsal.lowering --json [--contrast]

The graphs (:func:`shipped_graphs`) are ``gemma_nb.neuron.build``'s own modules with the NxD layers
replaced by the cpu stand-ins of ``gemma_nb.rehearsal.standins`` (contracts read from
neuronx-distributed 0.18; they prove this repo's code, not the SDK's layers), loaded from the
bundled TP=2 tiny checkpoint (``gemma-nb/tiny-gemma4-moe-tp2``: its KV heads split by 2) as
ModelBuilder shards it, at the shipped build's shapes (``NeuronBuildConfig``: prefill bucket 128,
KV state 512 slots, bf16), which fit the tiny model (its ``max_position_embeddings`` is 512).
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import torch

from gemma_nb.moe import swap_experts
from gemma_nb.neuron.build import (
    NeuronBuildConfig,
    NeuronGemma4,
    convert_checkpoint,
    read_hf_state,
    step_inputs,
    text_config,
)
from gemma_nb.neuron.lm_head import build_lm_head, lm_head_state_dict, trim_padded_logits
from gemma_nb.paths import REPO_ROOT
from gemma_nb.rehearsal.emulate import rank_module
from gemma_nb.rehearsal.standins import NXD_CONTRACT_VERSION, cpu_sdk, load_rank_module
from gemma_nb.tiny import BUNDLED_IDS, TP2_CHECKPOINT_DIR

XLA_PYTHON_ENV = "GEMMA_NB_XLA_PYTHON"
XLA_VENV = ".venv-xla"
# Allowed |logits(XLA) - logits(eager)|, in ulps of the largest |logit|. XLA's cpu backend fuses
# and reorders the same arithmetic (and keeps some bf16 intermediates in fp32), so the two runs
# round differently. In fp32 that stays within a few ulps: the exact comparison. In bf16 the
# roundings compound through the layers, for eager and XLA alike (each row's ``bf16_rounding``,
# eager bf16 against eager fp32, is of the same size as its bf16 difference), hence the wider bound.
TOLERANCE_ULPS = {torch.bfloat16: 32, torch.float32: 64}
MANTISSA_BITS = {torch.bfloat16: 7, torch.float32: 23}
PROMPT_TOKENS = 12   # real tokens in the padded prefill (the rest of the bucket is padding)
DECODE_POSITION = 12  # where the decode step writes; cache slots before it hold seeded values
SEED = 0
TP_DEGREES = (1, 2)

# One HLO instruction per line: "  [ROOT ]%name = <shape> opcode(operands), attributes".
_INSTRUCTION = re.compile(r"^\s+(?:ROOT\s+)?%?[\w.\-]+\s+=\s+(.*)$")
# The opcode is the first identifier directly followed by "(": a shape holds "f32[", never "f32(".
_OPCODE = re.compile(r"([a-z][a-z0-9\-]*)\(")


# --------------------------------------------------------------------------------------------
# Plain-Python helpers (main environment too)
# --------------------------------------------------------------------------------------------
def hlo_opcodes(hlo_text: str) -> list[str]:
    """The opcode of every instruction in an HLO module's text, all computations included."""
    opcodes = []
    for line in hlo_text.splitlines():
        match = _INSTRUCTION.match(line)
        if match:
            opcode = _OPCODE.search(match.group(1))
            if opcode is None:
                raise ValueError(f"HLO instruction without an opcode: {line.strip()[:120]!r}")
            opcodes.append(opcode.group(1))
    return opcodes


_GATHER = re.compile(r"^\s+(?:ROOT\s+)?%?[\w.\-]+\s+=\s+\S+\s+gather\(\w+\[([\d,]*)\]\S*\s+%?([\w.\-]+),")
_PARAMETER = re.compile(r"^\s+(?:ROOT\s+)?%?([\w.\-]+)\s+=\s+\S+\s+parameter\(")
_BRACES = re.compile(r"(\w+)=\{([\d,]*)\}")


def hlo_gathers(hlo_text: str) -> list[dict]:
    """Every ``gather`` of an HLO module's text: its operand's shape, whether that operand is a graph
    parameter (a weight or an input, not an intermediate), the axes it indexes (``start_index_map``)
    and the slice it takes per index (``slice_sizes``). A gather of whole experts on a weight's
    leading axis reads ``start_index_map == [0]`` and ``slice_sizes == [1, *operand[1:]]``."""
    parameters = {m.group(1) for m in map(_PARAMETER.match, hlo_text.splitlines()) if m}
    found = []
    for line in hlo_text.splitlines():
        match = _GATHER.match(line)
        if not match:
            continue
        attributes = {key: [int(v) for v in value.split(",") if v] for key, value in _BRACES.findall(line)}
        found.append({"operand_shape": [int(v) for v in match.group(1).split(",") if v],
                      "of_parameter": match.group(2) in parameters,
                      "start_index_map": attributes.get("start_index_map", []),
                      "slice_sizes": attributes.get("slice_sizes", [])})
    return found


def takes_whole_leading_slices(gather: dict) -> bool:
    """Whether a gather indexes only the leading axis and takes whole slices of everything else."""
    return gather["start_index_map"] == [0] and gather["slice_sizes"] == [1, *gather["operand_shape"][1:]]


def hlo_counts(hlo_text: str) -> dict:
    """``{"hlo_instructions": n, "gathers": g, "weight_gathers": w, "weight_gathers_leading_axis": l}``
    of an HLO module's text.

    ``gathers`` counts ``gather`` instructions: indexing a weight by a traced index (the sparse
    experts' ``weight[expert_indices]``, an embedding-style lookup) lowers to one; ``weight_gathers``
    those whose operand is a graph parameter, ``weight_gathers_leading_axis`` those of them that take
    whole slices along the leading axis (:func:`takes_whole_leading_slices`).
    """
    opcodes = hlo_opcodes(hlo_text)
    if not opcodes:
        raise ValueError("no HLO instructions found: expected the text of torch_xla._XLAC._get_xla_tensors_hlo")
    weights = [g for g in hlo_gathers(hlo_text) if g["of_parameter"]]
    return {"hlo_instructions": len(opcodes), "gathers": opcodes.count("gather"), "weight_gathers": len(weights),
            "weight_gathers_leading_axis": sum(takes_whole_leading_slices(g) for g in weights)}


def aten_fallbacks(counter_names) -> list[str]:
    """The ops that ran on the cpu instead of XLA: torch-xla counts each as ``aten::<op>``."""
    return sorted(name for name in counter_names if name.startswith("aten::"))


def ulp(value: float, dtype: torch.dtype) -> float:
    """The spacing of ``dtype`` numbers at ``|value|`` (bf16: 7 stored mantissa bits, fp32: 23)."""
    if dtype not in MANTISSA_BITS:
        raise ValueError(f"dtype {dtype} is not one of {', '.join(map(str, MANTISSA_BITS))}")
    if value == 0:
        return 0.0
    return 2.0 ** (math.floor(math.log2(abs(value))) - MANTISSA_BITS[dtype])


def tolerance(eager: torch.Tensor, dtype: torch.dtype) -> float:
    """The largest |XLA - eager| accepted for the logits ``eager`` of a ``dtype`` graph:
    ``TOLERANCE_ULPS[dtype]`` ulps of its largest |logit|."""
    if dtype not in TOLERANCE_ULPS:
        raise ValueError(f"dtype {dtype} has no tolerance rule; the graphs are built in bfloat16 or float32")
    return TOLERANCE_ULPS[dtype] * ulp(float(eager.abs().max()), dtype)


def lowered_cleanly(rows: list[dict]) -> bool:
    """Whether every graph lowered with no fallback, no transfer, one execution, within tolerance."""
    return bool(rows) and all(
        row["error"] is None and not row["aten_fallbacks"] and row["device_to_host_transfers"] == 0
        and row["xla_executions"] == 1 and row["max_abs_diff"] <= row["tolerance"]
        and row.get("max_abs_diff_fp32", 0.0) <= row.get("tolerance_fp32", 0.0) for row in rows)


def summary(report: dict) -> str:
    """The report in sentences (deterministic: counts and pass/fail, no floats), for the notebook."""
    rows, versions = report["graphs"], report["versions"]
    clean = [row for row in rows if lowered_cleanly([row])]
    tps = sorted({row["tp"] for row in rows})
    text = (f"At torch {versions['torch']} / torch-xla {versions['torch-xla']}, **{len(clean)} of {len(rows)}** "
            f"graphs (prefill, dense decode, sparse decode and the lm_head, at TP={' and '.join(map(str, tps))}) "
            "lower to one XLA graph per step with no aten fallback and no device-to-host transfer, with logits "
            f"equal to eager within {TOLERANCE_ULPS[torch.float32]} fp32 ulps of the largest logit (fp32 build) "
            f"and {TOLERANCE_ULPS[torch.bfloat16]} bf16 ulps (bf16 build).")
    failed = [f"{row['graph']} (tp={row['tp']}, {row['experts']})" for row in rows if row not in clean]
    if failed:
        text += f" **Not clean: {', '.join(failed)}** (see the tables)."
    by_key = {(row["graph"], row["tp"], row["experts"]): row for row in rows}
    extra = {tp: by_key[("decode", tp, "sparse")]["gathers"] - by_key[("decode", tp, "dense")]["gathers"]
             for tp in tps if ("decode", tp, "sparse") in by_key and ("decode", tp, "dense") in by_key}
    if extra:
        counts = " and ".join(f"{n} at TP={tp}" for tp, n in extra.items())
        text += (f" The selective-loading decode holds more gather instructions than the dense decode ({counts}): "
                 "in every layer it gathers the routed experts' gate/up and down weights and their scales, whole "
                 "experts on the weights' leading axis.")
    return text


def xla_python(repo_root: Path | str = REPO_ROOT) -> Path:
    """The interpreter of the xla environment: ``$GEMMA_NB_XLA_PYTHON`` or ``<repo>/.venv-xla/bin/python``."""
    override = os.environ.get(XLA_PYTHON_ENV)
    python = Path(override) if override else Path(repo_root) / XLA_VENV / "bin" / "python"
    if not python.exists():
        raise FileNotFoundError(
            f"no xla environment at {python}: create it with `make xla` (torch 2.9.0 + torch-xla 2.9.0 from "
            f"envs/xla/requirements.txt, ~7 GB, a few minutes), or point {XLA_PYTHON_ENV} at a Python that has them")
    return python


def run_in_xla_env(contrast: bool = False, repo_root: Path | str = REPO_ROOT, timeout_s: float = 900) -> dict:
    """Run this module's check in the xla environment (a subprocess) and return its JSON report.

    ``{"versions": {...}, "shapes": {...}, "graphs": [row, ...], "contrast": [row, ...]}``; a row is
    :func:`lower_step`'s dict. Raises RuntimeError with the subprocess's stderr if it fails.
    """
    command = [str(xla_python(repo_root)), "-m", "gemma_nb.rehearsal.lowering", "--json"]
    if contrast:
        command.append("--contrast")
    env = {**os.environ, "PJRT_DEVICE": "CPU", "PYTHONPATH": str(Path(repo_root).resolve())}
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=repo_root, timeout=timeout_s)
    if done.returncode:
        raise RuntimeError(f"the lowering check failed in {command[0]} (exit {done.returncode}):\n"
                           f"{done.stderr[-3000:]}")
    return json.loads(done.stdout)


# Column names of the notebook's tables: what each row field means, shortly.
STRUCTURE_COLUMNS = {"graph": "graph", "tp": "tp", "experts": "experts", "tokens": "tokens",
                     "aten_fallbacks": "aten fallbacks", "device_to_host_transfers": "to-host transfers",
                     "xla_executions": "XLA graphs", "hlo_instructions": "HLO ops", "gathers": "gathers",
                     "weight_gathers": "of weights", "weight_gathers_leading_axis": "whole, leading axis"}
NUMERIC_COLUMNS = {"graph": "graph", "tp": "tp", "experts": "experts", "max_abs_diff": "|XLA - eager| bf16",
                   "tolerance": "tolerance bf16", "bf16_rounding": "|eager bf16 - eager fp32|",
                   "max_abs_diff_fp32": "|XLA - eager| fp32", "tolerance_fp32": "tolerance fp32"}
CONTRAST_COLUMNS = {**STRUCTURE_COLUMNS, "error": "error"}


def lowering_tables(report: dict):
    """(structure, numbers, contrast) DataFrames of :func:`run_in_xla_env`'s report for the notebook.

    ``structure``: per graph, what the lowering did (deterministic for pinned versions); ``numbers``:
    the logits' differences (these depend on the cpu's instruction set); ``contrast``: the experts
    that do not lower (None when the report has no contrast rows). Fallback lists become text.
    """
    import pandas as pd  # the notebook's environment; the xla environment has no pandas

    def frame(rows, columns):
        table = pd.DataFrame(rows)[list(columns)].rename(columns=columns)
        table["experts"] = table["experts"].fillna("-")
        if "aten fallbacks" in table:
            table["aten fallbacks"] = table["aten fallbacks"].map(lambda names: ", ".join(names) or "none")
        return table

    contrast = None
    if report.get("contrast"):
        contrast = frame(report["contrast"], CONTRAST_COLUMNS)
        for column in (STRUCTURE_COLUMNS["hlo_instructions"], "gathers", "error"):  # None where the step failed
            contrast[column] = contrast[column].map(
                lambda v: "" if pd.isna(v) else int(v) if isinstance(v, float) else v)
    return frame(report["graphs"], STRUCTURE_COLUMNS), frame(report["graphs"], NUMERIC_COLUMNS), contrast


# --------------------------------------------------------------------------------------------
# On the XLA device (xla environment only)
# --------------------------------------------------------------------------------------------
def _import_xla():
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    try:
        import torch_xla
        import torch_xla.debug.metrics as metrics
    except ImportError as error:
        raise ImportError(f"cannot import torch_xla ({error}): run the lowering check in the xla environment "
                          f"(`make xla`, then {XLA_VENV}/bin/python -m gemma_nb.rehearsal.lowering)") from None
    return torch_xla, metrics


def _first(outputs):
    return outputs[0] if isinstance(outputs, (tuple, list)) else outputs


def lower_step(module: torch.nn.Module, inputs: tuple, dtype: torch.dtype, **labels) -> dict:
    """Run ``module(*inputs)`` eagerly on the cpu, then as one step on the XLA device; compare.

    The module and inputs are moved to the device and synced *before* the metrics are cleared, so
    what is counted is the step alone: the trace, the HLO of every output, one ``torch_xla.sync``.
    The outputs are read back only after the counters are. Returns ``labels`` plus
    ``aten_fallbacks`` (op names), ``device_to_host_transfers``, ``xla_executions`` (graphs run by
    the step: 1 when it lowers to one graph), ``hlo_instructions``, ``gathers``, ``max_abs_diff``
    of the first output (the logits) and the ``tolerance`` it is held to (:func:`tolerance`), and
    ``error``: None, or the exception the XLA step raised (then the HLO and numeric fields are None).
    ``module`` is left on the XLA device.
    """
    return _lower_step(module, inputs, dtype, **labels)[0]


def _lower_step(module: torch.nn.Module, inputs: tuple, dtype: torch.dtype, **labels) -> tuple[dict, torch.Tensor]:
    """:func:`lower_step`'s row and the eager logits (fp32 copy)."""
    torch_xla, metrics = _import_xla()
    module.eval()
    with torch.no_grad():
        eager = _first(module(*inputs)).float()
        device = torch_xla.device()
        module.to(device)
        on_device = tuple(t.to(device) for t in inputs)
        torch_xla.sync(wait=True)
        metrics.clear_all()
        try:
            outputs = module(*on_device)
            outputs = list(outputs) if isinstance(outputs, (tuple, list)) else [outputs]
            hlo = torch_xla._XLAC._get_xla_tensors_hlo(outputs)
            torch_xla.sync(wait=True)  # counters are read after the graph has run, not while it runs
            error = None
        except Exception as failure:  # noqa: BLE001 -- recorded: a fallback op may fail on the cpu
            error = f"{type(failure).__name__}: {str(failure).splitlines()[0]}"
        transfers = metrics.metric_data("TransferFromDeviceTime")
        row = {
            **labels,
            "dtype": str(dtype).removeprefix("torch."),
            "aten_fallbacks": aten_fallbacks(metrics.counter_names()),
            "device_to_host_transfers": transfers[0] if transfers else 0,
            "xla_executions": metrics.counter_value("ExecuteComputation") or 0,
            "error": error,
        }
        if error is not None:
            return {**row, "hlo_instructions": None, "gathers": None, "weight_gathers": None,
                    "weight_gathers_leading_axis": None, "max_abs_diff": None, "tolerance": None}, eager
        row.update(hlo_counts(hlo))
        logits = outputs[0].cpu().float()
    row["max_abs_diff"] = float((logits - eager).abs().max())
    row["tolerance"] = tolerance(eager, dtype)
    return row, eager


# --------------------------------------------------------------------------------------------
# The graphs ModelBuilder would trace, on the bundled checkpoint
# --------------------------------------------------------------------------------------------
def _tiny(model_dir: Path | str):
    config = text_config(model_dir)
    state = read_hf_state(model_dir)
    build = NeuronBuildConfig(model_dir=str(model_dir), output_dir="unused")  # the shipped shapes
    return config, state, build


def _embedded(config, state: dict, ids: torch.Tensor) -> torch.Tensor:
    return state["model.embed_tokens.weight"].float()[ids] * config.hidden_size ** 0.5


def prefill_inputs(config, state: dict, build) -> tuple:
    """The prefill bucket: ``PROMPT_TOKENS`` seeded token ids padded to ``build.bucket``, embedded as the host does."""
    generator = torch.Generator().manual_seed(SEED)
    ids = torch.full((1, build.bucket), config.pad_token_id or 0, dtype=torch.long)
    ids[0, :PROMPT_TOKENS] = torch.randint(3, config.vocab_size, (PROMPT_TOKENS,), generator=generator)
    return step_inputs(_embedded(config, state, ids), list(range(build.bucket)), build.max_len,
                       config.sliding_window, PROMPT_TOKENS - 1)


def decode_inputs(config, state: dict, build) -> tuple:
    """One seeded token at ``DECODE_POSITION``."""
    generator = torch.Generator().manual_seed(SEED + 1)
    ids = torch.randint(3, config.vocab_size, (1, 1), generator=generator)
    return step_inputs(_embedded(config, state, ids), [DECODE_POSITION], build.max_len, config.sliding_window)


def head_inputs(config, state: dict) -> tuple:
    """The lm_head's input: one token's final hidden state ``[1, 1, H]`` in bf16 (seeded, unit RMS)."""
    generator = torch.Generator().manual_seed(SEED + 3)
    return (torch.randn(1, 1, config.hidden_size, generator=generator).to(torch.bfloat16),)


def fill_cache(module) -> None:
    """Seeded N(0, 1) values in every K/V state slot (the mask hides the slots after the position)."""
    generator = torch.Generator().manual_seed(SEED + 2)
    with torch.no_grad():
        for state in [*module.k_cache, *module.v_cache]:
            state.copy_(torch.randn(state.shape, generator=generator))


def rank_graph_module(config, state: dict, build, tp: int, experts: str):
    """Rank 0's ``NeuronGemma4`` at TP=``tp`` on the cpu stand-ins, loaded as ModelBuilder loads it.

    ``group=None``: the layers hold one rank's shard shapes and the collectives are identities,
    which is the graph one rank traces (ModelBuilder traces one SPMD graph for all ranks; the rank
    is a tensor input, ``SPMDRank``).
    """
    build = replace(build, tp_degree=tp)
    checkpoint = convert_checkpoint(state, config, tp, dtype=getattr(torch, build.dtype))
    return rank_module(config, build, checkpoint, state, 0, cpu_sdk(), experts=experts, group=None)


class ShardedHead(torch.nn.Module):
    """The graph's lm_head alone (``build_lm_head``: int8 ``QuantizedColumnParallel``, gathered), as
    ``gemma_nb.neuron.lm_head.compile_lm_head`` traces it, on the stand-ins."""

    def __init__(self, hidden_size: int, vocab_size: int, tp: int, sdk, dtype: torch.dtype = torch.bfloat16):
        super().__init__()

        self.vocab_size = vocab_size
        self.lm_head = build_lm_head(hidden_size, vocab_size, quantized=True, dtype=dtype, pad=vocab_size % tp != 0,
                                     sdk=sdk)

    def forward(self, hidden):
        return trim_padded_logits(self.lm_head(hidden), self.vocab_size)


def rank_head_module(config, state: dict, tp: int, dtype: torch.dtype = torch.bfloat16):
    """Rank 0's ``ShardedHead`` at TP=``tp``, its int8 rows cut from the embedding table as ModelBuilder would."""
    sdk = cpu_sdk()
    checkpoint = lm_head_state_dict(state["model.embed_tokens.weight"], quantized=True)
    return load_rank_module(lambda: ShardedHead(config.hidden_size, config.vocab_size, tp, sdk, dtype),
                            checkpoint, tp, 0)


def _cpu_module(config, state, build, experts: str):
    """``NeuronGemma4(parallel=False)`` at TP=1 with ``gemma_nb.moe``'s ``experts`` swapped in (the contrast)."""
    module = NeuronGemma4(config, build, parallel=False)
    # The bundled checkpoints tie lm_head to the embedding and store the table once.
    module.load_state({**state, "lm_head.weight": state["model.embed_tokens.weight"]})
    if experts != "transformers":
        swap_experts(module.lm, experts)
    return module


def lower_in_both_dtypes(make_module, inputs: tuple, dtype: torch.dtype, **labels) -> dict:
    """:func:`lower_step` of ``make_module(dtype)`` (the shipped graph: every field) plus the same
    module built in fp32: its lowering gives ``max_abs_diff_fp32`` and ``tolerance_fp32``, its eager
    logits ``bf16_rounding`` (max |eager in ``dtype`` - eager in fp32|: what bf16 alone changes)."""
    row, eager = _lower_step(make_module(dtype), inputs, dtype, **labels)
    exact, fp32_eager = _lower_step(make_module(torch.float32),
                                    tuple(t.float() if t.dtype == dtype else t for t in inputs), torch.float32)
    if exact["error"] or exact["aten_fallbacks"] or exact["device_to_host_transfers"]:
        raise RuntimeError(f"the fp32 twin of {labels} does not lower like the {dtype} graph: {exact}")
    return {**row, "bf16_rounding": float((eager - fp32_eager).abs().max()),
            "max_abs_diff_fp32": exact["max_abs_diff"], "tolerance_fp32": exact["tolerance"]}


def shipped_graphs(model_dir: Path | str | None = None, tp_degrees=TP_DEGREES) -> list[dict]:
    """Each graph the neuron build traces, at each TP degree, lowered on the XLA cpu device.

    Per TP degree: the prefill (dense experts, the bucket's tokens), the decode with the port's
    dense experts, the decode with selective-loading sparse experts (one token each, over a
    seeded KV state), and the sharded lm_head alone; each in the build's dtype (bf16: every field
    of the row) and in fp32 (the exact comparison, :func:`lower_in_both_dtypes`). ``model_dir``
    defaults to the TP=2 tiny checkpoint (its KV heads split by 2). A list of rows.
    """
    config, state, build = _tiny(model_dir or TP2_CHECKPOINT_DIR)
    dtype = getattr(torch, build.dtype)
    steps = {"prefill": prefill_inputs(config, state, build), "decode": decode_inputs(config, state, build)}
    rows = []
    for tp in tp_degrees:
        for graph, experts in (("prefill", "dense"), ("decode", "dense"), ("decode", "sparse")):
            def make_module(module_dtype, experts=experts, graph=graph):
                module_build = replace(build, dtype=str(module_dtype).removeprefix("torch."))
                module = rank_graph_module(config, state, module_build, tp, experts)
                if graph == "decode":
                    fill_cache(module)
                return module

            rows.append(lower_in_both_dtypes(make_module, steps[graph], dtype, graph=graph, tp=tp, experts=experts,
                                             tokens=steps[graph][0].shape[1]))
        rows.append(lower_in_both_dtypes(lambda module_dtype: rank_head_module(config, state, tp, module_dtype),
                                         head_inputs(config, state), dtype, graph="lm_head", tp=tp, experts=None,
                                         tokens=1))
    return rows


def contrast_graphs(model_dir: Path | str | None = None) -> list[dict]:
    """What does not lower: the decode step with transformers' default experts, and with the cpu
    ``gemma_nb.experts.SparseExperts`` (data-dependent indexing: host syncs), at TP=1 on
    ``NeuronGemma4(parallel=False)``. A row per case; an exception in the XLA step (a fallback op
    failing on the cpu) is recorded as its ``error``."""
    config, state, build = _tiny(model_dir or TP2_CHECKPOINT_DIR)
    dtype = getattr(torch, build.dtype)
    inputs = decode_inputs(config, state, build)
    rows = []
    for experts in ("transformers", "sparse"):
        module = _cpu_module(config, state, build, experts)
        fill_cache(module)
        rows.append(lower_step(module, inputs, dtype, graph="decode", tp=1, experts=f"{experts} (cpu)", tokens=1))
    return rows


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for package in ("torch", "torch-xla", "transformers"):
        try:
            found[package] = version(package)
        except PackageNotFoundError:
            found[package] = None
    return found


def report(contrast: bool = False, model_dir: Path | str | None = None, tp_degrees=TP_DEGREES) -> dict:
    """Versions, the checkpoint and shapes lowered, the shipped graphs' rows and (optionally) the contrast rows."""
    model_dir = Path(model_dir or TP2_CHECKPOINT_DIR).resolve()
    build = NeuronBuildConfig(model_dir=str(model_dir), output_dir="unused")
    out = {"versions": versions(), "stand_ins": f"cpu stand-ins of neuronx-distributed {NXD_CONTRACT_VERSION}",
           "checkpoint": next((name for name, folder in BUNDLED_IDS.items() if folder == model_dir), model_dir.name),
           "shapes": {"bucket": build.bucket, "max_len": build.max_len, "dtype": build.dtype},
           "graphs": shipped_graphs(model_dir, tp_degrees)}
    if contrast:
        out["contrast"] = contrast_graphs(model_dir)
    return out


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m gemma_nb.rehearsal.lowering", description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the report as JSON (default: a text table)")
    parser.add_argument("--contrast", action="store_true", help="also lower the experts that do not lower")
    parser.add_argument("--model-dir", default=None, help="checkpoint folder (default: the bundled TP=2 tiny one)")
    parser.add_argument("--tp", default=",".join(map(str, TP_DEGREES)), help="TP degrees, comma-separated")
    args = parser.parse_args(argv)
    _import_xla()  # fail at once, before building any model, outside the xla environment
    try:
        tp_degrees = tuple(int(t) for t in args.tp.split(","))
    except ValueError:
        parser.error(f"--tp {args.tp!r}: give TP degrees as integers separated by commas, e.g. 1,2")
    result = report(contrast=args.contrast, model_dir=args.model_dir, tp_degrees=tp_degrees)
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        for row in result["graphs"] + result.get("contrast", []):
            print(row)
    return 0 if lowered_cleanly(result["graphs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
