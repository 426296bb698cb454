"""The neuron graphs lowered to XLA on the cpu at the SDK's torch-xla 2.9 (notebook 04, in
``.venv-xla``).

Each graph must lower to one XLA graph per step, with no aten fallback, no device-to-host transfer
and logits equal to eager; neuronx-cc, HBM and speed need an inf2. ``python -m
gemma_nb.rehearsal.lowering`` prints the report as JSON."""

import argparse
import json
import math
import os
import re
import subprocess
import sys
from dataclasses import replace
from functools import partial
from pathlib import Path

import pandas as pd
import torch
from transformers import AutoTokenizer

from gemma_nb.moe import swap_experts
from gemma_nb.neuron import build as B
from gemma_nb.neuron.deploy import until_eos
from gemma_nb.neuron.lm_head import HeadOnly, lm_head_state_dict
from gemma_nb.paths import REPO_ROOT
from gemma_nb.rehearsal.emulate import DEFAULT_PROMPTS, _setup, decode_all, rank_module
from gemma_nb.rehearsal.standins import NXD_CONTRACT_VERSION, cpu_sdk, load_rank_module
from gemma_nb.tiny import BUNDLED_TP2_ID, TP2_CHECKPOINT_DIR

XLA_PYTHON_ENV = "GEMMA_NB_XLA_PYTHON"
XLA_VENV = ".venv-xla"
# XLA's cpu backend only runs the graphs to check them: no LLVM optimization (half the compile time)
CPU_BACKEND_FLAG = "--xla_backend_optimization_level=0"
# Allowed |logits(XLA) - logits(eager)| in ulps of the largest |logit|: XLA fuses and reorders, so
# it rounds differently; in bf16 the roundings compound through the layers (of the size of each
# row's ``bf16_rounding``).
TOLERANCE_ULPS = {torch.bfloat16: 32, torch.float32: 64}
MANTISSA_BITS = {torch.bfloat16: 7, torch.float32: 23}
PROMPT_TOKENS = 12  # real tokens in the padded prefill (the rest of the bucket is padding)
DECODE_POSITION = 12  # where the decode step writes; cache slots before it hold seeded values
SEED = 0
TP_DEGREES = (1, 2)
# every graph the build traces: (graph, experts), in the tables' order
GRAPHS = (("prefill", "dense"), ("decode", "dense"), ("decode", "sparse"), ("lm_head", None))

# One HLO instruction per line: "  [ROOT ]%name = <shape> opcode(operands), attributes".
_NAME = r"^\s+(?:ROOT\s+)?%?([\w.\-]+)\s+=\s+"
_INSTRUCTION = re.compile(_NAME + r"(.*)$")
# The opcode is the first identifier directly followed by "(": a shape holds "f32[", never "f32(".
_OPCODE = re.compile(r"([a-z][a-z0-9\-]*)\(")
_GATHER = re.compile(_NAME + r"\S+\s+gather\(\w+\[([\d,]*)\]\S*\s+%?([\w.\-]+),")
_PARAMETER = re.compile(_NAME + r"\S+\s+parameter\(")
_BRACES = re.compile(r"(\w+)=\{([\d,]*)\}")
# An operand as torch-xla prints it: "f32[1,4,512,64]{3,2,1,0} %p2.7" -> (dtype, dims, name).
_OPERAND = re.compile(r"(\w+)\[([\d,]*)\](?:\{[\d,]*\})?\s+%?([\w.\-]+)")
ELEMENT_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s32": 4, "f32": 4, "s64": 8}
# the operand an in-place update writes: scatter's updates, dynamic-update-slice's update
UPDATE_OPERAND = {"scatter": 2, "dynamic-update-slice": 1}


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def hlo_opcodes(hlo_text: str) -> list[str]:
    """The opcode of every instruction in an HLO module's text, all computations included."""
    opcodes = []
    for match in filter(None, map(_INSTRUCTION.match, hlo_text.splitlines())):
        opcode = _OPCODE.search(match.group(2))
        assert opcode is not None, (
            f"HLO instruction without an opcode: {match.group(0).strip()[:120]!r}"
        )
        opcodes.append(opcode.group(1))
    return opcodes


