"""A Python stub that dies must not leave a server that is up, ready and fails every request
(issue 43: after the `ensemble` stub died of heap corruption, every request failed with "Stub
process 'ensemble_0_0' is not healthy" for 11 minutes while /v2/health/ready said 200).

`specdec serve` (the entry point of docker-compose and the Kubernetes manifests) watches the
stubs: one killed mid-stream ends that stream with an error, readiness turns false within
seconds, and the server comes back by itself and serves again."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import psutil
import pytest

from specdec.launcher import DEFAULT_MODEL_REPOSITORY, free_ports
from specdec.launcher.install import BACKEND_STUB_NAME
from specdec.launcher.processes import descendants, group_members
from specdec_client import GenerateRequest, SpecDecClient

READY_TIMEOUT_S = 300
NOT_READY_WITHIN_S = 10  # from the kill to a readiness probe that fails


def ready(http_port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/v2/health/ready", timeout=2) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


def read_until(proc: subprocess.Popen, marker: str, lines: list[str], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            raise AssertionError("specdec serve ended:\n" + "".join(lines))
        lines.append(line)
        if marker in line:
            return
    raise AssertionError(f"no {marker!r} within {timeout_s} s:\n" + "".join(lines))


def stub_of(server_pid: int, model: str) -> int:
    for pid in descendants(server_pid):
        cmd = " ".join(psutil.Process(pid).cmdline())
        if BACKEND_STUB_NAME in cmd and f"/{model}/" in cmd:
            return pid
    raise AssertionError(f"no stub of {model}")


def start_long_stream(address: str, max_tokens: int, model: str = "ensemble") -> tuple[threading.Thread, dict]:
    """A long stream on a thread of its own, returned once its first chunk arrived. outcome
    gets "finished" or "error", and "at" (time.monotonic()) when the stream ended."""
    outcome: dict = {}
    first_chunk = threading.Event()

    def stream() -> None:
        try:
            with SpecDecClient(address, protocol="grpc", timeout_s=120, model=model) as client:
                for _ in client.stream(GenerateRequest("Tell me a long story.", max_tokens=max_tokens, ignore_eos=True)):
                    first_chunk.set()
            outcome["finished"] = True
        except Exception as exc:  # noqa: BLE001 - the expected ending
            outcome["error"] = exc
        finally:
            outcome["at"] = time.monotonic()
            first_chunk.set()

    streamer = threading.Thread(target=stream, daemon=True)
    streamer.start()
    assert first_chunk.wait(120) and not outcome, outcome
    return streamer, outcome


@pytest.mark.server
def test_a_killed_stub_turns_readiness_false_and_the_server_comes_back(tmp_path, smol_dir):
    settings = json.loads((DEFAULT_MODEL_REPOSITORY / "specdec.json").read_text())
    settings["engine"].update(max_seq_len=512, max_tokens_limit=512)
    # One method that drafts in the verifier: what is killed and restarted here is the stub, and
    # a server without heads or the planner's start-up calibration starts (twice) in less time.
    settings["methods"] = {"ngram": settings["methods"]["ngram"]}
    settings["default_method"] = "ngram"
    (tmp_path / "specdec.json").write_text(json.dumps(settings))
    http, grpc, metrics = free_ports(3)
    cmd = [sys.executable, "-m", "specdec.launcher", "--http-port", str(http), "--grpc-port", str(grpc),
           "--metrics-port", str(metrics), "--log-file", str(tmp_path / "server.log")]
    env = {**os.environ, "SPECDEC_SETTINGS": str(tmp_path / "specdec.json")}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines: list[str] = []
    try:
        read_until(proc, "Ctrl-C", lines, READY_TIMEOUT_S)
        server_pid = int(next(line for line in lines if "(pid " in line).split("(pid ")[1].split(")")[0])
        assert ready(http)

        streamer, outcome = start_long_stream(f"127.0.0.1:{grpc}", max_tokens=400)
        os.kill(stub_of(server_pid, "ensemble"), signal.SIGKILL)
        killed = time.monotonic()
        while ready(http) and time.monotonic() - killed < NOT_READY_WITHIN_S:
            time.sleep(0.2)
        assert not ready(http), f"still ready {NOT_READY_WITHIN_S} s after the ensemble's stub died"
        streamer.join(120)
        assert not streamer.is_alive() and "error" in outcome, outcome  # the stream ended, with an error

        read_until(proc, "restarting tritonserver", lines, 60)
        read_until(proc, "specdec serve: ready", lines, READY_TIMEOUT_S)
        assert group_members(server_pid) == []  # the broken server is gone, stubs and all
        assert ready(http)
        with SpecDecClient(f"127.0.0.1:{grpc}", protocol="grpc") as client:
            assert client.generate(GenerateRequest("Say hello.", max_tokens=8)).text
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, "".join(lines) + rest
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
