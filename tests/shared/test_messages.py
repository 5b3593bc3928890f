"""Whole, bounded messages (issue 29, items 5 and 8): never cut inside a word, every problem named up to a
stated count and the rest counted, names shortened, and the whole error and warning list bounded."""

from __future__ import annotations

import json

from fluxbooth.errors import ErrorCode, FluxboothError
from fluxbooth.messages import (
    MAX_MESSAGE_CHARS,
    MAX_WARNINGS_CHARS,
    bounded_warnings,
    listed,
    short_name,
    whole_words,
)


def test_a_long_text_is_cut_between_words_and_marked() -> None:
    assert whole_words("input.fused_backward_pass: the fused pass trains bf16 weights", 40) == (
        "input.fused_backward_pass: the fused…"
    )


def test_problems_past_the_stated_count_are_counted() -> None:
    assert listed([f"problem {index}" for index in range(13)], limit=10).endswith("; problem 9; and 3 more")


def test_a_name_with_control_characters_is_escaped_and_shortened_keeping_its_end() -> None:
    shown = short_name("photo\n" + "x" * 500 + ".jpg", limit=40)
    assert len(shown) == 40 and shown.startswith("photo\\n") and shown.endswith("x.jpg") and "\n" not in shown


def test_an_error_message_reaches_the_caller_bounded() -> None:
    result = FluxboothError(ErrorCode.INVALID_DATASET, "dataset: " + "word " * 10_000).to_result()
    assert len(result["error"]["message"]) <= MAX_MESSAGE_CHARS
    assert result["error"]["message"].endswith("word…")
    assert len(json.dumps(result)) < 8 * 1024


def test_a_results_warnings_are_bounded_in_count_and_size_and_say_how_many_more() -> None:
    warnings = bounded_warnings([f"warning {index}: " + "x" * 500 for index in range(100)])
    assert sum(len(warning) for warning in warnings) <= MAX_WARNINGS_CHARS + 20
    assert warnings[-1] == f"and {100 - (len(warnings) - 1)} more"
