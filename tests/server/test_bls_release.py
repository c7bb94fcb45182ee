"""The stub crash of issue 43, reproduced on the real server, and its fix.

The bundled Python stub frees a decoupled BLS call's responses on its stub-to-parent thread,
without the GIL, when that thread's cleanup of the call comes after Python let go of the
iterator (specdec/triton_models/bls.py has the whole story). The test forces that order: the
server's log is a pipe the test reads at a trickle, so the stub-to-parent thread forwards log
lines slowly (the relay model queues 600 KB of them after its first response), and the call's
cleanup, queued when the relay reads the final response, waits behind them. The relay creates a
marker file once it has let go of the iterator (or reached the fence); only then does the test
read the log at full speed, after checking the backlog's last line had not come through yet.
(A log not read at all holds back the final response too, hence the trickle, not a pause.)

Each response's arrays carry a weak reference whose callback names the thread that freed them.
A callback run without the GIL crashes the stub at once, which turns "corrupts the heap now and
then" into a crash every time:
  * `drop` (let go of the iterator, as any BLS model would): the stub dies;
  * `keep` (RetiredIterators, as the loop model does): the arrays are freed on the event loop's
    thread, and the stub lives.

It used to hang, and was slow-marked: when the stub died, Triton never finished the relay's
decoupled request, and `stop_stream()` (cancel_requests=False) waited for the stream's end
forever. And its order was timed (a 1.5 s pause from the send): on busy cores the relay could
reach its first response after the log flowed again, and the `drop` stub lived. Every wait now
has a bound: the stream has a deadline and is closed by cancelling, the marker and the answer
are polled against deadlines (the answer also against the stub's death), the log is a FIFO this
process holds open both ways (opening it never blocks), tritonserver's exit waits 2 s, not 10,
for the request a dead stub left, and the server starts again on fresh ports if another process
took one first.
"""
import os
import queue
import select
import threading
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

tritonclient_grpc = pytest.importorskip("tritonclient.grpc")

pytestmark = pytest.mark.server

REPOSITORY = Path(__file__).resolve().parents[1] / "support" / "fixtures" / "bls_repository"
BACKLOG_LINES = 600  # x 1 KB: many times a pipe's 64 KiB buffer
TRICKLE_BYTES, TRICKLE_S = 1024, 0.01  # the backlog's pace until the relay has let go: 6 s for all of it
READY_S = 120  # the two stubs start (busy cores included)
ARRIVE_S = 60  # the relay reaches its marker
ANSWER_S = 60  # the answer, or the stub's death, after the log is read again
STREAM_S = READY_S  # the gRPC stream's own deadline, a bound under the others


class ServerLog:
    """The server's stdout as a FIFO that a thread drains, at full speed or at a trickle.

    This process holds the FIFO open for reading and writing, so opening it for writing never
    blocks (the launcher opens it twice, and a write end closed early would otherwise end the
    drain with EOF and block the next open for good), and the drain polls, so close() ends it."""

    def __init__(self, path: Path):
        os.mkfifo(path)
        self.path, self.chunks = path, []
        self._fd = os.open(path, os.O_RDWR | os.O_NONBLOCK)
        self._trickle, self._closed = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._drain, name="triton-log", daemon=True)
        self._thread.start()

    def _drain(self):
        while not self._closed.is_set():
            ready, _, _ = select.select([self._fd], [], [], 0.1)
            if not ready:
                continue
            trickle = self._trickle.is_set()
            try:
                self.chunks.append(os.read(self._fd, TRICKLE_BYTES if trickle else 65536))
            except BlockingIOError:
                continue
            if trickle:
                time.sleep(TRICKLE_S)

    def trickle(self, on: bool):
        (self._trickle.set if on else self._trickle.clear)()

    def text(self) -> str:
        return b"".join(self.chunks).decode(errors="replace")

    def close(self):
        self._closed.set()
        self._thread.join(timeout=5)
        os.close(self._fd)


def wait_for(predicate, timeout: float, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)
    return True


