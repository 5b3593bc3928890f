"""A captioner's raw text made into a training caption, by code (pure Python, no torch).

The vision-language captioner describes each training photo; what the caption says about the subject is decided
here, because the failures users of hosted FLUX trainers report are the model's: generic captions, the trigger
word forgotten, and a person's face, hair, skin, age or ethnicity described. A trait the caption names stays tied
to those words instead of the trigger word, so the LoRA learns it less and prompts with the trigger alone lose it.

`finish_caption` makes `"{trigger} {class noun}, {description}"`:

1. The model's preambles go ("The image shows", "In this photo,", "A photo of", "Here is"...). The framing words
   of one ("A close-up photo of", "A black and white portrait of") are camera words and stay, first in the
   description.
2. The model's own subject phrase at the start goes ("a young woman", "a golden retriever", "the subject"): the
   code's subject takes its place. The whole phrase goes, its adjectives with it, for every subject type, so
   "a brown dog lying on a sofa" becomes "sks dog, lying on a sofa": the look the phrase gives the subject is
   the trigger word's to carry. A colour elsewhere ("a dog with brown fur", "next to a brown cushion") stays for
   pets and objects. Only an expression or mood adjective of the phrase ("a smiling woman") stays, being what
   this one photo shows rather than what the subject looks like. The match is conservative: an article, up to
   MAX_SUBJECT_ADJECTIVES words, a noun of the subject's kind (or the class noun), then something a sentence
   goes on with (punctuation, a preposition, a verb); "a dog bed" or "a man's hand" is left as written.
3. For persons (subject type "person" or "auto", which may be one) the identity words go: hair, eyes, skin, face,
   facial hair, age, ethnicity and build (the IDENTITY_RULES groups). Facial hair is among them: like a
   hairstyle it is part of how this person looks across the photos, and left in the caption it would stay with
   the word "beard" rather than the trigger word; a user who wants it off can still prompt "clean-shaven".
   Pets and objects keep every colour and breed word past their subject phrase.
4. The text is tidied: whitespace collapsed, commas doubled by removals merged, leading "and"/"is"/commas and a
   trailing period dropped, the first letter lowercased (it follows a comma), and the description cut at a word
   before MAX_DESCRIPTION_CHARS. A leading "with" goes only when nothing follows it: "sks dog, with a red collar"
   reads as the model meant it, "sks dog, a red collar" does not.

The caption is NFC, as `fluxbooth.contract.captions.contains_word` compares, so the trigger word is found in it.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Iterable

SUBJECT_TYPES = ("person", "pet", "object", "auto")
# "auto" may be a person: a person's traits left in the caption cost more likeness than a pet's lost colour word.
IDENTITY_FILTERED_TYPES = frozenset({"person", "auto"})

# Long enough for a full Qwen description (96 tokens at most), short enough that a runaway one cannot bury the
# subject: FLUX's CLIP encoder reads the first 77 tokens only, its T5 encoder 512.
MAX_DESCRIPTION_CHARS = 300
# More words than this before the subject noun is no longer a subject phrase but a sentence the code cannot read.
MAX_SUBJECT_ADJECTIVES = 4
# The model writes at most 96 tokens (about 500 characters); a longer text (a runaway model's) is cut to this
# before the patterns run, which bounds their time and still leaves far more than the description's cap.
MAX_RAW_CHARS = 2000
# Preambles come stacked ("Sure! Here is a caption: The image shows..."), never deeper than this.
MAX_PREAMBLES = 6

_START = r"(?<![\w-])"  # a word starts here (a hyphen joins words: "slim-fit" is no "slim")
_END = r"(?![\w-])"


def _words(text: str) -> tuple[str, ...]:
    """The comma-separated entries of `text`: a word list written as one string stays a few lines long."""
    return tuple(word.strip() for word in text.split(",") if word.strip())


def _alternation(words: Iterable[str]) -> str:
    """A regex matching any of `words`, the longest first; a space or hyphen in one matches either."""
    escaped = (re.escape(word) for word in sorted(set(words), key=len, reverse=True))
    return "(?:" + "|".join(word.replace(r"\ ", r"[\s-]+").replace(r"\-", r"[\s-]?") for word in escaped) + ")"


# The model's openers, never part of the description. Each is anchored at the start and tried again on what
# follows, as they come stacked.
_IMAGE = r"(?:image|photo|photograph|picture|pic|shot|snapshot|scene|frame|screenshot)"
_PREAMBLE_END = rf"{_END}[\s,:;.!-]*"
PREAMBLES = tuple(
    re.compile(rf"^(?:{body}){_PREAMBLE_END}", re.IGNORECASE)
    for body in (
        r"sure|certainly|of\s+course|okay|ok",
        r"here(?:'s|’s|\s+is|\s+are)(?:\s+(?:a|an|the)\s+(?:[\w-]+\s+)?(?:caption|description)"
        rf"(?:\s+(?:of|for)\s+(?:the|this|your)\s+{_IMAGE})?)?",
        r"(?:caption|description)\s*:",
        rf"(?:in|within|from)\s+(?:the|this)\s+{_IMAGE}\s*,?(?:\s*(?:(?:we|you)\s+(?:can\s+)?see|there\s+(?:is|are)))?",
        rf"(?:the|this)\s+{_IMAGE}\s+(?:(?:also|clearly)\s+)?(?:shows|depicts|captures|features|presents|displays"
        r"|portrays|showcases|illustrates|contains|highlights|is\s+of|is)",
        r"(?:this|it)\s+is",
        r"there\s+(?:is|are)|(?:we|you)\s+(?:can\s+)?see",
        r"(?:shown|pictured|depicted|seen)(?:\s+here)?\s+(?:is|are)",
    )
)
# Camera and style words that may open a framing preamble ("a close-up photo of"): kept, as the caption's
# camera words are.
FRAMING_WORDS = _words(
    "close-up, closeup, black, white, and, color, colour, candid, professional, high-quality, high, quality, "
    "detailed, vintage, studio, outdoor, indoor, low-light, full-body, full-length, half-body, upper-body, medium, "
    "wide, wide-angle, low-angle, angle, side, side-view, profile, portrait, selfie, cropped, blurry, sharp, "
    "digital, film, dslr, realistic, natural, amateur, smartphone, phone, overhead, top-down, aerial, soft-focus, "
    "bright, moody, casual, formal, headshot"
)
# Generic words for an image: a framing preamble made only of one ("a photo of") keeps nothing.
_GENERIC_KINDS = frozenset(_words("photo, photograph, picture, image"))
FRAMED_PREAMBLE = re.compile(
    rf"^(?:(?:a|an|the)\s+)?(?P<framing>(?:{_alternation(FRAMING_WORDS)}[\s-]+)*)"
    r"(?P<kind>photo|photograph|picture|image|shot|snapshot|portrait|close-up|closeup|selfie|headshot)"
    rf"\s+(?:of|showing|featuring|depicting|capturing){_PREAMBLE_END}",
    re.IGNORECASE,
)
# Quotes and markdown the model may wrap its answer in.
_WRAPPING = re.compile(r"^[\s\"'“”‘’*`#>]+|[\s\"'“”‘’*`]+$")
_MARKDOWN = re.compile(r"[*`]+")

# The nouns a subject phrase may end in, by subject type; the class noun is added to each.
PERSON_NOUNS = _words(
    "man, woman, person, boy, girl, guy, lady, child, kid, individual, people, men, women, gentleman, teenager, "
    "teen, adult, subject"
)
PET_NOUNS = _words(
    "dog, cat, puppy, kitten, pet, animal, retriever, terrier, spaniel, shepherd, poodle, bulldog, labrador, "
    "husky, beagle, corgi, dachshund, chihuahua, pug, collie, tabby, rabbit, bunny, hamster, parrot, bird, horse, "
    "pony, subject"
)
OBJECT_NOUNS = _words("object, item, product, subject")
_NOUNS_BY_TYPE = {
    "person": PERSON_NOUNS,
    "pet": PET_NOUNS,
    "object": OBJECT_NOUNS,
    "auto": PERSON_NOUNS + PET_NOUNS + OBJECT_NOUNS,
}
# Expression and mood: what one photo shows, not what the subject looks like, so kept from the subject phrase.
KEPT_SUBJECT_ADJECTIVES = frozenset(
    _words(
        "smiling, laughing, grinning, happy, cheerful, joyful, serious, pensive, thoughtful, surprised, sad, "
        "relaxed, calm, confident, sleeping, sleepy, playful, curious, alert, excited, focused, shy"
    )
)
# Words that cannot be an adjective of the subject: meeting one, the phrase is a sentence and is left alone.
ADJECTIVE_STOPS = frozenset(
    _words(
        "a, an, the, this, that, these, those, his, her, their, its, my, our, your, with, without, in, on, at, of, "
        "by, for, from, to, into, near, next, under, over, behind, beside, against, through, while, as, like, and, "
        "or, but, is, are, was, were, has, have, who, which, whose, wearing, holding"
    )
)
_LEADING_ARTICLE = re.compile(r"^(?:a|an|the|this|one)\s+", re.IGNORECASE)
_PHRASE_WORD = re.compile(r"([\w'’-]+)(?:\s*,\s*|\s+)")
# What may follow the subject noun when it is one: the sentence goes on (or ends). Anything else ("a dog bed",
# "a man's hand") means the noun was part of another phrase.
_CONTINUES = re.compile(
    r"\s*(?:$|[,.;:!?)]|(?:with|without|who|that|which|is|are|was|were|has|have|in|on|at|by|near|next|beside"
    r"|behind|under|over|against|inside|outside|from|of|and|or|while|as|[\w'-]{2,}ing|[\w'-]{3,}ed|[\w'-]{3,}s)(?![\w'-]))",
    re.IGNORECASE,
)

# --- The identity deny-list (persons only) ---------------------------------------------------------------------
# Each group names a trait that is the same in every photo of the person: captioned, it is learnt as the
# caption's word instead of the trigger word's look. A group's descriptors only count before one of its nouns, so
# "blue" goes from "blue eyes" and stays in "a blue dress", and "with her eyes closed" (a pose) stays.
_POSSESSIVE = r"(?:her|his|their)"
_CONNECTORS = r"(?:(?:who|she|he|they)\s+)?(?:with|and|has|have|having|sporting)"

# Hair colour, length and style: the most-captioned identity trait, and one the photos share.
HAIR_DESCRIPTORS = _words(
    "black, brown, blonde, blond, golden, red, auburn, ginger, copper, chestnut, brunette, grey, gray, white, "
    "silver, salt-and-pepper, platinum, sandy, strawberry, dark, light, pink, blue, purple, green, dyed, "
    "highlighted, long, short, shoulder-length, medium-length, chin-length, waist-length, cropped, curly, wavy, "
    "straight, frizzy, coily, kinky, messy, tousled, thick, thin, thinning, fine, braided, slicked-back, spiky, "
    "loose, flowing, shiny, voluminous, neat, natural, receding, styled, side-swept, swept-back"
)
HAIRSTYLES = _words(
    "ponytail, pigtails, braids, braid, bun, bangs, curls, afro, dreadlocks, dreads, bob, updo, mohawk, cornrows, "
    "buzz cut, crew cut, haircut, hairstyle, hairdo, bald head, shaved head"
)
_HAIR_TAIL = (
    r"(?:\s+(?:tied|pulled|swept|slicked|styled|brushed)\s+(?:back|up|to\s+(?:one|the)\s+side)"
    r"|\s+in\s+(?:a|an|two)\s+(?:[\w-]+\s+)?(?:bun|buns|ponytail|ponytails|braid|braids|updo|knot|pigtails))"
)
# Facial hair: as much part of the person's look across the photos as the hairstyle (the module's docstring).
BEARD_DESCRIPTORS = _words(
    "full, thick, bushy, short, long, neat, neatly, trimmed, well-groomed, groomed, scruffy, patchy, light, heavy, "
    "dark, black, brown, grey, gray, white, red, ginger, blonde, salt-and-pepper, slight, faint, stubbly, designer"
)
BEARD_NOUNS = _words("beard, moustache, mustache, goatee, stubble, sideburns, facial hair, five o'clock shadow")
# Eye colour and shape; descriptors are required, so "with her eyes closed" (a pose) is kept.
EYE_DESCRIPTORS = _words(
    "blue, green, brown, hazel, grey, gray, dark, light, amber, deep, piercing, almond-shaped, hooded, deep-set, "
    "striking"
)
EYE_NOUNS = _words("eyes, eye colour, eye color")
# Skin tone: one of the traits the captioner names most, and an ethnicity proxy.
SKIN_DESCRIPTORS = _words(
    "fair, pale, light, dark, olive, tan, tanned, brown, black, white, porcelain, ebony, golden, bronzed, medium, "
    "deep, freckled, smooth, clear, rosy, sun-kissed"
)
SKIN_NOUNS = _words("skin tone, skintone, skin, complexion")
# Face shape and features.
FACE_DESCRIPTORS = _words(
    "round, oval, square, heart-shaped, angular, chiseled, chiselled, narrow, long, full, thin, thick, bushy, "
    "arched, defined, strong, sharp, high, prominent, soft, delicate, pointed, button, small, large, big, wide, "
    "broad, straight, aquiline, rosy, plump, chubby, youthful, wrinkled"
)
FACE_NOUNS = _words("face, cheekbones, jaw, jawline, chin, eyebrows, brows, lips, nose, forehead, cheeks")
FACE_MARKS = _words("freckles, dimples, wrinkles, moles, birthmark")
# Build: body shape is the person's across the photos as much as the face is.
BUILD_DESCRIPTORS = _words(
    "slim, slender, athletic, muscular, average, medium, stocky, heavy, large, small, thin, lean, petite, curvy, "
    "sturdy, strong, slight, broad, fit, toned"
)
BUILD_NOUNS = _words("build, figure, physique, frame, body type")
# Ethnicity words that, in a photo's caption, name a person's ancestry whatever follows them: removed anywhere.
ETHNICITY_WORDS = _words(
    "Caucasian, Hispanic, Latina, Latino, Latinx, African American, East Asian, South Asian, Southeast Asian, "
    "Central Asian, West Asian, Asian, biracial, multiracial, mixed-race, Eurasian"
)
# Nationality and colour words that also name clothing, food, places and objects ("an Indian saree", "a Japanese
# garden", "a white wall"): removed only before a person noun ("an Indian woman") or as a descent phrase.
NATIONALITY_WORDS = _words(
    "Indian, Chinese, Japanese, Korean, Vietnamese, Thai, Filipino, Filipina, Indonesian, Malaysian, Pakistani, "
    "Bangladeshi, Arab, Arabic, Persian, Turkish, Middle Eastern, African, Nigerian, Ethiopian, Kenyan, European, "
    "Scandinavian, Nordic, Slavic, Russian, Italian, Spanish, French, German, British, Irish, Scottish, Greek, "
    "Mexican, Brazilian, Colombian, American, Canadian, Australian, Native American, Indigenous, Black, White, "
    "Brown"
)
# Age and build words that also describe things ("a tall tree", "an old car", "short sleeves"): removed only
# before a person noun.
PERSON_ADJECTIVES = _words("tall, short, thin, lean, athletic, old, older, aged, senior, mature")
# Words that only ever describe the person's look: removed anywhere in a person's caption.
IDENTITY_WORDS = _words(
    "blonde, blond, brunette, redhead, redheaded, bald, balding, bearded, clean-shaven, unshaven, mustachioed, "
    "freckled, young, younger, youthful, elderly, middle-aged, teenage, teenaged, adolescent, slim, slender, "
    "skinny, muscular, overweight, obese, chubby, plump, petite, curvy, stocky, heavyset, lanky, broad-shouldered, "
    "well-built, full-figured, plus-size, plus-sized"
)
# Age, as a phrase ("in her early thirties", "30-year-old", "who appears to be 45 years old"): the same in
# every photo of the person, and a guess of the model's besides.
_AGE_PHRASE = (
    r"(?:(?:who\s+)?(?:is|appears\s+to\s+be|appearing\s+to\s+be|seems\s+to\s+be|looks|looking)\s+)?"
    r"(?:(?:about|around|approximately|roughly|likely|probably|perhaps)\s+)?"
    r"(?:in\s+(?:her|his|their)\s+(?:(?:early|mid|late)[\s-]?)?"
    r"(?:teens|twenties|thirties|forties|fifties|sixties|seventies|eighties|nineties|\d0'?s)"
    r"|(?:aged\s+)?\d{1,3}(?:\s*-\s*|\s+)years?(?:\s*-\s*|\s+)old|aged\s+\d{1,3})"
)
_ANCESTRY = _alternation(ETHNICITY_WORDS + NATIONALITY_WORDS)
_DESCENT_PHRASE = (
    rf"(?:of|with)\s+(?:(?:a|an)\s+)?{_ANCESTRY}(?:(?:\s+and\s+|\s+or\s+|\s*/\s*|[\s-]+){_ANCESTRY})*"
    r"\s+(?:descent|heritage|origin|ethnicity|background|appearance|features|roots|look)"
)
_PERSON_AHEAD = (
    rf"(?=(?:[\s,]+(?!{_alternation(ADJECTIVE_STOPS)}{_END})[\w'-]+)?[\s,]+{_alternation(PERSON_NOUNS)}{_END})"
)
# At most this many descriptors before a trait's noun: no caption piles up more, and the bound keeps each
# pattern's work at one position constant, so a runaway text costs linear time.
MAX_DESCRIPTORS = 6
_SOME, _ANY = f"{{1,{MAX_DESCRIPTORS}}}", f"{{0,{MAX_DESCRIPTORS}}}"
# A removed word takes its comma or "and" along: "a young, smiling woman" is "a smiling woman".
_WORD_TAIL = r"(?:\s*,(?=\s)|\s+and(?=\s))?"


def _descriptors(words: Iterable[str]) -> str:
    """One of `words` followed by a space, comma, "and" or hyphen ("long, " "dark-" "brown and "), to repeat."""
    return rf"(?:{_alternation(words)}(?:\s*,\s*|\s+and\s+|[\s-]+))"


def _feature_rules(descriptors: str, nouns: str, free_nouns: str = "(?!)") -> list[tuple[str, str]]:
    """The removals for one trait: "with long brown hair" and a bare "long brown hair" go, "her long brown hair"
    keeps "her hair". `nouns` need a descriptor; `free_nouns` ("a ponytail", "a beard") are the trait alone."""
    trait = rf"(?:{descriptors}{_SOME}{nouns}|{descriptors}{_ANY}{free_nouns})"
    return [
        (rf"{_CONNECTORS}\s+(?:(?:{_POSSESSIVE}|a|an)\s+)?{trait}", ""),
        (rf"({_POSSESSIVE})\s+{descriptors}{_SOME}({nouns}|{free_nouns})", r"\1 \2"),
        (rf"{descriptors}{_SOME}(?:{nouns}|{free_nouns})", ""),
    ]


def _identity_rules() -> tuple[tuple[re.Pattern[str], str], ...]:
    """Every identity removal, phrases before words (so "with long blonde hair" goes whole, not as "blonde"), and
    the words that need a person noun after them last, once the words between have gone."""
    hair_nouns = rf"(?:hair|hairline)(?:{_HAIR_TAIL})?"
    hair_free = rf"(?:(?:hair|hairline){_HAIR_TAIL}|{_alternation(HAIRSTYLES)})"
    rules = [(_AGE_PHRASE, ""), (_DESCENT_PHRASE, "")]
    rules += _feature_rules(_descriptors(HAIR_DESCRIPTORS), hair_nouns, hair_free)
    rules += _feature_rules(_descriptors(BEARD_DESCRIPTORS), "(?!)", _alternation(BEARD_NOUNS))
    rules += _feature_rules(_descriptors(EYE_DESCRIPTORS), _alternation(EYE_NOUNS))
    rules += _feature_rules(_descriptors(SKIN_DESCRIPTORS), _alternation(SKIN_NOUNS))
    rules += _feature_rules(_descriptors(FACE_DESCRIPTORS), _alternation(FACE_NOUNS), _alternation(FACE_MARKS))
    build = rf"{_descriptors(BUILD_DESCRIPTORS)}{_SOME}{_alternation(BUILD_NOUNS)}"
    rules += [
        (rf"(?:with|of|has|having)\s+(?:(?:a|an)\s+)?{build}", ""),
        (r"[\w]+(?:-[\w]+)*-(?:haired|skinned)" + _WORD_TAIL, ""),
        (rf"{_alternation(EYE_DESCRIPTORS)}-eyed" + _WORD_TAIL, ""),
        (r"(?:round|oval|square|freckle|baby|moon|fresh)-faced" + _WORD_TAIL, ""),
        (r"\w+-American" + _WORD_TAIL, ""),
        (_alternation(ETHNICITY_WORDS + IDENTITY_WORDS) + _WORD_TAIL, ""),
        (_alternation(NATIONALITY_WORDS + PERSON_ADJECTIVES) + _WORD_TAIL + _PERSON_AHEAD, ""),
    ]
    return tuple(
        (re.compile(rf"{_START}(?:{pattern}){_END}", re.IGNORECASE), replacement) for pattern, replacement in rules
    )


IDENTITY_RULES = _identity_rules()
# An article a removal left before the wrong sound ("an elderly woman" → "an woman"); lowercase words only, so
# "an MRI" and "a European" (a "yoo" sound) are left as they were.
_AN_BEFORE_CONSONANT = re.compile(r"(?<![\w-])([Aa])n(\s+)(?=[bcdfgjklmnpqrstvwxyz])")
_A_BEFORE_VOWEL = re.compile(r"(?<![\w-])([Aa])(\s+)(?=[ai]|e(?!u)|o(?!n(?:e|ce)(?![a-z])))")

# --- Tidying -----------------------------------------------------------------------------------------------------
_TIDY_RULES = tuple(
    (re.compile(pattern, re.IGNORECASE), replacement)
    for pattern, replacement in (
        (r"\s+", " "),
        (r"\(\s*\)", ""),  # a parenthesis emptied by a removal
        (r"\s+([,.;:!?])", r"\1"),
        (r",(?:\s*,)+", ","),
        (r",\s*([.;:!?])", r"\1"),
        (r"([.;:!?])(?:\s*[.;:!?])+", r"\1"),
        (r",(?=[^\s\d])", ", "),  # "smiling,standing"; "1,000" is a number
        (r"([.;:!?])\s*,", r"\1"),
        # A connector a removal left with nothing to connect: "smiling and, wearing".
        (r"\s+(?:and|or|with)(?=\s*(?:[,.;:!?]|$))", ""),
    )
)
# Left at the start by a removal (or by the model: "a man who is standing" → "who is standing").
_LEADING_LEFTOVERS = re.compile(
    r"^(?:[\s,;:.!?-]+|(?:and|or|but|also|who|that|which)\s+"
    r"|(?:is|are|was|were)\s+(?:(?:seen|shown|pictured|depicted|captured)\s+)?"
    rf"|(?:in|from)\s+(?:the|this)\s+{_IMAGE}{_END}"
    r"|with(?=\s*(?:[,.;:!?]|$)))",
    re.IGNORECASE,
)
_TRAILING_LEFTOVERS = re.compile(r"(?:[\s,;:.]+|(?<![\w-])(?:and|or|with|who|is|are))$", re.IGNORECASE)
# Words a cut at MAX_DESCRIPTION_CHARS may leave hanging at the end.
_DANGLING_END = re.compile(
    r"(?:[\s,;:.]+|(?<![\w-])(?:and|or|with|who|is|are|a|an|the|of|in|on|at|to|by|for|from|her|his|their|its"
    r"|while|as|into|next))$",
    re.IGNORECASE,
)


def identity_words_in(text: str) -> list[str]:
    """The identity words and phrases IDENTITY_RULES would remove from `text`, in the order they occur ("with long
    brown hair", "Asian"): for a test, or a warning that a user's own caption describes the person."""
    text = unicodedata.normalize("NFC", text)
    spans = sorted(
        (match.span() for pattern, _ in IDENTITY_RULES for match in pattern.finditer(text) if match.group().strip()),
        key=lambda span: (span[0], -span[1]),
    )
    hits: list[str] = []
    covered = 0
    for start, end in spans:
        if start >= covered:
            hits.append(text[start:end].strip(" ,"))
            covered = end
    return hits


def without_identity_words(text: str) -> str:
    """`text` without the identity words of IDENTITY_RULES, each article before a removal still the right one."""
    for pattern, replacement in IDENTITY_RULES:
        text = pattern.sub(replacement, text)
    text = _AN_BEFORE_CONSONANT.sub(r"\1\2", text)
    return _A_BEFORE_VOWEL.sub(r"\1n\2", text)


def _strip_preambles(text: str) -> tuple[str, str]:
    """`text` without its leading preambles, and the framing words one held ("close-up photo"), or ""."""
    framing = ""
    for _ in range(MAX_PREAMBLES):
        if framed := FRAMED_PREAMBLE.match(text):
            kind = framed.group("kind").lower()
            words = " ".join(word if word.isupper() else word.lower() for word in framed.group("framing").split())
            if not framing and (words or kind not in _GENERIC_KINDS):
                framing = f"{words} {kind}" if words else kind
            text = text[framed.end() :]
            continue
        match = next((found for pattern in PREAMBLES if (found := pattern.match(text))), None)
        if match is None or not match.end():
            break
        text = text[match.end() :]
    return text, framing


def _head_noun_end(text: str, position: int, nouns: tuple[str, ...]) -> int | None:
    """Where the subject noun starting at `position` ends, if one of `nouns` (longest first) starts there."""
    for noun in nouns:
        end = position + len(noun)
        if text[position:end].lower() == noun and (end == len(text) or not (text[end].isalnum() or text[end] in "_-")):
            return end
    return None


def _strip_subject_phrase(text: str, nouns: tuple[str, ...]) -> tuple[list[str], str]:
    """The expression adjectives of `text`'s leading subject phrase, and what follows it; `([], text)` when the text
    does not open with one (the module's docstring, point 2)."""
    article = _LEADING_ARTICLE.match(text)
    if article is None:
        return [], text
    position, adjectives = article.end(), list[str]()
    for _ in range(MAX_SUBJECT_ADJECTIVES + 1):
        end = _head_noun_end(text, position, nouns)
        if end is not None and _CONTINUES.match(text, end):
            return [word.lower() for word in adjectives if word.lower() in KEPT_SUBJECT_ADJECTIVES], text[end:]
        word = _PHRASE_WORD.match(text, position)
        if word is None or word.group(1).lower() in ADJECTIVE_STOPS:
            break
        adjectives.append(word.group(1))
        position = word.end()
    return [], text


def _subject_nouns(subject_type: str, class_noun: str) -> tuple[str, ...]:
    """The nouns a subject phrase of this type may end in, the class noun among them, longest first."""
    nouns = {noun.lower() for noun in _NOUNS_BY_TYPE[subject_type]} | ({class_noun.lower()} if class_noun else set())
    return tuple(sorted(nouns, key=len, reverse=True))


def _tidy(text: str) -> str:
    """`text` with the spaces, commas and connectors that removals leave behind gone (module docstring, point 4)."""
    for pattern, replacement in _TIDY_RULES:
        text = pattern.sub(replacement, text)
    previous = None
    while text != previous:
        previous = text
        text = _TRAILING_LEFTOVERS.sub("", _LEADING_LEFTOVERS.sub("", text))
    return text


def _lowercase_first(text: str) -> str:
    """`text` with its first letter lowercased, unless the first word is an acronym ("DSLR")."""
    if text[:1].isupper() and not text[1:2].isupper():
        return text[0].lower() + text[1:]
    return text


def _capped(text: str) -> str:
    """`text` cut at the last word that ends within MAX_DESCRIPTION_CHARS, with no word left hanging."""
    if len(text) <= MAX_DESCRIPTION_CHARS:
        return text
    cut = text[: MAX_DESCRIPTION_CHARS + 1]
    space = cut.rfind(" ")
    text = cut[:space] if space > 0 else text[:MAX_DESCRIPTION_CHARS]
    previous = None
    while text != previous:
        previous = text
        text = _DANGLING_END.sub("", text)
    return text


def describe(raw: str, *, class_noun: str, subject_type: str) -> str:
    """The description part of the caption: `raw` without preambles, subject phrase and (for persons) identity
    words, tidied and capped (the module's docstring); "" when nothing is left."""
    text = " ".join(unicodedata.normalize("NFC", raw)[:MAX_RAW_CHARS].split())
    text = _WRAPPING.sub("", _MARKDOWN.sub("", text))
    text, framing = _strip_preambles(text)
    kept, text = _strip_subject_phrase(text, _subject_nouns(subject_type, class_noun))
    if subject_type in IDENTITY_FILTERED_TYPES:
        text = without_identity_words(text)
    description = _tidy(", ".join(part for part in (framing, *kept, _tidy(text)) if part))
    return _capped(_lowercase_first(description))


def finish_caption(raw: str, *, trigger_word: str | None, class_noun: str, subject_type: str) -> str:
    """`"{trigger} {class noun}, {description}"` from the model's `raw` text; `"{class noun}, {description}"` with
    no trigger word, and no comma or description when nothing of `raw` is left. In NFC, so the trigger word is
    found by `contains_word` in every caption."""
    if subject_type not in SUBJECT_TYPES:
        raise ValueError(f"subject_type must be one of {', '.join(SUBJECT_TYPES)}, not {subject_type!r}")
    noun = " ".join(unicodedata.normalize("NFC", class_noun).split())
    trigger = unicodedata.normalize("NFC", trigger_word) if trigger_word and trigger_word.strip() else ""
    subject = " ".join(part for part in (trigger, noun) if part)
    description = describe(raw, class_noun=noun, subject_type=subject_type)
    return ", ".join(part for part in (subject, description) if part)
