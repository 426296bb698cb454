"""``python -m gemma_nb run | serve | plan | preflight | runbook``: every command's arguments, cheap
to import (``--help`` loads no torch, transformers, papermill or fastapi), and ``main``, which
imports a command's module only when that command runs."""

import argparse
import importlib
import math

from gemma_nb import plan_input

DEFAULT_TP, DEFAULT_SCHEME = 2, "int8_squeeze"  # plan's and preflight's: the port's build
STEPS = ("compile", "deploy")  # preflight's host budgets
# serve's: the API key's variable, where it listens, its limits, how it runs the model
API_KEY_ENV = "GEMMA_NB_API_KEY"
DEFAULT_HOST, DEFAULT_PORT = "127.0.0.1", 8080
DEFAULT_KEEP_ALIVE_TIMEOUT_S, DEFAULT_LIMIT_CONCURRENCY = 5, 64
DEFAULT_QUEUE_SIZE, DEFAULT_MAX_TOKENS, DEFAULT_MAX_TOKENS_CAP = 8, 256, 1024
DEFAULT_MAX_BODY_BYTES = 4_000_000  # 4 MB: a 128k-token prompt as text is well under 1 MB
DEFAULT_BODY_TIMEOUT_S, DEFAULT_SLOT_WATCHDOG_S = 30.0, 900.0
RUNTIMES = ("auto", "deploy", "transformers")


def number(kind: type, least: float, most: float, what: str):
    """An argparse type: a ``kind`` from ``least`` to ``most``, else "'text' is not ``what``"."""

    def parse(text: str):
        try:
            value = kind(text)
        except (ValueError, OverflowError):
            value = math.nan
        if not least <= value <= most:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
        return value

    return parse


def at_least(least: int):
    return number(int, least, math.inf, f"an integer >= {least}")


# asyncio overflows on a timer of 1e308 s, and anything past a day is a typo
SECONDS = number(float, 0.001, 86_400, "a number of seconds from 0.001 to 86400 (a day)")
PORT = number(int, 0, 65_535, "a TCP port (0-65535)")
GIGABYTES = number(float, 0, 1e6, "a runtime allowance: pass GB per NeuronCore, e.g. 3.2 (0-1e6)")


def _run(parser) -> None:
    """execute the notebooks with papermill into outputs/<target>/"""
    add = parser.add_argument
    add("--target", default="cpu", help="cpu (default), neuron or cuda")
    add("--only", default=None, help="comma-separated notebook numbers, e.g. 01,03")
    add("--output-dir", default=None, help="instead of outputs/<target>/")
    add(
        "-p",
        "--parameter",
        nargs=2,
        action="append",
        default=[],
        metavar=("NAME", "VALUE"),
        help="a notebook parameter, e.g. -p model_id /data/gemma-4-26b-a4b-it",
    )
    add("--no-progress", action="store_true", help="no per-cell progress bars")


