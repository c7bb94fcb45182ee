"""Stop strings end speculative output exactly where they end the baseline (issue 22).

The rules are applied one token at a time, so how tokens arrive (one per step, or a whole
accepted run at once) must not change the kept ids, the text or the finish reason. Then the
real engine and the real server: every method equals the baseline on derived stop sets.
"""
from __future__ import annotations

import random

import pytest

from specdec.bench.check_stops import (Case, Outcome, check, compare, engine_runner, literal_decoder, passed, server_runner,
                                       stop_cut, stop_sets)
from specdec.config import SamplingParams
from specdec.serving.detok import IncrementalDetokenizer
from specdec.serving.state import FINISH_EOS, FINISH_LENGTH, FINISH_STOP, RequestState

TEXTS = [
    "import React from 'react-dom';\nimport { useState } from 'react';",
    "Here is the definition of a function: def add(a, b): return a + b. That is all.",
    "Grüße aus Köln! 東京は晴れです。 Emoji 🙂🚀 end.",
    "The quick brown fox jumps over the lazy dog. The end is near.",
]
STOP_SETS = [(), (".",), (" is", "."), ("def", ":"), ("\n",), ("e i",), ("end", "The"), ("晴れ",), ("🚀",), ("x" * 40,),
             ("'re",), (" '",)]


def run_request(tokenizer, ids, stops, arrivals, max_tokens=1000, eos=frozenset()):
    """Feed ids in the given chunk sizes; return (kept ids, text, finish reason)."""
    req = RequestState("r", [1], SamplingParams(max_tokens=max_tokens, stop=stops), "none", 0, 4096, eos,
                       detok=IncrementalDetokenizer(tokenizer, stops))
    text, at = [], 0
    for size in arrivals:
        if req.finished:
            break
        kept, delta = req.accept(ids[at : at + size])
        text.append(delta)
        at += size
    if not req.finished:  # the caller's budget ran out: end as max_tokens would
        req.finish(FINISH_LENGTH)
        text.append(req.detok.flush())
    return req.output_ids, "".join(text), req.finish_reason


def splits(n: int, rng: random.Random) -> list[list[int]]:
    out = [[1] * n, [n]]
    for _ in range(4):
        sizes, left = [], n
        while left:
            sizes.append(min(left, rng.randint(1, 6)))
            left -= sizes[-1]
        out.append(sizes)
    return out


@pytest.mark.parametrize("text", TEXTS)
def test_how_tokens_arrive_does_not_change_ids_text_or_reason(smol_tokenizer, text):
    ids = smol_tokenizer.encode(text, add_special_tokens=False)
    rng = random.Random(0)
    for stops in STOP_SETS:
        results = {tuple(s): run_request(smol_tokenizer, ids, stops, s) for s in splits(len(ids), rng)}
        first = next(iter(results.values()))
        assert all(r == first for r in results.values()), (stops, results)
        kept, out_text, reason = first
        # Plain decoding's cut: the shortest prefix whose text holds a stop, cut before the earliest one in it.
        assert (len(kept), out_text) == stop_cut(ids, stops, literal_decoder(smol_tokenizer)), stops
        if reason == FINISH_STOP:
            shorter = smol_tokenizer.decode(kept[:-1], clean_up_tokenization_spaces=False)
            assert not any(s in shorter for s in stops) and any(s in smol_tokenizer.decode(kept, clean_up_tokenization_spaces=False) for s in stops)
        else:
            assert kept == ids and not any(s in text for s in stops)


def test_text_is_literal_no_space_clean_up(smol_tokenizer):
    """transformers' decode turns " 're" into "'re"; released text must never be rewritten."""
    text = "import React from 'react-dom';"
    ids = smol_tokenizer.encode(text, add_special_tokens=False)
    assert run_request(smol_tokenizer, ids, (), [1] * len(ids))[1] == text
    assert run_request(smol_tokenizer, ids, (";",), [1] * len(ids))[1] == "import React from 'react-dom'"


