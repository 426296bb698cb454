"""``python -m gemma_nb runbook``: writes docs/inf2.md (filled in below)."""

from __future__ import annotations


def add_arguments(parser) -> None:
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/inf2.md differs from what it would write")


def main(args) -> int:
    raise NotImplementedError
