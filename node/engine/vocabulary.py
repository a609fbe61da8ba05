"""The tokenizer's vocabulary as bytes: llguidance's view of a tokenizer, which the grammar
engine masks with (engine/grammar.py) and which gives each token's own bytes.

A token's text is not its bytes: byte-level BPE splits a character outside ASCII over several
tokens (é is two, ✓ three), and each of them alone decodes to U+FFFD. OpenAI's logprobs carry
each token's `bytes` so that a client can join such tokens into the character; the replacement
character's UTF-8 would give it three bytes that are in no text."""

from __future__ import annotations

import functools
import logging
from typing import Any

import llguidance
import llguidance.hf

logger = logging.getLogger(__name__)


@functools.lru_cache(maxsize=8)
def ll_tokenizer(tokenizer: Any) -> llguidance.LLTokenizer:
    """llguidance's view of a tokenizer: made once per tokenizer (the node keeps one).

    Raises:
        ValueError (or llguidance's errors): a tokenizer llguidance cannot read (not a fast one).
    """
    return llguidance.hf.from_tokenizer(getattr(tokenizer, "_tokenizer", tokenizer))


@functools.lru_cache(maxsize=8)
def _bytes_view(tokenizer: Any) -> llguidance.LLTokenizer | None:
    try:
        return ll_tokenizer(tokenizer)
    except Exception as e:  # noqa: BLE001 - any tokenizer llguidance cannot read: tokens' text instead
        logger.warning("tokens' bytes are their text's for this tokenizer (%s: %s)", type(e).__name__, e)
        return None


def token_bytes(tokenizer: Any, token: int) -> bytes:
    """A token's own bytes (a special token's: its text), or its text's UTF-8 where llguidance
    cannot read the tokenizer."""
    view = _bytes_view(tokenizer)
    if (
        view is None or token >= view.vocab_size
    ):  # an id past the tokenizer's (a padded embedding's): no bytes of its own
        return tokenizer.decode([token]).encode("utf-8")
    return view.decode_bytes([token])
