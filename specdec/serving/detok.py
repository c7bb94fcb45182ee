"""Incremental detokenisation with stop strings, one token at a time.

Why one token at a time: a speculative step emits several tokens at once, and the baseline
one. Both must end at the same token with the same text, so every rule is applied after
each token, exactly as plain decoding sees them (the loop cuts the accepted run there).

Text is decoded by the tokenizers library's DecodeStream: prefix-stable (the text of a
token sequence never rewrites text already released) and it waits for the bytes that
complete a multi-byte character. transformers' `decode` is not prefix-stable: its
`clean_up_tokenization_spaces` turns " 're" into "'re" once "re" arrives, so text released
before would be wrong. The text is therefore the tokens' literal text, as vLLM streams it.

Stop strings (OpenAI's semantics, vLLM's default): the first token whose text completes a
stop string ends the sequence and is the last output token; the text stops just before
the earliest stop string then present (the stop string is never emitted). With
overlapping stops ("abc" and "b") the first to complete wins, although "abc" starts
earlier; several completing in one token: the earliest start. Text that could still become the
start of a stop string is held back until it cannot (a stop may straddle steps); at the
end of the sequence everything held back is released.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream


def backend_of(tokenizer) -> Tokenizer:
    """The tokenizers.Tokenizer behind a transformers fast tokenizer (or itself)."""
    return tokenizer if isinstance(tokenizer, Tokenizer) else tokenizer.backend_tokenizer


@dataclass
class IncrementalDetokenizer:
    tokenizer: object  # a transformers fast tokenizer or a tokenizers.Tokenizer
    stop: tuple[str, ...] = ()
    token_ids: list[int] = field(default_factory=list)
    stopped: str | None = None  # the stop string that ended the sequence
    _text: str = ""  # text of every complete character so far (cut before a stop string)
    _released: int = 0  # characters of _text already returned
    _pending: list[int] = field(default_factory=list)  # tokens whose bytes are not a character yet

    def __post_init__(self) -> None:
        self._backend = backend_of(self.tokenizer)
        self._stream = DecodeStream(skip_special_tokens=True)

    def add(self, token_id: int) -> bool:
        """Append one token; True when it completed a stop string (the sequence ends here)."""
        if self.stopped is not None:
            raise RuntimeError("a stopped sequence takes no more tokens")
        self.token_ids.append(token_id)
        self._pending.append(token_id)
        piece = self._stream.step(self._backend, token_id)
        if piece is None:  # a partial character or a skipped special token
            return False
        self._pending.clear()
        checked = len(self._text)
        self._text += piece
        return self._find_stop(checked)

    def _find_stop(self, checked: int) -> bool:
        """The earliest stop string that ends in the new text (one that lay wholly in the
        text before would have stopped an earlier token)."""
        first = None
        for s in self.stop:
            at = self._text.find(s, max(0, checked - len(s) + 1))
            if at != -1 and (first is None or at < first[0]):
                first = (at, s)
        if first is None:
            return False
        self._text, self.stopped = self._text[: first[0]], first[1]
        return True

    def release(self) -> str:
        """The text that became final: all of it once stopped, else all but what could still
        start a stop string."""
        if self.stopped is not None:
            return self._release(len(self._text))
        return self._release(len(self._text) - self._holdback())

    def flush(self) -> str:
        """At the end of the sequence: everything held back, and the bytes of an unfinished
        character as U+FFFD (what a full decode shows)."""
        if self._pending and self.stopped is None:
            self._text += self._backend.decode(self._pending, skip_special_tokens=True)
            self._pending.clear()
        return self._release(len(self._text))

    def _holdback(self) -> int:
        """Length of the longest suffix of the text that is a proper prefix of a stop string."""
        hold, text = 0, self._text
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
