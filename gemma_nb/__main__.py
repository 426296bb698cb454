"""Command line: ``python -m gemma_nb run | serve | plan | preflight | runbook ...``."""

import argparse
import ast
import sys

from gemma_nb.serving import serve
from gemma_nb.targets import TargetError
from gemma_nb.tools import plan, preflight, runbook
from gemma_nb.tools.run import RunError, Terminated, run

TOOLS = {
    "plan": (plan, "will a Hugging Face causal LM fit an inf2? bytes per rank, $/h"),
    "preflight": (preflight, "checklist before a run: SDK, NeuronCores, RAM, disk, model"),
    "runbook": (runbook, "write docs/inf2.md, the inf2 runbook, from the catalog"),
}


def _parse_parameter(pair: list[str]) -> tuple[str, object]:
    name, raw = pair
    if name in ("target", "hf_token", "HF_TOKEN"):
        raise SystemExit(
            f"-p {name} is not a notebook parameter: use --target, and HF_TOKEN from the "
            "environment"
        )
    try:
        return name, ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        return name, raw  # a plain string such as a model id


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser (``serve`` parses its own arguments: ``serve.build_parser``)."""
    parser = argparse.ArgumentParser(prog="python -m gemma_nb", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    run_p = sub.add_parser(
        "run", help="execute the notebooks with papermill into outputs/<target>/"
    )
    run_p.add_argument("--target", default="cpu", help="cpu (default), neuron or cuda")
    run_p.add_argument("--only", default=None, help="comma-separated notebook numbers, e.g. 01,03")
    run_p.add_argument("--output-dir", default=None, help="instead of outputs/<target>/")
    run_p.add_argument(
        "-p",
        "--parameter",
        nargs=2,
        action="append",
        default=[],
        metavar=("NAME", "VALUE"),
        help="a notebook parameter, e.g. -p model_id /data/gemma-4-26b-a4b-it",
    )
    run_p.add_argument("--no-progress", action="store_true", help="no per-cell progress bars")
    sub.add_parser(
        "serve", help="OpenAI-compatible server for the deployed model (see --help)", add_help=False
    )
    for name, (module, summary) in TOOLS.items():
        module.add_arguments(sub.add_parser(name, help=summary))
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if args.command == "serve":
        return serve.main(rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command in TOOLS:
        return TOOLS[args.command][0].main(args)
    try:
        results = run(
            target=args.target,
            only=args.only,
            output_dir=args.output_dir,
            parameters=dict(_parse_parameter(p) for p in args.parameter),
            progress=not args.no_progress,
        )
    except (RunError, TargetError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as interrupt:  # Ctrl-C, or SIGTERM (Terminated)
        print(
            f"interrupted ({interrupt or 'Ctrl-C'}); the previous outputs were left as they were",
            file=sys.stderr,
        )
        return 143 if isinstance(interrupt, Terminated) else 130
    print(
        f"{len(results)} notebook(s) for target {args.target} in "
        f"{sum(r.seconds for r in results):.0f} s",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
