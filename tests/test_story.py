"""Every claim names its sources (described in docs/sources.md) and its range; an unknown claim is one error."""

import re
import subprocess

import pytest

from gemma_nb.paths import REPO_ROOT
from gemma_nb.story import CLAIMS, source_keys

SOURCES = REPO_ROOT / "docs" / "sources.md"


def defined_sources() -> set[str]:
    return set(re.findall(r"^### ([a-z0-9][a-z0-9.\-]*)\s*$", SOURCES.read_text(), flags=re.MULTILINE))


def test_every_claim_names_a_source_described_in_docs_sources():
    defined = defined_sources()
    assert {"port-card", "port-review", "inferentia2-arch"} <= defined
    for key, claim in CLAIMS.items():
        keys = source_keys(claim)
        assert keys, f"claim {key!r} names no source"
        missing = [k for k in keys if k not in defined]
        assert not missing, f"claim {key!r} names {missing}, not defined as '### key' in docs/sources.md"


def test_the_repo_cites_only_its_own_sources_document():
    # the briefing the project was planned from is not in this repository: no file may point at it
    # (the tiny corpus's constant FACTS is a name, not a citation)
    tracked = subprocess.run(["git", "ls-files", "gemma_nb", "notebooks", "tests", "docs", "README.md",
                              "CONTRIBUTING.md"], cwd=REPO_ROOT, capture_output=True, text=True, check=True)
    pattern = re.compile("FACTS" + r"(\.md| ?§)")
    offenders = []
    for name in tracked.stdout.split():
        path = REPO_ROOT / name
        if path.suffix in {".py", ".md", ".ipynb", ".cfg"} and path.exists():
            offenders += [f"{name}: {line.strip()[:80]}" for line in path.read_text().splitlines() if pattern.search(line)]
    assert not offenders, offenders


def test_an_unknown_claim_is_one_error_everywhere():
    """story, metrics and the verdicts raise the same UnknownClaim: a KeyError and a ValueError."""
    from gemma_nb.metrics import headline
    from gemma_nb.story import UnknownClaim, agrees_with_claim, claim_range, compare

    for call in (lambda: compare({"not_a_claim": 1.0}), lambda: headline("x", 1.0, "GB", claim="not_a_claim"),
                 lambda: claim_range("not_a_claim"), lambda: agrees_with_claim("not_a_claim", 1.0)):
        with pytest.raises(UnknownClaim, match="'not_a_claim' is not in gemma_nb.story.CLAIMS") as info:
            call()
        assert isinstance(info.value, KeyError) and isinstance(info.value, ValueError)


def test_every_claim_range_is_written_out_and_holds_its_value():
    for key, claim in CLAIMS.items():
        low, high = claim.within
        assert low <= claim.value <= high and low < high, key
    assert CLAIMS["int8_experts_gap_gb"].within == (3.0, 4.0)  # the write-up's "~3-4 GB", not parsed from the text
