"""Tests of specdec.launcher: locating Triton, preparing the backend dir, running the real server."""

from __future__ import annotations

import json
import os
import queue
import signal
import stat
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

import specdec.launcher as L
from specdec.launcher import install as L_install
from specdec.launcher import processes as L_processes

FIXTURE_REPO = Path(__file__).resolve().parents[1] / "support" / "fixtures" / "echo_repository"
READY_TIMEOUT = 120


def _triton_available() -> bool:
    try:
        L.find_triton_install()
    except L.TritonNotFoundError:
        return False
    return True


needs_triton = pytest.mark.skipif(not _triton_available(), reason="no tritonserver installation")


# --------------------------------------------------------------------- no server needed


def test_module_import_is_light():
    code = (
        "import sys, specdec.launcher; "
        "bad = [m for m in ('tritonclient', 'triton_python_backend_utils', 'pytriton', 'torch') if m in sys.modules]; "
        "sys.exit(1 if bad else 0)"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=L.REPO_ROOT)


def test_free_ports_are_distinct():
    ports = L.free_ports(5)
    assert len(set(ports)) == 5
    assert all(0 < p < 65536 for p in ports)
    assert 0 < L.free_port() < 65536


def test_endpoints_format():
    ep = L.Endpoints("127.0.0.1", 8000, 8001, 8002)
    assert ep.http == "127.0.0.1:8000"
    assert ep.grpc == "127.0.0.1:8001"
    assert ep.http_url == "http://127.0.0.1:8000"
    assert ep.metrics_url == "http://127.0.0.1:8002/metrics"


def test_missing_pytriton_error_names_the_package(monkeypatch, tmp_path):
    monkeypatch.delenv("TRITONSERVER_BIN", raising=False)
    monkeypatch.setattr(L_install, "SYSTEM_TRITON_ROOT", tmp_path / "no-such-triton")
    monkeypatch.setattr(L_install, "_pytriton_package_dir", lambda: None)
    with pytest.raises(L.TritonNotFoundError, match=r"nvidia-pytriton is not installed: pip install nvidia-pytriton==0\.7\.0"):
        L.find_triton_install()


def test_bad_tritonserver_bin_env_is_an_error(monkeypatch, tmp_path):
    monkeypatch.setenv("TRITONSERVER_BIN", str(tmp_path / "nope" / "tritonserver"))
    with pytest.raises(L.TritonNotFoundError, match="TRITONSERVER_BIN"):
        L.find_triton_install()


def _fake_system_triton(root: Path, with_stub: bool = True) -> Path:
    binary = root / "bin" / "tritonserver"
    binary.parent.mkdir(parents=True)
    binary.write_text("#!/bin/sh\nexit 0\n")
    binary.chmod(binary.stat().st_mode | stat.S_IXUSR)
    py = root / "backends" / "python"
    py.mkdir(parents=True)
    (py / "libtriton_python.so").write_bytes(b"")
    (py / "triton_python_backend_utils.py").write_text("")
    if with_stub:
        (py / L.BACKEND_STUB_NAME).write_bytes(b"")
    return binary


def test_system_triton_is_preferred(monkeypatch, tmp_path):
    monkeypatch.delenv("TRITONSERVER_BIN", raising=False)
    monkeypatch.delenv("TRITONSERVER_BACKEND_DIR", raising=False)
    _fake_system_triton(tmp_path / "opt")
    monkeypatch.setattr(L_install, "SYSTEM_TRITON_ROOT", tmp_path / "opt")
    inst = L.find_triton_install()
    assert inst.kind == "system"
    assert inst.binary == tmp_path / "opt" / "bin" / "tritonserver"
    assert L.prepare_backend_dir(tmp_path / "cache", inst) == tmp_path / "opt" / "backends"


def test_tritonserver_bin_env_wins(monkeypatch, tmp_path):
    monkeypatch.delenv("TRITONSERVER_BACKEND_DIR", raising=False)
    binary = _fake_system_triton(tmp_path / "custom")
    monkeypatch.setenv("TRITONSERVER_BIN", str(binary))
    inst = L.find_triton_install()
    assert (inst.kind, inst.binary, inst.backends_dir) == ("system", binary, tmp_path / "custom" / "backends")


