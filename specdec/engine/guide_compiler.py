"""Guides compile off the scheduler's thread, within a time limit whose breach stops the work.

A structured-output guide is a client's text, and what compiling it costs is the client's
choice: a large or deeply nested schema, or a regex with big repetition counts, can take
seconds. The scheduler steps every live sequence on one thread, so a compile there froze every
other stream (issue 43: 12-22 s stalls from one request). Here, as in vLLM's structured-output
manager, a waiting request compiles on a worker thread while the others decode (xgrammar
releases the GIL while it compiles), and joins the batch when its grammar is ready.

A thread cannot be stopped, and on 2 cores a refused compile that runs on would still take a
core. So a guide not seen before is first compiled in a probe process (`python -m
specdec.engine.guide_compiler`, one kept warm), which is killed when the limit passes: the
request is refused naming `guided_decoding_guide` and nothing of it runs on. A guide that
compiles there in time is compiled again in process (a compiled grammar is tens of MB, far
dearer to ship between processes than to rebuild), single-threaded, the cost the probe just
measured. Guides repeat (one schema per application), and both results are cached, so the
probe is paid once per guide.
"""
from __future__ import annotations

import concurrent.futures
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Callable

import specdec_wire as P
from specdec.errors import InvalidRequestError

REFUSED_CACHE_SIZE = 256  # guides refused for their cost: a repeat is refused at once


def _python() -> str:
    """An interpreter for the probe: inside a Triton stub sys.executable is the stub, not Python."""
    for candidate in (sys.executable, str(Path(sys.prefix) / "bin" / "python3"), shutil.which("python3") or ""):
        if candidate and Path(candidate).name.startswith("python") and os.access(candidate, os.X_OK):
            return candidate
    raise RuntimeError("no Python interpreter found for the guide-compile probe")


