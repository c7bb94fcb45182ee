"""The response path's coalescing (issue 74): rounds that were already waiting when one arrives
go out with it as one response; nothing is lost, reordered or held past its run, and an error
comes after the rounds before it."""
from __future__ import annotations

import asyncio

import pytest

from specdec.serving.loop import LoopUpdate, coalesced


def _rounds(*texts: str, finished_last: bool = True) -> list[LoopUpdate]:
    return [LoopUpdate([i], text, finished_last and i == len(texts) - 1, "length" if finished_last and i == len(texts) - 1
                       else None) for i, text in enumerate(texts)]


def _runs(rounds: list[LoopUpdate], waiting_after: list[bool], fail_at: int | None = None) -> tuple[list, BaseException | None]:
    """coalesced over `rounds`, where waiting_after[i] says whether another round was already
    waiting when round i was read (what the queue's ready() answers); the source raises before
    round fail_at."""
    read = []

    async def source():
        for i, update in enumerate(rounds):
            if i == fail_at:
                raise RuntimeError("the verifier failed")
            read.append(i)
            yield update

    async def go():
        runs, error = [], None
        try:
            async for run in coalesced(source(), lambda: waiting_after[read[-1]]):
                runs.append([u.text for u in run])
        except RuntimeError as exc:
            error = exc
        return runs, error

    return asyncio.run(go())


def test_rounds_already_waiting_go_out_with_the_one_that_came():
    runs, error = _runs(_rounds("a", "b", "c", "d", "e"), [False, True, True, False, False])
    assert runs == [["a"], ["b", "c", "d"], ["e"]] and error is None


def test_the_last_round_ends_its_run_even_with_more_waiting():
    runs, _ = _runs(_rounds("a", "b"), [True, True])
    assert runs == [["a", "b"]]


def test_nothing_waits_one_response_per_round():
    runs, _ = _runs(_rounds("a", "b", "c"), [False, False, False])
    assert runs == [["a"], ["b"], ["c"]]


@pytest.mark.parametrize("waiting", [True, False])
def test_an_error_comes_after_the_rounds_before_it(waiting):
    runs, error = _runs(_rounds("a", "b", "c", finished_last=False), [waiting] * 3, fail_at=2)
    assert runs == ([["a", "b"]] if waiting else [["a"], ["b"]])
    assert isinstance(error, RuntimeError)
