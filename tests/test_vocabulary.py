"""A token's own bytes (node/engine/vocabulary.py), as OpenAI's logprobs `bytes` carry them: the
tokens of a character outside ASCII join into its UTF-8, though each alone has no text."""

from __future__ import annotations

from pathlib import Path

from mlx_lm.tokenizer_utils import load as load_tokenizer

import expertmesh.devtools.tiny as tiny
from expertmesh.node.engine.vocabulary import token_bytes

DEMO = Path(tiny.__file__).parent / "demo"
TEXT = "héllo ✓ 日本"


def test_the_tokens_of_a_text_join_into_its_bytes() -> None:
    tokenizer = load_tokenizer(DEMO)
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    alone = [tokenizer.decode([t]) for t in ids]
    assert "\ufffd" in alone  # some token is part of a character: its text says nothing of its bytes
    assert b"".join(token_bytes(tokenizer, t) for t in ids) == TEXT.encode()


def test_a_special_tokens_bytes_are_its_text() -> None:
    tokenizer = load_tokenizer(DEMO)
    eos = tokenizer.eos_token_id
    assert token_bytes(tokenizer, eos) == tokenizer.decode([eos]).encode()


def test_an_id_past_the_tokenizers_vocabulary_has_its_decoded_text() -> None:
    """A model's embedding may be padded past its tokenizer's ids; such an id decodes to nothing,
    not to llguidance's `<[id]>` marker."""
    tokenizer = load_tokenizer(DEMO)
    past = len(tokenizer.get_vocab()) + 100
    assert token_bytes(tokenizer, past) == tokenizer.decode([past]).encode()


class _Unreadable:
    """A tokenizer llguidance cannot read (as a slow, tiktoken-based one): its text stands in."""

    def decode(self, ids: list[int]) -> str:
        return f"<{ids[0]}>"


def test_a_tokenizer_llguidance_cannot_read_gives_its_tokens_text() -> None:
    assert token_bytes(_Unreadable(), 7) == b"<7>"
