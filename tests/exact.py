"""Exact output distributions of the real engine, by enumerating its randomness.

Every random choice the engine makes goes through two functions of
specdec.engine.sampling: `sample` (a token from a distribution) and `uniform` (a number in
[0, 1), which acceptance only ever compares with a threshold). `exact_outcomes(run)` swaps
both, wherever a module imported them, for branch points, and runs `run()` once per
combination of outcomes (depth-first, replaying the choices made so far): a `sample` branches
over every token of non-zero probability, a comparison `uniform() * a < b` over True and
False with probabilities min(1, b / a) and the rest. Each run's result is weighed by the
product of its branches' probabilities, so the returned distribution is the one the code
draws from, computed exactly (up to float rounding), not estimated from samples. A
statistical test needs thousands of samples to see a 1% bias; this sees a 1e-6 one.

Replays must be deterministic: the engine's clocks (which feed the planner) are replaced
by a counter, and a replay that meets a different set of choices than the run it replays
fails loudly.
"""
from __future__ import annotations

import contextlib
import sys
import time
from collections import defaultdict
from typing import Callable, Hashable, Iterator

import torch

import specdec.engine.sampling as sampling

_REAL_SAMPLE, _REAL_UNIFORM = sampling.sample, sampling.uniform


class ReplayDiverged(AssertionError):
    pass


class _Choices:
    """The depth-first walk over every combination of random outcomes."""

    def __init__(self):
        self.path: list[list[int]] = []  # per branch point of the current run: [chosen, options]
        self.position = 0
        self.weight = 1.0

    def begin(self) -> None:
        self.position, self.weight = 0, 1.0

    def choose(self, options: list[tuple[Hashable, float]]) -> Hashable:
        options = [(value, p) for value, p in options if p > 0.0]
        if not options:
            raise ReplayDiverged("a random choice with no outcome of non-zero probability")
        if self.position < len(self.path):
            chosen, count = self.path[self.position]
            if count != len(options):
                raise ReplayDiverged(f"branch point {self.position}: {len(options)} outcomes on replay, {count} before")
        else:
            chosen = 0
            self.path.append([0, len(options)])
        self.position += 1
        value, p = options[chosen]
        self.weight *= p
        return value

    def advance(self) -> bool:
        """Move to the next combination; False when every one has been run."""
        if self.position != len(self.path):
            raise ReplayDiverged(f"the replay met {self.position} branch points, the run it replayed {len(self.path)}")
        while self.path:
            self.path[-1][0] += 1
            if self.path[-1][0] < self.path[-1][1]:
                return True
            self.path.pop()
        return False


class _Uniform:
    """One uniform draw u, known only through the one comparison the caller makes with it."""

    def __init__(self, choices: _Choices, scale: float = 1.0):
        self.choices, self.scale, self.used = choices, scale, False

    def __mul__(self, factor) -> "_Uniform":
        return _Uniform(self.choices, self.scale * float(factor))

    __rmul__ = __mul__

    def __lt__(self, bound) -> bool:  # u * scale < bound
        if self.used:
            raise ReplayDiverged("a uniform draw compared twice: the enumeration would treat the comparisons as independent")
        self.used = True
        bound = float(bound)
        p = (1.0 if bound > 0 else 0.0) if self.scale <= 0 else min(max(bound / self.scale, 0.0), 1.0)
        return self.choices.choose([(True, p), (False, 1.0 - p)])

    def __float__(self):
        raise TypeError("exact enumeration supports uniform() only in a comparison u * a < b")


class _Clock:
    """A clock that advances 1 ms per read: timings the planner learns from are the same on
    every replay."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        self.now += 0.001
        return self.now


def _patched_modules() -> list:
    return [m for name, m in list(sys.modules.items()) if m is not None and (name.startswith("specdec") or name == "toy")]


@contextlib.contextmanager
def _enumerating(choices: _Choices) -> Iterator[None]:
    def sample(probs: torch.Tensor, generator=None) -> int:
        weights = probs.double()
        weights = weights / weights.sum()
        nonzero = torch.nonzero(weights > 0).flatten().tolist()
        return int(choices.choose([(t, float(weights[t])) for t in nonzero]))

    def uniform(generator=None) -> _Uniform:
        return _Uniform(choices)

    swapped = []
    for module in _patched_modules():
        for name, real, fake in (("sample", _REAL_SAMPLE, sample), ("uniform", _REAL_UNIFORM, uniform)):
            if getattr(module, name, None) is real:
                setattr(module, name, fake)
                swapped.append((module, name, real))
    clock = _Clock()
    saved_clocks = (time.perf_counter, time.monotonic)
    time.perf_counter = time.monotonic = clock
    try:
        yield
    finally:
        time.perf_counter, time.monotonic = saved_clocks
        for module, name, real in swapped:
            setattr(module, name, real)


def exact_outcomes(run: Callable[[], Hashable], max_runs: int = 5_000) -> dict[Hashable, float]:
    """result -> probability, over every combination of the random outcomes `run` meets.
    `run` must start from the same state each time (it is replayed)."""
    choices = _Choices()
    dist: dict[Hashable, float] = defaultdict(float)
    runs = 0
    with _enumerating(choices):
        while True:
            choices.begin()
            result = run()
            dist[result] += choices.weight
            runs += 1
            if runs > max_runs:
                raise AssertionError(f"more than {max_runs} combinations: make the case smaller")
            if not choices.advance():
                break
    total = sum(dist.values())
    assert abs(total - 1.0) < 1e-9, total
    return dict(dist)


def conditionals(dist: dict[tuple[int, ...], float]) -> dict[tuple[int, ...], dict[int, float]]:
    """For outputs (token tuples of varying length): prefix s -> the distribution of the
    next token given that the output starts with s and goes on past it. Lossless means each
    equals the target's distribution after s: the output then continues in a fresh step,
    drawn from the target as well, so the whole stream is the target's."""
    joint: dict[tuple[int, ...], dict[int, float]] = defaultdict(lambda: defaultdict(float))
    for tokens, p in dist.items():
        for j, token in enumerate(tokens):
            joint[tuple(tokens[:j])][token] += p
    out = {}
    for prefix, nxt in joint.items():
        mass = sum(nxt.values())
        out[prefix] = {t: p / mass for t, p in nxt.items()}
    return out
