"""Bounds on what a message may hold: never cut inside a word, every problem named up to a stated count and the
rest counted, names shortened. Owned once so every refusal and warning list stays whole and small."""

from __future__ import annotations

from collections.abc import Sequence

ELLIPSIS = "…"
# A file or member name in a message: enough to recognise it (its start and its end, with the extension).
MAX_NAME_CHARS = 120
# One problem's text; the worker's own are shorter, so this only bounds what echoes user input.
MAX_PROBLEM_CHARS = 600
# Problems named one by one in a message; the rest are counted ("and 3 more").
MAX_LISTED_PROBLEMS = 10
# A whole error message, and a job result's warnings (count, characters of all, characters of one).
MAX_MESSAGE_CHARS = 6000
MAX_WARNINGS = 40
MAX_WARNINGS_CHARS = 8000
MAX_WARNING_CHARS = 2500


def whole_words(text: str, limit: int = MAX_PROBLEM_CHARS) -> str:
    """`text` within `limit` characters, cut between words (a single longer word is cut, marked "…")."""
    if len(text) <= limit:
        return text
    cut = text[: limit - 1]
    space = cut.rfind(" ")
    if space > limit // 2:
        cut = cut[:space]
    return cut.rstrip(" ;,") + ELLIPSIS


def short_name(name: str, limit: int = MAX_NAME_CHARS) -> str:
    """A name safe to show: control characters escaped (as repr writes them, without its quotes), and a long
    one shortened in its middle so its start and its extension stay."""
    shown = repr(name)[1:-1]
    if len(shown) <= limit:
        return shown
    head = (limit - 1) * 2 // 3
    tail = limit - 1 - head
    return shown[:head] + ELLIPSIS + shown[-tail:]


def listed(problems: Sequence[str], limit: int = MAX_LISTED_PROBLEMS, separator: str = "; ") -> str:
    """The first `limit` problems, each whole (within MAX_PROBLEM_CHARS), then "and N more"."""
    shown = [whole_words(problem) for problem in problems[:limit]]
    if len(problems) > limit:
        shown.append(f"and {len(problems) - limit} more")
    return separator.join(shown)


def bounded_list(
    items: Sequence[str], max_items: int, max_chars: int, item_chars: int = MAX_PROBLEM_CHARS
) -> list[str]:
    """Items kept in order while they fit `max_items` and `max_chars` in all (each cut to `item_chars` between
    words); a last item counts the rest."""
    kept: list[str] = []
    total = 0
    for index, item in enumerate(items):
        text = whole_words(item, item_chars)
        if index >= max_items or total + len(text) > max_chars:
            kept.append(f"and {len(items) - index} more")
            break
        kept.append(text)
        total += len(text)
    return kept


def describe_seconds(seconds: float) -> str:
    """A duration as a person reads it: "45 s", "1 min", "2.5 min", "1.5 h"."""
    if seconds < 60:
        return f"{seconds:.0f} s"
    if seconds < 3600:
        return f"{seconds / 60:.1f}".removesuffix(".0") + " min"
    return f"{seconds / 3600:.1f}".removesuffix(".0") + " h"


def bounded_warnings(warnings: Sequence[str]) -> list[str]:
    """A result's warnings, each once, within MAX_WARNINGS and MAX_WARNINGS_CHARS; the last counts the rest."""
    return bounded_list(list(dict.fromkeys(warnings)), MAX_WARNINGS, MAX_WARNINGS_CHARS, MAX_WARNING_CHARS)


def os_reason(error: OSError) -> str:
    """What went wrong with a file, for a message: the system's words, else the error's text or its type."""
    return error.strerror or str(error) or type(error).__name__


def format_bytes(count: int | float) -> str:
    """Bytes for people, binary units: 23807475712 → "22.2 GiB"."""
    value = float(count)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"
