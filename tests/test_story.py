"""Every claim names its sources (described in docs/sources.md) and its range; an unknown claim is
one error."""

import re
import subprocess

import pytest

from gemma_nb.paths import REPO_ROOT
from gemma_nb.story import CLAIMS

SOURCES = REPO_ROOT / "docs" / "sources.md"


def source_keys(claim) -> list[str]:
    """The ``docs/sources.md`` keys a claim names."""
    return [key.strip() for key in claim.source.split(",") if key.strip()]


def defined_sources() -> set[str]:
    return set(
        re.findall(r"^### ([a-z0-9][a-z0-9.\-]*)\s*$", SOURCES.read_text(), flags=re.MULTILINE)
    )


def test_every_claim_names_a_source_described_in_docs_sources():
    defined = defined_sources()
    assert {"port-card", "port-review", "inferentia2-arch"} <= defined
    for key, claim in CLAIMS.items():
        keys = source_keys(claim)
        assert keys, f"claim {key!r} names no source"
        missing = [k for k in keys if k not in defined]
        assert not missing, (
            f"claim {key!r} names {missing}, not defined as '### key' in docs/sources.md"
        )


def test_the_repo_cites_only_its_own_sources_document():
    # the briefing the project was planned from is not in this repository: no file may point at it
    # (the tiny corpus's constant FACTS is a name, not a citation)
    tracked = subprocess.run(
        [
            "git",
            "ls-files",
            "gemma_nb",
            "notebooks",
            "tests",
            "docs",
            "README.md",
            "CONTRIBUTING.md",
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    pattern = re.compile("FACTS" + r"(\.md| ?§)")
    offenders = []
    for name in tracked.stdout.split():
        path = REPO_ROOT / name
        if path.suffix in {".py", ".md", ".ipynb", ".cfg"} and path.exists():
            offenders += [
                f"{name}: {line.strip()[:80]}"
                for line in path.read_text().splitlines()
                if pattern.search(line)
            ]
    assert not offenders, offenders


def test_an_unknown_claim_is_one_error_everywhere():
    """story, metrics and the verdicts raise the same UnknownClaim: a KeyError and a ValueError."""
    from gemma_nb.metrics import headline
    from gemma_nb.story import UnknownClaim, agrees_with_claim, claims_table, get_claim

    for call in (
        lambda: claims_table({"not_a_claim": 1.0}),
        lambda: headline("x", 1.0, "GB", claim="not_a_claim"),
        lambda: get_claim("not_a_claim").within,
        lambda: agrees_with_claim("not_a_claim", 1.0),
    ):
        with pytest.raises(UnknownClaim, match="'not_a_claim'.*gemma_nb.story.CLAIMS") as info:
            call()
        assert isinstance(info.value, KeyError) and isinstance(info.value, ValueError)


def test_every_claim_range_is_written_out_and_holds_its_value():
    for key, claim in CLAIMS.items():
        low, high = claim.within
        assert low <= claim.value <= high and low < high, key
    # the write-up's "~3-4 GB", not parsed from the text
    assert CLAIMS["int8_experts_gap_gb"].within == (
        3.0,
        4.0,
    )


# Keys a source of this project's own would have: its planning estimates, earlier runs, counts.
PROJECT_SOURCES = {"inf2-roofline", "reference-box", "meta-device-count"}


def test_claims_are_what_outside_sources_published():
    named = {key for claim in CLAIMS.values() for key in source_keys(claim)}
    assert not named & PROJECT_SOURCES, sorted(named & PROJECT_SOURCES)
    assert not defined_sources() & PROJECT_SOURCES
    assert "This project's own earlier figures" not in SOURCES.read_text()


def test_claims_table_shows_claims_as_written_and_a_difference_only_between_like_figures():
    from gemma_nb.story import LowerBound, claims_table

    table = claims_table(
        {
            "experts_bf16_gb": 45.67597056,
            "int8_experts_gap_gb": -0.650821572,
            "experts_share_pct": 93.2355,
            "compile_peak_host_gb": LowerBound(51.71),
        }
    )
    assert list(table.columns) == ["figure", "claimed", "computed", "diff", "holds", "source"]
    rows = table.set_index("claimed").to_dict(orient="index")
    assert rows["45.6 GB"] | {"figure": None, "source": None} == {
        "figure": None,
        "computed": "45.68 GB",
        "diff": "+0.17%",
        "holds": True,
        "source": None,
    }
    assert (
        rows["3-4 GB"]["computed"] == "-0.65 GB"
        and rows["3-4 GB"]["diff"] == ""
        and not rows["3-4 GB"]["holds"]
    )
    assert rows["93%"]["computed"] == "93.2%" and rows["93%"]["holds"]  # "93%" stands for 92-94%
    # a bound, never a difference
    assert rows["180.0 GB"] | {"figure": None} == {
        "figure": None,
        "computed": "≥ 51.71 GB",
        "diff": "",
        "holds": True,
        "source": "port-review",
    }
