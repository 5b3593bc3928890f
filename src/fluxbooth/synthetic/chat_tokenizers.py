"""The FLUX.2 text encoders' tokenizers, built offline: byte-level BPE with the special tokens and chat
templates the FLUX.2 pipelines use.

FLUX.2 [klein] prompts Qwen3 through its chat template (one user turn, generation prompt, thinking off);
FLUX.2 [dev] prompts Mistral-Small-3 through its template (a system prompt and a user turn whose content is
a list of typed parts). Neither vocabulary can be downloaded here, so these keep the specials and the chat
format and have every byte as a token (any prompt tokenises without an unknown token); the merges join a
few prompt words (tiny) or lowercase letters breadth-first until the published vocabulary size (full), so
ordinary words split differently from the real tokenizers'. Sequence lengths after padding are what
training sees.
"""

from __future__ import annotations

import string
from collections.abc import Iterable
from typing import Any

from fluxbooth.synthetic.tiny import bytes_to_unicode

QWEN_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
QWEN_ADDED = ("<think>", "</think>")
# Qwen3's template for what the pipeline sends: user turns, then the assistant's turn with thinking off.
QWEN_CHAT_TEMPLATE = (
    "{%- for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}"
)
# Tekken's first special tokens, in its order ([IMG] is id 10, Mistral3's image_token_index).
MISTRAL_SPECIALS = (
    "<unk>",
    "<s>",
    "</s>",
    "[INST]",
    "[/INST]",
    "[AVAILABLE_TOOLS]",
    "[/AVAILABLE_TOOLS]",
    "[TOOL_RESULTS]",
    "[/TOOL_RESULTS]",
    "[TOOL_CALLS]",
    "[IMG]",
    "<pad>",
    "[IMG_BREAK]",
    "[IMG_END]",
    "[PREFIX]",
    "[MIDDLE]",
    "[SUFFIX]",
    "[SYSTEM_PROMPT]",
    "[/SYSTEM_PROMPT]",
)
MISTRAL_CHAT_TEMPLATE = (
    "{{ bos_token }}{%- for message in messages %}"
    "{%- if message['content'] is string %}{%- set text = message['content'] %}"
    "{%- else %}{%- set text = message['content'] | selectattr('type', 'equalto', 'text') | map(attribute='text') | join('') %}{%- endif %}"
    "{%- if message['role'] == 'system' %}{{ '[SYSTEM_PROMPT]' + text + '[/SYSTEM_PROMPT]' }}"
    "{%- elif message['role'] == 'user' %}{{ '[INST]' + text + '[/INST]' }}"
    "{%- else %}{{ text + eos_token }}{%- endif %}{%- endfor %}"
)
# Words merged whole in the tiny tokenizers, so prompts (and FLUX.2 [dev]'s long system prompt) stay short.
TINY_WORDS = (
    "a",
    "an",
    "the",
    "of",
    "in",
    "on",
    "and",
    "to",
    "with",
    "photo",
    "sks",
    "dog",
    "person",
    "cat",
    "style",
    "image",
    "user",
    "assistant",
    "system",
    "you",
    "are",
    "for",
    "that",
    "is",
    "it",
    "as",
    "be",
    "or",
    "by",
    "descriptions",
    "description",
    "generate",
    "generating",
    "images",
    "based",
    "textual",
    "prompts",
)


def _merge_word(word: str, tokens: dict[str, int], merges: list[tuple[str, str]]) -> None:
    pieces = list(word)
    while len(pieces) > 1:
        merged = pieces[0] + pieces[1]
        if merged not in tokens:
            merges.append((pieces[0], pieces[1]))
            tokens[merged] = len(tokens)
        pieces = [merged] + pieces[2:]


def byte_level_vocabulary(
    first: Iterable[str], words: Iterable[str], size: int | None
) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """`first` (special tokens) at ids 0.., the 256 byte characters, the merges of `words` (each also with
    the leading-space marker `Ġ`), then lowercase pairs, triples, ... breadth-first until `size` tokens."""
    tokens: dict[str, int] = {}
    for token in (*first, *bytes_to_unicode().values()):
        tokens.setdefault(token, len(tokens))
    merges: list[tuple[str, str]] = []
    for word in words:
        _merge_word(word, tokens, merges)
        _merge_word("Ġ" + word, tokens, merges)
    if size is not None:
        for letter in string.ascii_lowercase:
            _merge_word("Ġ" + letter, tokens, merges)
    prefixes = list(string.ascii_lowercase)
    while size is not None and len(tokens) < size:
        longer = []
        for prefix in prefixes:
            for letter in string.ascii_lowercase:
                for left in (prefix, "Ġ" + prefix):
                    if len(tokens) < size and left + letter not in tokens:
                        merges.append((left, letter))
                        tokens[left + letter] = len(tokens)
                longer.append(prefix + letter)
        prefixes = longer
    return tokens, merges


def _backend(vocabulary: dict[str, int], merges: list[tuple[str, str]], unknown: str | None) -> Any:
    # Deferred with the transformers imports below: only building a tokenizer needs the tokenizer libraries.
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tokenizer = Tokenizer(models.BPE(vocab=vocabulary, merges=merges, unk_token=unknown))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def qwen_tokenizer(vocabulary_size: int | None) -> Any:
    """A Qwen2TokenizerFast with Qwen3's specials and chat template; `vocabulary_size` None: tiny."""
    # Deferred: the synthetic package imports without torch, which transformers imports.
    from transformers import Qwen2TokenizerFast

    size = None if vocabulary_size is None else vocabulary_size - len(QWEN_SPECIALS) - len(QWEN_ADDED)
    vocabulary, merges = byte_level_vocabulary((), TINY_WORDS, size)
    tokenizer = Qwen2TokenizerFast(vocab=vocabulary, merges=merges, model_max_length=131072)
    tokenizer.add_special_tokens({"additional_special_tokens": list(QWEN_SPECIALS[1:])})
    tokenizer.add_tokens(list(QWEN_ADDED))
    tokenizer.chat_template = QWEN_CHAT_TEMPLATE
    return tokenizer


def mistral_tokenizer(vocabulary_size: int | None) -> Any:
    """A byte-level tokenizer with Tekken's first specials and Mistral-Small-3's chat format for text."""
    # Deferred: the synthetic package imports without torch, which transformers imports.
    from transformers import PreTrainedTokenizerFast

    vocabulary, merges = byte_level_vocabulary(MISTRAL_SPECIALS, TINY_WORDS, vocabulary_size)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=_backend(vocabulary, merges, "<unk>"),
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        model_max_length=131072,
    )
    tokenizer.add_special_tokens(
        {"additional_special_tokens": [token for token in MISTRAL_SPECIALS if token[0] == "["]}
    )
    tokenizer.chat_template = MISTRAL_CHAT_TEMPLATE
    return tokenizer
