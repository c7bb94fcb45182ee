"""Speculation that never costs: each step's draft budget chosen from measured costs.

A step's value is the tokens it emits per second of step time. Measured models price it:
  * VerifyCost: seconds of one batched verification by the batch's sequences and total
    tokens, tables measured by a start-up microbenchmark and then by every step served;
  * DraftCost: seconds of one drafting call by its draft passes (depths) and sequences;
  * the time between consecutive steps that is not verification (the serving loop).
Acceptance is estimated online, per method, from what verification kept: the chance that a
node is accepted given that its parent was, looked up by the drafter's own confidence in
the node (calibrated: EAGLE-2 observed that draft confidence tracks acceptance) or, for
drafters without probabilities (n-gram), by draft position; a decayed per-sequence factor
corrects for how predictable this particular text is. Estimates are decayed so they follow
the traffic.

Per step, for the whole batch (BudgetPlanner.select): every drafted node has an expected
gain (the probability that its whole path is accepted); nodes join the verification in
order of gain while the step's expected tokens per second still rises. With no node the
step is plain decoding, so a step is never planned slower than the baseline. The same price
decides drafting: another draft pass is run only while the nodes it is expected to add are
worth its seconds (confidence-cut drafting, like llama.cpp's draft p-min but with the
threshold derived from the costs). All of this only decides what is proposed and verified;
acceptance itself is unchanged, so output stays lossless.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Hashable, Sequence

import numpy as np

from specdec.engine.tree import IID_SAMPLED, DraftTree

# Confidence bins (the drafter's probability of a node given its parent): deciles.
_CONFIDENCE_BINS = 10
_DEPTH_KEY = 100  # keys _DEPTH_KEY + d: drafters without probabilities, by draft position
_PRIOR_WEIGHT = 2.0  # pseudo-observations behind each prior rate
_DECAY = 0.998  # per observed node: ~500 recent nodes carry the estimate
_SEQ_DECAY = 0.9  # per step of a sequence: its factor follows the last ~10 steps
_SEQ_PRIOR = 3.0
_MAX_RATE = 0.98  # no node is ever certain: keeps path gains strictly decreasing
# Steps of a method without a verified node before one sequence verifies one anyway: keeps
# the estimates measured, at one node (and one sequence's draft) per 16 steps of the method.
EXPLORE_EVERY = 16


class VerifyCost:
    """Seconds of one batched verification by the batch's sequences and total tokens (root +
    nodes of every sequence). A small target's forward is weight-bandwidth bound: flat up to
    a knee, then rising (SmolLM2 on 2 CPU cores: ~33 ms for 1 to 6 tokens, ~50 ms for 16),
    and attention over every sequence's context makes a batch of 16 dearer than one of 4 at
    the same token count. So it is kept as measured tables, one per batch size, not a line:
    a mean per token count (start-up calibration, then a running average of served steps),
    made non-decreasing by isotonic regression, interpolated between measured counts and
    extrapolated along the steepest measured per-token slope beyond them. A batch size not
    yet seen borrows the nearest measured one's table, moved by its extra sequences."""

    MIN_PER_TOKEN = 1e-6  # a verified token always costs something, so budgets stay finite

    def __init__(self, refit_every: int = 16):
        self.means: dict[int, dict[int, float]] = {}  # sequences -> tokens -> seconds
        self.counts: dict[int, dict[int, float]] = {}
        self.refit_every = refit_every
        self._since_fit = 0
        self._curves: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self.slope = 0.0  # steepest measured seconds per extra token

    def observe(self, tokens: int, seconds: float, sequences: int = 1) -> None:
        means = self.means.setdefault(sequences, {})
        counts = self.counts.setdefault(sequences, {})
        counts[tokens] = min(counts.get(tokens, 0.0) + 1.0, 20.0)  # after 20 steps: a running average that follows drift
        mean = means.get(tokens, seconds)
        means[tokens] = mean + (seconds - mean) / counts[tokens]
        self._since_fit += 1
        if self._since_fit >= self.refit_every or sequences not in self._curves:
            self.fit()

    def fit(self) -> None:
        self._curves = {}
        slopes = [0.0]
        for b, means in self.means.items():
            keys = sorted(means)
            xs = np.array(keys, dtype=float)
            ys = _isotonic([means[k] for k in keys], [self.counts[b][k] for k in keys])
            self._curves[b] = (xs, ys)
            if len(xs) > 1:
                slopes.append(float(np.max(np.diff(ys) / np.diff(xs))))
        self.slope = max(slopes)
        self._since_fit = 0

    def seconds_for(self, tokens: int, sequences: int = 1) -> float:
        if not self._curves:
            return self.MIN_PER_TOKEN * tokens
        nearest = min(self._curves, key=lambda b: (abs(b - sequences), -b))
        xs, ys = self._curves[nearest]
        shift = sequences - nearest  # another batch size: as many extra tokens, and its extra sequences
        t = tokens - shift
        if t <= xs[-1]:
            base = float(np.interp(t, xs, ys))
        else:
            base = float(ys[-1] + self.slope * (t - xs[-1]))
        return base + self.slope * max(shift, 0) + self.MIN_PER_TOKEN * tokens

    def marginal(self, tokens: int, sequences: int = 1) -> float:
        """Seconds that one more token adds to a batch of `tokens`."""
        return self.seconds_for(tokens + 1, sequences) - self.seconds_for(tokens, sequences)