def hlo_gathers(hlo_text: str) -> list[dict]:
    """Every ``gather``: operand shape, whether the operand is a graph parameter, start_index_map,
    slice_sizes."""
    parameters = {m.group(1) for m in map(_PARAMETER.match, hlo_text.splitlines()) if m}
    found = []
    for line in hlo_text.splitlines():
        if match := _GATHER.match(line):
            attributes = {key: _ints(value) for key, value in _BRACES.findall(line)}
            found.append(
                {
                    "operand_shape": _ints(match.group(2)),
                    "of_parameter": match.group(3) in parameters,
                    "start_index_map": attributes.get("start_index_map", []),
                    "slice_sizes": attributes.get("slice_sizes", []),
                }
            )
    return found


def _opcode_operands(instruction: str) -> tuple[str, list[tuple[str, str, str]]]:
    opcode = _OPCODE.search(instruction)
    return opcode.group(1), _OPERAND.findall(instruction[opcode.end() :])


def hlo_state_write_fraction(hlo_text: str, outputs) -> float:
    """Bytes a step writes into the entry's ``outputs`` (root tuple indices: the aliased KV state)
    over their bytes. A scatter or dynamic-update-slice into a graph parameter of the output's shape
    writes only its update (XLA updates an aliased buffer in place); any other op, all of it."""
    lines = [m for m in map(_INSTRUCTION.match, hlo_text.splitlines()) if m]
    by_name = {m.group(1): m.group(2) for m in lines}
    parameters = {m.group(1) for m in map(_PARAMETER.match, hlo_text.splitlines()) if m}
    root = next(m for m in reversed(lines) if m.group(0).lstrip().startswith("ROOT"))
    opcode, returned = _opcode_operands(root.group(2))
    assert opcode == "tuple", f"the entry's root is a {opcode}, not a tuple of outputs"
    written = held = 0
    for dtype, dims, name in (returned[i] for i in outputs):
        opcode, operands = _opcode_operands(by_name[name])
        update = UPDATE_OPERAND.get(opcode)
        in_place = update is not None and operands[0] in [(dtype, dims, p) for p in parameters]
        held += ELEMENT_BYTES[dtype] * math.prod(_ints(dims))
        dtype, dims, _ = operands[update] if in_place else (dtype, dims, name)
        written += ELEMENT_BYTES[dtype] * math.prod(_ints(dims))
    return written / held


def takes_whole_leading_slices(gather: dict) -> bool:
    return gather["start_index_map"] == [0] and gather["slice_sizes"] == [
        1,
        *gather["operand_shape"][1:],
    ]


def hlo_counts(hlo_text: str) -> dict:
    """Instructions, gathers, gathers of a graph parameter, and those taking whole leading-axis
    slices."""
    opcodes = hlo_opcodes(hlo_text)
    assert opcodes, "no HLO instructions found"
    weights = [g for g in hlo_gathers(hlo_text) if g["of_parameter"]]
    return {
        "hlo_instructions": len(opcodes),
        "gathers": opcodes.count("gather"),
        "weight_gathers": len(weights),
        "weight_gathers_leading_axis": sum(takes_whole_leading_slices(g) for g in weights),
    }


def aten_fallbacks(counter_names) -> list[str]:
    """The ops that ran on the cpu instead of XLA: torch-xla counts each as ``aten::<op>``."""
    return sorted(name for name in counter_names if name.startswith("aten::"))


def ulp(value: float, dtype: torch.dtype) -> float:
    """The spacing of ``dtype`` numbers at ``|value|`` (bf16: 7 stored mantissa bits, fp32: 23)."""
    assert dtype in MANTISSA_BITS, f"{dtype} is not one of {list(MANTISSA_BITS)}"
    return 0.0 if value == 0 else 2.0 ** (math.floor(math.log2(abs(value))) - MANTISSA_BITS[dtype])