def test_system_triton_without_stub_names_the_missing_file(monkeypatch, tmp_path):
    monkeypatch.delenv("TRITONSERVER_BACKEND_DIR", raising=False)
    binary = _fake_system_triton(tmp_path / "custom", with_stub=False)
    monkeypatch.setenv("TRITONSERVER_BIN", str(binary))
    with pytest.raises(L.TritonNotFoundError, match=L.BACKEND_STUB_NAME):
        L.find_triton_install()


@needs_triton
def test_prepare_backend_dir_is_idempotent_and_repairs(monkeypatch, tmp_path):
    monkeypatch.delenv("TRITONSERVER_BIN", raising=False)
    inst = L.find_triton_install()
    if inst.kind != "pytriton":
        pytest.skip("backend directory assembly only applies to the pytriton wheel")
    first = L.prepare_backend_dir(tmp_path, inst)
    stub = first / "python" / L.BACKEND_STUB_NAME
    assert os.access(stub, os.X_OK)
    assert (first / "python" / "libtriton_python.so").is_file()
    mtime = stub.stat().st_mtime_ns
    assert L.prepare_backend_dir(tmp_path, inst) == first
    assert stub.stat().st_mtime_ns == mtime  # not rebuilt
    stub.unlink()  # incomplete -> rebuilt
    assert L.prepare_backend_dir(tmp_path, inst) == first
    assert os.access(stub, os.X_OK)


def test_server_environment(monkeypatch):
    inst = L.TritonInstall(
        kind="pytriton",
        binary=Path("/x/tritonserver"),
        python_backend_dir=Path("/x/python"),
        stub=Path("/x/stub"),
        libs_dir=Path("/x/libs"),
    )
    env = L.server_environment(inst, {"PATH": "/usr/bin", "LD_LIBRARY_PATH": "/old", "PYTHONHOME": "/bad"})
    assert env["LD_LIBRARY_PATH"].split(":")[0] == "/x/libs"
    assert env["LD_LIBRARY_PATH"].split(":")[-1] == "/old"
    assert Path(env["PATH"].split(":")[0]) == Path(sys.prefix) / "bin"
    assert env["PATH"].endswith("/usr/bin")
    assert env["PYTHONPATH"].split(":")[0] == str(L.REPO_ROOT)
    assert "PYTHONHOME" not in env


def test_the_thread_cap_bounds_every_served_models_team(monkeypatch):
    """SPECDEC_MAX_THREADS (a pod's CPU limit, test workers sharing cores) caps the `threads`
    settings and torch's default; without it both stand; a bad value names the variable."""
    from specdec.config import MAX_THREADS_ENV, ServingConfig, team_size
    from specdec.errors import ConfigError

    raw = {"methods": {}, "threads": {"verifier": 4, "drafter": 1}}
    monkeypatch.delenv(MAX_THREADS_ENV, raising=False)
    assert ServingConfig.from_dict(raw).threads == {"verifier": 4, "drafter": 1}
    assert team_size({}, "ensemble", 8) is None
    monkeypatch.setenv(MAX_THREADS_ENV, "2")
    threads = ServingConfig.from_dict(raw).threads
    assert threads == {"verifier": 2, "drafter": 1}
    assert team_size(threads, "verifier", 8) == 2 and team_size(threads, "ensemble", 8) == 2
    assert team_size(threads, "ensemble", 1) is None  # never raised above torch's default
    monkeypatch.setenv(MAX_THREADS_ENV, "zero")
    with pytest.raises(ConfigError, match=MAX_THREADS_ENV):
        ServingConfig.from_dict(raw)


def test_missing_model_repository_is_a_clear_error(tmp_path):
    server = L.TritonServer(cache_dir=tmp_path)
    missing = tmp_path / "does-not-exist"
    with pytest.raises(L.ModelRepositoryNotFoundError, match="does-not-exist"):
        server.start(missing, *L.free_ports(3))
    assert server.pid is None
    assert server.stop() is None


