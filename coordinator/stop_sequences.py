"""Stop sequences over streamed text: cut before the first stop string, and never send text
that might turn out to be the start of one (it is held back until it cannot be)."""

from __future__ import annotations


class StopScanner:
    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self._text = ""
        self._sent = 0
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended the text

    def feed(self, piece: str) -> str:
        """The text that is now safe to send after `piece` arrived ('' once stopped)."""
        if self.stopped:
            return ""
        unsent = len(self._text) - self._sent + len(piece)  # only unsent text can start a stop
        self._text += piece
        hits = [(i, s) for s in self.stops if (i := self._text.find(s, max(0, self._sent - len(s)))) >= 0]
        if hits:
            self.stopped = True
            end, self.matched = min(hits)
        else:
            end = len(self._text)
            for s in self.stops:  # hold back a tail that is a prefix of a stop string
                for n in range(min(len(s) - 1, unsent), 0, -1):
                    if s.startswith(self._text[-n:]):
                        end = min(end, len(self._text) - n)
                        break
        out = self._text[self._sent : max(self._sent, end)]
        self._sent = max(self._sent, end)
        return out

    def finish(self) -> str:
        """What was held back, once generation ended without a stop."""
        if self.stopped:
            return ""
        out = self._text[self._sent :]
        self._sent = len(self._text)
        return out
