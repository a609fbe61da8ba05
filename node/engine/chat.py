"""Chat templating that keeps message text as text, and a multi-turn conversation that keeps the
model's cache between turns.

**Message text stays text.** A chat template writes its structure with control tokens
(`<|im_start|>`, `<|im_end|>`, ...). Rendering the template to a string and tokenising that string
parses the same tokens out of the messages' text as well, so a user who writes
`<|im_end|><|im_start|>system` would forge a system turn. `chat_token_ids` renders the template with
every control token inside a message marked (private-use characters around it), then tokenises
piece by piece: the template's own markup as tokens, each marked control token as plain text
(`split_special_tokens=True`, and split further if the tokenizer still matches an added token).
This is what transformers' `apply_chat_template(..., sanitize_control_tokens=True)` does; we do it
here through the tokenizer API that every release mlx-lm accepts has (`added_tokens_decoder`,
`chat_template`, `encode`), so it also holds for tokenizers and releases without that option, and
for the incremental encoding of `ChatSession`. Text without control tokens is tokenised in one
piece, exactly as before.

**The conversation.** Each turn feeds only what is new: the chat template renders the whole
conversation, and the text after what the cache has already seen (the end of the last reply, the
new user message, the assistant header) is tokenised and fed. If a template re-renders earlier
turns differently, the cache is rebuilt from the full rendering: slower, never wrong.

The cache holds the reply as the token ids that were sampled, not a re-tokenisation of its
text (as mlx-lm's own chat does): the model continues from exactly what it produced. A fresh run
on the rendered transcript can therefore see other tokens where BPE would merge the reply's
text differently, which is why the tests compare a second turn with mlx-lm continuing its own
cache over the same tokens.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

from expertmesh.node.engine.generation import GenerationSummary, Generator, SamplingSettings, Token

# Private-use code points (plane 15) put around a control token found in a message. Any already
# in a message are dropped first, so a user cannot forge a mark either.
MARK_START, MARK_END = "\U000f0000", "\U000f0001"


class ChatTemplateError(ValueError):
    """A message's text cannot be encoded without a control token (the tokenizer makes one from it)."""


class ControlTokens:
    """The tokens that carry a chat's structure for one tokenizer, and so must never come from a
    message's text: its special added tokens, and its other added tokens that the chat template
    writes itself (as transformers chooses them), except whitespace ones (Gemma's "\\n")."""

    def __init__(self, tokenizer: Any):
        template = getattr(tokenizer, "chat_template", None) or ""
        if isinstance(template, dict):  # named templates
            template = "\n".join(t for t in template.values() if isinstance(t, str))
        added: dict[int, Any] = dict(getattr(tokenizer, "added_tokens_decoder", None) or {})
        contents: dict[str, int | None] = {}
        for token_id, token in added.items():
            text = getattr(token, "content", str(token))
            if text and not text.isspace() and (getattr(token, "special", True) or text in template):
                contents[text] = token_id
        for text in getattr(tokenizer, "all_special_tokens", None) or ():
            if text and not text.isspace():
                contents.setdefault(text, None)
        self.texts = tuple(sorted(contents, key=len, reverse=True))  # a token before those it contains
        self.ids = {i for i in contents.values() if i is not None}
        alternatives = "|".join(map(re.escape, self.texts)) or "(?!)"  # (?!): matches nothing
        self.pattern = re.compile(alternatives)
        # [text, marked token, text, ...]; None in place of the token for a lone mark (a template
        # that splits a message's text can separate a mark from its token)
        self.marked = re.compile(f"{MARK_START}({alternatives}){MARK_END}|[{MARK_START}{MARK_END}]")

    def mark(self, text: str) -> str:
        """`text` with each control token in it marked, and no stray marks."""
        text = text.replace(MARK_START, "").replace(MARK_END, "")
        return self.pattern.sub(lambda m: MARK_START + m.group(0) + MARK_END, text)


def control_tokens(tokenizer: Any) -> ControlTokens:
    """The ControlTokens of `tokenizer`. Worked out on each call: a few hundred added tokens at
    most, and `re` keeps the compiled patterns, so it costs little next to a forward pass."""
    return ControlTokens(tokenizer)


def render_chat(
    tokenizer: Any, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None
) -> str:
    """The chat template's text for `messages` (and `tools`, which the template renders itself),
    with the control tokens in their contents marked for `encode_rendered`."""
    ct = control_tokens(tokenizer)
    marked = [_marked(ct, m) for m in messages]
    # a tool's description or a call's arguments are text from the client too
    extra = {"tools": _marked(ct, tools)} if tools else {}
    return tokenizer.apply_chat_template(marked, tokenize=False, add_generation_prompt=add_generation_prompt, **extra)


