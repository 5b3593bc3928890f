"""The README's hazard table stays true: every test it cites as proof exists."""

from __future__ import annotations

import re

from tests.conftest import REPO_ROOT



def cited_tests() -> list[tuple[str, str]]:
    """(file, test) pairs; a bare `::test_x` refers to the file cited before it in the same cell."""
    text = REPO_ROOT.joinpath("README.md").read_text()
    table = text.split("## Hostile input and faults", 1)[1].split("\n## ", 1)[0]
    pairs: list[tuple[str, str]] = []
    for row in table.splitlines():
        if not row.startswith("|"):
            continue
        current_file = ""
        for match in re.finditer(r"`((test_\w+\.py)?::(test_\w+))(\[[^\]`]*\])?`", row):
            current_file = match.group(2) or current_file
            pairs.append((current_file, match.group(3)))
    return pairs


def test_every_test_the_hazard_table_cites_exists() -> None:
    pairs = cited_tests()
    assert len(pairs) > 50
    missing = [
        f"{file}::{name}" for file, name in pairs
        if not re.search(rf"def {name}\(", (REPO_ROOT / "tests" / file).read_text())
    ]
    assert missing == []
