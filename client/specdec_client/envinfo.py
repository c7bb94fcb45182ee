"""The environment record stored with every benchmark result: versions, hardware,
server version and the server's settings (model_repository/specdec.json)."""
from __future__ import annotations

import datetime as dt
import hashlib
import importlib.metadata
import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

PACKAGES = ("specdec", "tritonclient", "grpcio", "aiohttp", "numpy", "torch", "transformers", "tokenizers",
            "nvidia-pytriton", "locust", "matplotlib", "rich")


def package_versions(names=PACKAGES) -> dict[str, str | None]:
    out = {}
    for name in names:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def gpus() -> list[str]:
    """GPU names from nvidia-smi; [] without an NVIDIA driver."""
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in out.splitlines() if line.strip()]


def host_info() -> dict[str, Any]:
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    names = gpus()
    return {
        "hostname": platform.node(), "platform": platform.platform(), "python": sys.version.split()[0],
        "cpu_model": cpu_model(), "cpu_count": os.cpu_count(), "cpus_usable": usable,
        "gpu_models": names, "gpu_count": len(names),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
    }


def server_settings(path: str | Path | None) -> dict[str, Any]:
    """Precision, max_batch_size, threads and speculative config from specdec.json
    (read on this machine: it describes the server only when both use the same file)."""
    if path is None:
        return {"path": None, "error": "no settings file given"}
    path = Path(path)
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        return {"path": str(path), "error": f"{type(exc).__name__}: {exc}"}
    engine = raw.get("engine", {})
    return {
        "path": str(path),
        "precision": engine.get("dtype"),
        "device": engine.get("device"),
        "max_batch_size": engine.get("max_batch_size"),
        "max_seq_len": engine.get("max_seq_len"),
        "max_num_draft_tokens": engine.get("max_num_draft_tokens"),
        "compile": engine.get("compile"),
        "threads": raw.get("threads", {}),
        "model_dir": raw.get("model_dir"),
        "apply_chat_template": raw.get("apply_chat_template"),
        "speculative": {"default_method": raw.get("default_method"), "methods": raw.get("methods", {})},
    }


def _git(args: list[str], cwd: str | Path | None, timeout: int = 30) -> str:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=timeout, check=True).stdout


# What a result's tree state compares: tracked code, not the results being written.
_TREE_PATHS = ["--", ".", ":!results"]


def tree_state(cwd: str | Path | None = None) -> str | None:
    """"clean", or "diff:<sha256 of `git diff HEAD`, 16 hex>" (the local changes a run measured,
    so two runs on the same uncommitted tree can be told to match); None outside a git checkout."""
    try:
        diff = _git(["diff", "HEAD", "--no-ext-diff", "--binary", *_TREE_PATHS], cwd)
    except (OSError, subprocess.SubprocessError):
        return None
    return "clean" if not diff else "diff:" + hashlib.sha256(diff.encode()).hexdigest()[:16]


def _commit_and_state(cwd: str | Path | None = None) -> tuple[str | None, str | None]:
    try:
        head = _git(["rev-parse", "HEAD"], cwd, timeout=10).strip()
    except (OSError, subprocess.SubprocessError):
        return None, None
    state = tree_state(cwd)
    return head + ("" if state == "clean" else "+dirty"), state


def git_commit(cwd: str | Path | None = None) -> str | None:
    """The checked-out commit the result measured, "+dirty" when tracked code outside
    results/ differs from it; None outside a git checkout."""
    return _commit_and_state(cwd)[0]


