"""Losslessness computed exactly (tests/support/exact.py) for the draft model served apart, as it
ships (model_repository/specdec.json: `draft_model`, `colocated: false`).

The shipped path, in process: the verifier's EngineLoop (specdec/serving/engine_loop.py)
asks the drafter through serving/drafter_apart.py's DrafterApart and the BLS calls of
specdec/triton_models/drafter_calls.py (START with the prompt and first token, then what
the verifier committed, the budget it decided); the `drafter` model
(specdec/triton_models/drafter_model.py, initialized from a settings file as Triton does)
answers with the tree's tokens, parents and float32 draft probabilities, which DrafterCalls
checks and rebuilds into the tree the verifier verifies. Only Triton itself is a fake: a
pb_utils whose InferenceRequest.async_exec hands the request to the drafter model's
execute in this process, with the control inputs the sequence batcher adds (START, END) and
the requests of one round in one execute. Nothing else crosses a process boundary, so the
enumeration is exact here too: every draw (the target's, and the drafter's on its own
stream, seeded across the wire) is a branch point.

Two speculative steps, the shipped budget (3), top_k = 2 as in test_exact_lossless's
draft_model case; a seeded request, so the drafter's stream is the one the wire's seed
gives it (the verifier's seed plus an offset: with none, the generator control
(test_a_drafter_sharing_the_verifiers_random_stream_is_caught) in
test_exact_lossless fails)."""
from __future__ import annotations

import asyncio
import copy
import dataclasses
import json
import sys
import threading
import types

import numpy as np
import pytest
import torch

from exact import (MAX_SEQ_LEN, MAX_TOKENS, Outcomes, Request, Verified, emitted_tokens, exact_outcomes, toy,  # noqa: F401
                   worst_deviation)
from specdec.config import SERVED_SETTINGS, ServingConfig
from specdec.engine.speculator import Speculator
from specdec.serving.spec_engine import SpecEngine
from test_exact_lossless import TOLERANCE, TOP_K

METHOD = "draft_model"
STEPS = 2


# ---- Triton, faked: requests between the models' Python code, in process -----------------------
class _Tensor:
    def __init__(self, name: str, value):
        self._name, self._value = name, np.asarray(value)

    def name(self) -> str:
        return self._name

    def as_numpy(self) -> np.ndarray:
        return self._value


class _Error:
    def __init__(self, message: str):
        self._message = message

    def message(self) -> str:
        return self._message


class _Response:
    def __init__(self, output_tensors=(), error=None):
        self.tensors, self._error = {t.name(): t for t in output_tensors}, error

    def has_error(self) -> bool:
        return self._error is not None

    def error(self) -> _Error:
        return self._error


class _Metric:
    def set(self, value): ...

    def increment(self, value): ...

    def observe(self, value): ...


class _MetricFamily:
    COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"

    def __init__(self, name, description, kind):
        pass

    def Metric(self, labels, **kwargs):  # noqa: N802 - pb_utils' name
        return _Metric()


class _Models:
    """The served models by name; a request is answered by its model's execute, together with
    the other requests sent in the same turn of the event loop (the sequence batcher's
    window: the scheduler asks every drafted-apart sequence of a round at once)."""

    def __init__(self):
        self.models: dict[str, object] = {}
        self.queued: list[tuple["_Request", asyncio.Future]] = []

    async def infer(self, request: "_Request") -> _Response:
        done = asyncio.get_running_loop().create_future()
        self.queued.append((request, done))
        await asyncio.sleep(0)
        if self.queued:
            batch, self.queued = self.queued, []
            by_model: dict[str, list] = {}
            for req, fut in batch:
                by_model.setdefault(req.model_name, []).append((req, fut))
            for name, items in by_model.items():
                try:
                    responses = self.models[name].execute([req for req, _ in items])
                except Exception as exc:  # noqa: BLE001 - Triton answers every request of a failed execute with its error
                    responses = [_Response(error=_Error(str(exc)))] * len(items)
                for (_, fut), response in zip(items, responses):
                    fut.set_result(response)
        return await done


MODELS = _Models()


class _Request:
    def __init__(self, model_name, inputs, requested_output_names, correlation_id=0, flags=0):
        self.model_name, self._cid = model_name, correlation_id
        self.inputs = {t.name(): t for t in inputs}
        for control, bit in (("START", 1), ("END", 2)):  # the sequence batcher's control inputs
            self.inputs[control] = _Tensor(control, np.int32([[1 if flags & bit else 0]]))
        self.requested = list(requested_output_names)

    def correlation_id(self):
        return self._cid

    async def async_exec(self):
        return await MODELS.infer(self)


def fake_pb_utils() -> types.ModuleType:
    pb = types.ModuleType("triton_python_backend_utils")
    pb.Tensor, pb.InferenceRequest, pb.InferenceResponse, pb.TritonError = _Tensor, _Request, _Response, _Error
    pb.MetricFamily = _MetricFamily
    pb.TRITONSERVER_REQUEST_FLAG_SEQUENCE_START, pb.TRITONSERVER_REQUEST_FLAG_SEQUENCE_END = 1, 2
    pb.get_input_tensor_by_name = lambda request, name: request.inputs.get(name)
    pb.get_output_tensor_by_name = lambda response, name: response.tensors.get(name)
    return pb


