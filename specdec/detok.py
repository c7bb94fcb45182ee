"""Incremental detokenisation with stop strings.

Text is released only when it is final: never a partial multi-byte character (decoding
ends in U+FFFD) and never text that could still become the start of a stop string. A
stop string may straddle steps; it is never emitted.
"""
from __future__ import annotations

from dataclasses import dataclass, field

REPLACEMENT_CHAR = "\ufffd"


@dataclass
class IncrementalDetokenizer:
    tokenizer: object  # anything with decode(list[int], skip_special_tokens=...) -> str
    stop: tuple[str, ...] = ()
    token_ids: list[int] = field(default_factory=list)
    _text: str = ""  # decoded text of all complete characters so far
    _released: int = 0  # characters of _text already returned
    stopped: bool = False

    def add(self, new_ids: list[int]) -> str:
        """Append tokens; return the newly final text (may be '')."""
        if self.stopped:
            return ""
        self.token_ids.extend(new_ids)
        text = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
        if text.endswith(REPLACEMENT_CHAR):  # an incomplete UTF-8 sequence: wait for more bytes
            text = text.rstrip(REPLACEMENT_CHAR)
        self._text = text
        for s in self.stop:
            at = text.find(s, max(0, self._released - len(s)))
            if at != -1:
                self.stopped = True
                self._text = text[:at]
                return self._release(len(self._text))
        return self._release(len(text) - self._holdback(text))

    def flush(self) -> str:
        """At the end of the sequence release everything that is not a stop string."""
        return self._release(len(self._text))

    def _holdback(self, text: str) -> int:
        """Length of the longest suffix of text that is a proper prefix of a stop string."""
        hold = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(text)), hold, -1):
                if text.endswith(s[:k]):
                    hold = k
                    break
        return hold

    def _release(self, upto: int) -> str:
        upto = max(upto, self._released)
        out = self._text[self._released : upto]
        self._released = upto
        return out

    @property
    def text(self) -> str:
        return self._text[: self._released]
