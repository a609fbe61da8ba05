"""A multi-turn conversation that keeps the model's cache between turns.

Each turn feeds only what is new: the chat template renders the whole conversation, and the
text after what the cache has already seen (the end of the last reply, the new user message,
the assistant header) is tokenised and fed. If a template re-renders earlier turns differently,
the cache is rebuilt from the full rendering: slower, never wrong.

The cache holds the reply as the token ids that were sampled, not a re-tokenisation of its
text (as mlx-lm's own chat does): the model continues from exactly what it produced. A fresh run
on the rendered transcript can therefore see other tokens where BPE would merge the reply's
text differently, which is why the tests compare a second turn with mlx-lm continuing its own
cache over the same tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from expertmesh.node.engine.generation import GenerationSummary, Generator, SamplingSettings, Token


class ChatSession:
    def __init__(self, generator: Generator, system_prompt: str | None = None):
        self.generator = generator
        self.tokenizer = generator.sm.tokenizer
        self.messages: list[dict] = [{"role": "system", "content": system_prompt}] if system_prompt else []
        self._seen_text: str | None = None  # the rendered text the cache holds; None: unknown
        self.rebuilds = 0  # turns whose cache had to be rebuilt from scratch

    def _render(self, messages: list[dict]) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

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
        tokens = self.tokenizer.encode(new_text, add_special_tokens=not self.generator.history)
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
            self._seen_text = rendered + fed_text if consistent else None
