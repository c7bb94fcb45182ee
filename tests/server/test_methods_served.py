"""Every method the model repository ships (model_repository/specdec.json), through the real
server's `speculative_loop` over gRPC (in `make test`): greedy token ids equal the matched
baseline's (num_draft_tokens 0, same prompts) with one stream and with four concurrent
streams, and the method's counters on the metrics port rise.

The method list is read from specdec.json, so a method added there is held here too. Four
streams is the most at which the fixed methods still draft (`max_concurrency: 4`), so their
draft counter must rise in the four-stream phase too; the adaptive planner may choose to
draft little in a crowded batch, so for those methods drafting is asserted at one stream.
Acceptance is asserted over both phases, for every method (the default, eagle3-hybrid, too).
A planned method whose measured costs say drafting does not pay (a loaded machine) verifies
only its exploration nodes, one per EXPLORE_EVERY steps, which 16-token answers can leave
all rejected; such a method then also answers LONG_PROMPTS (long, predictable answers, the
output again equal to the baseline's) before its acceptance is asserted."""
from __future__ import annotations

import asyncio
import json

import pytest

import specdec_wire as P
from specdec.config import METHOD_NONE
from specdec.config import SERVED_SETTINGS
from specdec_client import AsyncSpecDecClient, GenerateRequest, server_metrics

pytestmark = pytest.mark.server

SETTINGS = json.loads(SERVED_SETTINGS.read_text())
SHIPPED = list(SETTINGS["methods"])
# The first SOLO run alone too. They are predictable in the two ways drafters are: counting
# (what models, the heads and draft models, guess well) and copying the prompt (what n-gram
# lookup finds), so every drafter, the planned ones too, gets some drafts accepted.
PROMPTS = [
    "Count from 1 to 20, separated by commas.",
    "Repeat after me: speculative decoding is lossless. Repeat it again.",
    "Copy this text: one two three four five six seven eight.",
    "List the days of the week.",
    "Write a Python function that returns the square of a number.",
    "What is the capital of Italy?",
    "Name three primary colors.",
    "Repeat this sentence exactly: the quick brown fox jumps over the lazy dog.",
]
SOLO = 3
STREAMS = 4
MAX_TOKENS = 16
# Answers that repeat (what n-gram lookup copies) and count (what the heads and draft models
# guess): long enough for several exploration nodes of a planned method.
LONG_PROMPTS = [
    "Repeat after me: speculative decoding is lossless. Repeat it again.",
    "List the numbers from 1 to 30, one per line.",
]
LONG_MAX_TOKENS = 64


BASELINE = METHOD_NONE  # plain decoding (num_draft_tokens 0)


def generate(server, prompts: list[str], method: str, concurrency: int,
             max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    """Token ids per prompt, at most `concurrency` streams in flight over one channel."""

    async def run() -> list[list[int]]:
        gate = asyncio.Semaphore(concurrency)
        async with AsyncSpecDecClient(server.endpoints.grpc, model="speculative_loop") as client:
            async def one(prompt: str) -> list[int]:
                async with gate:
                    request = GenerateRequest(prompt, max_tokens=max_tokens, method=method,
                                              num_draft_tokens=0 if method == BASELINE else None)
                    return (await client.generate(request)).token_ids

            return list(await asyncio.gather(*(one(p) for p in prompts)))

    return asyncio.run(run())


def counters(server, method: str) -> dict[str, float]:
    samples = server_metrics.scrape(server.endpoints.metrics_url)
    names = (P.ACCEPTED_TOKENS_TOTAL, P.DRAFT_TOKENS_TOTAL, P.VERIFICATION_STEPS_TOTAL)
    return {name: server_metrics.by_label(samples, name, "method").get(method, 0.0) for name in names}


@pytest.fixture(scope="module")
def baseline(triton_server) -> list[list[int]]:
    """Plain decoding of every prompt, four at once; the one-stream prompts also alone,
    which must not change them (so both phases below compare with the matched baseline)."""
    together = generate(triton_server, PROMPTS[:STREAMS], BASELINE, concurrency=STREAMS)
    assert generate(triton_server, PROMPTS[:SOLO], BASELINE, concurrency=1) == together[:SOLO]
    assert all(len(ids) > 1 for ids in together), together
    return together


@pytest.fixture(scope="module")
def long_baseline(triton_server):
    """Plain decoding of LONG_PROMPTS, made on first use (most runs never need it)."""
    made: list[list[list[int]]] = []

    def get() -> list[list[int]]:
        if not made:
            made.append(generate(triton_server, LONG_PROMPTS, BASELINE, concurrency=1, max_tokens=LONG_MAX_TOKENS))
        return made[0]

    return get


def test_the_parametrisation_holds_the_shipped_methods():
    """Guards the parametrisation below against an empty or renamed list: these four were
    never served in a test before this file."""
    assert {"eagle3-hybrid", "eagle3-tree-adaptive", "draft_model-colocated", "draft_model-adaptive"} <= set(SHIPPED)


@pytest.mark.parametrize("method", SHIPPED)
def test_shipped_method_equals_the_baseline_at_1_and_4_streams(triton_server, baseline, long_baseline, method):
    start = counters(triton_server, method)
    solo = generate(triton_server, PROMPTS[:SOLO], method, concurrency=1)
    assert solo == baseline[:SOLO], method
    after_solo = counters(triton_server, method)
    # One stream is below every load control: the method drafts (the planned ones at least
    # their exploration nodes).
    assert after_solo[P.DRAFT_TOKENS_TOTAL] > start[P.DRAFT_TOKENS_TOTAL], (method, start, after_solo)

    together = generate(triton_server, PROMPTS[:STREAMS], method, concurrency=STREAMS)
    assert together == baseline, method
    end = counters(triton_server, method)
    # Every stream verified at least its first step under this method's label.
    steps = end[P.VERIFICATION_STEPS_TOTAL] - after_solo[P.VERIFICATION_STEPS_TOTAL]
    assert steps >= STREAMS, (method, after_solo, end)
    if not SETTINGS["methods"][method].get("adaptive"):  # fixed budgets still draft at four streams
        assert end[P.DRAFT_TOKENS_TOTAL] > after_solo[P.DRAFT_TOKENS_TOTAL], (method, after_solo, end)
    if SETTINGS["methods"][method].get("adaptive") and end[P.ACCEPTED_TOKENS_TOTAL] == start[P.ACCEPTED_TOKENS_TOTAL]:
        longer = generate(triton_server, LONG_PROMPTS, method, concurrency=1, max_tokens=LONG_MAX_TOKENS)
        assert longer == long_baseline(), method
        end = counters(triton_server, method)
    # The target accepted some of the method's drafts (over both phases), the planned methods and
    # the served default included: a method that equals the baseline without speculating proves
    # nothing about its speculation.
    assert end[P.ACCEPTED_TOKENS_TOTAL] > start[P.ACCEPTED_TOKENS_TOTAL], (method, start, after_solo, end)
