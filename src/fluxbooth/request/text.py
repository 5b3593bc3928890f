"""What the request's free text must be: plain, visible, and in one Unicode form.

A prompt may span lines, but other control characters (NUL, ESC, BEL, ...) are no text. A value whose every
character is whitespace, a format character (zero-width space and joiners, the word joiner, the byte-order mark)
or a Hangul filler draws nothing: it is as blank as an empty string. Prompts and the trigger word are compared
and put together (fluxbooth.contract.captions), so they are kept in NFC: a trigger word typed precomposed is
the same word in a prompt typed decomposed.
"""

from __future__ import annotations

import re
import unicodedata

# A prompt may span lines; other control characters (NUL first) are no text.
PROMPT_CONTROL_CHARACTERS = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")
PROMPT_CONTROL_MESSAGE = "contains a control character (NUL or another); send plain text"
BLANK_MESSAGE = "must not be blank"
# Control, format (U+200B-U+200D, U+2060, U+FEFF, U+180E, ...), separator and combining-mark categories draw
# nothing on their own.
_INVISIBLE_CATEGORIES = frozenset({"Cc", "Cf", "Zs", "Zl", "Zp", "Mn", "Me"})
# Letters by category that render as nothing: the Hangul fillers and the braille blank.
_FILLERS = frozenset("\u115f\u1160\u3164\uffa0\u2800")


def is_visible(character: str) -> bool:
    """Whether `character` draws something."""
    return character not in _FILLERS and unicodedata.category(character) not in _INVISIBLE_CATEGORIES


def is_blank(value: str) -> bool:
    """Whether `value` holds no visible character (empty, whitespace, zero-width or filler characters only)."""
    return not any(is_visible(character) for character in value)


def prompt_text(value: str) -> str:
    """`value` as a prompt: refused (ValueError) with a control character other than a line break, or blank;
    else stripped, in NFC."""
    if PROMPT_CONTROL_CHARACTERS.search(value):
        raise ValueError(PROMPT_CONTROL_MESSAGE)
    if is_blank(value):
        raise ValueError(BLANK_MESSAGE)
    return unicodedata.normalize("NFC", value.strip())
