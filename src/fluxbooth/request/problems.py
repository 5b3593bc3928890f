"""How a refused request is reported: one line naming every failing field, each problem whole, never a value."""

from __future__ import annotations

from pydantic import ValidationError
from pydantic_core import ErrorDetails

from fluxbooth.messages import listed, short_name


class RequestProblems(ValueError):
    """The cross-field rules a request breaks, each naming its fields: reported one by one, never cut."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("; ".join(problems))
        self.problems = problems


def _field_label(location: tuple[int | str, ...]) -> str:
    label = "input"
    for part in location:
        if isinstance(part, int):
            label += f"[{part}]"
        else:
            label += f".{short_name(str(part), 64)}"
    return label


def _describe_error(error: ErrorDetails) -> list[str]:
    location = tuple(error.get("loc", ()))
    if error.get("type") == "extra_forbidden":
        return [f"{_field_label(location)}: unknown field"]
    cause = error.get("ctx", {}).get("error")
    if isinstance(cause, RequestProblems):
        # Cross-field rules name their fields themselves, one problem each.
        return list(cause.problems)
    reason = str(error.get("msg", "invalid value")).removeprefix("Value error, ")
    return [f"{_field_label(location)}: {reason}" if location else reason]


def describe_validation_error(error: ValidationError) -> str:
    """One line naming every failing field (up to messages.MAX_LISTED_PROBLEMS, then how many more), each
    problem whole, never echoing values."""
    problems = [
        problem for item in error.errors(include_url=False, include_input=False) for problem in _describe_error(item)
    ]
    return "invalid request: " + listed(problems)