class CompileProbe:
    """A process that compiles guides and answers ok or the error; killed past a deadline.

    tokenizer_info_json: xgrammar.TokenizerInfo.serialize_json() of the vocabulary (the probe
    compiles against the same token table as the engine)."""

    def __init__(self, tokenizer_info_json: str):
        fd, path = tempfile.mkstemp(prefix="specdec-tokinfo-", suffix=".json")
        with os.fdopen(fd, "w", encoding="utf-8") as f:  # a Triton stub's default encoding is ASCII
            f.write(tokenizer_info_json)
        self._info_path = path
        self._proc: subprocess.Popen | None = None
        self.kills = 0  # probes killed at the deadline (a test and the metrics read it)

    def start(self) -> subprocess.Popen:
        if self._proc is None or self._proc.poll() is not None:
            first = self._proc is None  # at load: nothing served yet (a restart after a kill starts niced)
            self._proc = subprocess.Popen(
                [_python(), "-m", "specdec.engine.guide_compiler", self._info_path] + ([NICE_AFTER_READY] if first else []),
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, encoding="utf-8", bufsize=1,
                env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONIOENCODING": "utf-8"},
            )
            if not self._expect_line(self._proc, timeout_s=120.0):  # "ready": xgrammar imported, table loaded
                self.kill()
                raise RuntimeError("the guide-compile probe did not start")
        return self._proc

    @staticmethod
    def _expect_line(proc: subprocess.Popen, timeout_s: float) -> str | None:
        """The probe's next line; "" when it ended (crashed), None when no line came within timeout_s."""
        box: list[str] = []
        reader = threading.Thread(target=lambda: box.append(proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(timeout_s)
        return box[0] if box else None

    def check(self, guide_type: str, guide: str | None, timeout_s: float) -> None:
        """Returns when the guide compiles within timeout_s of the probe's CPU time (wall
        time where /proc is missing); raises InvalidRequestError naming the guide when it
        does not compile, or is still compiling at the deadline (then the probe is killed,
        and the next check starts a new one). CPU time, because the probe runs at nice 19:
        on a busy server its wall time is the load's, not the guide's; the wall clock still
        bounds it at WALL_FACTOR times the limit."""
        proc = self.start()
        cpu_before = _cpu_seconds(proc.pid)
        proc.stdin.write(json.dumps({"type": guide_type, "guide": guide}) + "\n")
        proc.stdin.flush()
        box: list[str] = []
        reader = threading.Thread(target=lambda: box.append(proc.stdout.readline()), daemon=True)
        reader.start()
        wall_deadline = time.monotonic() + (timeout_s if cpu_before is None else WALL_FACTOR * timeout_s)
        while not box and time.monotonic() < wall_deadline:
            reader.join(min(0.05, timeout_s))
            cpu = _cpu_seconds(proc.pid)
            if not box and cpu is not None and cpu_before is not None and cpu - cpu_before > timeout_s:
                break
        line = box[0] if box else None
        if not line:
            self.kill()
            if line == "":
                raise InvalidRequestError(P.GUIDED_DECODING_GUIDE, "crashed the grammar compiler")
            self.kills += 1
            raise InvalidRequestError(P.GUIDED_DECODING_GUIDE, f"did not compile within {timeout_s:g} s "
                                      "(engine.guide_compile_timeout_s); its compile was stopped")
        answer = json.loads(line)
        if answer.get("error"):
            raise InvalidRequestError(P.GUIDED_DECODING_GUIDE, answer["error"])

    def kill(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
        self._proc = None

    def close(self) -> None:
        self.kill()
        Path(self._info_path).unlink(missing_ok=True)


class GuideCompiler:
    """One worker thread that turns (guide_type, guide) into a compiled grammar: the probe
    (when a limit is set), then `compile_in_process`. Futures carry the result or the
    refusal; at most one guide compiles at a time, so guides take at most one core.

    The worker runs at normal priority and only the in-process compile (xgrammar, the GIL
    released) runs on a thread at nice 19. A nice-19 thread that holds the GIL is a priority
    inversion: when the scheduler's thread comes back from a forward op and waits for the
    GIL, the holder gets a core only when the forward's threads leave one, so the wait runs to
    scheduler quanta (the probe's 50 ms polls on a nice-19 worker left 125-210 ms gaps in a
    plain stream, make bench-hostile). The worker's own Python work is a few polls."""

    def __init__(self, compile_in_process: Callable[[str, str | None], object],
                 tokenizer_info_json: Callable[[], str], timeout_s: float | None):
        self._compile = compile_in_process
        self._info_json = tokenizer_info_json
        self.timeout_s = timeout_s
        self._probe: CompileProbe | None = None
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="specdec-guides")
        self._compile_pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="specdec-guide-compile",
                                                                   initializer=yield_the_cores)
        self._refused: OrderedDict[tuple[str, str], InvalidRequestError] = OrderedDict()
        self._working = threading.Event()  # a guide is being probed or compiled now

    @property
    def busy(self) -> bool:
        """A guide is compiling now (in the probe or in process): it holds a core."""
        return self._working.is_set()

    def warm(self) -> None:
        """Start the probe process now."""
        self._pool.submit(self._probe_started).result()

    def _probe_started(self) -> CompileProbe | None:
        if self.timeout_s is not None and self._probe is None:
            self._probe = CompileProbe(self._info_json())
        if self._probe is not None:
            self._probe.start()
        return self._probe

    def submit(self, guide_type: str, guide: str | None) -> concurrent.futures.Future:
        return self._pool.submit(self._run, guide_type, guide)

    def _run(self, guide_type: str, guide: str | None):
        key = (guide_type, guide or "")
        refused = self._refused.get(key)
        if refused is not None:
            raise refused
        self._working.set()
        try:
            probe = self._probe_started()
            if probe is not None:
                probe.check(guide_type, guide, self.timeout_s)
            return self._compile_pool.submit(self._compile, guide_type, guide).result()
        except InvalidRequestError as exc:
            self._refused[key] = exc
            if len(self._refused) > REFUSED_CACHE_SIZE:
                self._refused.popitem(last=False)
            raise
        finally:
            self._working.clear()

    @property
    def kills(self) -> int:
        return 0 if self._probe is None else self._probe.kills

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._compile_pool.shutdown(wait=False, cancel_futures=True)
        if self._probe is not None:
            self._probe.close()


# The lowest CPU priority for compiles, the probe's and the in-process compile thread's. The forward's
# threads (torch's, one per core) meet at a barrier after every op, so a compile that holds a
# core at equal priority holds back the whole forward by scheduler quanta: on 2 cores a plain
# stream's longest gap between chunks went from 1.6x to 9-11x its median while hostile guides
# compiled (make bench-hostile). At nice 19 the compile gets what the forward leaves.
COMPILE_NICENESS = 19


WALL_FACTOR = 6  # the probe's wall-clock bound, in compile-time limits (CompileProbe.check)


def _cpu_seconds(pid: int) -> float | None:
    """A process's user + system CPU seconds (Linux /proc), or None."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def yield_the_cores() -> None:
    """Lower the calling thread's CPU priority (Linux: a thread id is a process id to
    setpriority); elsewhere, nothing."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), COMPILE_NICENESS)
    except (AttributeError, OSError):
        pass


NICE_AFTER_READY = "--nice-after-ready"


def _probe_main(info_path: str, nice_after_ready: bool = False) -> None:
    """The probe process: one JSON line in per guide, one out ({} or {"error": ...}). The first
    probe (started while the model loads, before anything is served) starts at normal priority
    and yields the cores once ready: at nice 19 on a fully busy machine its start (importing
    xgrammar, loading the vocabulary) waited out the 120 s bound and failed the model's load."""
    if not nice_after_ready:
        yield_the_cores()
    import xgrammar

    from specdec.engine.grammar import compile_guide

    info = xgrammar.TokenizerInfo.deserialize_json(Path(info_path).read_text(encoding="utf-8"))
    compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    print("ready", flush=True)
    if nice_after_ready:
        yield_the_cores()
    for line in sys.stdin:
        request = json.loads(line)
        try:
            compile_guide(compiler, request["type"], request["guide"])
            print("{}", flush=True)
        except InvalidRequestError as exc:  # the message without its field: the caller names it again
            print(json.dumps({"error": str(exc).split(": ", 1)[-1]}), flush=True)


if __name__ == "__main__":
    _probe_main(sys.argv[1], NICE_AFTER_READY in sys.argv[2:])
