"""Every claim names its sources, and every source it names is described in docs/sources.md."""

import re
import subprocess

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
