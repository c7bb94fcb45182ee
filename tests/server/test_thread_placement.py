"""Cores placed on purpose (issue 74): with a core to spare beside the forward's team, the
engine host's scheduler thread (which runs every forward, and whose OpenMP workers inherit its
cores) runs on the team's cores, and every other thread of every stub on the rest.

Through the real server: `threads.verifier` 1 leaves the rest of this machine's cores (one
on the 2-core CI machine) for every other thread. The split itself, and where nothing is pinned, in the unit tests."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from specdec.config import ServingConfig
from specdec.serving import placement
from specdec.serving.placement import planned_split, split_cores
from specdec_client import GenerateRequest, SpecDecClient


def test_the_team_gets_the_lowest_cores_and_the_rest_the_others():
    split = split_cores([3, 1, 0, 2], 2)
    assert (split.forward, split.rest) == ({0, 1}, {2, 3})
    assert split_cores([0, 1], 1).rest == {1}
    assert split_cores([0, 1], 2) is None and split_cores([0], 1) is None  # no core left over: nothing pinned


def test_nothing_is_pinned_when_off_or_when_the_server_shares_its_machine(monkeypatch):
    base = {"engine": {}, "methods": {}, "default_method": "none"}
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    monkeypatch.setattr(placement, "cpu_quota", lambda: None)
    monkeypatch.delenv("SPECDEC_MAX_THREADS", raising=False)
    assert planned_split(ServingConfig.from_dict(base), 2).forward == {0, 1}
    assert planned_split(ServingConfig.from_dict({**base, "thread_placement": "off"}), 2) is None
    monkeypatch.setattr(placement, "cpu_quota", lambda: 2.0)  # a pod's quota of 2 CPUs on a 4-core node: not its cores
    assert planned_split(ServingConfig.from_dict(base), 2) is None
    monkeypatch.setattr(placement, "cpu_quota", lambda: 4.0)
    assert planned_split(ServingConfig.from_dict(base), 2) is not None
    monkeypatch.setenv("SPECDEC_MAX_THREADS", "2")  # test workers: the cores are not this server's to split
    assert planned_split(ServingConfig.from_dict(base), 2) is None
    with pytest.raises(Exception, match="thread_placement"):
        ServingConfig.from_dict({**base, "thread_placement": "pinned"})


def test_the_cpu_quota_is_read_from_either_cgroup_version(tmp_path):
    assert placement.cpu_quota(tmp_path) is None  # neither file: no quota
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert placement.cpu_quota(tmp_path) is None
    (tmp_path / "cpu.max").write_text("250000 100000\n")
    assert placement.cpu_quota(tmp_path) == 2.5
    (tmp_path / "cpu.max").unlink()
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert placement.cpu_quota(tmp_path) is None
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("150000\n")
    assert placement.cpu_quota(tmp_path) == 1.5


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_the_builder_moves_onto_the_forwards_cores_and_the_threads_it_starts_go_back():
    import concurrent.futures
    import subprocess
    import sys
    import threading

    from specdec.serving.placement import CoreSplit, built_on_the_forwards_cores

    usable = sorted(os.sched_getaffinity(0))
    split = CoreSplit(frozenset(usable[:1]), frozenset(usable[1:]))
    seen = {}

    def scheduler():
        def build():
            pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)  # a helper the build starts (the guides' worker)
            # and a process it starts (the guide compiler's probe)
            child = pool.submit(lambda: subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                                                         stdin=subprocess.PIPE)).result()
            return pool, child
        pool, child = built_on_the_forwards_cores(split, build)
        seen["scheduler"] = os.sched_getaffinity(0)
        seen["helper"] = pool.submit(lambda: os.sched_getaffinity(0)).result()
        seen["child"] = os.sched_getaffinity(child.pid)
        child.communicate(b"")
        pool.shutdown()

    thread = threading.Thread(target=scheduler)
    thread.start()
    thread.join()
    assert seen == {"scheduler": split.forward, "helper": split.rest, "child": split.rest}
    assert os.sched_getaffinity(0) == set(usable)  # the caller's thread untouched


def threads_of(pid: int) -> list[tuple[str, set[int]]]:
    """(thread name, allowed cores) of each thread of a process."""
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        status = dict(line.split(":\t", 1) for line in (task / "status").read_text().splitlines() if ":\t" in line)
        out.append((status["Name"].strip(), cores_of(status["Cpus_allowed_list"].strip())))
    return out


def cores_of(listed: str) -> set[int]:
    cores = set()
    for part in listed.split(","):
        low, _, high = part.partition("-")
        cores.update(range(int(low), int(high or low) + 1))
    return cores


def cores_of_main(pid: int) -> set[int]:
    line = next(x for x in Path(f"/proc/{pid}/status").read_text().splitlines() if x.startswith("Cpus_allowed_list"))
    return cores_of(line.split(":\t", 1)[1].strip())


def stubs_of(server_pid: int) -> dict[str, int]:
    """model name -> pid of the server's Python backend stubs."""
    stubs = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            stat = (proc / "stat").read_text()
            cmdline = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == server_pid and cmdline[0].endswith(b"triton_python_backend_stub"):
            stubs[Path(cmdline[1].decode()).parents[1].name] = int(proc.name)
    return stubs


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2 or (placement.cpu_quota() or 1e9) < len(os.sched_getaffinity(0)),
                    reason="needs a core beside the forward's, and the cores its own (no CPU quota below them)")
def test_the_forward_runs_on_its_cores_and_every_other_stub_thread_on_the_rest(tmp_path):
    from specdec.launcher import DEFAULT_MODEL_REPOSITORY, TritonServer, free_ports
    from specdec.triton_models.keys import INTERNAL_KEY_ENV
    from tests.conftest import TEST_INTERNAL_KEY

    usable = sorted(os.sched_getaffinity(0))
    settings = json.loads((DEFAULT_MODEL_REPOSITORY / "specdec.json").read_text())
    settings["threads"]["verifier"] = 1
    (tmp_path / "specdec.json").write_text(json.dumps(settings))
    http, grpc, metrics = free_ports(3)
    server = TritonServer(log_path=tmp_path / "triton.log")
    env = {"SPECDEC_SETTINGS": str(tmp_path / "specdec.json"), INTERNAL_KEY_ENV: TEST_INTERNAL_KEY,
           "SPECDEC_MAX_THREADS": "", "OMP_NUM_THREADS": "1"}  # the whole machine is this server's: its cores are split
    server.start(DEFAULT_MODEL_REPOSITORY, http_port=http, grpc_port=grpc, metrics_port=metrics, env=env)
    try:
        server.wait_ready(timeout=300)
        with SpecDecClient(server.endpoints.grpc) as client:  # a forward has run, drafting too
            assert client.generate(GenerateRequest("Name three rivers.", max_tokens=8, temperature=0.0, method="eagle3")).text
        stubs = stubs_of(server.pid)
        assert {"ensemble", "drafter", "speculative_loop"} <= set(stubs), stubs
        forward, rest = {usable[0]}, set(usable[1:])
        host = dict(threads_of(stubs["ensemble"]))  # OS names: the scheduler's and the event loop's are set
        assert host["specdec-sched"] == forward and host["specdec-loop"] == rest, host
        assert cores_of_main(stubs["ensemble"]) == rest  # the stub's own thread (python_backend's message loop)
        for model, pid in stubs.items():
            if model != "ensemble":
                assert all(cores == rest for _, cores in threads_of(pid)), (model, threads_of(pid))
    finally:
        server.stop()
