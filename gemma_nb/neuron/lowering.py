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

    PJRT_DEVICE=CPU .venv-xla/bin/python -m gemma_nb.neuron.lowering --json [--contrast]

The graphs (:func:`shipped_graphs`) are built by ``gemma_nb.neuron.build`` on the bundled tiny
checkpoint, at the shipped build's shapes (``NeuronBuildConfig``: prefill bucket 128, KV cache 512
slots, bf16), which fit the tiny model (its ``max_position_embeddings`` is 512).
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import torch

from gemma_nb.paths import REPO_ROOT

XLA_PYTHON_ENV = "GEMMA_NB_XLA_PYTHON"
XLA_VENV = ".venv-xla"
# Allowed |logits(XLA) - logits(eager)|, in units in the last place of the largest |logit|: XLA's
# cpu backend fuses and reorders the same arithmetic, so bf16 graphs differ by a few bf16 roundings.
TOLERANCE_ULPS = {torch.bfloat16: 8, torch.float32: 64}
MANTISSA_BITS = {torch.bfloat16: 7, torch.float32: 23}
PROMPT_TOKENS = 12   # real tokens in the padded prefill (the rest of the bucket is padding)
DECODE_POSITION = 12  # where the decode step writes; cache slots before it hold seeded values
SEED = 0

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


def hlo_counts(hlo_text: str) -> dict:
    """``{"hlo_instructions": n, "gathers": g}`` of an HLO module's text.

    ``gathers`` counts ``gather`` instructions: indexing a weight by a traced index (the sparse
    experts' ``weight[top_k_index]``, an embedding-style lookup) lowers to one.
    """
    opcodes = hlo_opcodes(hlo_text)
    if not opcodes:
        raise ValueError("no HLO instructions found: expected the text of torch_xla._XLAC._get_xla_tensors_hlo")
    return {"hlo_instructions": len(opcodes), "gathers": opcodes.count("gather")}


def aten_fallbacks(counter_names) -> list[str]:
    """The ops that ran on the cpu instead of XLA: torch-xla counts each as ``aten::<op>``."""
    return sorted(name for name in counter_names if name.startswith("aten::"))


def ulp(value: float, dtype: torch.dtype) -> float:
    """The spacing of ``dtype`` numbers at ``|value|`` (bf16: 7 stored mantissa bits, fp32: 23)."""
    if dtype not in MANTISSA_BITS:
        raise ValueError(f"dtype {dtype} has no tolerance rule; use one of {', '.join(map(str, MANTISSA_BITS))}")
    if value == 0:
        return 0.0
    return 2.0 ** (math.floor(math.log2(abs(value))) - MANTISSA_BITS[dtype])


def tolerance(reference: torch.Tensor, dtype: torch.dtype) -> float:
    """The largest |XLA - eager| accepted for logits ``reference``: ``TOLERANCE_ULPS`` ulps of its max."""
    return TOLERANCE_ULPS[dtype] * ulp(float(reference.abs().max()), dtype)


