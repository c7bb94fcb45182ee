"""Where a served engine's threads run (issue 74, cores placed on purpose).

The target's forward is one OpenMP team whose passes end in barriers: when any thread of the
team is preempted, the others wait for it at the next barrier. On a machine with more cores
than that team, the team gets cores of its own and every other thread of the server's Python
stubs (the asyncio event loops that send responses, the relays, a drafter served apart, guide
compiles) runs on the rest, so a response being sent never takes a core from the forward.

The team takes whole physical cores (one logical CPU of each, the highest-numbered: CPU 0
usually takes the interrupts) and the rest is every usable CPU outside them, hyperthread
siblings included, so no stub thread shares a physical core with a forward thread. Nothing is
pinned where no core is left over (2 cores and a team of 2, the CI machine: there both the team
and the response path need the same cores, measured in docs/results.md); where the server
shares its machine (`SPECDEC_MAX_THREADS`: test workers; a CPU quota below the cores it may run
on; a Kubernetes pod that may run on every CPU of its node, i.e. without exclusive cores); where
OpenMP is bound already (`OMP_PROC_BIND`, `OMP_PLACES`, `GOMP_CPU_AFFINITY`); or with
`"thread_placement": "off"`.

Threads inherit their creator's cores: the scheduler thread moves onto the team's cores before
it builds the engine, so the OpenMP workers it starts there (the build runs a parallel region)
are the team's; the Python threads and processes the build starts (the guide worker and its
probe, the capture writer) go back to the rest, and the pool its event loop hands blocking calls
to (BLS to a drafter served apart) starts its threads there. Native threads the build starts
besides OpenMP's (the tokenizers' rayon pool, idle in serving) stay with the team: nothing
outside tells them apart.
"""
from __future__ import annotations

import concurrent.futures
import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Mapping, TypeVar

from specdec.config import ServingConfig, max_threads

T = TypeVar("T")
_log = logging.getLogger("specdec")
CGROUP_ROOT = Path("/sys/fs/cgroup")
CPU_TOPOLOGY = Path("/sys/devices/system/cpu")


@dataclass(frozen=True)
class CoreSplit:
    forward: frozenset[int]  # the forward's team: the scheduler thread and its OpenMP workers
    rest: frozenset[int]  # every other thread of the stubs


def split_cores(usable: Iterable[int], team: int, siblings: Mapping[int, frozenset[int]] | None = None) -> CoreSplit | None:
    """`team` physical cores for the forward (one logical CPU of each, the highest cores first),
    every usable CPU outside those cores for the rest; None when the rest would be empty.
    siblings: each CPU's hyperthread siblings (itself included); None reads the machine's."""
    cores = set(usable)
    siblings = siblings if siblings is not None else {cpu: thread_siblings(cpu) for cpu in cores}
    physical = sorted({frozenset(siblings.get(cpu, frozenset({cpu})) & cores) for cpu in cores}, key=max, reverse=True)
    if team < 1 or len(physical) <= team:
        return None
    taken = physical[:team]
    forward = frozenset(min(core) for core in taken)
    return CoreSplit(forward, frozenset(cores - set().union(*taken)))


def thread_siblings(cpu: int) -> frozenset[int]:
    """The logical CPUs sharing `cpu`'s physical core (itself alone where the OS does not say)."""
    try:
        return frozenset(cpu_list((CPU_TOPOLOGY / f"cpu{cpu}" / "topology" / "thread_siblings_list").read_text()))
    except (OSError, ValueError):
        return frozenset({cpu})


def cpu_list(listed: str) -> set[int]:
    """A kernel CPU list ("0-3,8,10-11") as a set."""
    cpus: set[int] = set()
    for part in listed.strip().split(","):
        if part:
            low, _, high = part.partition("-")
            cpus.update(range(int(low), int(high or low) + 1))
    return cpus


