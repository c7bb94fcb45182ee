"""The stub crash of issue 43, reproduced on the real server, and its fix.

The bundled Python stub frees a decoupled BLS call's responses on its stub-to-parent thread,
without the GIL, when that thread's cleanup of the call comes after Python let go of the
iterator (specdec/triton_models/bls.py has the whole story). The test forces that order: the
server's log is a pipe the test stops reading, so the stub-to-parent thread blocks forwarding
log lines (the relay model queues 300 KB of them), and the call's cleanup waits behind them.

Each response's arrays carry a weak reference whose callback names the thread that freed them.
A callback run without the GIL crashes the stub at once, which turns "corrupts the heap now and
then" into a crash every time:
  * `drop` (let go of the iterator, as any BLS model would): the stub dies;
  * `keep` (RetiredIterators, as the loop model does): the arrays are freed on the event loop's
    thread, and the stub lives.
"""
import os
import queue
import threading
import time
from pathlib import Path

import numpy as np
import pytest

tritonclient_grpc = pytest.importorskip("tritonclient.grpc")

# Slow, and outside make test: run twice under pytest it hung once on 2 busy cores (not yet
# diagnosed; likely the FIFO log when a stub dies). The same requests by hand crashed the
# stub in 5 of 5 `drop` runs and never in `keep` ones.
pytestmark = pytest.mark.slow

REPOSITORY = Path(__file__).resolve().parents[1] / "support" / "fixtures" / "bls_repository"
BACKLOG_LINES = 300  # x 1 KB: several times a pipe's 64 KiB buffer


class PausableLog:
    """The server's stdout as a FIFO that a thread drains, except while paused."""

    def __init__(self, path: Path):
        os.mkfifo(path)
        self.path, self.reading, self.chunks = path, threading.Event(), []
        self.reading.set()
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self):
        with open(self.path, "rb", buffering=0) as fh:
            while True:
                self.reading.wait()
                chunk = fh.read(65536)
                if not chunk:
                    return
                self.chunks.append(chunk)

    def text(self) -> str:
        return b"".join(self.chunks).decode(errors="replace")


@pytest.fixture
def relay_server(tmp_path):
    from specdec.launcher import TritonServer, free_ports

    log = PausableLog(tmp_path / "triton.log")
    http, grpc, metrics = free_ports(3)
    server = TritonServer(log_path=log.path)
    server.start(REPOSITORY, http_port=http, grpc_port=grpc, metrics_port=metrics)
    try:
        server.wait_ready(timeout=120)
        yield server, log
    finally:
        log.reading.set()
        server.stop()


def relay(server, log: PausableLog, mode: str):
    """One relay request while the log is not read for 1.5 s: (freed_on threads or None, error)."""
    answers = queue.Queue()
    client = tritonclient_grpc.InferenceServerClient(server.endpoints.grpc)
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    try:
        inputs = []
        for name, value in (("mode", np.array([mode.encode()], dtype=np.object_)), ("n", np.int32([8])),
                            ("backlog", np.int32([BACKLOG_LINES]))):
            tensor = tritonclient_grpc.InferInput(name, [1], "BYTES" if value.dtype == np.object_ else "INT32")
            tensor.set_data_from_numpy(value)
            inputs.append(tensor)
        log.reading.clear()
        client.async_stream_infer("relay", inputs)
        time.sleep(1.5)  # the relay has its responses, its backlog is queued, the cleanup behind it
        log.reading.set()
        try:
            result, error = answers.get(timeout=30)
        except queue.Empty:
            return None, "no answer"
        if error is not None:
            return None, str(error)
        return {name.decode() for name in result.as_numpy("freed_on").reshape(-1)}, None
    finally:
        client.stop_stream()
        client.close()


# Each on a fresh stub, whose first request is the one that crashed every time in 5 tries: on
# later requests the server's own log threads, blocked on the same pipe, also hold back the
# call's final response until the backlog has passed, which hides the race.
def test_a_kept_iterator_is_freed_with_the_gil(relay_server):
    server, log = relay_server
    for _ in range(2):
        freed_on, error = relay(server, log, "keep")
        assert error is None, f"{error}\n{log.text()[-3000:]}"
        # every array freed (the callback ran, so with the GIL), on the stub's event loop thread
        assert freed_on and all("run_forever" in name for name in freed_on), freed_on
        assert not server.dead_stubs()


def test_a_dropped_iterator_kills_the_stub(relay_server):
    """The control: without the fence, the same request kills the stub, as in issue 43."""
    server, log = relay_server
    freed_on, error = relay(server, log, "drop")
    deadline = time.monotonic() + 10
    while not server.dead_stubs() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert server.dead_stubs(), f"the stub survived letting go of the iterator (freed on {freed_on}); has the stub been fixed (python_backend #390)?"
    assert error is not None
