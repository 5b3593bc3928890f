"""Worker settings read from the environment: defaults, and refusals that name the variable."""

from __future__ import annotations

import pytest

from fluxbooth.settings import WorkerSettings


def test_two_checkpoints_are_kept_by_default() -> None:
    assert WorkerSettings.from_environ({}).checkpoints_keep == 2


@pytest.mark.parametrize(("raw", "expected"), [("0", 0), ("5", 5), (" 3 ", 3), ("", 2)])
def test_checkpoints_keep_is_read_from_the_environment(raw: str, expected: int) -> None:
    assert WorkerSettings.from_environ({"FLUXBOOTH_CHECKPOINTS_KEEP": raw}).checkpoints_keep == expected


@pytest.mark.parametrize("raw", ["two", "2.5", "1e3"])
def test_checkpoints_keep_that_is_not_a_whole_number_is_refused(raw: str) -> None:
    with pytest.raises(ValueError) as caught:
        WorkerSettings.from_environ({"FLUXBOOTH_CHECKPOINTS_KEEP": raw})

    assert str(caught.value) == f"environment variable FLUXBOOTH_CHECKPOINTS_KEEP={raw!r} is not a whole number"


def test_a_negative_checkpoints_keep_is_refused() -> None:
    with pytest.raises(ValueError) as caught:
        WorkerSettings.from_environ({"FLUXBOOTH_CHECKPOINTS_KEEP": "-1"})

    assert str(caught.value) == "environment variable FLUXBOOTH_CHECKPOINTS_KEEP='-1' must be 0 or more"
