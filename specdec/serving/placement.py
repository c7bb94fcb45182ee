"""Where a served engine's threads run (issue 74, cores placed on purpose).

The target's forward is one OpenMP team whose passes end in barriers: when any thread of the
team is preempted, the others wait for it at the next barrier. On a machine with more cores
than that team, the team gets cores of its own and every other thread of the server's Python
stubs (the asyncio event loops that send responses, the relays, a drafter served apart, guide
compiles) runs on the rest, so a response being sent never takes a core from the forward.

Nothing is pinned where no core is left over (2 cores and a team of 2, the CI machine: there
both the team and the response path need the same cores, measured in docs/serving.md), where
the server shares its machine (`SPECDEC_MAX_THREADS`: test workers; a CPU quota below the cores
it may run on: a Kubernetes pod without exclusive cores, where pinning would put the forward on
cores other pods use), or with `"thread_placement": "off"`. Threads inherit their creator's cores: the scheduler thread
moves onto the team's cores before it builds the engine, so the OpenMP workers it starts there
(the build runs a parallel region) are the team's; the Python threads the build starts (the
guide worker, the capture writer) go back to the rest. Native threads the build starts besides
OpenMP's (the tokenizers' rayon pool, idle in serving) stay with the team: nothing outside
tells them apart.
"""
from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, TypeVar

T = TypeVar("T")

from specdec.config import ServingConfig, max_threads


@dataclass(frozen=True)
class CoreSplit:
    forward: frozenset[int]  # the forward's team: the scheduler thread and its OpenMP workers
    rest: frozenset[int]  # every other thread of the stubs


def split_cores(usable: Iterable[int], team: int) -> CoreSplit | None:
    """The lowest `team` usable cores for the forward, the others for the rest; None when no
    core would be left for the rest."""
    cores = sorted(usable)
    if team < 1 or len(cores) <= team:
        return None
    return CoreSplit(frozenset(cores[:team]), frozenset(cores[team:]))


def planned_split(settings: ServingConfig, team: int) -> CoreSplit | None:
    """This server's split, or None where it places nothing (see the module's docstring)."""
    usable = os.sched_getaffinity(0)
    quota = cpu_quota()
    if settings.thread_placement == "off" or max_threads() is not None or (quota is not None and quota < len(usable)):
        return None
    return split_cores(usable, team)


def cpu_quota(cgroup: Path = Path("/sys/fs/cgroup")) -> float | None:
    """The CPUs this process's cgroup may use per period (cgroup v2 `cpu.max`, or v1's CFS
    quota), or None without a quota."""
    try:
        quota, period = (cgroup / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota_us = int((cgroup / "cpu" / "cpu.cfs_quota_us").read_text())
        period_us = int((cgroup / "cpu" / "cpu.cfs_period_us").read_text())
        return None if quota_us <= 0 else quota_us / period_us
    except (OSError, ValueError):
        return None


def pin_process(cores: frozenset[int]) -> None:
    """Every thread this process has now (and so every thread they start later) on `cores`."""
    for task in Path("/proc/self/task").iterdir():
        try:
            os.sched_setaffinity(int(task.name), cores)
        except ProcessLookupError:  # a thread that ended since the listing
            pass


def pin_this_thread(cores: frozenset[int]) -> None:
    os.sched_setaffinity(0, cores)  # Linux: 0 is the calling thread, not the whole process


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
        try:
            os.sched_setaffinity(tid, split.rest)
        except ProcessLookupError:  # ended since
            pass
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