def start_server(log: ServerLog, attempts: int = 3):
    """The fixture repository on fresh ports; again on new ones if a port was taken meanwhile
    (free_ports releases them before tritonserver binds)."""
    from specdec.launcher import ServerExitedError, TritonServer, free_ports

    for attempt in range(attempts):
        seen = len(log.text())
        http, grpc, metrics = free_ports(3)
        server = TritonServer(log_path=log.path)
        # exit_timeout: a request the dead stub left unfinished holds tritonserver's exit that long
        server.start(REPOSITORY, http_port=http, grpc_port=grpc, metrics_port=metrics, exit_timeout_secs=2)
        try:
            return server.wait_ready(timeout=READY_S)
        except ServerExitedError:
            server.stop(timeout=10)
            if "already in use" not in log.text()[seen:] or attempt == attempts - 1:
                raise AssertionError(f"tritonserver exited before ready:\n{log.text()[-3000:]}") from None
        except BaseException:
            server.stop(timeout=10)
            raise


@pytest.fixture
def relay_server(tmp_path):
    log = ServerLog(tmp_path / "triton.log")
    try:
        server = start_server(log)
        try:
            yield server, log
        finally:
            log.trickle(False)
            server.stop(timeout=15)
    finally:
        log.close()


def relay(server, log: ServerLog, mode: str, marker_dir: Path, forced: bool = True):
    """One relay request, its backlog trickling through the log until the relay has reached its
    marker (forced; else the log flows): (freed_on threads or None, error). Every wait is
    bounded; the stream is cancelled at the end, never drained (Triton never finishes a request
    whose stub died)."""
    marker = marker_dir / f"{mode}-{uuid.uuid4().hex}.arrived"
    answers = queue.Queue()
    client = tritonclient_grpc.InferenceServerClient(server.endpoints.grpc)
    try:
        client.start_stream(callback=lambda result, error: answers.put((result, error)), stream_timeout=STREAM_S)
        inputs = []
        for name, value in (("mode", np.array([mode.encode()], dtype=np.object_)), ("n", np.int32([8])),
                            ("backlog", np.int32([BACKLOG_LINES])), ("marker", np.array([str(marker).encode()], dtype=np.object_))):
            tensor = tritonclient_grpc.InferInput(name, [1], "BYTES" if value.dtype == np.object_ else "INT32")
            tensor.set_data_from_numpy(value)
            inputs.append(tensor)
        log.trickle(forced)
        try:
            client.async_stream_infer("relay", inputs)
            if forced and not wait_for(lambda: marker.exists() or not answers.empty() or server.dead_stubs(), ARRIVE_S):
                return None, f"the relay did not reach its marker in {ARRIVE_S} s"
            if forced and not marker.exists():
                return None, "the relay answered or died before reaching its marker"
            # The premise: the backlog's last line, and so the cleanup queued after it, had not
            # passed when the relay let go of the iterator (or reached the fence).
            assert not forced or f"backlog {BACKLOG_LINES - 1} " not in log.text(), "the backlog passed before the relay got there"
        finally:
            log.trickle(False)
        deadline = time.monotonic() + ANSWER_S
        while time.monotonic() < deadline:
            try:
                result, error = answers.get(timeout=0.2)
            except queue.Empty:
                if server.dead_stubs():
                    return None, "the relay's stub died"
                continue
            if error is not None:
                return None, str(error)
            return {name.decode() for name in result.as_numpy("freed_on").reshape(-1)}, None
        return None, f"no answer in {ANSWER_S} s"
    finally:
        client.stop_stream(cancel_requests=True)  # cancel_requests=False waits for the server's end, unbounded
        client.close()


# Each on a fresh stub, whose first request is the one that crashed every time in 5 tries: on
# later requests the server's own log threads, blocked on the same pipe, also hold back the
# call's final response until the backlog has passed, which hides the race (the order cannot be
# forced: the backlog's last line comes before the relay reaches its marker).
def test_a_kept_iterator_is_freed_with_the_gil(relay_server, tmp_path):
    server, log = relay_server
    for forced in (True, False):  # the forced order, then a later request on the same stub
        freed_on, error = relay(server, log, "keep", tmp_path, forced=forced)
        assert error is None, f"{error}\n{log.text()[-3000:]}"
        # every array freed (the callback ran, so with the GIL), on the stub's event loop thread
        assert freed_on and all("run_forever" in name for name in freed_on), freed_on
        assert not server.dead_stubs()


def test_a_dropped_iterator_kills_the_stub(relay_server, tmp_path):
    """The control: without the fence, the same request kills the stub, as in issue 43."""
    server, log = relay_server
    freed_on, error = relay(server, log, "drop", tmp_path)
    wait_for(server.dead_stubs, 10, 0.1)
    assert server.dead_stubs(), (f"the stub survived letting go of the iterator (freed on {freed_on}, {error}); "
                                 "has the stub been fixed (python_backend #390)?")
    assert freed_on is None and error is not None
