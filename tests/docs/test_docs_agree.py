"""The README, the deploy page and the environment page say the same as the code and as each other: the
CUDA versions, that an unfit worker stays up and answers worker_unfit, when images are built and tagged, the
Hub presets' names, and the error codes."""

from __future__ import annotations

import json
import re

import pytest

from fluxbooth.errors import ErrorCode
from tests.conftest import REPO_ROOT

AGREEING_PAGES = ("README.md", "docs/deploy.md", "docs/environment.md")
HUB_JSON = REPO_ROOT / ".runpod" / "hub.json"
OLDEST_CUDA = "13.0"
# What the pages say: exactly the versions .runpod/hub.json allows (RunPod's API lists none newer than 13.0).
CUDA_WORDS = "13.0 (host driver 580 or newer)"


def page_text(name: str) -> str:
    """The page with its lines joined, so that a phrase broken across lines is found."""
    return re.sub(r"\s*\n\s*", " ", (REPO_ROOT / name).read_text())


def hub_config() -> dict:
    return json.loads(HUB_JSON.read_text())["config"]


@pytest.mark.parametrize("name", AGREEING_PAGES)
def test_every_mention_of_the_allowed_cuda_versions_says_13_0_with_driver_580(name: str) -> None:
    text = page_text(name)
    mentions = re.findall(rf"Allowed CUDA versions:?\**:? (.{{{len(CUDA_WORDS)}}})", text)
    assert all(mention.startswith(CUDA_WORDS) for mention in mentions), mentions


def test_the_readme_and_the_deploy_page_state_the_cuda_versions() -> None:
    assert all(
        "Allowed CUDA versions" in page_text(name) and CUDA_WORDS in page_text(name)
        for name in ("README.md", "docs/deploy.md")
    )


def test_the_hub_allows_exactly_the_cuda_version_the_pages_state() -> None:
    assert hub_config()["allowedCudaVersions"] == [OLDEST_CUDA]


@pytest.mark.parametrize("name", AGREEING_PAGES)
def test_no_page_says_an_unfit_worker_stops_or_refuses_with_another_code(name: str) -> None:
    text = page_text(name)
    assert not re.search(r"stops at start|refuses every job", text)
    assert "worker_unfit" in text


@pytest.mark.parametrize("name", ("README.md", "docs/deploy.md"))
def test_images_are_built_on_a_v_tag_and_tagged_x_y_z_and_x_y(name: str) -> None:
    text = page_text(name)
    assert "Push a `v*` tag" in text and "`:X.Y.Z` and `:X.Y`" in text
    assert "to `main`" not in text


@pytest.mark.parametrize("name", AGREEING_PAGES)
def test_every_hub_preset_a_page_names_is_one_in_hub_json(name: str) -> None:
    presets = {preset["name"] for preset in hub_config()["presets"]}
    named = re.findall(r'preset "([^"]+)"|"([^"]+)" preset', page_text(name))
    assert [found for pair in named for found in pair if found and found not in presets] == []


def test_the_readme_names_each_hub_preset_it_relies_on() -> None:
    assert re.search(r'preset "[^"]+"', page_text("README.md"))


def test_the_readmes_error_table_lists_exactly_the_error_codes() -> None:
    rows = re.findall(r"^\| (`[a-z_]+`(?:, `[a-z_]+`)*) \|", (REPO_ROOT / "README.md").read_text(), re.MULTILINE)
    listed = [code.strip("`") for row in rows for code in row.split(", ")]
    assert sorted(listed) == sorted(code.value for code in ErrorCode)