# The engine's int8 kernel paths, best first, with the CPU flags each needs (specdec/engine/kernels/
# int8_linear.c picks the same way; this package may not import the engine, and a client-only
# install has none).
KERNEL_PATHS = (("amx", {"amx_int8", "amx_tile", "avx512f", "avx512bw", "avx512vl", "avx512_vnni"}),
                ("avx512_vnni", {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"}),
                ("avx2", {"avx2", "fma"}))


def kernel_path() -> str:
    """The int8 kernel path a process started here runs: SPECDEC_INT8_PATH when set, else the best
    path this CPU's flags allow (reference where none)."""
    forced = os.environ.get("SPECDEC_INT8_PATH")
    if forced:
        return forced
    flags: set[str] = set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    return next((name for name, needs in KERNEL_PATHS if needs <= flags), "reference")


def thread_settings() -> dict[str, Any]:
    """The thread settings a measurement ran under: the environment's and, with torch loaded, its team."""
    out: dict[str, Any] = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS")}
    torch = sys.modules.get("torch")
    if torch is not None:
        out["torch"] = torch.get_num_threads()
    return out


def provenance() -> dict[str, Any]:
    """Commit, whether the tree was clean (and the diff's hash when not), date and machine (its CPU,
    the kernel path and the threads): what every file under results/ records about its run (at its
    top level: `stamped`)."""
    commit, state = _commit_and_state()
    return {"commit": commit, "clean": None if commit is None else not commit.endswith("+dirty"),
            "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "host": {**host_info(), "kernel_path": kernel_path(), "threads": thread_settings()},
            "tree": state or "unknown"}


PROVENANCE_KEYS = ("commit", "clean", "date", "host", "tree")


def _head(commit: str | None) -> str | None:
    return commit.removesuffix("+dirty") if commit else None


def stamped(record: dict[str, Any], started: dict[str, Any] | None = None) -> dict[str, Any]:
    """`record` with its run's provenance first, at the top level: commit ("+dirty" when tracked
    code outside results/ differed from it), clean (an explicit boolean; None outside a git
    checkout), date and host (the machine: host_info()).

    The commit and date are those of the run's start when known: `started` (a provenance()
    taken then), else the record's own top-level or `env` commit and date (what env records
    and `{**provenance(), ...}` hold). The tree counts as clean only when it was clean at the
    start and still is as the record is written, on the same commit: a run whose tree changed
    under it says so (clean false, and `commit_at_write` names the later commit when HEAD
    moved). Everything else in the record, its `env` included, is kept as it is."""
    env = record.get("env") if isinstance(record.get("env"), dict) else {}
    now = provenance()
    start = started or next((r for r in (record, env) if r.get("commit")), now)
    commit = start.get("commit")
    known = [c for c in (commit, now["commit"]) if c is not None]
    clean = None if not known else (all(not c.endswith("+dirty") for c in known) and len({_head(c) for c in known}) == 1
                                    and start.get("clean") is not False and env.get("clean") is not False)
    host = start.get("host") if isinstance(start.get("host"), dict) else now["host"]
    # a start without a tree state (an env record) on a run clean at both ends: the tree was clean
    tree = start.get("tree") or env.get("tree") or (now.get("tree") if clean else None) or "unknown"
    if clean is False and tree == "clean":  # clean at the start, changed under the run: that diff
        tree = now.get("tree") or "unknown"
    out: dict[str, Any] = {"commit": commit if commit is not None else now["commit"], "clean": clean,
                           "date": start.get("date") or now["date"], "host": host, "tree": tree}
    if commit is not None and now["commit"] is not None and _head(commit) != _head(now["commit"]):
        out["commit_at_write"] = now["commit"]
    return {**out, **{k: v for k, v in record.items() if k not in (*PROVENANCE_KEYS, "commit_at_write")}}


def write_result(path: str | Path, record: dict[str, Any], started: dict[str, Any] | None = None, *,
                 indent: int | None = 2, default: Any = None) -> Path:
    """Write `record` as JSON to `path` (folders made), stamped with its provenance: the one
    writer of every record under results/."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(stamped(record, started), indent=indent, default=default) + "\n")
    return path


def environment(server_metadata: dict[str, Any] | None, settings_path: str | Path | None) -> dict[str, Any]:
    return {
        **provenance(),
        "packages": package_versions(),
        "server": server_metadata or {},
        "server_config": server_settings(settings_path),
    }