def tolerance(eager: torch.Tensor, dtype: torch.dtype) -> float:
    """The largest |XLA - eager| accepted: ``TOLERANCE_ULPS[dtype]`` ulps of the largest eager
    logit."""
    assert dtype in TOLERANCE_ULPS, f"{dtype} has no tolerance rule"
    return TOLERANCE_ULPS[dtype] * ulp(float(eager.abs().max()), dtype)


def lowered_cleanly(rows: list[dict]) -> bool:
    """Whether every graph lowered with no fallback, no transfer, one execution, within
    tolerance."""
    return bool(rows) and all(
        row["error"] is None
        and not row["aten_fallbacks"]
        and row["device_to_host_transfers"] == 0
        and row["xla_executions"] == 1
        and row["max_abs_diff"] <= row["tolerance"]
        and row.get("max_abs_diff_fp32", 0.0) <= row.get("tolerance_fp32", 0.0)
        for row in rows
    )


def xla_python(repo_root: Path | str = REPO_ROOT) -> Path:
    """The interpreter of the xla environment: ``$GEMMA_NB_XLA_PYTHON`` or
    ``<repo>/.venv-xla/bin/python``."""
    python = Path(os.environ.get(XLA_PYTHON_ENV) or Path(repo_root) / XLA_VENV / "bin" / "python")
    if not python.exists():
        raise FileNotFoundError(
            f"no xla environment at {python}: create it with `make xla` (torch 2.9.0 + torch-xla "
            "2.9.0 from envs/xla/requirements.txt, ~7 GB, a few minutes), or point "
            f"{XLA_PYTHON_ENV} at a Python that has them"
        )
    return python


def run_in_xla_env(contrast: bool = False, timeout_s: float = 900) -> dict:
    """Run this module's check in the xla environment (a subprocess) and return its JSON report."""
    command = [str(xla_python()), "-m", "gemma_nb.rehearsal.lowering"] + (
        ["--contrast"] if contrast else []
    )
    env = {**os.environ, "PJRT_DEVICE": "CPU", "PYTHONPATH": str(REPO_ROOT.resolve())}
    done = subprocess.run(
        command, capture_output=True, text=True, env=env, cwd=REPO_ROOT, timeout=timeout_s
    )
    if done.returncode:
        raise RuntimeError(
            f"the lowering check failed in {command[0]} (exit "
            f"{done.returncode}):\n{done.stderr[-3000:]}"
        )
    return json.loads(done.stdout)


# the notebook's column names of the row fields
STRUCTURE_COLUMNS = {
    "graph": "graph",
    "tp": "tp",
    "experts": "experts",
    "tokens": "tokens",
    "aten_fallbacks": "aten fallbacks",
    "device_to_host_transfers": "to-host transfers",
    "xla_executions": "XLA graphs",
    "hlo_instructions": "HLO ops",
    "gathers": "gathers",
    "weight_gathers": "of weights",
    "weight_gathers_leading_axis": "whole, leading axis",
}
NUMERIC_COLUMNS = {
    "graph": "graph",
    "tp": "tp",
    "experts": "experts",
    "max_abs_diff": "|XLA - eager| bf16",
    "tolerance": "tolerance bf16",
    "bf16_rounding": "|eager bf16 - eager fp32|",
    "max_abs_diff_fp32": "|XLA - eager| fp32",
    "tolerance_fp32": "tolerance fp32",
}
CONTRAST_COLUMNS = {**STRUCTURE_COLUMNS, "error": "error"}