def planned_split(settings: ServingConfig, team: int) -> CoreSplit | None:
    """This server's split, or None where it places nothing (see the module's docstring)."""
    usable = os.sched_getaffinity(0)
    quota = cpu_quota()
    shared = (max_threads() is not None or (quota is not None and quota < len(usable))
              or (os.environ.get("KUBERNETES_SERVICE_HOST") and len(usable) >= (os.cpu_count() or 0))
              or any(os.environ.get(name) for name in ("OMP_PROC_BIND", "GOMP_CPU_AFFINITY", "OMP_PLACES")))
    if settings.thread_placement == "off" or shared:
        return None
    return split_cores(usable, team)


def cpu_quota(root: Path = CGROUP_ROOT, membership: str | None = None) -> float | None:
    """The fewest CPUs per period that this process's cgroup or any above it may use (cgroup v2
    `cpu.max` along its path, else v1's CFS quota), or None without a quota. membership: the
    text of /proc/self/cgroup (read when None)."""
    if membership is None:
        try:
            membership = Path("/proc/self/cgroup").read_text()
        except OSError:
            membership = ""
    quotas = []
    for line in membership.splitlines():
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2: cpu.max in the cgroup and each one above it
            folder = root / path.lstrip("/")
            for level in [folder, *folder.parents]:
                quotas.append(_v2_quota(level / "cpu.max"))
                if level == root:
                    break
        elif "cpu" in controllers.split(","):
            folder = root / controllers / path.lstrip("/")
            if not folder.is_dir():
                folder = root / "cpu" / path.lstrip("/")
            quotas.append(_v1_quota(folder))
    if not quotas:  # no membership to read: the namespace's root
        quotas = [_v2_quota(root / "cpu.max"), _v1_quota(root / "cpu")]
    known = [q for q in quotas if q is not None]
    return min(known) if known else None


def _v2_quota(path: Path) -> float | None:
    try:
        quota, period = path.read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError, ZeroDivisionError):
        return None


def _v1_quota(folder: Path) -> float | None:
    try:
        quota_us = int((folder / "cpu.cfs_quota_us").read_text())
        period_us = int((folder / "cpu.cfs_period_us").read_text())
        return None if quota_us <= 0 else quota_us / period_us
    except (OSError, ValueError, ZeroDivisionError):
        return None


def _set_affinity(tid: int, cores: frozenset[int]) -> None:
    """A thread (or process) onto `cores`; one that ended since is skipped, and a refusal only
    logged: placement is an optimization, never a reason for a model not to load."""
    try:
        os.sched_setaffinity(tid, cores)
    except ProcessLookupError:
        pass
    except OSError as exc:
        _log.warning("thread placement: could not move thread %d onto cores %s: %s", tid, sorted(cores), exc)


def pin_process(cores: frozenset[int]) -> None:
    """Every thread this process has now (and so every thread they start later) on `cores`."""
    for task in _tasks(os.getpid()):
        _set_affinity(int(task.name), cores)


def pin_this_thread(cores: frozenset[int]) -> None:
    _set_affinity(0, cores)  # Linux: 0 is the calling thread, not the whole process


def pool_on(cores: frozenset[int], name: str) -> concurrent.futures.ThreadPoolExecutor:
    """A thread pool whose threads start on `cores`, whoever starts them."""
    return concurrent.futures.ThreadPoolExecutor(thread_name_prefix=name, initializer=pin_this_thread, initargs=(cores,))


def built_on_the_forwards_cores(split: CoreSplit, build: Callable[[], T]) -> T:
    """build() on this thread (the one that will run every forward) moved onto the forward's
    cores first; the Python threads and the child processes (the guide compiler's probe)
    started meanwhile are moved back to the rest's."""
    pin_this_thread(split.forward)
    before = {t.native_id for t in threading.enumerate()}
    children_before = child_processes()
    built = build()
    started = [t.native_id for t in threading.enumerate()
               if t.native_id is not None and t.native_id not in before and t is not threading.current_thread()]
    for pid in child_processes() - children_before:
        started += [int(task.name) for task in _tasks(pid)]
    for tid in started:
        _set_affinity(tid, split.rest)
    return built


def _tasks(pid: int) -> list[Path]:
    try:
        return list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:  # ended since
        return []


def child_processes() -> set[int]:
    """This process's children now (by their parent id in /proc)."""
    me, children = os.getpid(), set()
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                parent = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            if parent == me:
                children.add(int(proc.name))
    return children
