"""``make rehearse``: the runbook's commands, in order, against the emulated SDK at the SDK's torch."""

from __future__ import annotations

from pathlib import Path

SDK_PATH = Path(__file__).resolve().parent / "sdk_path"
