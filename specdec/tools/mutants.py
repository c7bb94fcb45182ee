"""`make mutants`: does `make test` catch small semantic bugs in the engine and serving code?

tests/support/mutants/*.toml list the mutants, one file per area: each is one edit of one source
file (an `old` snippet that occurs exactly once, replaced by `new`) that models a bug a correct
test suite must catch (acceptance, the residual, tree merges, KV compaction, the prefix index,
grammar masks, the planner, stop handling, seeds, the scheduler's failure path, the C kernels,
the weight formats, the OpenAI front end, the Triton models), and names the `make test` tests
that should catch it. This tool applies them one at a time and runs those tests (`-m "not
slow"`, so a kill is a kill by `make test`), then writes results/mutants.json: per mutant its
outcome and seconds, the SHA-256 of its definition, of the file it mutated and of what its tests
load (the test files it names, their conftest.py files, tests/support's Python, and for a C mutant
the kernels' headers), the totals, the score, and the machine (CPU model, kernel path). A result
whose file or tests changed since is stale (`record_status`); `--stale` reruns only those. tests/project/test_mutants.py checks in `make test` that the record holds a result
for every mutant listed today, and the README's score is rendered from it with the number of
mutated files changed since, so a stale record shows itself.

Outcomes:
  killed    a test it names FAILED with the mutant in place (a setup or teardown ERROR, a fixture
            whose server never came up, is not a kill: it is an error);
  timeout   they ran past the limit, where unmutated they passed within less than half of it
            (a quarter, by TIMEOUT_FACTOR): the mutant made them hang, so it counts as killed
            (recorded apart);
  not run   the mutated file is one ISA's path (AVX2, AVX-512 VNNI, AMX) and this CPU has not got
            it: nothing was learnt, and it is not in the score;
  survived  they passed: a bug the suite does not see;
  error     nothing was learnt: the `old` snippet no longer occurs exactly once (the code
            moved on, the list must follow), a C mutant does not compile, the tests select
            nothing, they fail unmutated, or they could not be collected (a mutant that breaks
            an import kills no test: it must model a bug, not a syntax slip). Errors are not
            survivors and not in the score; any makes the run fail.

Every run happens in a private copy of the working tree (tracked and untracked files that
git does not ignore; the virtualenv is the caller's), never in the checkout itself: others
may edit it meanwhile, and a mutant left behind by a killed run would corrupt their work.
Each worker (--jobs) has its own copy, with the kernel library built in it, and restores the file
(and for a C mutant the library) after every mutant. Bytecode is never written there, so a
mutated module is never served from a stale cache.

The tests' names are checked by tests/project/test_mutants.py in `make test`: the list parses and
every `old` snippet applies exactly once.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import json
import os
import platform
import queue
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import tomllib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_LIST = REPO_ROOT / "tests" / "support" / "mutants"  # a directory of *.toml, or one file
DEFAULT_OUT = Path("results") / "mutants.json"

KILLED, TIMEOUT, SURVIVED, ERROR, NOT_RUN = "killed", "timeout", "survived", "error", "not run"
# The files that are one ISA's path of the int8 kernels, and the path a CPU must run to execute them.
ISA_FILES = {"specdec/engine/kernels/int8_linear_avx2.c": "avx2",
             "specdec/engine/kernels/int8_linear_avx512.c": "avx512_vnni",
             "specdec/engine/kernels/int8_linear_amx.c": "amx"}
# A mutant's tests may run this many times as long as they take unmutated (and at least
# MIN_TIMEOUT_S) before the run counts as a hang the mutant caused.
TIMEOUT_FACTOR = 4.0
MIN_TIMEOUT_S = 60.0
BASELINE_TIMEOUT_S = 900.0  # an unmutated selection that runs longer is not one to name for a mutant
# pytest's exit codes (pytest.ExitCode): 1 tests failed, 2 interrupted (a collection error:
# the mutant broke an import), 5 no tests collected.
PYTEST_FAILED, PYTEST_COLLECTION_ERROR, PYTEST_NO_TESTS = 1, 2, 5
PYTEST_ARGS = ("-q", "-x", "-p", "no:cacheprovider", "-m", "not slow")
_FIELDS = {"id", "file", "old", "new", "description", "tests", "k"}
COMPILED_SUFFIXES = (".c", ".h")  # a mutant of these rebuilds the kernel library in its copy
BUILD_KERNELS = ("setup.py", "-q", "build_ext", "--inplace", "--force")
KERNEL_LIBRARY_GLOB = "specdec/engine/kernels/_native*.so"
_ID = re.compile(r"^[a-z0-9][a-z0-9-]*$")


class MutantListError(ValueError):
    """The mutant list is malformed; the message names the mutant and the field."""


@dataclass(frozen=True)
class Mutant:
    id: str
    file: str  # relative to the repository root
    old: str  # occurs exactly once in `file`
    new: str
    description: str  # the bug it models, one line
    tests: tuple[str, ...]  # test files or node ids that `make test` runs
    k: str | None = None  # a pytest -k expression narrowing `tests`

    def pytest_args(self) -> list[str]:
        return [*self.tests, *(["-k", self.k] if self.k else [])]

    def selection(self) -> tuple[str, ...]:
        """Mutants with the same selection share one unmutated (baseline) run."""
        return tuple(self.pytest_args())

    @property
    def compiled(self) -> bool:
        return self.file.endswith(COMPILED_SUFFIXES)

    def digest(self) -> str:
        """The definition's hash: a record made for another edit or other tests is not this mutant's."""
        fields = json.dumps([self.file, self.old, self.new, list(self.tests), self.k])
        return hashlib.sha256(fields.encode()).hexdigest()


def file_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def loaded_by_tests(mutant: Mutant, repo: Path = REPO_ROOT) -> list[Path]:
    """What a mutant's verdict rests on besides the mutated file: the test files it names, the
    conftest.py files above them (up to tests/), tests/support's Python, and for a C mutant the
    kernels' headers."""
    tests_root = repo / "tests"
    files: set[Path] = set()
    for test in mutant.tests:
        path = repo / test.split("::", 1)[0]
        files.add(path)
        for folder in [path.parent, *path.parent.parents]:
            if folder == tests_root.parent:
                break
            files.add(folder / "conftest.py")
    files.update((tests_root / "support").rglob("*.py"))
    if mutant.compiled:
        files.update((repo / mutant.file).parent.glob("*.h"))
    return sorted(f for f in files if f.is_file())