def test_serve_main_missing_repository(tmp_path, capsys):
    code = L.serve_main(["--model-repository", str(tmp_path / "nope"), "--log-file", str(tmp_path / "log")])
    assert code == 2
    assert "model repository" in capsys.readouterr().err


def test_serve_main_accepts_leading_double_dash(tmp_path, capsys):
    # `specdec serve -- --model-repository X` reaches serve_main with the "--" kept
    assert L.serve_main(["--", "--model-repository", str(tmp_path / "nope")]) == 2
    assert "nope" in capsys.readouterr().err


def test_default_model_repository_is_under_repo_root():
    assert L.DEFAULT_MODEL_REPOSITORY == L.REPO_ROOT / "model_repository"
    assert (L.REPO_ROOT / "specdec" / "launcher" / "server.py").is_file()


# ------------------------------------------------------------------------ real server


@pytest.fixture(scope="module")
def echo_server(tmp_path_factory):
    log = tmp_path_factory.mktemp("triton") / "tritonserver.log"
    server = L.TritonServer(log_path=log)
    server.start(FIXTURE_REPO, *L.free_ports(3), address="127.0.0.1")
    try:
        server.wait_ready(READY_TIMEOUT)
        yield server
    finally:
        server.stop()


@pytest.mark.server
@needs_triton
def test_server_ready_and_models_loaded(echo_server):
    ep = echo_server.endpoints
    with urllib.request.urlopen(f"{ep.http_url}/v2/health/ready", timeout=5) as resp:
        assert resp.status == 200
    for model in ("echo", "echo_stream"):
        with urllib.request.urlopen(f"{ep.http_url}/v2/models/{model}/ready", timeout=5) as resp:
            assert resp.status == 200
    with urllib.request.urlopen(ep.metrics_url, timeout=5) as resp:
        assert b"nv_inference" in resp.read()
    assert echo_server.log_path.is_file()
    assert "successfully loaded 'echo'" in echo_server.log_path.read_text()
    # The python backend's pool is sized not to grow in normal use (issue 22's crash).
    from specdec.launcher.install import PYTHON_SHM_BYTES

    for name in ("shm-default-byte-size", "shm-growth-byte-size"):
        assert f"--backend-config=python,{name}={PYTHON_SHM_BYTES}" in echo_server.command


@pytest.mark.server
@needs_triton
def test_http_infer_echo(echo_server):
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(echo_server.endpoints.http)
    try:
        inp = httpclient.InferInput("text_input", [1], "BYTES")
        inp.set_data_from_numpy(np.array(["hello triton"], dtype=np.object_))
        result = client.infer("echo", [inp], outputs=[httpclient.InferRequestedOutput("text_output")])
        assert result.as_numpy("text_output").tolist() == [b"HELLO TRITON"]
    finally:
        client.close()


@pytest.mark.server
@needs_triton
def test_grpc_stream_echo_stream(echo_server):
    import tritonclient.grpc as grpcclient

    results: "queue.Queue" = queue.Queue()
    client = grpcclient.InferenceServerClient(echo_server.endpoints.grpc)
    try:
        client.start_stream(callback=lambda result, error: results.put((result, error)))
        text = grpcclient.InferInput("text_input", [1], "BYTES")
        text.set_data_from_numpy(np.array(["abc"], dtype=np.object_))
        n = grpcclient.InferInput("n", [1], "INT32")
        n.set_data_from_numpy(np.array([5], dtype=np.int32))
        client.async_stream_infer("echo_stream", [text, n], request_id="r1", enable_empty_final_response=True)
        outputs = []
        deadline = time.monotonic() + 30
        while True:
            result, error = results.get(timeout=max(0.1, deadline - time.monotonic()))
            assert error is None, error
            response = result.get_response()
            final = response.parameters.get("triton_final_response")
            if response.outputs:
                outputs.append((int(result.as_numpy("index")[0]), result.as_numpy("text_output")[0]))
            if final is not None and final.bool_param:
                break
        assert outputs == [(i, f"{i}:ABC".encode()) for i in range(5)]
    finally:
        client.stop_stream()
        client.close()