def lowering_tables(report: dict):
    """(structure, numbers, contrast) DataFrames of :func:`run_in_xla_env`'s report
    (``contrast=True``) for the notebook."""

    def frame(rows, columns):
        table = pd.DataFrame(rows)[list(columns)].rename(columns=columns)
        table["experts"] = table["experts"].fillna("-")
        if "aten fallbacks" in table:
            table["aten fallbacks"] = table["aten fallbacks"].map(
                lambda names: ", ".join(names) or "none"
            )
        return table

    # blank where the step failed, the counts as integers
    contrast = (
        frame(report["contrast"], CONTRAST_COLUMNS).convert_dtypes().astype(object).fillna("")
    )
    return (
        frame(report["graphs"], STRUCTURE_COLUMNS),
        frame(report["graphs"], NUMERIC_COLUMNS),
        contrast,
    )


def _import_xla():
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    if CPU_BACKEND_FLAG not in (flags := os.environ.get("XLA_FLAGS", "")):  # read at first use
        os.environ["XLA_FLAGS"] = f"{flags} {CPU_BACKEND_FLAG}".strip()
    try:
        import torch_xla
        import torch_xla.debug.metrics as metrics
    except ImportError as error:
        raise ImportError(
            f"cannot import torch_xla ({error}): run the lowering check in the xla environment "
            f"(`make xla`, then {XLA_VENV}/bin/python -m gemma_nb.rehearsal.lowering)"
        ) from None
    return torch_xla, metrics


def lower_step(
    module: torch.nn.Module, inputs: tuple, dtype: torch.dtype, **labels
) -> tuple[dict, torch.Tensor]:
    """(row, eager logits) of ``module(*inputs)`` run eagerly, then as one step on the XLA device
    (counted after the move)."""
    torch_xla, metrics = _import_xla()
    module.eval()
    with torch.no_grad():
        eager = module(*inputs)
        eager = (eager[0] if isinstance(eager, (tuple, list)) else eager).float()
        device = torch_xla.device()
        module.to(device)
        on_device = tuple(t.to(device) for t in inputs)
        torch_xla.sync(wait=True)
        metrics.clear_all()
        try:
            outputs = module(*on_device)
            outputs = list(outputs) if isinstance(outputs, (tuple, list)) else [outputs]
            hlo = torch_xla._XLAC._get_xla_tensors_hlo(outputs)
            # counters are read after the graph has run, not while it runs
            torch_xla.sync(wait=True)
            error = None
        except Exception as failure:  # noqa: BLE001 -- recorded: a fallback op may fail on the cpu
            error = f"{type(failure).__name__}: {str(failure).splitlines()[0]}"
        transfers = metrics.metric_data("TransferFromDeviceTime")
        row = {
            # None where the step fails
            **dict.fromkeys([*STRUCTURE_COLUMNS, "max_abs_diff", "tolerance", "kv_write_fraction"]),
            **labels,
            "dtype": str(dtype).removeprefix("torch."),
            "aten_fallbacks": aten_fallbacks(metrics.counter_names()),
            "device_to_host_transfers": transfers[0] if transfers else 0,
            "xla_executions": metrics.counter_value("ExecuteComputation") or 0,
            "error": error,
        }
        if error is not None:
            return row, eager
        row.update(hlo_counts(hlo))
        aliased = getattr(module, "input_output_aliases", dict)().values()  # the KV state's outputs
        row["kv_write_fraction"] = hlo_state_write_fraction(hlo, aliased) if aliased else None
        logits = outputs[0].cpu().float()
    return {
        **row,
        "max_abs_diff": float((logits - eager).abs().max()),
        "tolerance": tolerance(eager, dtype),
    }, eager


def _tiny(model_dir: Path | str):
    """(config, state, the build at the shipped shapes)."""
    build = B.NeuronBuildConfig(model_dir=str(model_dir), output_dir="unused")
    return B.text_config(model_dir), B.read_hf_state(model_dir), build


