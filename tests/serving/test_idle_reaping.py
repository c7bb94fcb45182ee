"""A client that vanishes without an END leaves a sequence behind in the drafter (a draft
model served apart holds a KV slot per sequence); the drafter model calls
release_idle(idle_timeout_s) at the top of every execute() (drafter_model.py). The verifier
needs no reaping: each sequence lives exactly as long as its decoupled request (in-flight
batching), and a client that goes away cancels it. Here the drafter's call runs on a fake
clock: the abandoned sequence is freed with its slot, the live one is not."""
from __future__ import annotations

import pytest

import specdec.engine.drafters.service
import specdec.engine.sequences
import specdec.engine.target
from specdec.config import EngineConfig, SamplingParams, SpeculativeConfig
from specdec.engine.drafters.service import DraftService
from specdec.engine.sequences import SequenceRecord
from specdec.errors import UnknownSequenceError
from specdec.serving.runtime import build_drafters

from conftest import save_tiny_hf

IDLE_S = 300.0
PROMPT = [5, 6, 7, 5, 6, 7, 5]


class FakeClock:
    """Stands in for the `time` module of the modules that stamp last_used."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    def perf_counter(self) -> float:
        return self.now


@pytest.fixture()
def clock(monkeypatch) -> FakeClock:
    fake = FakeClock()
    for module in (specdec.engine.sequences, specdec.engine.target, specdec.engine.drafters.service):
        monkeypatch.setattr(module, "time", fake)
    return fake


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return save_tiny_hf(tmp_path_factory.mktemp("idle_target"))


def test_the_drafter_reaps_an_abandoned_sequence_and_frees_its_draft_slot(clock, target_dir, tmp_path):
    """The `drafter` model's state (a draft model served apart holds a KV slot per sequence)."""
    from specdec.engine.models.loading import read_model_config

    draft_dir = save_tiny_hf(tmp_path / "draft", seed=1, num_hidden_layers=1)
    spec = SpeculativeConfig(method="draft_model", speculative_model=str(draft_dir), max_draft_len=3, colocated=False)
    engine = EngineConfig(max_batch_size=2, max_seq_len=64, max_num_draft_tokens=4, draft_dtype="float32")
    drafter = build_drafters(read_model_config(target_dir), {"dm": spec}, engine, target_dir)["dm"]
    drafts = DraftService({"dm": drafter})
    params = SamplingParams(max_tokens=16)
    drafts.start(SequenceRecord(11, list(PROMPT), params, "dm", output_ids=[5]))
    drafts.start(SequenceRecord(12, list(PROMPT), params, "dm", output_ids=[5]))
    assert drafter.cache.num_free == 0

    clock.now += IDLE_S - 1
    drafts.advance(12, [6], 0)  # the live sequence hears of a verified step
    clock.now += 2
    assert drafts.release_idle(IDLE_S) == [11]
    assert 11 not in drafts and drafts.active == 1 and drafter.cache.num_free == 1
    assert len(drafts.propose([(12, 3)])[0]) == 3  # the live one still drafts
    with pytest.raises(UnknownSequenceError):
        drafts.propose([(11, 3)])