def lowered_cleanly(rows: list[dict]) -> bool:
    """Whether every graph lowered with no fallback, no transfer, one execution, within tolerance."""
    return bool(rows) and all(
        row["error"] is None and not row["aten_fallbacks"] and row["device_to_host_transfers"] == 0 and row["xla_executions"] == 1
        and row["max_abs_diff"] <= row["tolerance"] for row in rows)


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
    command = [str(xla_python(repo_root)), "-m", "gemma_nb.neuron.lowering", "--json"]
    if contrast:
        command.append("--contrast")
    env = {**os.environ, "PJRT_DEVICE": "CPU", "PYTHONPATH": str(Path(repo_root).resolve())}
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=repo_root, timeout=timeout_s)
    if done.returncode:
        raise RuntimeError(f"the lowering check failed in {command[0]} (exit {done.returncode}):\n"
                           f"{done.stderr[-3000:]}")
    return json.loads(done.stdout)


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
                          f"(`make xla`, then {XLA_VENV}/bin/python -m gemma_nb.neuron.lowering)") from None
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
    of the first output (the logits) and the ``tolerance`` it is held to, and ``error``: None, or
    the exception the XLA step raised (then the HLO and numeric fields are None).
    """
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
            return {**row, "hlo_instructions": None, "gathers": None, "max_abs_diff": None, "tolerance": None}
        row.update(hlo_counts(hlo))
        logits = outputs[0].cpu().float()
    row["max_abs_diff"] = float((logits - eager).abs().max())
    row["tolerance"] = tolerance(eager, dtype)
    return row


# --------------------------------------------------------------------------------------------
# The graphs ModelBuilder would trace, on the bundled checkpoint
# --------------------------------------------------------------------------------------------
def _tiny():
    from gemma_nb.neuron.build import NeuronBuildConfig, read_hf_state, text_config
    from gemma_nb.tiny import CHECKPOINT_DIR

    config = text_config(CHECKPOINT_DIR)
    state = read_hf_state(CHECKPOINT_DIR)
    build = NeuronBuildConfig(model_dir=str(CHECKPOINT_DIR), output_dir="unused")  # the shipped shapes
    return config, state, build


def prefill_inputs(config, state: dict, build) -> tuple:
    """The prefill bucket: ``PROMPT_TOKENS`` seeded token ids padded to ``build.bucket``, embedded as the host does."""
    from gemma_nb.neuron.build import step_inputs

    generator = torch.Generator().manual_seed(SEED)
    ids = torch.full((1, build.bucket), config.pad_token_id or 0, dtype=torch.long)
    ids[0, :PROMPT_TOKENS] = torch.randint(3, config.vocab_size, (PROMPT_TOKENS,), generator=generator)
    embeds = state["model.embed_tokens.weight"].float()[ids] * config.hidden_size ** 0.5
    return step_inputs(embeds, list(range(build.bucket)), build.max_len, config.sliding_window, PROMPT_TOKENS - 1)


def decode_inputs(config, state: dict, build) -> tuple:
    """One token at ``DECODE_POSITION``."""
    from gemma_nb.neuron.build import step_inputs

    generator = torch.Generator().manual_seed(SEED + 1)
    ids = torch.randint(3, config.vocab_size, (1, 1), generator=generator)
    embeds = state["model.embed_tokens.weight"].float()[ids] * config.hidden_size ** 0.5
    return step_inputs(embeds, [DECODE_POSITION], build.max_len, config.sliding_window)


def fill_cache(module) -> None:
    """Seeded N(0, 1) values in every K/V state slot (the mask hides the slots after the position)."""
    generator = torch.Generator().manual_seed(SEED + 2)
    with torch.no_grad():
        for state in [*module.k_cache, *module.v_cache]:
            state.copy_(torch.randn(state.shape, generator=generator))


def _cpu_module(config, state, build, experts: str):
    """``NeuronGemma4(parallel=False)`` at TP=1 with ``gemma_nb.moe``'s ``experts`` swapped in."""
    from gemma_nb.moe import swap_experts
    from gemma_nb.neuron.build import NeuronGemma4

    module = NeuronGemma4(config, build, parallel=False)
    # The tiny checkpoint ties lm_head to the embedding and stores the table once.
    module.load_state({**state, "lm_head.weight": state["model.embed_tokens.weight"]})
    if experts != "transformers":
        swap_experts(module.lm, experts)
    return module


def shipped_graphs() -> list[dict]:
    """Each graph the neuron build traces, lowered on the XLA cpu device: a list of :func:`lower_step` rows."""
    config, state, build = _tiny()
    dtype = getattr(torch, build.dtype)
    rows = []
    module = _cpu_module(config, state, build, "dense")
    rows.append(lower_step(module, prefill_inputs(config, state, build), dtype,
                           graph="prefill", tp=1, experts="dense", tokens=build.bucket))
    module = _cpu_module(config, state, build, "dense")
    fill_cache(module)
    rows.append(lower_step(module, decode_inputs(config, state, build), dtype,
                           graph="decode", tp=1, experts="dense", tokens=1))
    return rows


def contrast_graphs() -> list[dict]:
    """What does not lower: the decode step with transformers' default experts, and with the cpu
    ``gemma_nb.moe.SparseExperts`` (data-dependent indexing: host syncs). A row per case; an
    exception in the XLA step (a fallback op failing on the cpu) is recorded as its ``error``."""
    config, state, build = _tiny()
    dtype = getattr(torch, build.dtype)
    rows = []
    for experts in ("transformers", "sparse"):
        module = _cpu_module(config, state, build, experts)
        fill_cache(module)
        rows.append(lower_step(module, decode_inputs(config, state, build), dtype,
                               graph="decode", tp=1, experts=f"{experts} (cpu)", tokens=1))
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


def report(contrast: bool = False) -> dict:
    """Versions, the shapes lowered, the shipped graphs' rows and (optionally) the contrast rows."""
    _, _, build = _tiny()
    out = {"versions": versions(), "shapes": {"bucket": build.bucket, "max_len": build.max_len, "dtype": build.dtype},
           "graphs": shipped_graphs()}
    if contrast:
        out["contrast"] = contrast_graphs()
    return out


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m gemma_nb.neuron.lowering", description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the report as JSON (default: a text table)")
    parser.add_argument("--contrast", action="store_true", help="also lower the experts that do not lower")
    args = parser.parse_args(argv)
    _import_xla()  # fail at once, before building any model, outside the xla environment
    result = report(contrast=args.contrast)
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        for row in result["graphs"] + result.get("contrast", []):
            print(row)
    return 0 if lowered_cleanly(result["graphs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