def test_earliest_stop_wins_not_the_first_listed(smol_tokenizer):
    ids = smol_tokenizer.encode("one two three four", add_special_tokens=False)
    kept, text, reason = run_request(smol_tokenizer, ids, ("four", "two"), [len(ids)])
    assert (text, reason) == ("one ", FINISH_STOP)
    assert smol_tokenizer.decode(kept).endswith("two")
    detok = IncrementalDetokenizer(smol_tokenizer, ("four", "two"))  # it reports which stop ended it
    assert any(detok.add(t) for t in ids) and detok.stopped == "two"


def test_a_stop_straddling_steps_is_held_back_then_cut(smol_tokenizer):
    ids = smol_tokenizer.encode("Here is the answer", add_special_tokens=False)
    detok = IncrementalDetokenizer(smol_tokenizer, ("e is t",))
    released = []
    for t in ids:
        if detok.add(t):
            break
        released.append(detok.release())
    assert detok.stopped == "e is t"
    assert "".join(released) + detok.release() == "Her"


def test_partial_utf8_is_held_until_complete_and_flushed_at_the_end(smol_tokenizer):
    ids = smol_tokenizer.encode("a🚀", add_special_tokens=False)
    detok = IncrementalDetokenizer(smol_tokenizer, ())
    pieces = []
    for t in ids:
        detok.add(t)
        pieces.append(detok.release())
    assert "".join(pieces) == "a🚀" and "\ufffd" not in "".join(pieces)
    # A character cut off by the end of the sequence shows as U+FFFD, as a full decode does.
    cut = IncrementalDetokenizer(smol_tokenizer, ())
    for t in ids[:-1]:
        cut.add(t)
    assert cut.release() + cut.flush() == smol_tokenizer.decode(ids[:-1])


def test_eos_length_and_stop_order_per_token(smol_tokenizer):
    ids = smol_tokenizer.encode("Hello world. Bye", add_special_tokens=False)
    dot = next(i for i, t in enumerate(ids) if "." in smol_tokenizer.decode([t]))
    # The stop completes on the last allowed token: stop wins (as the baseline would see it).
    assert run_request(smol_tokenizer, ids, (".",), [len(ids)], max_tokens=dot + 1)[2] == FINISH_STOP
    assert run_request(smol_tokenizer, ids, (".",), [len(ids)], max_tokens=dot)[2] == FINISH_LENGTH
    # An end token before the stop: eos, the end token not kept, the text before it released.
    kept, text, reason = run_request(smol_tokenizer, ids, (".",), [len(ids)], eos=frozenset({ids[1]}))
    assert (kept, reason) == (ids[:1], FINISH_EOS) and text == smol_tokenizer.decode(ids[:1])


PIECES = {1: "a", 2: ".", 3: " b", 4: "c", 5: "x", 6: "abc", 7: "d"}


def piece_text(ids) -> str:
    return "".join(PIECES[i] for i in ids)


def test_compare_flags_a_method_that_differs_and_a_baseline_cut_wrong():
    """The check itself can fail (a negative control for check-stops)."""
    cases = [Case(0, (".",))]
    unstopped = [Outcome("a. b", (1, 2, 3), 3, "length")]
    good = Outcome("a", (1, 2), 2, "stop")
    assert passed(compare(cases, unstopped, {"none": [good], "m": [good]}, piece_text))
    assert not passed(compare(cases, unstopped, {"none": [good], "m": [Outcome("a", (1, 2, 3), 3, "stop")]}, piece_text))
    assert not passed(compare(cases, unstopped, {"none": [Outcome("a.", (1, 2), 2, "stop")], "m": [Outcome("a.", (1, 2), 2, "stop")]},
                              piece_text))


