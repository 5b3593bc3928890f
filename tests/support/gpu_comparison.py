"""The README's own request planned on every RunPod type (`plan --runpod-gpu all`), as the README's "Which GPU"
section and docs/gpus.md show it: the command they print, its output now, and the output the page shows.

Regenerate both pages' blocks after a planner change: `python -m tests.support.gpu_comparison --write`."""

from __future__ import annotations

import io
import json
import os
import re
import sys
import tempfile
from pathlib import Path

from fluxbooth.cli import main

REPO_ROOT = Path(__file__).resolve().parents[2]
PAGES = (REPO_ROOT / "README.md", REPO_ROOT / "docs" / "gpus.md")
# The command as the pages print it, its arguments after `python -m fluxbooth`.
COMMAND = ("plan", "--runpod-gpu", "all", "--request", "request.json", "--instance-images", "20")
PROMPT = "$ python -m fluxbooth " + " ".join(COMMAND)
# The block on a page: the command's line, then its output up to the closing fence.
BLOCK = re.compile(r"```text\n" + re.escape(PROMPT) + r"\n(.*?)```", re.DOTALL)
# The README's request: the JSON block under "The first job".
README_REQUEST = re.compile(r"## The first job.*?```json\n(.*?)```", re.DOTALL)


def readme_request() -> dict:
    found = README_REQUEST.search((REPO_ROOT / "README.md").read_text())
    assert found, "README.md has no request.json block under 'The first job'"
    return json.loads(found.group(1))


def isolated_env(root: Path) -> dict[str, str]:
    """The worker's defaults: nothing of this machine's FLUXBOOTH_* settings or caches."""
    return {
        "PATH": os.environ.get("PATH", ""),
        "HOME": str(root),
        "FLUXBOOTH_WORK_DIR": str(root / "work"),
        "FLUXBOOTH_CACHE_DIR": str(root / "cache"),
        "FLUXBOOTH_VOLUME_DIR": str(root / "no-volume"),
        "HF_HUB_OFFLINE": "1",
    }


def comparison(*extra: str) -> tuple[int, str]:
    """(exit status, output) of the pages' command (with `extra` arguments) for the README's request."""
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        (root / "request.json").write_text(json.dumps(readme_request()))
        arguments = [str(root / "request.json") if part == "request.json" else part for part in COMMAND]
        out = io.StringIO()
        return main([*arguments, *extra], isolated_env(root), out), out.getvalue()


def shown_output(page: Path) -> str | None:
    found = BLOCK.search(page.read_text())
    return found.group(1) if found else None


def write_pages() -> None:
    _, output = comparison()
    for page in PAGES:
        text = page.read_text()
        assert BLOCK.search(text), f"{page.name} has no block for `{PROMPT}`"
        page.write_text(BLOCK.sub(lambda _: f"```text\n{PROMPT}\n{output}```", text))


if __name__ == "__main__" and sys.argv[1:] == ["--write"]:
    write_pages()
