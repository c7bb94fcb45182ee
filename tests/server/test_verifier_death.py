"""A verifier that dies mid-stream must not leave its streams hanging (issue 43, section 5).

Triton does not end a decoupled BLS call whose callee's stub died: the loop would wait for the
verifier's next round forever. So a stream quiet for PROBE_AFTER_S sends the verifier a STOP
with correlation id 0 (no sequence has it): a live verifier answers it, a dead one's error ends
the stream. The verifier lives in the `ensemble` model's stub (contract.ENGINE_HOST); a relay
(`speculative_loop`) reaches it over BLS. Here the host's stub is killed under a stream through
the relay, on a server of its own (only those two loaded, one method, so it starts quickly):
the client hears an error within a bound, and the relay gives its slot back.
"""
from __future__ import annotations

import json
import os
import signal
import time

import pytest

import specdec_wire as W
from specdec.launcher import DEFAULT_MODEL_REPOSITORY, TritonServer, free_ports
from specdec_client import server_metrics
from specdec_client.errors import ClientConnectionError

from test_stub_death import start_long_stream, stub_of

# From the kill: the quiet time before the probe (loop_model.PROBE_AFTER_S, 5 s; the module
# imports Triton's stub utilities, so it is not imported here), a poll (0.25 s) and the
# probe's own answer, with slack for 2 busy cores.
ENDS_WITHIN_S = 30.0


@pytest.fixture()
def small_server(tmp_path, smol_dir):
    settings = json.loads((DEFAULT_MODEL_REPOSITORY / "specdec.json").read_text())
    settings["engine"].update(max_seq_len=512, max_tokens_limit=512)
    settings["methods"] = {"ngram": settings["methods"]["ngram"]}  # drafts in the verifier: no drafter model
    settings["default_method"] = "ngram"
    (tmp_path / "specdec.json").write_text(json.dumps(settings))
    http, grpc, metrics = free_ports(3)
    server = TritonServer(log_path=tmp_path / "triton.log")
    server.start(DEFAULT_MODEL_REPOSITORY, http_port=http, grpc_port=grpc, metrics_port=metrics,
                 env={"SPECDEC_SETTINGS": str(tmp_path / "specdec.json")}, model_control_mode="explicit",
                 load_models=("ensemble", "speculative_loop"))
    try:
        server.wait_ready(timeout=300)
        yield server
    finally:
        server.stop(timeout=5.0)  # the host's stub was killed: a drain would wait out its whole timeout, as `specdec serve` knows


@pytest.mark.server
def test_a_stream_whose_verifier_died_ends_with_an_error(small_server):
    streamer, outcome = start_long_stream(small_server.endpoints.grpc, max_tokens=500, model="speculative_loop")
    os.kill(stub_of(small_server.pid, "ensemble"), signal.SIGKILL)
    killed = time.monotonic()
    streamer.join(ENDS_WITHIN_S + 5)
    assert not streamer.is_alive(), f"the stream still runs {ENDS_WITHIN_S + 5:g} s after its verifier died"
    assert "error" in outcome, outcome  # ended by the error, not run to max_tokens
    assert outcome["at"] - killed <= ENDS_WITHIN_S, outcome["at"] - killed
    # tritonserver may exit after a stub dies (the launcher restarts it: test_stub_death.py); while
    # it is up, the relay must have given its slot back.
    try:
        samples = server_metrics.scrape(small_server.endpoints.metrics_url)
    except ClientConnectionError:
        deadline = time.monotonic() + 30
        while small_server.is_running() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not small_server.is_running(), "the metrics port refused while the server still runs"
        return
    assert server_metrics.total(samples, W.SLOT_OCCUPANCY, model="speculative_loop") == 0  # the relay gave its slot back
