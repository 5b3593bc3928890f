"""`python -m fluxbooth plan --runpod-gpu all` (**contract**): the job planned on every RunPod type the planner
knows, on a first job (the base model's download counted) and with the model cached; the README and docs/gpus.md
show its output for the README's own request, and the Hub config lists only pools where that request trains."""

from __future__ import annotations

import io
import json
import re
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from fluxbooth.cli import main
from fluxbooth.cli.exits import EXIT_USAGE
from fluxbooth.plan.runpod_gpus import RUNPOD_GPUS, pool_gpus, runpod_gpu
from tests.support.gpu_comparison import PAGES, PROMPT, comparison, isolated_env, shown_output

REPO_ROOT = Path(__file__).resolve().parents[2]
HUB = json.loads((REPO_ROOT / ".runpod" / "hub.json").read_text())
HUB_TESTS = json.loads((REPO_ROOT / ".runpod" / "tests.json").read_text())


@cache
def readme_table() -> str:
    """What the pages' command prints for the README's request (planned once for every test here)."""
    return comparison()[1]


@cache
def readme_rows() -> dict[str, dict[str, Any]]:
    """The README's request on every type, by type name (`--json`)."""
    _, printed = comparison("--json")
    return {row["gpu"]: row for row in json.loads(printed)["rows"]}


def hub_pools() -> list[str]:
    return HUB["config"]["gpuIds"].split(",")


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_the_page_shows_what_the_command_prints_for_the_readmes_request(page: Path) -> None:
    assert shown_output(page) == readme_table(), (
        f"{page.name}'s `{PROMPT}` block differs from the command's output: run "
        "`python -m tests.support.gpu_comparison --write`"
    )


def test_every_type_the_planner_knows_has_a_row_with_both_cases() -> None:
    rows = readme_rows()
    assert list(rows) == [gpu.name for gpu in RUNPOD_GPUS]
    assert all(row["first_job"]["download_bytes"] > 0 for row in rows.values())
    assert all(row["cached_model"]["download_bytes"] == 0 for row in rows.values())


def test_a_first_job_takes_longer_than_one_with_the_model_cached() -> None:
    rows = [row for row in readme_rows().values() if row["first_job"]["minutes"] is not None]
    assert rows and all(row["first_job"]["minutes"] > row["cached_model"]["minutes"] for row in rows)


def test_a_refusal_says_how_many_steps_fit_and_prices_nothing() -> None:
    row = readme_rows()["RTX 4090"]
    assert (row["first_job"]["trains"], row["cached_model"]["trains"]) == (False, True)
    assert re.fullmatch(r"refused: \d+ steps fit", row["first_job"]["answer"])
    assert row["first_job"]["cost"] is None and row["cached_model"]["cost"] > 0


@pytest.mark.parametrize("flag", [["--gpu-memory", "24GiB"], ["--gpu-name", "L40S"], ["--cached"]])
def test_flags_that_describe_one_card_are_refused(
    flag: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["plan", "--runpod-gpu", "all", *flag], isolated_env(tmp_path), io.StringIO())

    assert code == EXIT_USAGE
    assert capsys.readouterr().err == (
        "error (invalid_input): --runpod-gpu all plans every type, each with its own memory and name, on a first "
        f"job and with the model cached: drop {flag[0]}\n"
    )


@pytest.mark.parametrize("pool", hub_pools())
def test_every_card_of_every_hub_pool_trains_the_readmes_request_first_job_or_cached(pool: str) -> None:
    cards = pool_gpus(pool)
    assert cards, f"{pool}: no RunPod type the planner knows is in this pool"
    rows = readme_rows()
    assert [card.name for card in cards if not rows[card.name]["first_job"]["trains"]] == []
    assert [card.name for card in cards if not rows[card.name]["cached_model"]["trains"]] == []


def test_the_hubs_first_pool_trains_the_readmes_request_on_a_first_job_without_a_warning_on_its_tested_card() -> None:
    tested = runpod_gpu(HUB_TESTS["config"]["gpuTypeId"])
    assert tested is not None and tested.pool == hub_pools()[0]
    assert readme_rows()[tested.name]["first_job"]["answer"] == "trains"


@pytest.mark.parametrize("pool", ["AMPERE_16", "AMPERE_24", "ADA_24"])
def test_pools_where_a_first_job_is_refused_are_not_offered(pool: str) -> None:
    assert any(not readme_rows()[card.name]["first_job"]["trains"] for card in pool_gpus(pool))
    assert pool not in hub_pools()


@pytest.mark.parametrize(
    ("pool", "cards"),
    [
        ("ADA_24", ["RTX 4090"]),
        ("AMPERE_48", ["RTX A6000", "A40"]),
        ("ADA_48_PRO", ["L40", "L40S", "RTX 6000 Ada"]),
        ("AMPERE_80", ["A100 PCIe", "A100 SXM"]),
        ("ADA_80_PRO", ["H100 SXM"]),
        ("HOPPER_141", ["H200 SXM"]),
    ],
)
def test_a_pool_holds_the_cards_runpod_lists_for_it(pool: str, cards: list[str]) -> None:
    assert [card.name for card in pool_gpus(pool)] == cards


def test_each_preset_the_readme_names_sets_the_deadline_the_readme_states() -> None:
    readme = re.sub(r"\s*\n\s*", " ", (REPO_ROOT / "README.md").read_text())
    stated = re.findall(r"FLUXBOOTH_JOB_DEADLINE_SECONDS=(\d+)` \(the Hub preset \"([^\"]+)\"", readme)
    presets = {
        preset["name"]: preset["defaults"]["FLUXBOOTH_JOB_DEADLINE_SECONDS"] for preset in HUB["config"]["presets"]
    }
    assert stated and [(int(seconds), name) for seconds, name in stated] == [
        (presets.get(name), name) for _, name in stated
    ]
