"""Exact output distributions of the real engine, by enumerating its randomness.

Every random choice the engine makes goes through two functions of
specdec.engine.sampling: `sample` (a token from a distribution, by inverse CDF of one
uniform draw) and `uniform` (a number in [0, 1), which acceptance only ever compares with a
threshold). `exact_outcomes(run)` swaps both, wherever a module imported them, for branch
points, and runs `run()` once per combination of outcomes (depth-first, replaying the
choices made so far). Each run's result is weighed by the product of its branches'
probabilities, so the returned distribution is the one the code draws from, computed
exactly (up to float rounding), not estimated from samples. A statistical test needs
thousands of samples to see a 1% bias; this sees a 1e-6 one.

Random streams are honoured, as torch draws them: a draw is the next number of its
generator's stream, and two generators seeded alike (torch.Generator.initial_seed) give
the same numbers in the same order. So each draw is the variable u[seed, n] (n: how many
draws that generator object made before), uniform on [0, 1) and known to the enumeration
as the interval its earlier uses left: a `sample` splits the interval at the CDF's steps,
a comparison `u * a < b` at b / a, and each branch weighs its share of the interval. A
variable used once branches exactly as an independent draw; one that two consumers share
(a drafter and a verifier seeded alike) is enumerated jointly, so the correlation that
makes such code lossy shows in the distribution. A draw without a generator (None) is a
fresh variable.

Replays must be deterministic: the engine's clocks (which feed the planner) are replaced
by a counter, torch runs on one thread (tiny matrices: thread hand-offs cost 20x the
arithmetic on a loaded 2-core machine), and a replay that meets a different set of choices
than the run it replays fails loudly. A run in stages (`staged_outcomes`: one engine step
each) keeps a copy of its state after each stage, and a replay that shares that stage's
draws resumes from the copy: runs that differ only in their last step's draws redo only it.

Below the enumerator: the toy world the proofs run in (a 4-token target and drafters for
it, engines with the shipped method settings), the runner that takes requests through an
engine for a number of speculative steps, and the reference (the target's conditionals,
computed apart from the engine).
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Hashable, Iterator, Sequence, TypeVar

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import specdec.engine.sampling as sampling
from specdec.config import SERVED_SETTINGS, EngineConfig, SamplingParams, ServingConfig, SpeculativeConfig
from specdec.engine.drafters.base import Drafter
from specdec.engine.drafters.eagle3 import Eagle3Drafter
from specdec.engine.drafters.medusa import MedusaDrafter
from specdec.engine.drafters.ngram import NgramDrafter
from specdec.engine.drafters.suffix import SuffixCorpora, SuffixDrafter
from specdec.engine.models.eagle3_head import Eagle3Head, load_eagle3
from specdec.engine.models.llama import Transformer, build_batch
from specdec.engine.models.loading import load_transformer
from specdec.engine.models.medusa_heads import MedusaHeads
from specdec.engine.planner import VerifyCost
from specdec.serving.runtime import build_drafters, served_methods
from specdec.serving.spec_engine import SpecEngine, StepOutput
from specdec.serving.state import FINISH_EOS

_REAL_SAMPLE, _REAL_UNIFORM = sampling.sample, sampling.uniform
S = TypeVar("S")


class ReplayDiverged(AssertionError):
    pass


class _Choices:
    """The depth-first walk over every combination of random outcomes, and the random
    variables of the current run (stream position -> the interval it is known to lie in)."""

    def __init__(self, streams: bool = True):
        self.streams = streams
        self.path: list[list[int]] = []  # per branch point of the current run: [chosen, options]
        self.position = 0
        self.weight = 1.0
        self.intervals: dict[Hashable, tuple[float, float]] = {}
        self.drawn: dict[int, tuple[torch.Generator, int]] = {}  # id(generator) -> (it, draws so far)
        self.fresh = 0

    def begin(self) -> None:
        self.position, self.weight = 0, 1.0
        self.intervals, self.drawn, self.fresh = {}, {}, 0

    @property
    def unchanged(self) -> int:
        """How many leading branch points the next run takes as the last one did (after
        advance: all but the last of the path)."""
        return len(self.path) - 1

    def snapshot(self) -> tuple:
        return self.position, self.weight, dict(self.intervals), dict(self.drawn), self.fresh

    def restore(self, snapshot: tuple) -> None:
        position, self.weight, intervals, drawn, self.fresh = snapshot
        self.position, self.intervals, self.drawn = position, dict(intervals), dict(drawn)

    def variable(self, generator: torch.Generator | None) -> Hashable:
        """The stream position of the next draw from `generator`."""
        if generator is None or not self.streams:
            self.fresh += 1
            return ("fresh", self.fresh)
        held, n = self.drawn.get(id(generator), (generator, 0))
        self.drawn[id(generator)] = (generator, n + 1)  # the generator held: its id is not reused within the run
        return (generator.initial_seed(), n)

    def split(self, var: Hashable, cuts: list[tuple[Hashable, float, float]]) -> Hashable:
        """var lies in one of the intervals [lo, hi) of `cuts` (outcome, lo, hi): choose one,
        weighed by its share of what var is known to lie in."""
        lo, hi = self.intervals.get(var, (0.0, 1.0))
        options = []
        for value, a, b in cuts:
            a, b = max(a, lo), min(b, hi)
            if b > a:
                options.append((value, (b - a) / (hi - lo), (a, b)))
        value, interval = self.choose(options)
        self.intervals[var] = interval
        return value

    def choose(self, options: list[tuple[Hashable, float, tuple[float, float]]]) -> tuple[Hashable, tuple[float, float]]:
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
        value, p, interval = options[chosen]
        self.weight *= p
        return value, interval

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
    """One uniform draw u, known only through the comparisons the caller makes with it."""

    def __init__(self, choices: _Choices, var: Hashable, scale: float = 1.0):
        self.choices, self.var, self.scale = choices, var, scale

    def __mul__(self, factor) -> "_Uniform":
        return _Uniform(self.choices, self.var, self.scale * float(factor))

    __rmul__ = __mul__

    def __lt__(self, bound) -> bool:  # u * scale < bound
        bound = float(bound)
        if self.scale <= 0:
            cut = 1.0 if bound > 0 else 0.0
        else:
            cut = min(max(bound / self.scale, 0.0), 1.0)
        return self.choices.split(self.var, [(True, 0.0, cut), (False, cut, 1.0)])

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
        """Inverse CDF, as sampling.sample draws: token t where cdf[t - 1] <= u < cdf[t]."""
        cdf = probs.double().cumsum(-1)
        bounds = (cdf / cdf[-1]).tolist()
        cuts = [(t, bounds[t - 1] if t else 0.0, bounds[t]) for t in range(len(bounds))]
        return int(choices.split(choices.variable(generator), cuts))

    def uniform(generator=None) -> _Uniform:
        return _Uniform(choices, choices.variable(generator))

    swapped = []
    for module in _patched_modules():
        for name, real, fake in (("sample", _REAL_SAMPLE, sample), ("uniform", _REAL_UNIFORM, uniform)):
            if getattr(module, name, None) is real:
                setattr(module, name, fake)
                swapped.append((module, name, real))
    clock = _Clock()
    saved_clocks = (time.perf_counter, time.monotonic)
    time.perf_counter = time.monotonic = clock
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    # Checkpoints share generators: the fake draws never move their state, and a stream is
    # known by the generator object (its seed and the draws it made, _Choices.drawn). A
    # grammar's matcher (native) is copied by forking it.
    copiers = {torch.Generator: lambda generator, memo: generator}
    if "xgrammar" in sys.modules:
        copiers[sys.modules["xgrammar"].GrammarMatcher] = lambda matcher, memo: matcher.fork()
    copy._deepcopy_dispatch.update(copiers)
    try:
        yield
    finally:
        for cls in copiers:
            del copy._deepcopy_dispatch[cls]
        torch.set_num_threads(threads)
        time.perf_counter, time.monotonic = saved_clocks
        for module, name, real in swapped:
            setattr(module, name, real)


def exact_outcomes(run: Callable[[], Hashable], max_runs: int = 20_000, streams: bool = True) -> dict[Hashable, float]:
    """result -> probability, over every combination of the random outcomes `run` meets.
    `run` must start from the same state each time (it is replayed). streams=False: every
    draw independent of every other, whatever its generator (the enumeration before streams
    were honoured; the generator control shows what it misses)."""
    return staged_outcomes(lambda: None, lambda _: run(), max_runs=max_runs, streams=streams)


def staged_outcomes(start: Callable[[], S], advance: Callable[[S], Hashable | None], memo: dict | None = None,
                    max_runs: int = 20_000, streams: bool = True, checkpoints: bool = True) -> dict[Hashable, float]:
    """exact_outcomes for a run in stages: start() makes its state, advance(state) runs one
    stage on it and returns the result once there is one (None: more stages). After each
    stage the state is kept (a deepcopy; `memo` names what copies share, such as the
    models), with the branch points met so far; a replay that would meet the same ones
    resumes from the last such checkpoint instead of recomputing the stages before it. Depth
    first, runs that differ only in their last stage's draws redo only that stage
    (checkpoints=False: every run from the start)."""
    choices = _Choices(streams)
    dist: dict[Hashable, float] = defaultdict(float)
    saved: list[tuple[int, tuple, object]] = []  # (branch points met, choices, state), along the path
    runs = 0
    with _enumerating(choices):
        while True:
            choices.begin()
            while saved and saved[-1][0] > choices.unchanged:
                saved.pop()
            if saved:
                _, snapshot, state = saved[-1]
                choices.restore(snapshot)
                state = copy.deepcopy(state, dict(memo or {}))
            else:
                state = start()
            while (result := advance(state)) is None:
                if checkpoints:
                    saved.append((choices.position, choices.snapshot(), copy.deepcopy(state, dict(memo or {}))))
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


# ---- the toy world the proofs run in ------------------------------------------------------
# Four tokens, every one of non-zero probability: every acceptance and rejection branch of
# every draft position carries weight (cut by top-k, drafts outside the target's top-k are
# rejected with certainty; the top_k cases run for that and for depth).
VOCAB = 4
PROMPT = (1, 2, 3, 1, 2, 3, 1)  # repetitive, so prompt lookup (n-gram, hybrid) finds continuations
# Two steps at the largest shipped budget (16 draft tokens and a bonus each) fit in the request.
MAX_TOKENS = 40
MAX_SEQ_LEN = len(PROMPT) + MAX_TOKENS + 8
END = 0  # the toy's end token (EOS)


@dataclass
class Toy:
    """A 4-token target, an EAGLE-3 head, Medusa heads and a draft model sized for it."""

    target: Transformer
    head: Eagle3Head
    medusa: MedusaHeads
    target_dir: Path
    draft_dir: Path


def build_toy(root: Path, arch: str = "llama", **family) -> Toy:
    """arch and family (e.g. sliding_window): another decoder family for the same toy (issue 46)."""
    from conftest import save_tiny_hf
    from test_eagle3 import random_published_checkpoint
    from test_medusa import random_heads

    shape = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, initializer_range=0.15, eos_token_id=END,
                 bos_token_id=0, **family)
    target_dir = save_tiny_hf(root / "target", arch=arch, num_hidden_layers=2, seed=11, **shape)
    target = load_transformer(target_dir)
    sd = random_published_checkpoint(root / "head", hidden=32, inter=64, heads=4, kv=2, vocab=VOCAB,
                                     draft_vocab=VOCAB - 1, taps=(0, 1, 1))
    sd["lm_head.weight"] = sd["lm_head.weight"] * 12  # confident but not one-hot drafts
    save_file({k: v.contiguous() for k, v in sd.items()}, str(root / "head" / "model.safetensors"))
    draft_dir = save_tiny_hf(root / "draft", num_hidden_layers=1, seed=12, **shape)
    # four heads: the shipped Medusa depth (max_draft_len 4) is reachable
    medusa = random_heads(target.cfg, num_heads=4, draft_vocab=VOCAB - 1, sharpness=6.0, seed=4)
    return Toy(target, load_eagle3(root / "head", target.embed, target.cfg), medusa, target_dir, draft_dir)


@pytest.fixture(scope="module")
def toy(tmp_path_factory) -> Toy:
    return build_toy(tmp_path_factory.mktemp("exact"))


def shipped_max_draft_tokens() -> int:
    return ServingConfig.from_file(SERVED_SETTINGS).engine.max_num_draft_tokens


def staircase_cost() -> VerifyCost:
    """Verification seconds by tokens, shaped as measured on CPU (flat while the weights
    dominate, then a step as the next GEMM tile fills): 1-3 tokens 30 ms, 4 tokens 40 ms,
    5-8 tokens 41-42 ms. Expected tokens per second rises to 3 tokens, falls at 4 and can
    rise again after: two peaks, the case where keeping the best prefix of a sampled tree
    would depend on later draws (planner.select stops at the first peak for those)."""
    cost = VerifyCost()
    for tokens, seconds in {1: 0.030, 2: 0.030, 3: 0.030, 4: 0.040, 5: 0.041, 6: 0.041, 7: 0.042, 8: 0.042}.items():
        cost.observe(tokens, seconds, 1)
    cost.fit()
    return cost


def flat_cost() -> VerifyCost:
    """Verification that costs the same for any tree up to 40 tokens: the planner verifies
    every node it is given (the shipped budget whole)."""
    cost = VerifyCost()
    for tokens in (1, 40):
        cost.observe(tokens, 0.030, 1)
    cost.fit()
    return cost


def drafter_for(toy: Toy, name: str, spec: SpeculativeConfig, config: EngineConfig, corpora: SuffixCorpora) -> Drafter:
    if spec.method == "eagle3":
        return Eagle3Drafter(toy.head, spec, config.max_batch_size, config.max_seq_len, corpora if spec.hybrid_suffix else None)
    if spec.method == "suffix":
        return SuffixDrafter(spec, corpora)
    if spec.method == "medusa":
        return MedusaDrafter(toy.medusa, spec)
    if spec.method == "ngram":
        return NgramDrafter(spec)
    spec = dataclasses.replace(spec, speculative_model=str(toy.draft_dir), colocated=True)
    return build_drafters(toy.target.cfg, {name: spec}, config)[name]


def make_engine(toy: Toy, methods: Sequence[str], apart: Sequence[str] = (), prefix_cache: bool = False,
                max_batch_size: int = 1, cost: Callable[[], VerifyCost] = staircase_cost) -> SpecEngine:
    """The engine with the shipped settings (model_repository/specdec.json) of `methods`
    drafted beside the target and of `apart` drafted elsewhere (their trees come with each
    step). The suffix corpus holds an earlier request of the same scope whose continuation
    of the prompt differs from the prompt's own pattern: the suffix drafts (alone, and
    merged into the hybrid) branch off it."""
    specs = served_methods()
    config = EngineConfig(max_batch_size=max_batch_size, max_seq_len=MAX_SEQ_LEN, draft_dtype="float32",
                          max_num_draft_tokens=shipped_max_draft_tokens(), enable_prefix_caching=prefix_cache)
    corpora = SuffixCorpora(1000, 4)
    corpora.add(None, list(PROMPT) + [0, 0, 2])
    drafters = {name: drafter_for(toy, name, specs[name], config, corpora) for name in methods}
    engine = SpecEngine(toy.target, config, drafters=drafters, methods={name: specs[name] for name in apart})
    engine.speculator.planner.verify_cost = cost()
    engine.speculator.planner.step_extra_seconds = 0.0
    return engine


def _shared(engine: SpecEngine) -> dict[int, object]:
    """deepcopy memo: what every copy of the engine shares (read only): the models, and the
    grammar compiler (its cache of compiled guides)."""
    shared = [engine.speculator.target_pass.target, engine.speculator.target_pass.grammars]
    for drafter in engine.drafts.drafters.values():
        shared += [v for v in vars(drafter).values() if isinstance(v, torch.nn.Module)]
    return {id(m): m for m in shared if m is not None}


# ---- running requests through the engine, every outcome ----------------------------------
@dataclass(frozen=True)
class Request:
    method: str
    params: SamplingParams
    budget: int | None = None  # num_draft_tokens; None: the method's shipped default, as the server gives it
    prompt: tuple[int, ...] = PROMPT
    join: int = 0  # the engine step (0: the first) in which it is added


@dataclass(frozen=True)
class Verified:
    """One verification step of one request, as a run saw it."""

    draft_tokens: int
    accepted: int
    depth: int
    cached_tokens: int = 0  # of the request's prompt (the same in each of its steps)


@dataclass
class Outcomes:
    """Every run's outputs (per request: the tokens emitted, the end token included when one
    ended it) with their probabilities, and what each run verified."""

    joint: dict[tuple[tuple[int, ...], ...], float]
    runs: list[tuple[tuple[Verified, ...], ...]]  # per run, per request

    def marginal(self, i: int = 0) -> dict[tuple[int, ...], float]:
        out: dict[tuple[int, ...], float] = defaultdict(float)
        for outputs, p in self.joint.items():
            out[outputs[i]] += p
        return dict(out)

    def steps(self, i: int = 0) -> list[tuple[Verified, ...]]:
        return [run[i] for run in self.runs]

    def partially_accepted_then_drafted(self, i: int = 0) -> bool:
        """Some run rejected part of its first tree's path and verified a second tree from there."""
        return any(len(s) > 1 and s[0].accepted < s[0].depth and s[1].draft_tokens for s in self.steps(i))