def seeded_inputs(config, state: dict, build, graph: str) -> tuple:
    """The prefill bucket (``PROMPT_TOKENS`` seeded ids, padded) or one seeded token at
    ``DECODE_POSITION``, embedded."""
    if graph == "prefill":
        generator = torch.Generator().manual_seed(SEED)
        ids = torch.full((1, build.bucket), config.pad_token_id or 0, dtype=torch.long)
        ids[0, :PROMPT_TOKENS] = torch.randint(
            3, config.vocab_size, (PROMPT_TOKENS,), generator=generator
        )
        positions, last = list(range(build.bucket)), (PROMPT_TOKENS - 1,)
    else:
        ids = torch.randint(
            3, config.vocab_size, (1, 1), generator=torch.Generator().manual_seed(SEED + 1)
        )
        positions, last = [DECODE_POSITION], ()
    embeds = state["model.embed_tokens.weight"].float()[ids] * config.hidden_size**0.5
    return B.step_inputs(embeds, positions, build.max_len, config.sliding_window, *last)


def fill_cache(module) -> None:
    """Seeded N(0, 1) values in every K/V state slot (the mask hides the slots after the
    position)."""
    generator = torch.Generator().manual_seed(SEED + 2)
    with torch.no_grad():
        for state in [*module.k_cache, *module.v_cache]:
            state.copy_(torch.randn(state.shape, generator=generator))


def lower_in_both_dtypes(make_module, inputs: tuple, dtype: torch.dtype, **labels) -> dict:
    """:func:`lower_step` of ``make_module(dtype)``, plus its fp32 twin's difference and tolerance,
    and the bf16 rounding."""
    row, eager = lower_step(make_module(dtype), inputs, dtype, **labels)
    exact, fp32_eager = lower_step(
        make_module(torch.float32),
        tuple(t.float() if t.dtype == dtype else t for t in inputs),
        torch.float32,
    )
    lowered = not (exact["error"] or exact["aten_fallbacks"] or exact["device_to_host_transfers"])
    assert lowered, f"the fp32 twin of {labels} does not lower like the {dtype} graph: {exact}"
    return {
        **row,
        "bf16_rounding": float((eager - fp32_eager).abs().max()),
        "max_abs_diff_fp32": exact["max_abs_diff"],
        "tolerance_fp32": exact["tolerance"],
    }


def shipped_graphs(model_dir: Path | str | None = None, tp_degrees=TP_DEGREES) -> list[dict]:
    """Each graph the neuron build traces, at each TP degree, lowered on the XLA cpu device."""
    config, state, build = _tiny(model_dir or TP2_CHECKPOINT_DIR)
    dtype = getattr(torch, build.dtype)
    steps = {graph: seeded_inputs(config, state, build, graph) for graph in ("prefill", "decode")}
    # the lm_head's input: one token's final hidden state [1, 1, H] in bf16 (seeded, unit RMS)
    hidden = torch.randn(
        1, 1, config.hidden_size, generator=torch.Generator().manual_seed(SEED + 3)
    )
    steps["lm_head"] = (hidden.to(torch.bfloat16),)
    head_checkpoint = lm_head_state_dict(state["model.embed_tokens.weight"])

    def make_module(module_dtype, tp: int, graph: str, experts: str | None):  # rank 0's
        if graph == "lm_head":  # the int8 HeadOnly, its rows cut as ModelBuilder would
            sizes = (config.hidden_size, config.vocab_size, config.vocab_size % tp != 0)
            head = partial(HeadOnly, *sizes, dtype=module_dtype)
            return load_rank_module(lambda: head(sdk=cpu_sdk()), head_checkpoint, tp, 0)
        module_build = replace(build, tp_degree=tp, dtype=str(module_dtype).removeprefix("torch."))
        checkpoint = B.convert_checkpoint(state, config, dtype=module_dtype)
        module = rank_module(config, module_build, checkpoint, state, 0, cpu_sdk(), experts=experts)
        if graph == "decode":
            fill_cache(module)
        return module

    rows = []
    for tp in tp_degrees:
        for graph, experts in GRAPHS:
            make = partial(make_module, tp=tp, graph=graph, experts=experts)
            labels = {"graph": graph, "tp": tp, "experts": experts}
            tokens = steps[graph][0].shape[1]
            rows.append(lower_in_both_dtypes(make, steps[graph], dtype, **labels, tokens=tokens))
    return rows


