"""Generated text on a terminal: tokens printed as they come, a summary after, and the chat loop.

Text goes to stdout and the summary to stderr, so `expertmesh run ... > out.txt` keeps only the
generated text. Ctrl-C during a reply stops that reply between two tokens (the cache stays
consistent, the conversation goes on); Ctrl-C or Ctrl-D at the prompt ends the chat.
"""

from __future__ import annotations

import signal
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TextIO

from expertmesh.node.engine.generation import GenerationSummary, Token


def stream_text(tokens: Iterator[Token], summary: GenerationSummary, out: TextIO | None = None) -> str:
    """Print each token's text as soon as it is made; returns the whole text."""
    out = out or sys.stdout  # looked up now, like print_summary's stderr
    parts = []
    try:
        for tok in tokens:
            if tok.text:
                out.write(tok.text)
                out.flush()
                parts.append(tok.text)
        if summary.trailing_text:
            out.write(summary.trailing_text)
            parts.append(summary.trailing_text)
    except BrokenPipeError:  # `run ... | head`: the reader left, so generation stops here, quietly
        close = getattr(tokens, "close", None)
        if close is not None:
            close()  # ends the generator now, while the MLX thread it runs on is alive
        raise
    finally:
        try:
            out.write("\n")  # also before an error message, which then starts its own line
            out.flush()
        except BrokenPipeError:
            pass
    return "".join(parts)


def print_summary(summary: GenerationSummary, out: TextIO | None = None) -> None:
    out = out or sys.stderr  # looked up now: a redirected stderr (a test's, a wrapper's) gets the summary
    for line in summary.lines():
        print(f"  {line}", file=out)
    out.flush()


class StopFlag:
    """Set by Ctrl-C while a reply streams; generation polls it between tokens."""

    def __init__(self) -> None:
        self.set = False

    def __call__(self) -> bool:
        return self.set


@contextmanager
def ctrl_c_stops(flag: StopFlag) -> Iterator[StopFlag]:
    """While inside, the first Ctrl-C sets `flag` instead of raising; a second one raises."""

    def handler(signum, frame):
        if flag.set:
            raise KeyboardInterrupt
        flag.set = True

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield flag
    finally:
        signal.signal(signal.SIGINT, previous)


def chat_loop(
    reply: Callable[[str, Callable[[], bool], GenerationSummary], Iterator[Token]],
    read_line: Callable[[str], str] = input,
    show_summary: bool = True,
) -> int:
    """Read a message, stream the reply, repeat until end of input; returns the turns taken."""
    turns = 0
    while True:
        try:
            text = read_line("> ")
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return turns
        text = text.strip()
        if not text:
            continue
        if text in ("/exit", "/quit"):
            return turns
        flag = StopFlag()
        summary = GenerationSummary()
        with ctrl_c_stops(flag):
            stream_text(reply(text, flag, summary), summary)
        if flag.set:
            print("  (stopped; the conversation goes on)", file=sys.stderr)
        if show_summary:
            print_summary(summary)
        turns += 1


class PrefillLine:
    """A streamed prompt's progress (engine/prefill.py's `PrefillProgress`) on stderr: one line
    rewritten in place on a terminal, else a line every `every_s` seconds and at each layer's end,
    so a cold prompt that fetches for minutes says where it is without flooding a log."""

    def __init__(self, out: TextIO | None = None, every_s: float = 2.0):
        self.out = out or sys.stderr
        self.every_s = every_s
        self.last = float("-inf")

    def __call__(self, progress) -> None:
        now = time.monotonic()
        layer_done = progress.experts_done >= progress.experts_needed
        tty = self.out.isatty()
        if not tty and not layer_done and now - self.last < self.every_s:
            return
        self.last = now
        last = layer_done and progress.layer + 1 >= progress.layers  # the prompt's last line: ended
        end = "\n" if last or not tty else ""
        print(("\r\033[K" if tty else "") + progress.line(), end=end, file=self.out, flush=True)