def _isotonic(values: Sequence[float], weights: Sequence[float]) -> np.ndarray:
    """The non-decreasing sequence closest to `values` in weighted least squares (pool
    adjacent violators): a forward pass never gets cheaper with more tokens."""
    blocks: list[list[float]] = []  # [mean, weight, size]
    for v, w in zip(values, weights):
        blocks.append([float(v), float(w), 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            m2, w2, n2 = blocks.pop()
            m1, w1, n1 = blocks.pop()
            blocks.append([(m1 * w1 + m2 * w2) / (w1 + w2), w1 + w2, n1 + n2])
    return np.array([m for m, _, n in blocks for _ in range(int(n))])


class DraftCost:
    """Seconds of one drafting call = fixed + per_pass * passes + per_sequence * sequences
    (catching up on each sequence's kept tokens): least squares over a sliding window of
    calls, refitted every `refit_every` calls."""

    def __init__(self, window: int = 512, refit_every: int = 16):
        self.window: deque[tuple[tuple[float, ...], float]] = deque(maxlen=window)
        self.refit_every = refit_every
        self.theta = np.zeros(3)
        self._since_fit = 0

    def observe(self, features: Sequence[float], seconds: float) -> None:
        """features: (1, passes, sequences)."""
        self.window.append((tuple(float(f) for f in features), float(seconds)))
        self._since_fit += 1
        if self._since_fit >= self.refit_every or len(self.window) < self.refit_every:
            self.fit()

    def fit(self) -> None:
        X = np.array([r[0] for r in self.window])
        y = np.array([r[1] for r in self.window])
        # A whisper of ridge: while every call drafts as deep, the columns are collinear.
        gram = X.T @ X + 1e-9 * np.eye(len(self.theta))
        self.theta = np.maximum(np.linalg.solve(gram, X.T @ y), 0.0)  # no cost is negative
        self._since_fit = 0

    def seconds(self, *features: float) -> float:
        return float(np.dot(self.theta, features))

    @property
    def per_pass(self) -> float:
        return float(self.theta[1])


@dataclass
class _Rates:
    """Decayed accept / tried counts per key, on top of a prior rate."""

    accepted: dict[int, float] = field(default_factory=dict)
    tried: dict[int, float] = field(default_factory=dict)

    def rate(self, key: int) -> float:
        prior = _prior_rate(key)
        a = self.accepted.get(key, 0.0) + _PRIOR_WEIGHT * prior
        t = self.tried.get(key, 0.0) + _PRIOR_WEIGHT
        return min(a / t, _MAX_RATE)

    def observe(self, outcomes: Sequence[tuple[int, bool]]) -> None:
        if not outcomes:
            return
        decay = _DECAY ** len(outcomes)
        for table in (self.accepted, self.tried):
            for key in table:
                table[key] *= decay
        for key, ok in outcomes:
            self.tried[key] = self.tried.get(key, 0.0) + 1.0
            self.accepted[key] = self.accepted.get(key, 0.0) + float(ok)


def _prior_rate(key: int) -> float:
    if key >= _DEPTH_KEY:
        return 0.5 ** (key - _DEPTH_KEY)  # by position: halving per depth until measured
    return (key + 0.5) / _CONFIDENCE_BINS  # trust the drafter's confidence until measured


def _usable_confidence(tree: DraftTree) -> list[float] | None:
    """Confidences that may decide what is verified. A sampled node (IID_SAMPLED) must be
    verified or dropped without looking at its own value: the acceptance rule min(1, p/q)
    assumes the verified token is a plain draw from q, and keeping only confident draws
    would bias it. Such trees are planned by position only, and cut at the rate's first
    peak (select), so whether a node is verified depends only on nodes drawn before it.
    Deterministic drafts (argmax, top-k) are a function of the context, so any selection
    among them stays lossless."""
    return None if tree.scheme == IID_SAMPLED else tree.confidence


def _key(confidence: float | None, depth: int) -> int:
    if confidence is None or confidence != confidence:  # not stated (None, or NaN in a merged tree)
        return _DEPTH_KEY + depth
    return min(int(confidence * _CONFIDENCE_BINS), _CONFIDENCE_BINS - 1)


@dataclass
class _SequenceFit:
    """How this sequence's acceptance compares with its method's estimate (decayed)."""

    accepted: float = 0.0
    expected: float = 0.0
    steps_without_nodes: int = 0

    @property
    def factor(self) -> float:
        return min(max((self.accepted + _SEQ_PRIOR) / (self.expected + _SEQ_PRIOR), 0.25), 2.0)


@dataclass
class PlanItem:
    seq_id: Hashable
    method: str
    tree: DraftTree
    adaptive: bool


class DraftCut:
    """Given to a drafter for one drafting call: before each further draft pass it asks
    whether the nodes that pass would add are worth its seconds; counts the passes."""

    def __init__(self, planner: "BudgetPlanner", method: str, seq_ids: Sequence[Hashable], record: bool = True):
        """record: feed the call's seconds to the method's draft cost."""
        self.planner, self.method, self.seq_ids, self.record = planner, method, list(seq_ids), record
        self.passes = 1  # the call's first pass (catching up) always runs

    def __call__(self, depth: int, path_confidence: Sequence[float]) -> bool:
        """depth: tokens already drafted on the best path of each row; path_confidence:
        the drafter's product of confidences along it, per row (in the call's row order)."""
        go = self.planner.pass_pays(self.method, self.seq_ids, depth, path_confidence)
        self.passes += go
        return go

    def finish(self, seconds: float) -> None:
        if self.record:
            cost = self.planner.draft_costs.setdefault(self.method, DraftCost())
            cost.observe((1.0, self.passes, len(self.seq_ids)), seconds)


class BudgetPlanner:
    def __init__(self):
        self.verify_cost = VerifyCost()
        self.draft_costs: dict[str, DraftCost] = {}
        self.rates: dict[str, _Rates] = {}
        self.position_rates: dict[str, _Rates] = {}  # by draft position, for metrics
        self.sequences: dict[Hashable, _SequenceFit] = {}
        self.method_idle: dict[str, int] = {}  # steps since the method last verified a node
        self.tokens_per_second = 0.0  # the last plan's expected rate: the price of a second
        self.planned_tokens = 1  # the last plan's batch tokens and sequences (where a further node is priced)
        self.planned_sequences = 1
        # Seconds of a step outside verification (drafting, the serving loop's turn-around),
        # measured between consecutive steps: part of every step's cost, so part of the rate.
        self.step_extra_seconds = 0.0

    # ---- estimates ----------------------------------------------------------------------
    def node_gains(self, method: str, seq_id: Hashable, tree: DraftTree, per_sequence: bool = True) -> list[float]:
        """Expected acceptance of each node's whole path (its expected emitted-token gain);
        per_sequence=False: the method's estimate alone, without this sequence's factor."""
        rates = self.rates.setdefault(method, _Rates())
        factor = self.sequences.setdefault(seq_id, _SequenceFit()).factor if per_sequence else 1.0
        conf = _usable_confidence(tree)
        gains: list[float] = []
        for i, (parent, depth) in enumerate(zip(tree.parents, tree.depths())):
            cond = min(rates.rate(_key(None if conf is None else conf[i], depth)) * factor, _MAX_RATE)
            gains.append(cond * (1.0 if parent < 0 else gains[parent]))
        return gains

    def position_estimates(self, method: str, max_depth: int) -> list[float]:
        """Measured chance that draft position d is accepted given d-1 was, d = 1..max_depth."""
        rates = self.position_rates.get(method, _Rates())
        return [rates.rate(_DEPTH_KEY + d) for d in range(1, max_depth + 1)]

    # ---- the step -----------------------------------------------------------------------
    def select(self, items: Sequence[PlanItem]) -> list[DraftTree]:
        """The nodes to verify this step for the whole batch: adaptive items' nodes in order
        of expected gain while the expected tokens per second rises; fixed items as given."""
        fixed_tokens = sum(1 + len(i.tree) for i in items if not i.adaptive)
        base_tokens = fixed_tokens + sum(1 for i in items if i.adaptive)
        candidates = []  # (gain, depth, item index, node)
        for n, item in enumerate(items):
            if item.adaptive and len(item.tree):
                gains = self.node_gains(item.method, item.seq_id, item.tree)
                depths = item.tree.depths()
                candidates += [(g, depths[j], n, j) for j, g in enumerate(gains)]
        # A parent's gain is above its children's (rates < 1), ties go to the shallower node:
        # every prefix of this order is a set of trees.
        candidates.sort(key=lambda c: (-c[0], c[1], c[2], c[3]))
        sequences = len(items)
        expected = float(sequences) + sum(sum(self.node_gains(i.method, i.seq_id, i.tree)) for i in items if not i.adaptive)
        # With a sampled tree in the batch, stop at the first node that does not raise the rate:
        # the best prefix overall would keep or cut a sampled node depending on whether later
        # candidates exist, and a sampled tree's later nodes exist depending on the draws
        # before them, that node's own value included (the measured cost curve need not be
        # convex, so the rate can have two peaks). Deterministic trees may take the best prefix.
        first_peak = any(i.adaptive and i.tree.scheme == IID_SAMPLED for i in items)
        best_n, best_rate = 0, expected / self._step_seconds(base_tokens, sequences)
        for n, (gain, *_rest) in enumerate(candidates, start=1):
            expected += gain
            rate = expected / self._step_seconds(base_tokens + n, sequences)
            if rate > best_rate:
                best_n, best_rate = n, rate
            elif first_peak:
                break
        self.tokens_per_second = best_rate
        self.planned_tokens, self.planned_sequences = base_tokens + best_n, sequences
        keep: list[list[int]] = [[] for _ in items]
        for _, _, n, j in candidates[:best_n]:
            keep[n].append(j)
        self._explore(items, keep)
        out = []
        for n, item in enumerate(items):
            if not item.adaptive:
                out.append(item.tree)
                continue
            seq = self.sequences.setdefault(item.seq_id, _SequenceFit())
            seq.steps_without_nodes = 0 if keep[n] else seq.steps_without_nodes + 1
            out.append(item.tree.select(sorted(keep[n])))
        return out

    def _explore(self, items: Sequence[PlanItem], keep: list[list[int]]) -> None:
        """A method that verified nothing for EXPLORE_EVERY steps verifies the first node of
        one sequence (the longest-waiting one with a tree)."""
        for method in {i.method for i in items if i.adaptive}:
            mine = [n for n, i in enumerate(items) if i.adaptive and i.method == method]
            if any(keep[n] for n in mine):
                self.method_idle[method] = 0
                continue
            self.method_idle[method] = self.method_idle.get(method, 0) + 1
            drafted = [n for n in mine if len(items[n].tree)]
            if drafted and self.method_idle[method] >= EXPLORE_EVERY:
                n = max(drafted, key=lambda n: self.sequences.setdefault(items[n].seq_id, _SequenceFit()).steps_without_nodes)
                keep[n] = [0]
                self.method_idle[method] = 0

    def _step_seconds(self, tokens: int, sequences: int) -> float:
        return max(self.verify_cost.seconds_for(tokens, sequences) + self.step_extra_seconds, 1e-6)

    def to_draft(self, method: str, seq_ids: Sequence[Hashable]) -> list[Hashable]:
        """Which of these sequences draft this step: all when a drafting call is expected to
        pay, else only those due to explore (so estimates stay measured at little cost)."""
        cost = self.draft_costs.get(method)
        seconds = 0.0 if cost is None else cost.seconds(1.0, 1.0, len(seq_ids))
        if self._value(method, seq_ids, [1.0] * len(seq_ids), 0) > seconds * self.tokens_per_second:
            return list(seq_ids)
        if self.method_idle.get(method, 0) + 1 < EXPLORE_EVERY or not seq_ids:
            return []
        return [max(seq_ids, key=lambda s: self.sequences.setdefault(s, _SequenceFit()).steps_without_nodes)]

    def pass_pays(self, method: str, seq_ids: Sequence[Hashable], depth: int, path_confidence: Sequence[float]) -> bool:
        cost = self.draft_costs.get(method)
        seconds = 0.0 if cost is None else cost.per_pass
        return self._value(method, seq_ids, path_confidence, depth) > seconds * self.tokens_per_second

    def _value(self, method: str, seq_ids: Sequence[Hashable], path_confidence: Sequence[float], depth: int) -> float:
        """Expected tokens that one more draft depth adds, net of verifying it: per row, the
        next node's gain (its path's calibrated acceptance) minus a node's verify price."""
        rates = self.rates.setdefault(method, _Rates())
        calibration = self._calibration(method)
        price = self.verify_cost.marginal(self.planned_tokens, self.planned_sequences) * self.tokens_per_second
        value = 0.0
        for seq_id, conf in zip(seq_ids, path_confidence):
            factor = self.sequences.setdefault(seq_id, _SequenceFit()).factor
            if calibration is None:  # no confidences: positional rates
                gain = math.prod(min(rates.rate(_DEPTH_KEY + d) * factor, _MAX_RATE) for d in range(1, depth + 2))
            else:
                gain = min(conf * calibration * factor, 1.0) * self._mean_rate(method)
            value += max(0.0, gain - price)
        return value

    def _calibration(self, method: str) -> float | None:
        """Measured acceptance over the drafter's stated confidence, per node; None when the
        method has not stated confidences (positional estimates apply)."""
        rates = self.rates.get(method)
        if rates is None or not any(k < _DEPTH_KEY for k in rates.tried):
            return None if rates is not None and rates.tried else 1.0
        num = sum(rates.accepted.get(k, 0.0) for k in rates.tried if k < _DEPTH_KEY)
        den = sum(rates.tried[k] * _prior_rate(k) for k in rates.tried if k < _DEPTH_KEY)
        return (num + _PRIOR_WEIGHT) / (den + _PRIOR_WEIGHT)

    def _mean_rate(self, method: str) -> float:
        rates = self.rates.get(method)
        if rates is None or not rates.tried:
            return 0.5
        return (sum(rates.accepted.values()) + 1.0) / (sum(rates.tried.values()) + 2.0)

    # ---- observations -------------------------------------------------------------------
    def observe_verify(self, tokens: int, sequences: int, seconds: float) -> None:
        self.verify_cost.observe(tokens, seconds, sequences)
        if not self.tokens_per_second:
            self.tokens_per_second = sequences / max(self.verify_cost.seconds_for(sequences, sequences), 1e-6)

    def observe_step_extra(self, seconds: float) -> None:
        self.step_extra_seconds += 0.1 * (seconds - self.step_extra_seconds)

    def observe_accepts(self, method: str, seq_id: Hashable, tree: DraftTree, accepted_nodes: Sequence[int]) -> None:
        """Every node whose parent was accepted was tried; the accepted path's nodes succeeded."""
        if not len(tree):
            return
        gains = self.node_gains(method, seq_id, tree, per_sequence=False)
        accepted = set(accepted_nodes)
        conf = _usable_confidence(tree)
        outcomes, positions = [], []
        expected = 0.0
        for i, (parent, depth) in enumerate(zip(tree.parents, tree.depths())):
            if parent >= 0 and parent not in accepted:
                continue
            ok = i in accepted
            outcomes.append((_key(None if conf is None else conf[i], depth), ok))
            positions.append((_DEPTH_KEY + depth, ok))
            expected += gains[i] / (1.0 if parent < 0 else gains[parent])
        self.rates.setdefault(method, _Rates()).observe(outcomes)
        self.position_rates.setdefault(method, _Rates()).observe(positions)
        seq = self.sequences.setdefault(seq_id, _SequenceFit())
        seq.accepted = seq.accepted * _SEQ_DECAY + len(accepted)
        seq.expected = seq.expected * _SEQ_DECAY + expected

    def forget(self, seq_id: Hashable) -> None:
        self.sequences.pop(seq_id, None)

    def snapshot(self) -> dict:
        """What the planner currently believes (for metrics and benchmark reports)."""
        return {
            "verify_seconds_by_sequences_and_tokens": {
                int(b): {int(x): float(y) for x, y in zip(xs, ys)} for b, (xs, ys) in self.verify_cost._curves.items()},
            "draft_seconds": {m: {"fixed": float(c.theta[0]), "per_pass": c.per_pass} for m, c in self.draft_costs.items()},
            "acceptance_by_position": {m: self.position_estimates(m, 8) for m in self.position_rates},
            "tokens_per_second": self.tokens_per_second,
            "step_extra_seconds": self.step_extra_seconds,
        }

