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


def test_the_team_gets_whole_physical_cores_from_the_top_and_the_rest_the_others():
    split = split_cores([3, 1, 0, 2], 2, siblings={})  # no hyperthreads
    assert (split.forward, split.rest) == ({2, 3}, {0, 1})  # CPU 0 (interrupts) stays with the rest
    pairs = {cpu: frozenset({cpu - cpu % 2, cpu - cpu % 2 + 1}) for cpu in range(8)}  # siblings numbered side by side
    split = split_cores(range(8), 2, siblings=pairs)
    assert split.forward == {4, 6} and split.rest == {0, 1, 2, 3}  # one thread per core; no stub on a team core's sibling
    assert split_cores([0, 1], 1, siblings={}).rest == {0}
    assert split_cores([0, 1], 2, siblings={}) is None and split_cores([0], 1, siblings={}) is None  # nothing left over
    assert split_cores(range(4), 2, siblings={c: frozenset(range(4)) for c in range(4)}) is None  # one physical core


def test_nothing_is_pinned_when_off_or_when_the_server_shares_its_machine(monkeypatch):
    base = {"engine": {}, "methods": {}, "default_method": "none"}
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    monkeypatch.setattr(placement, "cpu_quota", lambda: None)
    monkeypatch.setattr(placement, "thread_siblings", lambda cpu: frozenset({cpu}))
    for name in ("SPECDEC_MAX_THREADS", "KUBERNETES_SERVICE_HOST", "OMP_PROC_BIND", "GOMP_CPU_AFFINITY", "OMP_PLACES"):
        monkeypatch.delenv(name, raising=False)
    assert planned_split(ServingConfig.from_dict(base), 2).forward == {2, 3}
    assert planned_split(ServingConfig.from_dict({**base, "thread_placement": "off"}), 2) is None
    monkeypatch.setattr(placement, "cpu_quota", lambda: 2.0)  # a quota of 2 CPUs over 4 it may run on: not its cores
    assert planned_split(ServingConfig.from_dict(base), 2) is None
    monkeypatch.setattr(placement, "cpu_quota", lambda: 4.0)
    assert planned_split(ServingConfig.from_dict(base), 2) is not None
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")  # a pod given 4 of the node's 16: exclusive cores
    assert planned_split(ServingConfig.from_dict(base), 2) is not None
    monkeypatch.setattr(os, "cpu_count", lambda: 4)  # a pod that may run on all of its node's CPUs: shared
    assert planned_split(ServingConfig.from_dict(base), 2) is None
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST")
    monkeypatch.setenv("OMP_PROC_BIND", "true")  # OpenMP binds its threads itself
    assert planned_split(ServingConfig.from_dict(base), 2) is None
    monkeypatch.delenv("OMP_PROC_BIND")
    monkeypatch.setenv("SPECDEC_MAX_THREADS", "2")  # test workers: the cores are not this server's to split
    assert planned_split(ServingConfig.from_dict(base), 2) is None
    with pytest.raises(Exception, match="thread_placement"):
        ServingConfig.from_dict({**base, "thread_placement": "pinned"})


def test_the_cpu_quota_is_the_least_along_the_processs_cgroups(tmp_path):
    v2 = "0::/kubepods/pod1/ctr\n"
    assert placement.cpu_quota(tmp_path, v2) is None  # no files: no quota
    (tmp_path / "kubepods" / "pod1" / "ctr").mkdir(parents=True)
    (tmp_path / "kubepods" / "pod1" / "ctr" / "cpu.max").write_text("max 100000\n")
    (tmp_path / "kubepods" / "pod1" / "cpu.max").write_text("250000 100000\n")  # the pod's limit, above the container
    assert placement.cpu_quota(tmp_path, v2) == 2.5
    (tmp_path / "kubepods" / "pod1" / "ctr" / "cpu.max").write_text("150000 100000\n")
    assert placement.cpu_quota(tmp_path, v2) == 1.5
    (tmp_path / "cpu.max").write_text("max 0\n")  # malformed at the root: ignored
    assert placement.cpu_quota(tmp_path, v2) == 1.5
    v1 = "4:cpu,cpuacct:/docker/abc\n3:memory:/docker/abc\n"
    folder = tmp_path / "cpu,cpuacct" / "docker" / "abc"
    folder.mkdir(parents=True)
    (folder / "cpu.cfs_quota_us").write_text("-1\n")
    (folder / "cpu.cfs_period_us").write_text("100000\n")
    assert placement.cpu_quota(tmp_path, v1) is None
    (folder / "cpu.cfs_quota_us").write_text("300000\n")
    assert placement.cpu_quota(tmp_path, v1) == 3.0


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
    pool = placement.pool_on(split.rest, "io")  # a pool the scheduler starts later: its threads on the rest
    thread = threading.Thread(target=lambda: seen.update(later=pool.submit(lambda: os.sched_getaffinity(0)).result()))
    thread.start()
    thread.join()
    pool.shutdown()
    assert seen["later"] == split.rest
    assert os.sched_getaffinity(0) == set(usable)  # the caller's thread untouched


def threads_of(pid: int) -> dict[int, tuple[str, set[int]]]:
    """thread id -> (OS name, allowed cores) of each thread of a process."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            status = dict(line.split(":\t", 1) for line in (task / "status").read_text().splitlines() if ":\t" in line)
        except FileNotFoundError:  # ended since the listing
            continue
        out[int(task.name)] = (status["Name"].strip(), placement.cpu_list(status["Cpus_allowed_list"]))
    return out


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

    split = split_cores(os.sched_getaffinity(0), 1)
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
        stubs = stubs_of(server.pid)
        assert {"ensemble", "drafter", "speculative_loop"} <= set(stubs), stubs
        host_pid = stubs["ensemble"]
        built = threads_of(host_pid)
        with SpecDecClient(server.endpoints.grpc) as client:  # a co-located head, and a draft model served apart (BLS calls
            for method in ("eagle3", "draft_model"):         # from the scheduler's loop to the drafter stub)
                assert client.generate(GenerateRequest("Name three rivers.", max_tokens=8, temperature=0.0, method=method)).text
        host = threads_of(host_pid)
        scheduler = [tid for tid, (name, _) in built.items() if name == "specdec-sched"]
        assert len(scheduler) == 1 and host[scheduler[0]][1] == split.forward, host
        assert host[host_pid][1] == split.rest  # the stub's own thread (python_backend's message loop)
        assert [cores for name, cores in host.values() if name == "specdec-loop"] == [split.rest]
        started = {tid: v for tid, v in host.items() if tid not in built}  # by serving: the event loops' pools, BLS
        assert started and all(cores == split.rest for _, cores in started.values()), started
        for model, pid in stubs.items():
            if model != "ensemble":
                assert all(cores == split.rest for _, cores in threads_of(pid).values()), (model, threads_of(pid))
    finally:
        server.stop()