def kv_state_answers(new_tokens: int = 8) -> pd.DataFrame:
    """Greedy answers to the rehearsal's prompts by the bundled TP=2 checkpoint's build at TP=1 (cpu
    stand-ins, eager, 32 KV slots), per activation and KV-state dtype, against the float32 state's:
    the first prompt's answer, the tokens equal over all prompts, the largest logit difference."""
    model_dir = str(TP2_CHECKPOINT_DIR)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts_ids = [tokenizer(prompt).input_ids for prompt in DEFAULT_PROMPTS]
    rows = []
    for dtype in ("bfloat16", "float32"):
        config, hf_state, build, checkpoint, embed = _setup(model_dir, 1, 32, 8, dtype)
        inputs = (checkpoint, hf_state, embed, prompts_ids, new_tokens, cpu_sdk())
        runs = {
            kv: decode_all(config, replace(build, kv_dtype=kv), *inputs, modes=("dense",))
            for kv in B.KV_DTYPES
        }
        tokens = {kv: run["tokens"]["dense"] for kv, run in runs.items()}
        logits = {kv: run["logits"]["dense"] for kv, run in runs.items()}
        for kv in B.KV_DTYPES:
            pairs = list(zip(sum(tokens[kv], []), sum(tokens["float32"], [])))
            rows.append(
                {
                    "activations": dtype,
                    "KV state": kv,
                    "first answer": tokenizer.decode(until_eos(tokens[kv][0], config.eos_token_id)),
                    "tokens equal to float32 KV": f"{sum(a == b for a, b in pairs)}/{len(pairs)}",
                    "max |logit diff|": float((logits[kv] - logits["float32"]).abs().max()),
                }
            )
    return pd.DataFrame(rows)


def contrast_graphs(model_dir: Path | str | None = None) -> list[dict]:
    """What does not lower: the decode with transformers' and with the cpu ``SparseExperts`` (TP=1),
    failures as ``error``."""
    config, state, build = _tiny(model_dir or TP2_CHECKPOINT_DIR)
    inputs = seeded_inputs(config, state, build, "decode")
    rows = []
    for experts in ("transformers", "sparse"):
        module = B.NeuronGemma4(config, build, parallel=False)
        # The bundled checkpoints tie lm_head to the embedding and store the table once.
        module.load_state({**state, "lm_head.weight": state["model.embed_tokens.weight"]})
        if experts != "transformers":
            swap_experts(module.lm, experts)
        fill_cache(module)
        rows.append(
            lower_step(
                module,
                inputs,
                getattr(torch, build.dtype),
                graph="decode",
                tp=1,
                experts=f"{experts} (cpu)",
                tokens=1,
            )[0]
        )
    return rows


def report(contrast: bool = False) -> dict:
    """Versions, the checkpoint and shapes lowered, the shipped graphs' rows and (optionally) the
    contrast rows."""
    build = B.NeuronBuildConfig(model_dir=str(TP2_CHECKPOINT_DIR), output_dir="unused")
    return {
        "versions": B.package_versions(("torch", "torch-xla", "transformers")),
        "stand_ins": f"cpu stand-ins of neuronx-distributed {NXD_CONTRACT_VERSION}",
        "checkpoint": BUNDLED_TP2_ID,
        "shapes": {"bucket": build.bucket, "max_len": build.max_len, "dtype": build.dtype},
        "graphs": shipped_graphs(),
        **({"contrast": contrast_graphs()} if contrast else {}),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m gemma_nb.rehearsal.lowering", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--contrast", action="store_true", help="also lower the experts that do not lower"
    )
    args = parser.parse_args(argv)
    _import_xla()  # fail at once, before building any model, outside the xla environment
    result = report(contrast=args.contrast)
    print(json.dumps(result, indent=1))
    return 0 if lowered_cleanly(result["graphs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