def emitted_tokens(out: StepOutput) -> list[int]:
    """A step's output tokens, and the end token that finished the request (not output, but
    drawn: the stream's next token)."""
    tokens = list(out.new_token_ids)
    if out.finish_reason == FINISH_EOS:
        tokens.append(out.step.emitted[len(tokens)])
    return tokens


class _DraftingForMoreSteps:
    """The speculator's _draft_next, skipping the sequences that have verified their last
    tree: the tree drafted after it plays no part in the output, and its draws would only
    multiply the enumeration. An object, not a closure, so that a copy of the engine gets a
    copy bound to it."""

    def __init__(self, draft_next, verified: dict[str, list], steps: int):
        self.draft_next, self.verified, self.steps = draft_next, verified, steps

    def __call__(self, items, results, first=False):
        # this step's verification (first: the prefill's first token) is not counted yet
        keep = [(item, result) for item, result in zip(items, results)
                if len(self.verified.get(item.seq_id, ())) + (0 if first else 1) < self.steps]
        self.draft_next([item for item, _ in keep], [result for _, result in keep], first)


class _Run:
    """`requests` on `engine`, one engine step per stage, until each has verified `steps`
    trees (or finished): their emitted tokens, and their verification steps."""

    def __init__(self, engine: SpecEngine, requests: Sequence[Request], steps: int):
        self.engine, self.requests, self.steps = engine, list(requests), steps
        self.ids = [str(i) for i in range(len(requests))]
        self.tokens: dict[str, list[int]] = {rid: [] for rid in self.ids}
        self.verified: dict[str, list[Verified]] = {rid: [] for rid in self.ids}
        self.done: set[str] = set()
        self.step = 0
        speculator = engine.speculator
        speculator._draft_next = _DraftingForMoreSteps(speculator._draft_next, self.verified, steps)

    def advance(self) -> tuple[tuple, tuple] | None:
        if self.step > 4 * len(self.ids) * (self.steps + 2):
            raise AssertionError("the requests did not finish their steps")
        engine = self.engine
        for rid, req in zip(self.ids, self.requests):
            if req.join == self.step:
                engine.add_request(rid, list(req.prompt), req.params, req.method, req.budget)
        for out in engine.step():
            rid = out.request_id
            self.tokens[rid] += emitted_tokens(out)
            if out.verified:
                self.verified[rid].append(Verified(out.step.draft_tokens, out.step.accepted, out.step.draft_depth,
                                                   out.stats.cached_prompt_tokens))
            if out.finished or len(self.verified[rid]) == self.steps:
                self.done.add(rid)
                if not out.finished:
                    engine.cancel(rid)
        self.step += 1
        if len(self.done) < len(self.ids):
            return None
        return tuple(tuple(self.tokens[rid]) for rid in self.ids), tuple(tuple(self.verified[rid]) for rid in self.ids)


