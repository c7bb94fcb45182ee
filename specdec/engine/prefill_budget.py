"""How many prompt tokens the next target forward carries beside the running sequences.

vLLM's scheduler gives every step a token budget (max_num_batched_tokens) and fills it with
decode tokens first, then prompt chunks in arrival order. On a GPU a forward costs about the
same up to a few hundred tokens, so a fixed budget is also a fixed delay. On a CPU every row
costs: here a 16-stream decode forward takes ~32 ms and 256 prompt tokens beside it ~190 ms
more, so a fixed 256-token chunk makes each running stream's gap ~6x its step. So the budget
is a time: the prompt tokens that keep a forward within `max_slowdown` times a running
stream's usual step (the step once every sequence held decodes), from a fit of the forwards
served so far (seconds ~ a + b_prompt x prompt tokens + b_decode x decode rows, least squares
over the recent ones). With nothing decoding nobody waits but the prompts themselves: the
oldest goes whole and the next ones fill `most_tokens`, so the first prompts of a wave start
streaming before the last is prefilled.
"""
from __future__ import annotations

from collections import deque

import numpy as np


class PrefillBudget:
    WINDOW = 256  # forwards in the fit: recent enough to follow drift (threads, load), enough to span the kinds

    def __init__(self, most_tokens: int, max_slowdown: float, least_tokens: int = 16):
        """most_tokens: prompt tokens per forward at most (0: whole prompts); max_slowdown: a
        forward with prompt tokens beside running sequences costs at most this many times the
        step they decode at once every held sequence decodes (0: off, chunks of most_tokens);
        least_tokens: prompt tokens a forward beside running sequences carries at least, so a
        prompt always advances."""
        self.most_tokens = most_tokens
        self.max_slowdown = max_slowdown
        self.least_tokens = min(least_tokens, most_tokens) if most_tokens else least_tokens
        self._forwards: deque[tuple[int, int, float]] = deque(maxlen=self.WINDOW)
        self._fit: tuple[float, float, float] | None = None
        self._prompt_cost: float | None = None
        self._stale = False

    def observe(self, prompt_tokens: int, decode_rows: int, seconds: float) -> None:
        """One target forward as it ran."""
        self._forwards.append((prompt_tokens, decode_rows, seconds))
        self._stale = True
        if prompt_tokens:  # learn what a prompt token costs while such forwards are in the window
            self.fit()

    def fit(self) -> tuple[float, float, float] | None:
        """(a, b_prompt, b_decode) in seconds, or None before any forward with prompt tokens
        (a prompt token's cost unknown). At a steady load every forward has the same decode
        rows, so a and b_decode cannot be told apart: the least-norm solution splits them, and
        its prediction at the rows served (all the budget uses) is still the least-squares one.
        A prompt token's cost is kept from the last fit that saw prompts (a long stretch of
        decoding alone says nothing about it)."""
        if self._stale:
            self._stale = False
            if len(self._forwards) >= 3:
                rows = np.array(self._forwards, dtype=float)
                features = np.column_stack([np.ones(len(rows)), rows[:, 0], rows[:, 1]])
                scale = np.maximum(np.abs(features).max(axis=0), 1.0)
                coef = np.linalg.lstsq(features / scale, rows[:, 2], rcond=None)[0] / scale
                a, prompt, decode = (float(c) for c in coef)
                if not (rows[:, 0] == rows[0, 0]).all() and prompt > 0:  # prompt tokens that vary: their cost is told
                    self._prompt_cost = prompt
                elif self._prompt_cost is not None:  # refit the rest with the prompt cost held
                    fixed = rows[:, 2] - self._prompt_cost * rows[:, 0]
                    a, decode = (float(c) for c in np.linalg.lstsq(features[:, [0, 2]] / scale[[0, 2]], fixed, rcond=None)[0]
                                 / scale[[0, 2]])
                if self._prompt_cost is not None:
                    self._fit = (a, self._prompt_cost, decode)
        return self._fit

    def tokens(self, decode_rows: int, waiting: int = 0, oldest: int = 0) -> int | None:
        """The prompt tokens the next forward may carry beside `decode_rows` rows of running
        sequences (their roots and draft nodes), with `waiting` sequences still prefilling, the
        oldest of them with `oldest` tokens left; None: whole prompts."""
        if not self.most_tokens:
            return None
        if not decode_rows:
            # nobody waits but the prompts: the oldest goes whole (split, a prompt nobody waits
            # beside mostly took longer: median ~+15% for 1,000 tokens alone), the next ones fill most_tokens
            return max(self.most_tokens, oldest)
        fit = self.fit() if self.max_slowdown else None
        if fit is None:  # off, or not learnt yet: chunks of most_tokens, as before the fit
            return self.most_tokens
        a, prompt, decode = fit
        without = a + decode * decode_rows
        if without <= 0:
            return self.most_tokens
        # A running stream's gap is judged against its usual step, not against the few rows
        # decoding now: the step once every sequence held decodes (each waiting prompt adds a
        # row at least: while a wave's first prompts start, that is the step they will mostly
        # see). Not the recent forwards' median: with prompts arriving often most forwards carry
        # a chunk, and a budget grown from them can grow itself (to EOS at c=16, 20-26 of 48
        # streams past 3x with it, 15-19 without: docs/results.md).
        step = max(without, a + decode * (decode_rows + waiting))
        allowed = int((self.max_slowdown * step - without) / prompt)
        return max(self.least_tokens, min(self.most_tokens, allowed))