def _serve(parser) -> None:
    """OpenAI-compatible server for the deployed model"""
    parser.epilog = (
        f"The API key comes from {API_KEY_ENV} in the environment, never a flag. Exit status: 0 "
        "after Ctrl-C or SIGTERM, 1 if the model fails to load, 2 for a bad argument."
    )
    add = parser.add_argument
    add("--target", default="cpu", help="cpu (default), neuron or cuda")
    add("--model-id", help="local folder or hub id (default: the bundled checkpoint)")
    add("--served-model-name", help="the name /v1/models lists (default: --model-id)")
    add("--host", default=DEFAULT_HOST, help="interface (%(default)s; see the README's proxy)")
    add("--port", type=PORT, default=DEFAULT_PORT, help="%(default)s, as the port's container")
    add(
        "--runtime",
        choices=RUNTIMES,
        default="auto",
        help="deploy (the slim deploy of --artifact) or transformers (auto: deploy with "
        "--artifact on cpu)",
    )
    add(
        "--artifact",
        help="the compiled folder: notebook 04's (outputs/cpu/artifacts/04_tiny, made by make "
        "run), or on neuron its NxD one (required)",
    )
    add("--dtype", choices=("float32", "bfloat16"), default="float32", help="for transformers")
    add("--max-context", type=at_least(2), help="prompt + answer tokens (default: the model's)")
    for flag, kind, default, what in (
        ("--queue-size", at_least(1), DEFAULT_QUEUE_SIZE, "requests admitted, running one too"),
        ("--max-tokens", at_least(1), DEFAULT_MAX_TOKENS, "answer length if a request sets none"),
        ("--max-tokens-cap", at_least(1), DEFAULT_MAX_TOKENS_CAP, "most a request may ask"),
        ("--max-body-bytes", at_least(1), DEFAULT_MAX_BODY_BYTES, "largest request body"),
        ("--body-timeout-s", SECONDS, DEFAULT_BODY_TIMEOUT_S, "time for a body to arrive"),
        ("--keep-alive-timeout-s", SECONDS, DEFAULT_KEEP_ALIVE_TIMEOUT_S, "idle keep-alive"),
        ("--limit-concurrency", at_least(1), DEFAULT_LIMIT_CONCURRENCY, "uvicorn's, then 503"),
        ("--slot-watchdog-s", SECONDS, DEFAULT_SLOT_WATCHDOG_S, "slots held longer are overdue"),
    ):
        add(flag, type=kind, default=default, help=f"{what} (%(default)s)")
    add("--allowed-host", action="append", default=[], metavar="NAME", help="on loopback, too")
    add("--metrics-require-key", action="store_true", help="/metrics needs the API key too")
    add("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))


def _plan(parser) -> None:
    """will a Hugging Face causal LM fit an inf2? bytes per rank, $/h, decode upper bounds"""
    parser.epilog = (
        "exit status: 0 fits, 1 does not fit (or not loadable), 2 bad input, 3 marginal (fits only "
        'if the runtime takes little of its inferred allowance). The README\'s "Will it fit?" '
        "lists the --json keys and what each holds."
    )
    add = parser.add_argument
    # read and checked as it is parsed: no torch needed to refuse a bad file
    add("config", type=plan_input.read_raw_config, help="a config.json, or a folder holding one")
    add("--instance", help="judge this one, e.g. inf2.xlarge (default: the cheapest that fits)")
    add("--scheme", default=DEFAULT_SCHEME, help="one of gemma_nb.memory.SCHEMES (%(default)s)")
    add("--tp", type=at_least(1), default=DEFAULT_TP, help="ranks = NeuronCores (%(default)s)")
    add("--context", type=at_least(0), help="KV-cache tokens per stream (default: the port's 512)")
    add("--budget", default="spec", choices=("spec", "story"), help="HBM/core: 16 GiB or 16 GB")
    add(
        "--runtime-allowance",
        type=GIGABYTES,
        metavar="GB",
        help="Neuron runtime HBM per core, GB (default: the window notebook 01 infers from the "
        "port's builds)",
    )
    add("--json", action="store_true", help="print the plan as JSON")


def _preflight(parser) -> None:
    """checklist before a run: SDK, NeuronCores, GPU, RAM, disk, model"""
    add = parser.add_argument
    add("--target", default="neuron", help="neuron (default), cpu or cuda")
    add("--model-id", help="checkpoint folder (or hub id) to compile or serve (default: bundled)")
    add("--artifact", action="append", help="a compiled artifact folder (implies --step deploy)")
    add("--step", choices=STEPS, help="host budget (default: compile; deploy with --artifact)")
    add("--tp", type=at_least(1), default=DEFAULT_TP, help="tensor-parallel degree (%(default)s)")


def _runbook(parser) -> None:
    """write docs/inf2.md, the inf2 runbook, from the catalog"""
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/inf2.md is stale")


# Each command's module (its ``main(args)`` runs it) and its arguments.
COMMANDS = {
    "run": ("gemma_nb.tools.run", _run),
    "serve": ("gemma_nb.serving.serve", _serve),
    "plan": ("gemma_nb.tools.plan", _plan),
    "preflight": ("gemma_nb.tools.preflight", _preflight),
    "runbook": ("gemma_nb.tools.runbook", _runbook),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m gemma_nb", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (_, arguments) in COMMANDS.items():
        arguments(sub.add_parser(name, help=arguments.__doc__, description=arguments.__doc__))
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (exit 2 on a bad argument), then run the command: its module is imported
    here, so that no command pays for another's imports."""
    args = build_parser().parse_args(argv)
    return importlib.import_module(COMMANDS[args.command][0]).main(args)