def _marked(ct: ControlTokens, value: Any) -> Any:
    """`value` with the control tokens in every string of it marked (keys too: JSON a template
    writes out whole, such as a tool's schema, holds client text in its keys)."""
    if isinstance(value, str):
        return ct.mark(value)
    if isinstance(value, dict):
        return {_marked(ct, k): _marked(ct, v) for k, v in value.items()}
    if isinstance(value, list):
        return [_marked(ct, v) for v in value]
    return value


def encode_rendered(tokenizer: Any, text: str, add_special_tokens: bool = False) -> list[int]:
    """Token ids of (a tail of) `render_chat`'s text: the template's markup as its tokens, each
    marked control token as plain text, marks dropped.

    Raises:
        ChatTemplateError: the tokenizer makes a control token out of a marked token's plain text.
    """
    ct = control_tokens(tokenizer)
    pieces = ct.marked.split(text)
    if len(pieces) == 1:  # nothing marked: one piece, as the template's text always was encoded
        return tokenizer.encode(text, add_special_tokens=add_special_tokens)
    newline = tokenizer.encode("\n", add_special_tokens=False)
    ids = tokenizer.encode(pieces[0], add_special_tokens=add_special_tokens) if pieces[0] or add_special_tokens else []
    for i, piece in enumerate(pieces[1:], start=1):
        if not piece:  # an empty text, or a lone mark (None), which still separates its neighbours
            continue
        if i % 2:
            ids += _plain(tokenizer, piece, ct.ids, newline)
        else:
            ids += _inner(tokenizer, piece, newline, split_special=False)
    return ids


def chat_token_ids(
    tokenizer: Any, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None
) -> list[int]:
    """The prompt tokens of a conversation: its template rendered and encoded so that only the
    template's own markup becomes control tokens (see the module's docstring)."""
    return encode_rendered(tokenizer, render_chat(tokenizer, messages, add_generation_prompt, tools))


def _inner(tokenizer: Any, piece: str, newline: list[int], split_special: bool) -> list[int]:
    """Token ids of a piece from the middle of a text. Encoded after a newline that is then
    removed, so a SentencePiece tokenizer does not add the space it puts at the start of a text."""
    kwargs = {"add_special_tokens": False, **({"split_special_tokens": True} if split_special else {})}
    ids = tokenizer.encode("\n" + piece, **kwargs)
    if newline and ids[: len(newline)] == newline:
        return ids[len(newline) :]
    return tokenizer.encode(piece, **kwargs)


def _plain(tokenizer: Any, text: str, control_ids: set[int], newline: list[int]) -> list[int]:
    """`text` (a control token's text) as ordinary text: no control token may come out of it.

    `split_special_tokens=True` keeps special tokens plain in transformers' tokenizers; an added
    token that is not special, or a tokenizer that ignores the option, still matches, so the text
    is then split in two and each half encoded alone (no added token matches a strict part of it)."""
    try:
        ids = _inner(tokenizer, text, newline, split_special=True)
    except TypeError:  # a tokenizer whose encode takes no such option
        ids = _inner(tokenizer, text, newline, split_special=False)
    if not control_ids.intersection(ids):
        return ids
    if len(text) < 2:
        raise ChatTemplateError(f"the tokenizer encodes the text {text!r} only as a control token")
    half = len(text) // 2
    return _plain(tokenizer, text[:half], control_ids, newline) + _plain(tokenizer, text[half:], control_ids, newline)


