"""The noun for the subject's class, read from the words that name it.

The default validation prompts ("a photo of <trigger word> <noun>, on a beach at sunset") and prompt fidelity
use it, so it must be the thing photographed, not the last word of the prompt: "a photo of a dog in the park"
names a dog. The noun phrase is the words after the trigger word (in the instance prompt) or after the article
(in the class prompt, past any "a photo of"), up to the first word that starts something else: a preposition,
a conjunction, a clause, a participle ("a dog sitting on a couch", "a car parked outside"); its last word is the noun ("a golden
retriever" → retriever).
"""

from __future__ import annotations

import re

from fluxbooth.contract.captions import TRIGGER_PLACEHOLDER

_WORD = re.compile(r"[^\W\d_][\w'-]*")
# "a photo of", "a close-up portrait of": what frames the subject rather than names it.
_FRAMING = re.compile(
    r"\b(?:photo(?:graph)?|picture|image|portrait|shot|snapshot|selfie|close-?up|render(?:ing)?|painting|drawing|"
    r"illustration|headshot)s?\s+of\s+",
    re.IGNORECASE,
)
_DETERMINERS = frozenset({"a", "an", "the", "one", "my", "our", "your", "his", "her", "their", "its", "this", "that"})
# Words that end the noun phrase: what follows them is where, with what or doing what.
_PHRASE_ENDS = frozenset(
    {
        "in", "on", "at", "with", "by", "near", "under", "over", "behind", "beside", "next", "inside", "outside",
        "from", "for", "of", "against", "into", "onto", "through", "across", "around", "between", "among", "and",
        "or", "but", "while", "who", "which", "that", "is", "are", "as", "like", "to", "during", "after", "before",
        "without", "within", "wearing", "holding",
    }
)  # fmt: skip


def _head_noun(words: list[str]) -> str | None:
    """The last word of the noun phrase `words` opens (after a leading determiner), or None when it names none."""
    if words and words[0].lower() in _DETERMINERS:
        words = words[1:]
    phrase: list[str] = []
    for word in words:
        lowered = word.lower()
        # A participle after a noun starts a clause ("a dog sitting", "a car parked"); before one it describes
        # it ("a smiling man", "a red-haired woman").
        if lowered in _PHRASE_ENDS or (phrase and lowered.endswith(("ing", "ed")) and len(lowered) > 4):
            break
        phrase.append(lowered)
    return phrase[-1] if phrase else None


def noun_in_class_prompt(class_prompt: str, trigger_word: str | None) -> str | None:
    """The noun `class_prompt` names: after its framing ("a photo of") and its article, within its first clause."""
    text = class_prompt.replace(TRIGGER_PLACEHOLDER, trigger_word or " ").split(",")[0]
    framing = _FRAMING.search(text)
    if framing is not None:
        text = text[framing.end() :]
    words = [word for word in _WORD.findall(text) if word != trigger_word]
    return _head_noun(words)


def noun_after_trigger(instance_prompt: str, trigger_word: str) -> str | None:
    """The noun of the phrase right after the trigger word in `instance_prompt` ("a photo of TOK dog" → dog),
    with `[trigger]` replaced first; None where the trigger word is absent or nothing names a noun after it."""
    text = instance_prompt.replace(TRIGGER_PLACEHOLDER, trigger_word)
    found = re.search(rf"(?<!\w){re.escape(trigger_word)}(?!\w)", text)
    if found is None:
        return None
    return _head_noun(_WORD.findall(text[found.end() :].split(",")[0]))
