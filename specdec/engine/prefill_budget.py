"""How many prompt tokens the next target forward carries beside the running sequences.

vLLM's scheduler gives every step a token budget (max_num_batched_tokens) and fills it with
decode tokens first, then prompt chunks in arrival order. On a GPU a forward costs about the
same up to a few hundred tokens, so a fixed budget is also a fixed delay. On a CPU every row
costs: here a 16-stream decode forward takes ~32 ms and 256 prompt tokens beside it ~190 ms
more, so a fixed 256-token chunk makes each running stream's gap ~6x its step. So the budget
is a time: the prompt tokens that keep a forward within `max_slowdown` times what the same
forward costs without them, from a fit of the forwards served so far (seconds ~ a + b_prompt
x prompt tokens + b_decode x decode rows, least squares over the recent ones). With nothing
decoding nobody waits but the prompts themselves, and they go in chunks of `most_tokens`,
oldest first, so the first prompts of a wave start streaming before the last is prefilled.
"""
from __future__ import annotations

from collections import deque

import numpy as np


class PrefillBudget:
    WINDOW = 256  # forwards in the fit: recent enough to follow drift (threads, load), enough to span the kinds

    def __init__(self, most_tokens: int, max_slowdown: float, least_tokens: int = 16):
        """most_tokens: prompt tokens per forward at most (0: whole prompts); max_slowdown: a
        forward with prompt tokens beside running sequences costs at most this many times the
        same forward without them (0: off, chunks of most_tokens); least_tokens: prompt tokens a
        forward beside running sequences carries at least, so a prompt always advances."""
        self.most_tokens = most_tokens
        self.max_slowdown = max_slowdown
        self.least_tokens = min(least_tokens, most_tokens) if most_tokens else least_tokens
        self._forwards: deque[tuple[int, int, float]] = deque(maxlen=self.WINDOW)
        self._fit: tuple[float, float, float] | None = None
        self._stale = False

    def observe(self, prompt_tokens: int, decode_rows: int, seconds: float) -> None:
        """One target forward as it ran."""
        self._forwards.append((prompt_tokens, decode_rows, seconds))
        self._stale = True

    def fit(self) -> tuple[float, float, float] | None:
        """(a, b_prompt, b_decode) in seconds, or None while the forwards seen cannot tell
        the three apart (none of one kind yet, or all of one size) or make no sense (a
        prompt token that costs nothing)."""
        if self._stale:
            self._stale = False
            self._fit = None
            if len(self._forwards) >= 3:
                rows = np.array(self._forwards, dtype=float)
                features = np.column_stack([np.ones(len(rows)), rows[:, 0], rows[:, 1]])
                scale = np.maximum(np.abs(features).max(axis=0), 1.0)  # columns of one size: the rank test below means it
                coef, _, rank, singular = np.linalg.lstsq(features / scale, rows[:, 2], rcond=None)
                if rank == 3 and singular[-1] > 1e-3 * singular[0]:
                    a, prompt, decode = coef / scale
                    if prompt > 0 and decode > 0:
                        self._fit = (float(a), float(prompt), float(decode))
        return self._fit

    def tokens(self, decode_rows: int) -> int | None:
        """The prompt tokens the next forward may carry beside `decode_rows` rows of running
        sequences (their roots and draft nodes); None: whole prompts."""
        if not self.most_tokens:
            return None
        if not decode_rows or not self.max_slowdown:
            return self.most_tokens
        fit = self.fit()
        if fit is None:  # not learnt yet: chunks of most_tokens, as before the fit
            return self.most_tokens
        a, prompt, decode = fit
        without = max(a + decode * decode_rows, decode * decode_rows)
        allowed = int((self.max_slowdown - 1.0) * without / prompt)
        return max(self.least_tokens, min(self.most_tokens, allowed))
