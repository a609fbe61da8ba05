"""A small byte-level BPE tokenizer that `mlx_lm.load` (through transformers) accepts.

The fixtures cannot download a real tokenizer, so we train one, deterministically, on a short
built-in text. Byte-level means every string round-trips, which the equality tests rely on.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
EOS_TOKEN = "<|im_end|>"

# ChatML, the template most MoE chat models use.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_TRAINING_TEXT = """\
A mixture of experts model routes every token to a few experts out of many.
The router scores each expert and keeps the top k; the rest of the weights stay idle.
Households have several computers, and each one has a disk and some memory.
def fetch(expert, layer): return cache.get((layer, expert)) or hub.download(layer, expert)
for layer in range(92): hidden = attention(hidden); hidden = hidden + moe(hidden)
The quick brown fox jumps over the lazy dog. 0 1 2 3 4 5 6 7 8 9 10 100 1000
Once upon a time there was a small laptop that wanted to run a very large model.
user: hello! assistant: hi, how can I help you today? user: tell me a story.
"""


def build_tokenizer(vocab_size: int, special_tokens: Iterable[str] = ()) -> Tokenizer:
    """Train the tokenizer; the same `vocab_size` always gives the same vocabulary."""
    return train_tokenizer(_TRAINING_TEXT.splitlines() * 4, vocab_size, special_tokens)


def train_tokenizer(lines: Iterable[str], vocab_size: int, special_tokens: Iterable[str] = ()) -> Tokenizer:
    """Train a byte-level BPE with our special tokens (and `special_tokens`, a chat format's markup)
    on `lines` (the same lines, the same vocabulary)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[*SPECIAL_TOKENS, *special_tokens],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(lines, trainer=trainer)
    return tok


def write_tokenizer_files(out: Path, vocab_size: int) -> int:
    """Write tokenizer.json and tokenizer_config.json; return the id of the EOS token."""
    return save_tokenizer(out, build_tokenizer(vocab_size))


def save_tokenizer(out: Path, tok: Tokenizer) -> int:
    """Write `tok` as tokenizer.json plus our tokenizer_config.json (ChatML); return the EOS id."""
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": EOS_TOKEN,
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "model_max_length": 4096,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    eos = tok.token_to_id(EOS_TOKEN)
    if eos is None:
        raise ValueError(f"the tokenizer has no {EOS_TOKEN!r}")
    return eos