def request_outcomes(engine: SpecEngine, requests: Sequence[Request], steps: int = 2, max_runs: int = 20_000,
                     streams: bool = True, checkpoints: bool = True) -> Outcomes:
    """Every outcome of `requests` run together for `steps` verification steps each (after
    their prefill). Each replay starts from a copy of `engine` as given (the same KV and
    prefix cache, drafter state, planner estimates and suffix corpus every time), or resumes
    from a copy of the state after an engine step whose draws it shares."""
    memo = _shared(engine)
    runs = []

    def advance(run: _Run):
        out = run.advance()
        if out is None:
            return None
        outputs, verified = out
        runs.append(verified)
        return outputs

    dist = staged_outcomes(lambda: _Run(copy.deepcopy(engine, dict(memo)), requests, steps), advance, memo, max_runs, streams,
                           checkpoints)
    return Outcomes(dist, runs)


def one_request(toy: Toy, method: str, params: SamplingParams, budget: int | None = None, steps: int = 2,
                **engine_options) -> Outcomes:
    return request_outcomes(make_engine(toy, [method], **engine_options), [Request(method, params, budget)], steps)


# ---- the reference: the target's distributions, from an independent implementation ----------
def target_conditionals(target: Transformer, params: SamplingParams, prefixes, prompt: Sequence[int] = PROMPT,
                        allowed: Callable[[tuple[int, ...]], np.ndarray] | None = None) -> dict[tuple[int, ...], np.ndarray]:
    """The target's processed next-token distribution after prompt + each prefix (the logits
    rules and sampling written in numpy, tests/engine/test_speculative.py; allowed(prefix): a
    grammar's mask, by hand)."""
    from test_speculative import reference_probs, reference_rules

    prefixes = list(prefixes)
    longest = max(len(p) for p in prefixes)
    cache = target.new_cache(len(prefixes), len(prompt) + longest + 1, 4)
    slots = [cache.allocate() for _ in prefixes]
    rows = [list(prompt) + list(p) for p in prefixes]
    logits = target(build_batch(slots, [0] * len(rows), rows, sliding_window=target.cfg.sliding_window), cache,
                    last_only=True).logits[:, 0]
    out = {}
    for i, p in enumerate(prefixes):
        ruled = reference_rules(logits[i].double().numpy(), params, p, list(prompt))
        if allowed is not None:
            ruled[~allowed(p)] = -np.inf
        out[p] = reference_probs(ruled, params)
    return out


def worst_deviation(toy: Toy, dist: dict, params: SamplingParams, prompt: Sequence[int] = PROMPT,
                    allowed: Callable[[tuple[int, ...]], np.ndarray] | None = None) -> tuple[float, tuple[int, ...]]:
    """The largest |P(next = x | emitted prefix) - target(x | prefix)| over prefixes and x."""
    cond = conditionals(dist)
    reference = target_conditionals(toy.target, params, cond, prompt, allowed)
    worst, where = 0.0, ()
    for prefix, nxt in cond.items():
        got = np.zeros(VOCAB)
        for token, p in nxt.items():
            got[token] = p
        deviation = float(np.abs(got - reference[prefix]).max())
        if deviation > worst:
            worst, where = deviation, prefix
    return worst, where