@pytest.mark.server
@needs_triton
def test_http_generate_stream_sse(echo_server):
    import httpx
    from httpx_sse import connect_sse

    url = f"{echo_server.endpoints.http_url}/v2/models/echo_stream/generate_stream"
    with httpx.Client(timeout=30) as client, connect_sse(client, "POST", url, json={"text_input": "sse", "n": 4}) as source:
        assert source.response.headers.get("Content-Type", "").startswith("text/event-stream")
        events = [json.loads(event.data) for event in source.iter_sse()]
    assert [e["text_output"] for e in events] == [f"{i}:SSE" for i in range(4)]
    assert [e["index"] for e in events] == list(range(4))
    assert all(e["model_name"] == "echo_stream" for e in events)


@pytest.mark.server
@needs_triton
def test_http_generate_non_streaming(echo_server):
    req = urllib.request.Request(
        f"{echo_server.endpoints.http_url}/v2/models/echo/generate",
        data=json.dumps({"text_input": "plain"}).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(req, timeout=30) as resp:
        assert json.loads(resp.read())["text_output"] == "PLAIN"


@pytest.mark.server
@needs_triton
@pytest.mark.parametrize("stop_timeout", [30.0, 0.0], ids=["graceful", "sigkill"])
def test_stop_leaves_no_processes(tmp_path, stop_timeout):
    with L.TritonServer(log_path=tmp_path / "log") as server:
        server.start(FIXTURE_REPO, *L.free_ports(3), address="127.0.0.1")
        server.wait_ready(READY_TIMEOUT)
        pgid = server.pgid
        members = L.group_members(pgid)
        cmdlines = [L_processes._proc_cmdline(p) for p in members]
        assert server.pid in members
        assert sum(L.BACKEND_STUB_NAME in c for c in cmdlines) == 2  # one stub per model instance
        regions = [t for c in cmdlines for t in c.split() if t.startswith("triton_python_backend_shm_region_")]
        assert len(regions) == 2
        server.stop(timeout=stop_timeout)
        assert L.group_members(pgid) == []
        assert not [r for r in regions if os.path.exists(os.path.join("/dev/shm", r))]  # no leaked shm
        assert server.survivors() == []
        assert not server.is_running()
    assert L.group_members(pgid) == []


@pytest.mark.server
@needs_triton
def test_broken_model_fails_fast_with_log_tail(tmp_path):
    repo = tmp_path / "repo"
    (repo / "broken" / "1").mkdir(parents=True)
    (repo / "broken" / "config.pbtxt").write_text(
        'name: "broken"\nbackend: "python"\nmax_batch_size: 0\n'
        'input [ { name: "x" data_type: TYPE_FP32 dims: [ 1 ] } ]\n'
        'output [ { name: "y" data_type: TYPE_FP32 dims: [ 1 ] } ]\n'
    )
    (repo / "broken" / "1" / "model.py").write_text(
        "class TritonPythonModel:\n"
        "    def initialize(self, args):\n"
        "        raise RuntimeError('deliberately broken fixture')\n"
    )
    with L.TritonServer(log_path=tmp_path / "log") as server:
        server.start(repo, *L.free_ports(3), address="127.0.0.1")
        # The exit is noticed and reported (ServerExitedError with the model's error), not
        # waited out: a timeout would raise a different error.
        with pytest.raises(L.ServerExitedError, match="deliberately broken fixture"):
            server.wait_ready(READY_TIMEOUT)
        pgid = server.pgid
    assert L.group_members(pgid) == []


@pytest.mark.server
@needs_triton
def test_serve_main_runs_until_sigint(tmp_path):
    ports = L.free_ports(3)
    cmd = [
        sys.executable,
        "-m",
        "specdec.launcher",
        "--model-repository",
        str(FIXTURE_REPO),
        "--http-port",
        str(ports[0]),
        "--grpc-port",
        str(ports[1]),
        "--metrics-port",
        str(ports[2]),
        "--address",
        "127.0.0.1",
        "--log-file",
        str(tmp_path / "server.log"),
    ]
    proc = subprocess.Popen(cmd, cwd=L.REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    try:
        deadline = time.monotonic() + READY_TIMEOUT
        server_pid = None
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if "(pid " in line:
                server_pid = int(line.split("(pid ")[1].split(")")[0])
            if "Ctrl-C" in line:
                break
        output = "".join(lines)
        assert f"http://127.0.0.1:{ports[0]}" in output, output
        assert f"127.0.0.1:{ports[1]}" in output
        assert server_pid is not None
        assert L.group_members(server_pid)  # tritonserver is the leader of its own group
        with urllib.request.urlopen(f"http://127.0.0.1:{ports[0]}/v2/health/ready", timeout=5) as resp:
            assert resp.status == 200
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, output + rest
        assert "stopped" in rest
        assert L.group_members(server_pid) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_demo_serves_the_fastest_measured_served_method(tmp_path):
    """make run shows the method bench-serving measured fastest at c=1, among those served."""
    import json

    from specdec.tools.demo import fastest_measured

    modes = {
        "baseline": {"method": "none", "num_draft_tokens": 0, "triton_over_baseline": 1.0},
        "eagle3": {"method": "eagle3", "num_draft_tokens": 5, "triton_over_baseline": 1.6},
        "ngram": {"method": "ngram", "num_draft_tokens": 4, "triton_over_baseline": 2.1},
        "ngram-apart": {"method": "ngram-apart", "num_draft_tokens": 4, "triton_over_baseline": 2.5},
        # replays the answers bench-serving's earlier modes gave the same prompts: not a first answer's speed
        "suffix": {"method": "suffix", "num_draft_tokens": 16, "triton_over_baseline": 3.6},
    }
    path = tmp_path / "serving_overhead.json"
    path.write_text(json.dumps({"modes": modes}))
    method, k, why = fastest_measured({"eagle3", "ngram", "suffix"}, path)
    assert (method, k) == ("ngram", 4) and "2.10x" in why
    assert fastest_measured({"eagle3"}, path)[:2] == ("eagle3", 5)
    assert fastest_measured(set(), path) is None and fastest_measured({"eagle3"}, tmp_path / "missing.json") is None


def test_demo_runs_the_method_it_names():
    """make run once labelled its speculative run with the fastest method but sent method=None,
    so the server's default ran under another method's name and budget."""
    from specdec.tools.demo import demo_runs

    (spec_label, spec), (base_label, base) = demo_runs("Hi", 32, "ngram-tree", 4)
    assert "ngram-tree" in spec_label and (spec.method, spec.num_draft_tokens, spec.max_tokens) == ("ngram-tree", 4, 32)
    assert base_label == "baseline" and base.num_draft_tokens == 0 and base.method is None
    assert spec.prompt == base.prompt == "Hi"
    # like with like: neither run finds the other's prompt in the prefix cache (the same prefill in both TTFTs)
    assert spec.cache_salt and base.cache_salt and spec.cache_salt != base.cache_salt
    (default_label, default), _ = demo_runs("Hi", 32, None, None)
    assert "server default" in default_label and default.method is None and default.num_draft_tokens is None


def test_serve_binds_this_machine_only_unless_asked():
    from specdec.launcher.serve import _build_parser

    assert _build_parser().parse_args([]).address == "127.0.0.1"
    assert _build_parser().parse_args(["--address", "0.0.0.0"]).address == "0.0.0.0"


def test_bench_serving_pairs_only_methods_that_can_be_served_apart():
    """make bench-serving --two-model failed on the shipped settings: it asked for an
    adaptive method served apart, which the config refuses."""
    from specdec.config import SERVED_SETTINGS, ServingConfig
    from specdec.bench.bench_serving import add_apart_variants

    raw = json.loads(SERVED_SETTINGS.read_text())
    entries = list(raw["methods"])
    added = add_apart_variants(raw["methods"], entries)
    assert "eagle3-apart" in added and "eagle3-hybrid-apart" not in added and "draft_model-apart" not in added
    ServingConfig.from_dict(raw)  # every variant is a valid method
