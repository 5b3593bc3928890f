"""The trigger word in captions and prompts, as ai-toolkit (and Replicate's trainer built on it) puts it.

Torch-free: the request validates the word, the trainer applies it to every caption, the instance prompt
and the validation prompts (never to the class prompt, which must keep describing the class).
"""

from __future__ import annotations

import re
import unicodedata

TRIGGER_PLACEHOLDER = "[trigger]"
MAX_TRIGGER_CHARS = 100
# The longest caption a photo trains on (the dataset stage refuses a longer caption file; the trainer checks again).
MAX_CAPTION_CHARS = 2000


def contains_word(text: str, word: str) -> bool:
    """Whether `word` occurs in `text` on its own (case-sensitive): `TOK` is in "a TOK dog", not in "TOKYO".
    Both are compared in NFC, so a word typed precomposed is found in text typed decomposed."""
    text, word = unicodedata.normalize("NFC", text), unicodedata.normalize("NFC", word)
    return re.search(rf"(?<!\w){re.escape(word)}(?!\w)", text) is not None


def with_trigger(text: str, trigger_word: str | None) -> str:
    """`text` with every `[trigger]` replaced by `trigger_word`, and the word put in front (a space between,
    as ai-toolkit's `inject_trigger_into_prompt` does) when the text does not already hold it; in NFC, so a
    caption typed decomposed holds the precomposed trigger word once. Without a trigger word the text is
    returned unchanged."""
    if not trigger_word:
        return text
    text, trigger_word = unicodedata.normalize("NFC", text), unicodedata.normalize("NFC", trigger_word)
    replaced = text.replace(TRIGGER_PLACEHOLDER, trigger_word)
    if contains_word(replaced, trigger_word):
        return replaced
    return f"{trigger_word} {replaced}" if replaced else trigger_word
