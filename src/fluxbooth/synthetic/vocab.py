"""Tokenizers with the full-size vocabularies (CLIP-L: 49,408 entries; T5: 32,000 pieces + 100
extra ids), built offline.

The real vocabularies (openai/clip-vit-large-patch14's BPE merges, google/t5-v1_1-xxl's SentencePiece
model) cannot be downloaded here, so these keep their sizes, special tokens and token ids for the
specials, with synthetic entries in between: every byte (CLIP) and every printable ASCII character
(T5) is a token, so any prompt tokenises without an unknown token, but the splits of ordinary words
differ from the real tokenizers'. Sequence lengths (77 and 512 after padding) are what training sees,
so memory and speed are those of the real model.
"""

from __future__ import annotations

import string
from typing import Any

from fluxbooth.synthetic.tiny import CLIP_MAX_LENGTH, T5_MAX_LENGTH, bytes_to_unicode

CLIP_VOCAB_SIZE = 49408
T5_PIECES = 32000
T5_EXTRA_IDS = 100


def clip_vocabulary() -> tuple[dict[str, int], list[tuple[str, str]]]:
    """CLIP's layout: 256 byte characters, the same with `</w>`, merged tokens, then <|startoftext|>
    (49406) and <|endoftext|> (49407). The merges join lowercase letters breadth-first (all two-letter
    pieces, then three, ...) until the vocabulary is full."""
    alphabet = list(bytes_to_unicode().values())
    tokens = alphabet + [character + "</w>" for character in alphabet]
    merges: list[tuple[str, str]] = []
    wanted = CLIP_VOCAB_SIZE - 2 - len(tokens)
    prefixes = list(string.ascii_lowercase)
    while len(merges) < wanted:
        longer = []
        for prefix in prefixes:
            for letter in string.ascii_lowercase:
                for right, merged in ((letter, prefix + letter), (letter + "</w>", prefix + letter + "</w>")):
                    if len(merges) == wanted:
                        break
                    merges.append((prefix, right))
                    tokens.append(merged)
                longer.append(prefix + letter)
        prefixes = longer
    tokens += ["<|startoftext|>", "<|endoftext|>"]
    return {token: index for index, token in enumerate(tokens)}, merges


def t5_vocabulary() -> list[tuple[str, float]]:
    """T5's layout: <pad>=0, </s>=1, <unk>=2, then 31,997 Unigram pieces (characters, `▁`-prefixed
    characters, then `▁`-prefixed lowercase pairs and triples), scores falling with length."""
    pieces: list[tuple[str, float]] = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    for code in range(33, 127):
        pieces.append((chr(code), -6.0))
        pieces.append(("▁" + chr(code), -5.5))
    letters = string.ascii_lowercase
    combinations = (first + second for first in letters for second in letters)
    triples = (first + second + third for first in letters for second in letters for third in letters)
    for text in (*combinations, *triples):
        if len(pieces) == T5_PIECES:
            break
        pieces.append(("▁" + text, -4.0 - 0.5 * len(text)))
        if len(pieces) < T5_PIECES:
            pieces.append((text, -5.0 - 0.5 * len(text)))
    return pieces


def full_size_tokenizers() -> dict[str, Any]:
    """{"tokenizer": CLIP-L-sized CLIPTokenizer, "tokenizer_2": T5-sized T5TokenizerFast}."""
    # Deferred: the synthetic package imports without torch, which transformers imports.
    from transformers import CLIPTokenizer, T5TokenizerFast

    vocabulary, merges = clip_vocabulary()
    clip = CLIPTokenizer(vocab=vocabulary, merges=merges, model_max_length=CLIP_MAX_LENGTH, pad_token="<|endoftext|>")
    t5 = T5TokenizerFast(vocab=t5_vocabulary(), extra_ids=T5_EXTRA_IDS, model_max_length=T5_MAX_LENGTH)
    return {"tokenizer": clip, "tokenizer_2": t5}
