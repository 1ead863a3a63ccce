"""The READMEs link only to files that a clone of the repository has."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


@pytest.mark.parametrize("readme", ["README.md", "benchmarks/README.md"])
def test_relative_links_point_into_the_repository(readme):
    path = REPO / readme
    targets = [t for t in LINK.findall(path.read_text()) if not re.match(r"[a-z]+:|#", t)]
    for target in targets:
        file = (path.parent / target.split("#", 1)[0]).resolve()
        assert file.is_relative_to(REPO) and file.exists(), f"{readme} links to {target}, not in the repository"
