"""Gaps in make test that the Triton models' mutants (tests/support/mutants/triton_models.toml)
showed, closed here with bounded waits: a regression fails in seconds, it does not hang.

  * triton-refusal-leaves-the-stream-open: a request the loop refuses (a bad field) gets its
    error; no test checked that the request also ends. Without the final flag the server never
    completes it, and a client that closes its stream politely (SpecDecClient after any error:
    stop_stream(cancel_requests=False)) waits for the stream's deadline, ten minutes by default.
    The tests that send refused requests (test_serving's bad fields, test_robustness's malformed
    strings) close that way too: with the mutant they hang, they do not fail.
"""
from __future__ import annotations

import queue
import threading

import numpy as np
import pytest

import specdec_wire as P

pytestmark = pytest.mark.server

ANSWER_S = 60  # the refusal itself (parsing only; busy cores included)
COMPLETES_S = 30  # the stream's end once the error has come: immediate when the request ended
STREAM_S = 120  # the stream's own deadline: a request that never ends releases the test's thread by then


@pytest.mark.parametrize("model", ["ensemble", "speculative_loop"])
def test_a_refused_request_ends_its_stream(triton_server, model):
    """The error names the field, and the request ends with it: closing the stream without
    cancelling (what a client does after an error) returns at once, since the server has
    finished the request."""
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(triton_server.endpoints.grpc)
    answers: queue.Queue = queue.Queue()
    inputs = []
    for name, value, kind in ((P.TEXT_INPUT, np.array([[b"Say hi."]], dtype=np.object_), "BYTES"),
                              (P.MAX_TOKENS, np.int32([[0]]), "INT32")):  # max_tokens 0: refused by the parser
        tensor = grpcclient.InferInput(name, list(value.shape), kind)
        tensor.set_data_from_numpy(value)
        inputs.append(tensor)
    closed = threading.Event()
    try:
        client.start_stream(callback=lambda result, error: answers.put(error), stream_timeout=STREAM_S)
        client.async_stream_infer(model, inputs)
        error = answers.get(timeout=ANSWER_S)
        assert error is not None and P.MAX_TOKENS in str(error), error

        def close_politely():
            client.stop_stream(cancel_requests=False)  # returns once the server has ended every request
            closed.set()

        threading.Thread(target=close_politely, daemon=True).start()
        assert closed.wait(COMPLETES_S), f"{model}: the refused request never ended (no final flag after its error)"
    finally:
        if not closed.is_set():
            client.stop_stream(cancel_requests=True)  # cancels the stuck stream, which ends the polite close too
        client.close()