@pytest.fixture(scope="module")
def triton(tmp_path_factory, toy):
    """The shipped settings with the toy target and draft model: specdec.json's methods
    drafted apart (draft_model), as a settings file the drafter model initializes from."""
    names = ("triton_python_backend_utils", "specdec.triton_models.common", "specdec.triton_models.drafter_calls",
             "specdec.triton_models.drafter_model")
    saved = {name: sys.modules.pop(name, None) for name in names}  # imported again, over the fake
    sys.modules["triton_python_backend_utils"] = fake_pb_utils()
    threads = torch.get_num_threads()  # initialize sets the drafter's (specdec.json threads)
    shipped = json.loads(SERVED_SETTINGS.read_text())
    spec = dict(shipped["methods"][METHOD], speculative_model=str(toy.draft_dir))
    assert spec.get("colocated") is False, "draft_model no longer ships apart: this file tests the wrong path"
    raw = dict(shipped, model_dir=str(toy.target_dir), default_method=METHOD, methods={METHOD: spec},
               engine=dict(shipped["engine"], max_batch_size=1, max_seq_len=MAX_SEQ_LEN, max_tokens_limit=MAX_TOKENS,
                           draft_dtype="float32"))
    path = tmp_path_factory.mktemp("apart") / "specdec.json"
    path.write_text(json.dumps(raw))
    try:
        from specdec.triton_models.drafter_calls import DrafterCalls
        from specdec.triton_models.drafter_model import TritonPythonModel

        drafter = TritonPythonModel()
        drafter.initialize({"model_config": json.dumps({"name": "drafter", "max_batch_size": 1,
                                                        "parameters": {"settings_file": {"string_value": str(path)}}}),
                            "model_repository": str(path.parent)})
        yield ServingConfig.from_file(path), drafter, DrafterCalls
    finally:
        torch.set_num_threads(threads)
        for name, module in saved.items():
            sys.modules.pop(name, None)
            if module is not None:
                sys.modules[name] = module


class _StepSink:
    """One sequence's outputs; stops listening after its last verified step (the scheduler
    then drops it, and drafts nothing more for it)."""

    def __init__(self):
        self.tokens, self.verified, self.error = [], [], None
        self.done = threading.Event()

    def emit(self, out) -> bool:
        self.tokens += emitted_tokens(out)
        if out.verified:
            self.verified.append(Verified(out.step.draft_tokens, out.step.accepted, out.step.draft_depth))
        if out.finished or len(self.verified) == STEPS:
            self.done.set()
            return False
        return True

    def fail(self, exc):
        self.error = exc
        self.done.set()


def apart_outcomes(settings: ServingConfig, drafter, drafter_calls, target, request: Request) -> Outcomes:
    """Every outcome of `request` through the scheduler with its tree drafted apart; each
    replay on fresh copies of the verifier's engine and the drafter model."""
    from specdec.serving.engine_loop import EngineLoop

    engine = SpecEngine(None, settings.engine, speculator=Speculator(target, settings.engine, {}, methods=settings.methods))
    # shared by every copy: the models, and the drafter model's heap trimmer (a libc handle) and metrics
    shared = {id(x): x for x in (target, drafter.drafts.drafters[METHOD].model, drafter.heap, drafter.metrics)}
    runs = []

    def run():
        MODELS.models["drafter"] = copy.deepcopy(drafter, dict(shared))
        scheduler = EngineLoop(copy.deepcopy(engine, dict(shared)),
                                   apart_backend=lambda rid: drafter_calls(int(rid), None, target.cfg.vocab_size,
                                                                           settings.engine.max_num_draft_tokens),
                                   apart_methods=frozenset([METHOD]))
        sink = _StepSink()
        try:
            scheduler.submit("1", list(request.prompt), request.params, request.method, request.budget, sink)
            assert sink.done.wait(60), "the scheduler did not finish the request"
        finally:
            scheduler.close()
        if sink.error is not None:
            raise sink.error
        runs.append((tuple(sink.verified),))
        return (tuple(sink.tokens),)

    return Outcomes(exact_outcomes(run), runs)


def test_the_draft_model_served_apart_is_the_targets(toy, triton):
    settings, drafter, drafter_calls = triton
    params = dataclasses.replace(TOP_K, seed=7)
    outcomes = apart_outcomes(settings, drafter, drafter_calls, toy.target, Request(METHOD, params))
    dist = outcomes.marginal()
    worst, where = worst_deviation(toy, dist, params)
    assert worst < TOLERANCE, f"served apart: P(next | {where}) deviates by {worst:.2e} from the target's"
    assert max(s[0].draft_tokens for s in outcomes.steps()) == settings.methods[METHOD].max_total_draft_tokens
    assert outcomes.partially_accepted_then_drafted(), "no run verified a second tree after a rejection"


def test_a_wire_that_misaligns_the_draft_probabilities_is_caught(toy, triton, monkeypatch):
    """The proof has teeth on this path too: a tree rebuilt with each node's q taken from
    the next node's row (the rows rolled by one) accepts with the wrong min(1, p/q). (A tree
    rebuilt with no q at all is not such a bug: the one-hot rule is lossless for any draft
    drawn independently of the verifier's draws, only less often accepted.)"""
    settings, drafter, drafter_calls = triton
    real = drafter_calls._tree

    def misaligned(self, out):
        tree = real(self, out)
        return dataclasses.replace(tree, draft_probs=tree.draft_probs.roll(1, dims=0))

    monkeypatch.setattr(drafter_calls, "_tree", misaligned)
    params = dataclasses.replace(TOP_K, seed=7)
    outcomes = apart_outcomes(settings, drafter, drafter_calls, toy.target, Request(METHOD, params, 2))
    assert worst_deviation(toy, outcomes.marginal(), params)[0] > 100 * TOLERANCE