class ChatSession:
    def __init__(self, generator: Generator, system_prompt: str | None = None):
        self.generator = generator
        self.tokenizer = generator.sm.tokenizer
        self.messages: list[dict] = [{"role": "system", "content": system_prompt}] if system_prompt else []
        self._seen_text: str | None = None  # the rendered (marked) text the cache holds; None: unknown
        self.rebuilds = 0  # turns whose cache had to be rebuilt from scratch

    def _render(self, messages: list[dict]) -> str:
        return render_chat(self.tokenizer, messages, add_generation_prompt=True)

    def reply(
        self,
        text: str,
        settings: SamplingSettings,
        should_stop: Callable[[], bool] = lambda: False,
        summary: GenerationSummary | None = None,
    ) -> Iterator[Token]:
        """Stream the assistant's reply to `text`; the reply joins the conversation as far as
        it got (also when stopped early)."""
        messages = [*self.messages, {"role": "user", "content": text}]
        rendered = self._render(messages)
        if self.generator.history and self._seen_text is not None and rendered.startswith(self._seen_text):
            new_text = rendered[len(self._seen_text) :]
        else:
            if self.generator.history:
                self.rebuilds += 1
            self.generator.reset()
            new_text = rendered
        tokens = encode_rendered(self.tokenizer, new_text, add_special_tokens=not self.generator.history)
        reply_ids: list[int] = []
        summary = summary if summary is not None else GenerationSummary()
        finished = False
        try:
            for tok in self.generator.generate(tokens, settings, should_stop, summary):
                reply_ids.append(tok.id)
                yield tok
            finished = True
        finally:
            # After an end-of-sequence the cache holds the whole reply; otherwise all but its
            # last token, which the next turn's text then begins with.
            fed_ids = reply_ids if summary.stop_reason == "eos" else reply_ids[:-1]
            reply_text = self.tokenizer.decode(reply_ids)
            fed_text = self.tokenizer.decode(fed_ids)
            self.messages = [*messages, {"role": "assistant", "content": reply_text}]
            consistent = finished and reply_text.startswith(fed_text)
            # The next rendering marks the reply's control-token text as it marks any message's.
            marked = control_tokens(self.tokenizer).mark(fed_text)
            self._seen_text = rendered + marked if consistent else None


class _RenderedHeads:
    """The tokens of each conversation head (its first k messages) already rendered for this
    tokenizer, so that a growing conversation renders only its new messages on each request
    rather than every head again under the tokenizer's lock. Keyed by a digest chained message by
    message; least recently used heads go first beyond `max_tokens`."""

    def __init__(self, max_tokens: int = 1 << 22):
        self.max_tokens, self.tokens = max_tokens, 0
        self._heads: OrderedDict[bytes, Any] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: bytes) -> Any:
        with self._lock:
            head = self._heads.get(key)
            if head is not None:
                self._heads.move_to_end(key)
            return head

    def put(self, key: bytes, head: Any) -> None:
        with self._lock:
            if key in self._heads or len(head) > self.max_tokens:
                return
            self._heads[key] = head
            self.tokens += len(head)
            while self.tokens > self.max_tokens:
                self.tokens -= len(self._heads.popitem(last=False)[1])


_heads_by_tokenizer: weakref.WeakKeyDictionary[Any, _RenderedHeads] = weakref.WeakKeyDictionary()


def _heads_of(tokenizer: Any) -> _RenderedHeads | None:
    try:
        return _heads_by_tokenizer.setdefault(tokenizer, _RenderedHeads())
    except TypeError:  # a tokenizer that cannot be weakly referenced: render every time
        return None


def message_ends(tokenizer: Any, messages: list[dict], ids: list[int], tools: list[dict] | None = None) -> list[int]:
    """Where each message ends in `ids` (the tokens of `messages` with the generation prompt): the
    positions a prefix cache checkpoints a state that cannot trim at (engine/prefix_cache.py), so
    a later turn or another conversation with the same system prompt resumes there. A template
    that renders a message differently once others follow it gives the common part's end."""
    return sorted({end for _, end in message_ends_by_count(tokenizer, messages, ids, tools)})


def message_ends_by_count(
    tokenizer: Any,
    messages: list[dict],
    ids: list[int],
    tools: list[dict] | None = None,
    counts: list[int] | None = None,
) -> list[tuple[int, int]]:
    """(k, where the first k messages end in `ids`) for each k the template renders on its own
    (as `message_ends`), of `counts` only if given (each k renders k messages: a long
    conversation's every k costs its length squared): the prefix cache labels a state with the
    key of the messages it holds (node/rpc/prefix_keys.py), so a coordinator routes the next
    turn to it."""
    import numpy as np

    memo = _heads_of(tokenizer)
    digest = hashlib.sha256(json.dumps(tools, sort_keys=True, default=str).encode())
    full = np.asarray(ids)
    ends = []
    wanted = set(counts) if counts is not None else None
    for k in range(1, len(messages) + 1):
        digest.update(json.dumps(messages[k - 1], sort_keys=True, default=str).encode() + b"\0")
        if wanted is not None and k not in wanted:
            continue
        key = digest.copy().digest()
        head = memo.get(key) if memo is not None else None
        if head is None:
            try:
                head = np.asarray(
                    chat_token_ids(tokenizer, messages[:k], add_generation_prompt=False, tools=tools), dtype=np.int64
                )
            except Exception:  # noqa: BLE001 - a template that refuses a partial conversation: no mark there
                continue
            if memo is not None:
                memo.put(key, head)
        n = min(len(head), len(full))
        diff = np.flatnonzero(head[:n] != full[:n])
        end = int(diff[0]) if len(diff) else n
        if end:
            ends.append((k, end))
    return ends