def tests_digest(mutant: Mutant, repo: Path = REPO_ROOT) -> str:
    digest = hashlib.sha256()
    for path in loaded_by_tests(mutant, repo):
        digest.update(str(path.relative_to(repo)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def list_files(path: Path) -> list[Path]:
    path = Path(path)
    return sorted(path.glob("*.toml")) if path.is_dir() else [path]


def load_mutants(path: Path = DEFAULT_LIST) -> list[Mutant]:
    """Parse the list ([[mutant]] tables, from one file or every *.toml of a directory); unknown or
    missing fields, and an id used twice anywhere, are errors naming them."""
    tables = []
    for file in list_files(path):
        data = tomllib.loads(file.read_text())
        if set(data) != {"mutant"}:
            raise MutantListError(f"{file}: expected only [[mutant]] tables, got {sorted(data)}")
        tables += data["mutant"]
    if not tables:
        raise MutantListError(f"{path}: no mutants")
    mutants, seen = [], set()
    for n, table in enumerate(tables):
        name = table.get("id", f"#{n}")
        unknown = set(table) - _FIELDS
        if unknown:
            raise MutantListError(f"mutant {name}: unknown field(s) {sorted(unknown)}; allowed: {sorted(_FIELDS)}")
        for field in ("id", "file", "old", "description", "tests"):
            if not table.get(field):
                raise MutantListError(f"mutant {name}: field {field!r} is required and must not be empty")
        if not isinstance(table.get("new"), str):  # "" deletes `old`
            raise MutantListError(f"mutant {name}: field 'new' is required (a string; empty deletes 'old')")
        if not _ID.match(table["id"]):
            raise MutantListError(f"mutant {name}: field 'id' must be lower-case words joined by '-'")
        if table["id"] in seen:
            raise MutantListError(f"mutant {name}: field 'id' is used twice")
        if table["old"] == table["new"]:
            raise MutantListError(f"mutant {name}: field 'new' equals 'old' (no mutation)")
        if "\n" in table["description"].strip():
            raise MutantListError(f"mutant {name}: field 'description' must be one line")
        seen.add(table["id"])
        mutants.append(Mutant(table["id"], table["file"], table["old"], table["new"], table["description"].strip(),
                              tuple(table["tests"]), table.get("k")))
    return mutants


def mutated(mutant: Mutant, source: str) -> str:
    """The source with the mutant applied; MutantListError unless `old` occurs exactly once."""
    count = source.count(mutant.old)
    if count != 1:
        raise MutantListError(f"mutant {mutant.id}: field 'old' occurs {count} times in {mutant.file}, not once")
    return source.replace(mutant.old, mutant.new)


# ---- running --------------------------------------------------------------------------------
@dataclass(frozen=True)
class PytestRun:
    returncode: int | None  # None: killed at the time limit
    seconds: float
    output_tail: str

    @property
    def timed_out(self) -> bool:
        return self.returncode is None


@dataclass(frozen=True)
class Result:
    id: str
    file: str
    description: str
    tests: list[str]
    outcome: str
    seconds: float
    detail: str
    digest: str  # Mutant.digest(): which definition this result belongs to
    file_sha256: str  # the unmutated file it was applied to
    tests_sha256: str = ""  # tests_digest(): what its tests loaded ("" in records made before it was kept)


def snapshot(repo: Path, dest: Path) -> None:
    """Copy the working tree's tracked and untracked-but-not-ignored files to dest."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=repo,
                            check=True, capture_output=True).stdout.decode().split("\0")
    for rel in filter(None, dict.fromkeys(listed)):
        src = repo / rel
        if src.is_file():  # a tracked file someone deleted is simply absent
            target = dest / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, target)


def child_env(copy: Path, threads: int) -> dict[str, str]:
    env = dict(os.environ)
    # The copy's packages before the editable install's mapping to the checkout.
    env["PYTHONPATH"] = os.pathsep.join([str(copy), str(copy / "client"), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env["SPECDEC_TEST_THREADS"] = str(threads)
    return env


def check_imports_from(copy: Path, env: dict[str, str]) -> None:
    """A mutant applied to the copy must be what the tests import, not the checkout's file."""
    out = subprocess.run([sys.executable, "-c", "import specdec.engine.acceptance as m, specdec_wire as w; print(m.__file__); print(w.__file__)"],
                         cwd=copy, env=env, check=True, capture_output=True, text=True).stdout.split()
    outside = [f for f in out if not Path(f).resolve().is_relative_to(copy.resolve())]
    if outside:
        raise RuntimeError(f"the copy at {copy} imports {outside} from outside it; mutants would not be tested")


_running: set[subprocess.Popen] = set()  # the pytest runs in flight, ended if this tool is stopped


def run_pytest(copy: Path, args: Sequence[str], env: dict[str, str], timeout_s: float) -> PytestRun:
    """pytest in its own session, so a run past the limit is ended with all its children."""
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "pytest", *PYTEST_ARGS, *args], cwd=copy, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    _running.add(proc)
    try:
        output, _ = proc.communicate(timeout=timeout_s)
        code: int | None = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        code = None
    finally:
        _running.discard(proc)
        stop_left_behind(copy)
    return PytestRun(code, round(time.monotonic() - t0, 1), output[-4000:])


def stop_left_behind(copy: Path) -> list[int]:
    """Kill what a run left running from its copy: a tritonserver and its stubs start in their own
    session (out of reach of the run's killpg), and a fixture whose teardown a mutant broke, or a
    run ended at its limit, never stops them. Returns the pids killed."""
    marker, killed = (str(copy) + os.sep).encode(), []  # inside the copy: worker1/ is not worker10/
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            if marker in (proc / "cmdline").read_bytes():
                os.kill(int(proc.name), signal.SIGKILL)
                killed.append(int(proc.name))
        except (OSError, ProcessLookupError):
            continue
    return killed


def stop_running() -> None:
    """End the pytest runs this tool started (each in its own session, so Ctrl-C does not reach them)."""
    for proc in list(_running):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def time_limit(baseline: PytestRun) -> float:
    return max(MIN_TIMEOUT_S, TIMEOUT_FACTOR * baseline.seconds)


_SUMMARY_LINE = re.compile(r"^(FAILED|ERROR) \S+\.py")  # not a captured log line ("ERROR    name:...")


def first_failure(output: str) -> str:
    """pytest -q's summary line for the first failing test (or the last line)."""
    for line in output.splitlines():
        if _SUMMARY_LINE.match(line):
            return line[:300]
    lines = [ln for ln in output.splitlines() if ln.strip()]
    return lines[-1][:300] if lines else ""


def first_failed(output: str) -> str | None:
    """pytest -q's first FAILED summary line (a test's assertion or its call raising), if any."""
    return next((line[:300] for line in output.splitlines() if line.startswith("FAILED ") and _SUMMARY_LINE.match(line)), None)


def classify(baseline: PytestRun, run: PytestRun, limit: float) -> tuple[str, str]:
    """(outcome, detail) of a mutant's run, given the same tests' unmutated run."""
    if run.timed_out:
        if baseline.seconds >= limit / 2:  # too close to the limit unmutated to blame the mutant
            return ERROR, f"ran past {limit:.0f}s, and unmutated they took {baseline.seconds:.0f}s: not a kill"
        return TIMEOUT, f"ran past {limit:.0f}s; unmutated they pass in {baseline.seconds:.0f}s"
    if run.returncode == 0:
        return SURVIVED, "its tests passed"
    if run.returncode == PYTEST_FAILED:
        failed = first_failed(run.output_tail)
        if failed is None:  # only setup/teardown ERRORs: a fixture (a server that never came up), not an assertion
            return ERROR, f"a setup or teardown error, not a kill: {first_failure(run.output_tail)}"
        return KILLED, failed
    if run.returncode == PYTEST_COLLECTION_ERROR:
        return ERROR, f"its tests could not be collected (not a kill): {first_failure(run.output_tail)}"
    if run.returncode == PYTEST_NO_TESTS:
        return ERROR, "its tests select nothing"
    return ERROR, f"pytest exited {run.returncode}: {first_failure(run.output_tail)}"


def baseline_error(baseline: PytestRun) -> str | None:
    if baseline.returncode == 0:
        return None
    if baseline.returncode == PYTEST_NO_TESTS:
        return "its tests select nothing"
    if baseline.timed_out:
        return "its tests did not finish unmutated"
    return f"its tests fail unmutated: {first_failure(baseline.output_tail)}"


class Workers:
    """One private copy of the working tree per job; a task borrows one."""

    def __init__(self, repo: Path, jobs: int, root: Path):
        self.free: queue.Queue[Path] = queue.Queue()
        self.file_sha256: dict[str, str] = {}
        self.threads = max(1, (os.cpu_count() or 1) // jobs)
        for n in range(jobs):
            copy = root / f"worker{n}"
            snapshot(repo, copy)
            build = build_kernels(copy)
            if build is not None:
                raise RuntimeError(f"the kernels do not build in the copy {copy}: {build}")
            self.free.put(copy)
        self.first = self.free.get()
        check_imports_from(self.first, child_env(self.first, self.threads))
        self.free.put(self.first)

    def not_applying(self, mutants: Sequence[Mutant]) -> dict[str, str]:
        """Mutants whose `old` snippet does not occur exactly once (by id: why), checked
        before anything runs."""
        problems = {}
        for mutant in mutants:
            path = self.first / mutant.file
            if path.is_file():  # read before any mutant runs: the record's hash of the unmutated file
                self.file_sha256.setdefault(mutant.file, file_digest(path))
            try:
                mutated(mutant, path.read_text())
            except FileNotFoundError:
                problems[mutant.id] = f"no file {mutant.file}"
            except MutantListError as exc:
                problems[mutant.id] = str(exc)
        return problems

    def baseline(self, args: Sequence[str]) -> PytestRun:
        copy = self.free.get()
        try:
            return run_pytest(copy, args, child_env(copy, self.threads), BASELINE_TIMEOUT_S)
        finally:
            self.free.put(copy)

    def mutant(self, mutant: Mutant, baseline: PytestRun) -> Result:
        missing_isa = isa_missing(mutant)
        if missing_isa is not None:
            return self.result(mutant, NOT_RUN, f"this CPU does not run the {missing_isa} path")
        problem = baseline_error(baseline)
        if problem is not None:
            return self.result(mutant, ERROR, problem)
        copy = self.free.get()
        path = copy / mutant.file
        libraries = {lib: lib.read_bytes() for lib in copy.glob(KERNEL_LIBRARY_GLOB)} if mutant.compiled else {}
        try:
            original = path.read_text()
            path.write_text(mutated(mutant, original))
            try:
                failed_build = build_kernels(copy) if mutant.compiled else None
                if failed_build is not None:
                    return self.result(mutant, ERROR, f"the mutant does not compile: {failed_build}")
                limit = time_limit(baseline)
                run = run_pytest(copy, mutant.pytest_args(), child_env(copy, self.threads), limit)
            finally:
                path.write_text(original)
                for lib, data in libraries.items():  # the unmutated build, without rebuilding
                    lib.write_bytes(data)
        finally:
            self.free.put(copy)
        return self.result(mutant, *classify(baseline, run, limit), seconds=run.seconds)

    def result(self, mutant: Mutant, outcome: str, detail: str, seconds: float = 0.0) -> Result:
        return Result(mutant.id, mutant.file, mutant.description, mutant.pytest_args(), outcome, seconds, detail,
                      mutant.digest(), self.file_sha256.get(mutant.file, ""), tests_digest(mutant, self.first))


def cpu_paths() -> set[str]:
    """The int8 kernel paths this CPU runs (the engine's own check), or none without the kernels."""
    try:
        from specdec.engine import kernels
        from specdec.engine.kernels.int8 import ISA, isa_supported
    except ImportError:
        return set()
    return {name for isa, name in ISA.NAMES.items() if kernels.available() and isa_supported(isa)}


def isa_missing(mutant: Mutant) -> str | None:
    """The ISA path a mutant's file is, when this CPU cannot run it (its mutant is then not run)."""
    path = ISA_FILES.get(mutant.file)
    return path if path is not None and path not in cpu_paths() else None


def build_kernels(copy: Path) -> str | None:
    """Build the kernel library in place in a copy; None, or why it failed."""
    done = subprocess.run([sys.executable, *BUILD_KERNELS], cwd=copy, capture_output=True, text=True,
                          env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
    if done.returncode != 0 or not list(copy.glob(KERNEL_LIBRARY_GLOB)):
        errors = [ln for ln in (done.stderr + done.stdout).splitlines() if "error" in ln.lower()]
        return (errors or ["no library was built"])[0][:300]
    return None


def run_all(mutants: Sequence[Mutant], jobs: int, repo: Path = REPO_ROOT) -> tuple[list[Result], dict]:
    """Every mutant's result (in list order) and the unmutated runs by selection."""
    def report(r: Result) -> Result:
        print(f"{r.outcome:8s} {r.seconds:6.1f}s {r.id}: {r.detail}", flush=True)
        return r

    with tempfile.TemporaryDirectory(prefix="specdec-mutants-") as tmp:
        workers = Workers(repo, jobs, Path(tmp))
        broken = workers.not_applying(mutants)
        runnable = [m for m in mutants if m.id not in broken]
        selections = list(dict.fromkeys(m.selection() for m in runnable))
        with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
            try:
                baselines = dict(zip(selections, pool.map(workers.baseline, selections)))
                for selection, run in baselines.items():
                    print(f"unmutated {run.seconds:6.1f}s rc={run.returncode} {' '.join(selection)}", flush=True)
                futures = {m.id: pool.submit(workers.mutant, m, baselines[m.selection()]) for m in runnable}
                results = [report(workers.result(m, ERROR, broken[m.id]) if m.id in broken else futures[m.id].result())
                           for m in mutants]
            except BaseException:  # Ctrl-C included: nothing new starts, the runs in flight end now
                pool.shutdown(wait=False, cancel_futures=True)
                stop_running()
                raise
    return results, baselines


# ---- report ---------------------------------------------------------------------------------
def summary(results: Sequence[Result]) -> dict:
    totals = {o: sum(r.outcome == o for r in results) for o in (KILLED, TIMEOUT, SURVIVED, ERROR, NOT_RUN)}
    scored = totals[KILLED] + totals[TIMEOUT] + totals[SURVIVED]
    score = (totals[KILLED] + totals[TIMEOUT]) / scored if scored else 0.0
    return {"mutants": len(results), **totals, "score": round(score, 4),
            "survivors": [r.id for r in results if r.outcome == SURVIVED],
            "errors": [r.id for r in results if r.outcome == ERROR]}


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True).stdout


def tree_state() -> dict:
    """The working tree the copies are made from: its commit, whether it was clean, what differed
    (read when the copies are made, so a commit made during the run is not claimed)."""
    uncommitted = [line[3:] for line in git(REPO_ROOT, "status", "--porcelain", "--untracked-files=all").splitlines()]
    return {"commit": git(REPO_ROOT, "rev-parse", "HEAD").strip(), "clean": not uncommitted, "uncommitted": uncommitted}


def machine() -> str:
    """The CPU the verdicts hold for (an ISA path's mutants run only where the CPU has it) and the kernel path."""
    from specdec_client.envinfo import cpu_model, kernel_path

    return (f"{cpu_model()}, {platform.machine()}, {os.cpu_count()} CPUs, kernel path {kernel_path()} "
            f"(runs: {', '.join(sorted(cpu_paths())) or 'none'}), Python {platform.python_version()}")


def write_report(out: Path, command: str, results: Sequence[Result], baselines: dict, seconds: float, jobs: int,
                 tree: dict) -> dict:
    report = {
        "command": command,
        **tree,
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": machine(),
        "pytest": f"python -m pytest {' '.join(PYTEST_ARGS)} <tests>",
        "jobs": jobs,
        "seconds": round(seconds, 1),
        "totals": summary(results),
        "mutants": [asdict(r) for r in results],
        "unmutated": [{"tests": list(s), "returncode": run.returncode, "seconds": run.seconds} for s, run in baselines.items()],
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    return report


def update_report(path: Path, command: str, results: Sequence[Result], seconds: float, tree: dict,
                  listed: Sequence[Mutant]) -> dict:
    """Replace these mutants' results in the record at path, in list order, and say so under
    'updates' (this run's tree, date and ids); the totals are recomputed from every result."""
    report = json.loads(Path(path).read_text())
    fresh = {r.id: asdict(r) for r in results}
    order = [m.id for m in listed]
    merged = {r["id"]: r for r in report["mutants"]} | fresh
    report["mutants"] = [merged[i] for i in order if i in merged] + [r for i, r in merged.items() if i not in order]
    report["totals"] = summary([Result(**r) for r in report["mutants"]])
    report.setdefault("updates", []).append({"command": command, **tree, "machine": machine(),
                                             "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                                             "seconds": round(seconds, 1), "mutants": sorted(fresh)})
    Path(path).write_text(json.dumps(report, indent=1) + "\n")
    return report


@dataclass(frozen=True)
class RecordStatus:
    """How a record (results/mutants.json) stands against today's list and code."""
    missing: list[str]  # listed mutants with no result for their current definition
    unlisted: list[str]  # results for mutants no longer listed
    changed_files: list[str]  # mutated files whose content differs from what the record ran on
    files: list[str]  # every file the record mutated
    stale: list[str] = ()  # listed mutants whose file or tests changed since their result (or never hashed their tests)


def record_status(record: dict, mutants: Sequence[Mutant], repo: Path = REPO_ROOT) -> RecordStatus:
    recorded = {r["id"]: r for r in record["mutants"]}
    missing = [m.id for m in mutants if recorded.get(m.id, {}).get("digest") != m.digest()]
    listed = {m.id for m in mutants}
    files = sorted({r["file"] for r in record["mutants"]})
    today = {f: file_digest(repo / f) if (repo / f).is_file() else None for f in files}
    # per result: results of one file run at different times hold different hashes of it
    outdated = {r["id"] for r in record["mutants"] if today[r["file"]] != r.get("file_sha256", "")}
    changed = sorted({r["file"] for r in record["mutants"] if r["id"] in outdated})
    stale = [m.id for m in mutants if m.id in recorded and m.id not in missing and (
             m.id in outdated or recorded[m.id].get("tests_sha256") != tests_digest(m, repo))]
    return RecordStatus(missing, sorted(set(recorded) - listed), changed, files, stale)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m specdec.tools.mutants", description=__doc__.split("\n\n")[0])
    p.add_argument("--list", type=Path, default=DEFAULT_LIST, help="the mutant list (TOML)")
    p.add_argument("--only", action="append", metavar="ID", help="run only this mutant (repeatable)")
    p.add_argument("--jobs", type=int, default=1, help="mutants run at once, each in its own copy (default 1)")
    p.add_argument("--out", type=Path, help=f"the report (default {DEFAULT_OUT}; none with --only unless given)")
    p.add_argument("--min-score", type=float, default=0.95, help="exit 1 below this score (default 0.95)")
    p.add_argument("--update", type=Path, metavar="RECORD",
                   help="rerun only the --only mutants and replace their results in RECORD (a listed mutant edited "
                        "since the record, or a test added for a survivor); the record keeps its tree and adds this "
                        "run's under 'updates'")
    p.add_argument("--stale", type=Path, metavar="RECORD",
                   help="rerun only the mutants RECORD has no result for, or whose file or tests changed since their "
                        "result, and replace their results in it (what keeps the record true in minutes)")
    args = p.parse_args(argv)
    if args.jobs < 1:
        p.error("--jobs must be >= 1")
    if args.update and not args.only:
        p.error("--update needs --only: the mutants whose results it replaces")
    mutants = load_mutants(args.list)
    if args.stale:
        status = record_status(json.loads(args.stale.read_text()), mutants)
        args.only, args.update = [*status.missing, *status.stale], args.stale
        print(f"{len(status.missing)} without a result, {len(status.stale)} stale: {' '.join(args.only) or 'none'}")
        if not args.only:
            return 0
    if args.only:
        unknown = set(args.only) - {m.id for m in mutants}
        if unknown:
            p.error(f"--only: no mutant {sorted(unknown)} in {args.list}")
        mutants = [m for m in mutants if m.id in args.only]
    t0 = time.monotonic()
    tree = tree_state()
    results, baselines = run_all(mutants, args.jobs)
    seconds = time.monotonic() - t0
    out = args.out if args.out is not None or args.only else DEFAULT_OUT
    command = "python -m specdec.tools.mutants " + " ".join(argv if argv is not None else sys.argv[1:])
    if args.update:
        totals = update_report(args.update, command, results, seconds, tree, load_mutants(args.list))["totals"]
        out = args.update
    else:
        totals = write_report(out, command.strip(), results, baselines, seconds, args.jobs, tree)["totals"] if out else summary(results)
    print(f"score {totals['score']:.1%}: {totals[KILLED]} killed, {totals[TIMEOUT]} by timeout, "
          f"{totals[SURVIVED]} survived {totals['survivors']}, {totals[ERROR]} errors {totals['errors']} "
          f"in {seconds / 60:.1f} min" + (f" -> {out}" if out else ""))
    return 0 if not totals[ERROR] and totals["score"] >= args.min_score else 1


if __name__ == "__main__":
    sys.exit(main())