def test_compare_wants_the_shortest_stopping_prefix_not_any_prefix():
    """A baseline that kept one token past the stop ("a." then " b") is a prefix of the
    unstopped ids with the right text, and still wrong."""
    cases = [Case(0, (".",))]
    unstopped = [Outcome("a. bc", (1, 2, 3, 4), 4, "length")]
    late = Outcome("a", (1, 2, 3), 3, "stop")
    assert compare(cases, unstopped, {"none": [late]}, piece_text)["baseline_cut_wrong"] == [0]
    assert not compare(cases, unstopped, {"none": [Outcome("a", (1, 2), 2, "stop")]}, piece_text)["baseline_cut_wrong"]


def test_overlapping_stops_the_first_to_complete_wins():
    """Stops "abc" and "b": arriving as "a", " b", "c", the " b" token completes "b" first,
    so the output ends there, cut before "b", although "abc" would start earlier. Arriving
    as one token "abc", both complete at once and the earliest start wins. The engine's
    detokenizer and check-stops' rule agree on both."""
    assert stop_cut((1, 3, 4), ("a bc", "b"), piece_text) == (2, "a ")
    assert stop_cut((6, 7), ("abc", "b"), piece_text) == (1, "")
    assert stop_cut((5, 7), ("abc",), piece_text) == (2, "xd")  # never met: everything


def test_overlapping_stops_in_the_engine(smol_tokenizer):
    ids = smol_tokenizer.encode("one two three four", add_special_tokens=False)
    decode = literal_decoder(smol_tokenizer)
    stops = ("e two three", "two")  # "two" completes at " two", before the longer stop that starts earlier
    kept, text, reason = run_request(smol_tokenizer, ids, stops, [len(ids)])
    assert (len(kept), text, reason) == (*stop_cut(ids, stops, decode), FINISH_STOP)
    assert text == "one " and decode(kept).endswith("two")


def test_stop_sets_include_a_later_listed_earlier_stop():
    sets = stop_sets("The quick brown fox jumps over the lazy dog")
    pairs = [s for s in sets if len(s) == 2 and s not in (( " is", "."), ("def", ":"))]
    text = "The quick brown fox jumps over the lazy dog"
    assert pairs and all(-1 < text.find(second) < text.find(first) for first, second in pairs)


# ---- the real engine and the real server -------------------------------------------------

ENGINE_METHODS = ("ngram", "eagle3-hybrid", "eagle3-tree-adaptive", "draft_model-colocated", "medusa")


@pytest.fixture(scope="module")
def chat_prompts(smol_tokenizer):
    from specdec.tools.sharegpt import sharegpt_prompts

    return sharegpt_prompts(3, seed=7, tokenizer=smol_tokenizer, max_tokens=40)


def test_every_method_stops_where_the_baseline_stops_in_process(smol_tokenizer, chat_prompts):
    from specdec.config import ServingConfig
    from specdec.config import SERVED_SETTINGS
    from specdec.serving.runtime import encode_prompt

    settings = ServingConfig.from_file(SERVED_SETTINGS)
    run = engine_runner(settings, concurrency=8)
    report = check(run, [encode_prompt(smol_tokenizer, t) for t in chat_prompts], ENGINE_METHODS, max_tokens=32,
                   decode=literal_decoder(smol_tokenizer))
    assert report["cases"] >= 15
    assert passed(report), report
    assert all(m["stopped"] > 0 for m in report["methods"].values())


@pytest.mark.server
def test_every_method_stops_where_the_baseline_stops_through_the_server(triton_server, chat_prompts, smol_tokenizer):
    """Through speculative_loop (ids) and the ensemble (text, output_tokens, finish_reason)."""
    run = server_runner(triton_server.endpoints.grpc, concurrency=8)
    report = check(run, chat_prompts[:2], ("ngram", "eagle3-hybrid", "draft_model"), max_tokens=32,
                   decode=literal_decoder(smol_tokenizer))
    assert passed(report), report
    assert all(m["stopped"] > 0 for m in report["methods"].values())
