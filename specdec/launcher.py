"""Locate, prepare and run NVIDIA Triton Inference Server (``tritonserver``) as a child process.

Two kinds of installation are supported:

* **system** -- a Triton installed the way NVIDIA's container ships it
  (``/opt/tritonserver/bin/tritonserver`` with ``/opt/tritonserver/backends``), or any
  binary named by the ``TRITONSERVER_BIN`` environment variable (its backends are taken
  from ``TRITONSERVER_BACKEND_DIR`` or ``<binary>/../../backends``).  Preferred when present.
* **pytriton** -- the ``tritonserver`` binary bundled in the ``nvidia-pytriton`` wheel.  The
  wheel keeps one Python backend stub per Python version, so :func:`prepare_backend_dir`
  assembles (once, in a cache directory) a backend directory holding ``backends/python`` plus
  the stub that matches the running interpreter.

The child runs in its own session / process group (``start_new_session=True``) so that
:meth:`TritonServer.stop` can signal tritonserver *and* its ``triton_python_backend_stub``
children together and verify that none of them survive.

The environment of the child (see :func:`server_environment`):

* ``LD_LIBRARY_PATH`` -- the wheel's ``nvidia_pytriton.libs`` plus the interpreter's
  ``LIBDIR`` (the stub links ``libpython3.X.so.1.0``), ahead of anything inherited;
* ``PATH`` -- this environment's ``bin/`` first: the stub's embedded interpreter finds its
  prefix (hence site-packages, torch, numpy) through ``python3`` on ``PATH``;
* ``PYTHONPATH`` -- the repository root first, so model code can ``import specdec``;
* ``PYTHONUNBUFFERED=1`` -- model ``print`` output reaches the log promptly.

This module imports nothing outside the standard library at import time.
"""

from __future__ import annotations

import argparse
import atexit
import dataclasses
import importlib.metadata
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import urllib.error
import urllib.request
import weakref
from pathlib import Path
from typing import Dict, Iterable, List, Mapping, Optional, Sequence

from specdec.errors import SpecDecError

__all__ = [
    "BACKEND_STUB_NAME",
    "DEFAULT_MODEL_REPOSITORY",
    "Endpoints",
    "ModelRepositoryNotFoundError",
    "REPO_ROOT",
    "ServerExitedError",
    "ServerTimeoutError",
    "TritonInstall",
    "TritonLaunchError",
    "TritonNotFoundError",
    "TritonServer",
    "default_cache_dir",
    "find_triton_install",
    "free_port",
    "free_ports",
    "prepare_backend_dir",
    "serve_main",
    "server_environment",
]

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL_REPOSITORY = REPO_ROOT / "model_repository"
SYSTEM_TRITON_ROOT = Path("/opt/tritonserver")
BACKEND_STUB_NAME = "triton_python_backend_stub"
PYTRITON_REQUIREMENT = "nvidia-pytriton==0.7.0"
# Files that must exist in a usable python backend directory.
_PYTHON_BACKEND_FILES = ("libtriton_python.so", "triton_python_backend_utils.py", BACKEND_STUB_NAME)
_BUILD_MARKER = ".specdec-complete"
_SHM_REGION_PREFIX = "triton_python_backend_shm_region_"
# Below this much free /dev/shm the python backend is likely to fail (each model instance maps
# a region of shm-default-byte-size and grows it by shm-growth-byte-size on demand).
_MIN_SHM_FREE_BYTES = 64 * 1024 * 1024


# ----------------------------------------------------------------------------------- errors


class TritonLaunchError(SpecDecError, RuntimeError):
    """Triton could not be located, prepared, started or stopped."""


class TritonNotFoundError(TritonLaunchError, FileNotFoundError):
    """No usable tritonserver installation (binary, python backend or stub) was found."""


class ModelRepositoryNotFoundError(TritonLaunchError, FileNotFoundError):
    """The model repository given to the server does not exist or is not a directory."""


class ServerExitedError(TritonLaunchError):
    """tritonserver exited (e.g. a model failed to load, a port was taken) before being ready."""


class ServerTimeoutError(TritonLaunchError, TimeoutError):
    """tritonserver did not become ready within the timeout."""


# ----------------------------------------------------------------------------- installation


@dataclasses.dataclass(frozen=True)
class TritonInstall:
    """Where the pieces of a Triton installation are.

    ``kind`` is ``"system"`` or ``"pytriton"``.  ``backends_dir`` is the directory that can be
    passed as ``--backend-directory`` as is (system installs), or ``None`` when one has to be
    assembled by :func:`prepare_backend_dir` (pytriton).  ``stub`` is the Python backend stub
    for the running interpreter; ``libs_dir`` holds the shared libraries the binary needs
    (``None`` when they are on the default loader path).
    """

    kind: str
    binary: Path
    python_backend_dir: Path
    stub: Path
    libs_dir: Optional[Path]
    backends_dir: Optional[Path] = None
    version: Optional[str] = None

    @property
    def python_version(self) -> str:
        return f"{sys.version_info.major}.{sys.version_info.minor}"


def _pytriton_package_dir() -> Optional[Path]:
    """The ``pytriton`` package directory, found without importing it (or ``None``)."""
    try:
        spec = importlib.util.find_spec("pytriton")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def _pytriton_version() -> Optional[str]:
    try:
        return importlib.metadata.version("nvidia-pytriton")
    except importlib.metadata.PackageNotFoundError:
        return None


def _system_install(binary: Path, *, explicit: bool) -> TritonInstall:
    origin = "TRITONSERVER_BIN" if explicit else str(SYSTEM_TRITON_ROOT)
    if not binary.is_file() or not os.access(binary, os.X_OK):
        raise TritonNotFoundError(f"{origin}: {binary} is not an executable tritonserver binary")
    backend_env = os.environ.get("TRITONSERVER_BACKEND_DIR")
    backends = Path(backend_env) if backend_env else binary.resolve().parent.parent / "backends"
    python_dir = backends / "python"
    missing = [name for name in _PYTHON_BACKEND_FILES if not (python_dir / name).is_file()]
    if missing:
        raise TritonNotFoundError(
            f"{origin}: the python backend at {python_dir} is incomplete (missing {', '.join(missing)}); "
            "set TRITONSERVER_BACKEND_DIR to the directory that holds python/libtriton_python.so"
        )
    return TritonInstall(
        kind="system",
        binary=binary,
        python_backend_dir=python_dir,
        stub=python_dir / BACKEND_STUB_NAME,
        libs_dir=None,
        backends_dir=backends,
        version=None,
    )


def _pytriton_install() -> TritonInstall:
    pkg = _pytriton_package_dir()
    if pkg is None:
        raise TritonNotFoundError(
            f"nvidia-pytriton is not installed: pip install {PYTRITON_REQUIREMENT} "
            "(or set TRITONSERVER_BIN to an existing tritonserver binary)"
        )
    root = pkg / "tritonserver"
    binary = root / "bin" / "tritonserver"
    python_dir = root / "backends" / "python"
    pyver = f"{sys.version_info.major}.{sys.version_info.minor}"
    stubs_root = root / "python_backend_stubs"
    stub = stubs_root / pyver / BACKEND_STUB_NAME
    libs = pkg.parent / "nvidia_pytriton.libs"
    hint = f"reinstall it: pip install --force-reinstall {PYTRITON_REQUIREMENT}"
    if not binary.is_file():
        raise TritonNotFoundError(f"nvidia-pytriton at {pkg} has no tritonserver binary ({binary} is missing); {hint}")
    for name in ("libtriton_python.so", "triton_python_backend_utils.py"):
        if not (python_dir / name).is_file():
            raise TritonNotFoundError(f"nvidia-pytriton at {pkg}: python backend file {python_dir / name} is missing; {hint}")
    if not stub.is_file():
        available = sorted(p.name for p in stubs_root.iterdir() if (p / BACKEND_STUB_NAME).is_file()) if stubs_root.is_dir() else []
        raise TritonNotFoundError(
            f"nvidia-pytriton at {pkg} has no python backend stub for Python {pyver} ({stub} is missing); "
            f"stubs exist for: {', '.join(available) or 'none'}"
        )
    return TritonInstall(
        kind="pytriton",
        binary=binary,
        python_backend_dir=python_dir,
        stub=stub,
        libs_dir=libs if libs.is_dir() else None,
        backends_dir=None,
        version=_pytriton_version(),
    )


def find_triton_install() -> TritonInstall:
    """Find the tritonserver to run.

    Order: ``$TRITONSERVER_BIN`` (an error if it is set but unusable), then a system install
    under ``/opt/tritonserver``, then the binary bundled in ``nvidia-pytriton``.
    Raises :class:`TritonNotFoundError` naming what is missing.
    """
    env_bin = os.environ.get("TRITONSERVER_BIN")
    if env_bin:
        return _system_install(Path(env_bin), explicit=True)
    system_bin = SYSTEM_TRITON_ROOT / "bin" / "tritonserver"
    if system_bin.is_file():
        try:
            return _system_install(system_bin, explicit=False)
        except TritonNotFoundError:
            if _pytriton_package_dir() is None:
                raise
    return _pytriton_install()


def default_cache_dir() -> Path:
    """``$SPECDEC_CACHE_DIR``, else ``<repo>/.cache`` when writable, else ``~/.cache/specdec``."""
    env = os.environ.get("SPECDEC_CACHE_DIR")
    if env:
        return Path(env)
    repo_cache = REPO_ROOT / ".cache"
    if (repo_cache.is_dir() and os.access(repo_cache, os.W_OK)) or os.access(REPO_ROOT, os.W_OK):
        return repo_cache
    return Path.home() / ".cache" / "specdec"


def _backend_dir_complete(backends: Path, install: TritonInstall) -> bool:
    python_dir = backends / "python"
    marker = backends / _BUILD_MARKER
    if not marker.is_file():
        return False
    try:
        if marker.read_text() != _build_fingerprint(install):
            return False
    except OSError:
        return False
    for name in _PYTHON_BACKEND_FILES:
        if not (python_dir / name).is_file():
            return False
    return os.access(python_dir / BACKEND_STUB_NAME, os.X_OK)


def _build_fingerprint(install: TritonInstall) -> str:
    parts = []
    for path in (install.python_backend_dir / "libtriton_python.so", install.stub):
        st = path.stat()
        parts.append(f"{path}:{st.st_size}:{int(st.st_mtime)}")
    return "\n".join(parts) + "\n"


def prepare_backend_dir(cache_dir: Optional[os.PathLike] = None, install: Optional[TritonInstall] = None) -> Path:
    """Return a directory usable as ``--backend-directory``.

    For a system install that is its own backends directory.  For pytriton, assemble (once)
    ``<cache_dir>/triton-backends-pytriton<ver>-py<maj.min>/python/`` with the wheel's python
    backend plus the stub for the running interpreter.  Idempotent and safe to call from
    concurrent processes: an incomplete or outdated directory is rebuilt in a temporary
    directory and swapped in with a rename.
    """
    install = install or find_triton_install()
    if install.backends_dir is not None:
        return install.backends_dir
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    name = f"triton-backends-pytriton{install.version or 'unknown'}-py{install.python_version}"
    target = cache / name
    if _backend_dir_complete(target, install):
        return target
    cache.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=cache))
    try:
        os.chmod(tmp, 0o755)
        shutil.copytree(
            install.python_backend_dir,
            tmp / "python",
            ignore=shutil.ignore_patterns("__pycache__", BACKEND_STUB_NAME),
        )
        shutil.copy2(install.stub, tmp / "python" / BACKEND_STUB_NAME)
        os.chmod(tmp / "python" / BACKEND_STUB_NAME, 0o755)
        (tmp / _BUILD_MARKER).write_text(_build_fingerprint(install))
        if target.exists():
            if _backend_dir_complete(target, install):  # another process finished first
                return target
            stale = Path(tempfile.mkdtemp(prefix=f".{name}.stale.", dir=cache))
            try:
                os.replace(target, stale / "old")
            except OSError:
                pass
            shutil.rmtree(stale, ignore_errors=True)
        try:
            os.replace(tmp, target)
        except OSError:
            if not _backend_dir_complete(target, install):
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    if not _backend_dir_complete(target, install):
        raise TritonLaunchError(f"could not prepare the Triton backend directory {target}")
    return target


def server_environment(install: TritonInstall, base: Optional[Mapping[str, str]] = None) -> Dict[str, str]:
    """The environment tritonserver (and its python stubs) must run with; see the module doc."""
    env = dict(os.environ if base is None else base)

    def prepend(var: str, entries: Iterable[Optional[os.PathLike]]) -> None:
        new = [str(e) for e in entries if e]
        old = [p for p in env.get(var, "").split(os.pathsep) if p and p not in new]
        env[var] = os.pathsep.join(dict.fromkeys(new + old))

    libdir = sysconfig.get_config_var("LIBDIR")
    prepend("LD_LIBRARY_PATH", [install.libs_dir, libdir])
    bin_dirs = [Path(sys.prefix) / "bin", Path(sys.executable).parent]
    prepend("PATH", [d for d in bin_dirs if (d / "python3").exists() or (d / "python").exists()] or bin_dirs[:1])
    prepend("PYTHONPATH", [REPO_ROOT])
    env["PYTHONUNBUFFERED"] = "1"
    env.pop("PYTHONHOME", None)
    return env


# ------------------------------------------------------------------------------- processes


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free right now (another process may still take it later)."""
    return free_ports(1, host)[0]


def free_ports(n: int, host: str = "127.0.0.1") -> List[int]:
    """``n`` distinct free TCP ports (all bound at once, then released)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _proc_stat(pid: int) -> Optional[tuple]:
    """(state, ppid, pgrp) of a process from /proc, or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            data = fh.read().decode("utf-8", "replace")
    except OSError:
        return None
    rest = data[data.rfind(")") + 2 :].split()
    try:
        return rest[0], int(rest[1]), int(rest[2])
    except (IndexError, ValueError):
        return None


def _proc_cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read().replace(b"\0", b" ").decode("utf-8", "replace").strip()
    except OSError:
        return ""


def _all_pids() -> List[int]:
    try:
        return [int(name) for name in os.listdir("/proc") if name.isdigit()]
    except OSError:
        return []


def _alive(pid: int) -> bool:
    st = _proc_stat(pid)
    if st is None:
        if not os.path.isdir("/proc"):
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return False
            except PermissionError:
                return True
            return True
        return False
    return st[0] not in ("Z", "X")


def group_members(pgid: int) -> List[int]:
    """Live (non-zombie) processes whose process group is ``pgid``."""
    out = []
    for pid in _all_pids():
        st = _proc_stat(pid)
        if st is not None and st[2] == pgid and st[0] not in ("Z", "X"):
            out.append(pid)
    return out


def descendants(root: int) -> List[int]:
    """Live descendants of ``root`` (from /proc)."""
    children: Dict[int, List[int]] = {}
    for pid in _all_pids():
        st = _proc_stat(pid)
        if st is not None and st[0] not in ("Z", "X"):
            children.setdefault(st[1], []).append(pid)
    out, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _tail(path: Optional[Path], max_lines: int = 40, max_bytes: int = 64 * 1024) -> str:
    if path is None:
        return ""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - max_bytes))
            data = fh.read().decode("utf-8", "replace")
    except OSError:
        return ""
    return "\n".join(data.splitlines()[-max_lines:])


@dataclasses.dataclass(frozen=True)
class Endpoints:
    """Where a running server listens.

    ``http`` and ``grpc`` are ``host:port`` (the form tritonclient expects); ``http_url`` and
    ``metrics_url`` are full URLs.
    """

    host: str
    http_port: int
    grpc_port: int
    metrics_port: int

    @property
    def http(self) -> str:
        return f"{self.host}:{self.http_port}"

    @property
    def grpc(self) -> str:
        return f"{self.host}:{self.grpc_port}"

    @property
    def http_url(self) -> str:
        return f"http://{self.host}:{self.http_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.host}:{self.metrics_port}/metrics"

    def __str__(self) -> str:
        return f"HTTP {self.http_url}  gRPC {self.grpc}  metrics {self.metrics_url}"


_LIVE_SERVERS: "weakref.WeakSet[TritonServer]" = weakref.WeakSet()


def _stop_live_servers() -> None:  # atexit: never leave an orphaned server group behind
    for server in list(_LIVE_SERVERS):
        try:
            server.stop(timeout=10)
        except Exception:
            pass


atexit.register(_stop_live_servers)


class TritonServer:
    """One tritonserver child process (plus its python stubs) in its own process group.

    >>> with TritonServer() as server:                               # doctest: +SKIP
    ...     server.start("model_repository", 8000, 8001, 8002)
    ...     server.wait_ready(120)
    ...     print(server.endpoints)

    ``start`` returns ``self`` so ``with TritonServer().start(...) as s:`` works too; leaving
    the ``with`` block calls :meth:`stop`.  Everything the server (and the python models)
    writes to stdout/stderr goes to :attr:`log_path`.
    """

    def __init__(
        self,
        install: Optional[TritonInstall] = None,
        *,
        cache_dir: Optional[os.PathLike] = None,
        log_path: Optional[os.PathLike] = None,
    ):
        self._install = install
        self._cache_dir = Path(cache_dir) if cache_dir is not None else None
        self._log_path: Optional[Path] = Path(log_path) if log_path is not None else None
        self._proc: Optional[subprocess.Popen] = None
        self._log_fh = None
        self._endpoints: Optional[Endpoints] = None
        self._pgid: Optional[int] = None
        self._known_children: Dict[int, str] = {}
        self._lock = threading.RLock()
        self.command: List[str] = []

    # -- properties --------------------------------------------------------------------
    @property
    def install(self) -> TritonInstall:
        if self._install is None:
            self._install = find_triton_install()
        return self._install

    @property
    def log_path(self) -> Optional[Path]:
        return self._log_path

    @property
    def endpoints(self) -> Endpoints:
        if self._endpoints is None:
            raise TritonLaunchError("the server has not been started")
        return self._endpoints

    @property
    def pid(self) -> Optional[int]:
        return self._proc.pid if self._proc is not None else None

    @property
    def pgid(self) -> Optional[int]:
        return self._pgid

    @property
    def returncode(self) -> Optional[int]:
        return self._proc.poll() if self._proc is not None else None

    def is_running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def log_tail(self, max_lines: int = 40) -> str:
        return _tail(self._log_path, max_lines)

    # -- lifecycle ---------------------------------------------------------------------
    def start(
        self,
        model_repository: os.PathLike,
        http_port: int = 8000,
        grpc_port: int = 8001,
        metrics_port: int = 8002,
        log_verbose: int = 0,
        extra_args: Sequence[str] = (),
        env: Optional[Mapping[str, str]] = None,
        *,
        address: Optional[str] = None,
        model_control_mode: str = "none",
        load_models: Sequence[str] = (),
        strict_readiness: bool = True,
        exit_timeout_secs: int = 10,
        shm_default_byte_size: Optional[int] = None,
        shm_growth_byte_size: Optional[int] = None,
        allow_gpu_metrics: Optional[bool] = None,
    ) -> "TritonServer":
        """Launch tritonserver (does not wait; see :meth:`wait_ready`).

        ``env`` entries are added on top of :func:`server_environment`.  ``address`` binds
        HTTP, gRPC and metrics to one interface (default: tritonserver's ``0.0.0.0``).
        ``extra_args`` are appended last and can override anything.
        """
        with self._lock:
            if self.is_running():
                raise TritonLaunchError(f"the server is already running (pid {self.pid})")
            repo = Path(model_repository).expanduser()
            if not repo.is_dir():
                raise ModelRepositoryNotFoundError(
                    f"model repository {repo} does not exist or is not a directory"
                    + (" (pass --model-repository, or create it)" if repo.resolve() == DEFAULT_MODEL_REPOSITORY else "")
                )
            repo = repo.resolve()
            ports = {"http_port": http_port, "grpc_port": grpc_port, "metrics_port": metrics_port}
            for name, value in ports.items():
                if not isinstance(value, int) or isinstance(value, bool) or not 0 < value < 65536:
                    raise TritonLaunchError(f"{name}: {value!r} is not a TCP port")
            if len(set(ports.values())) != 3:
                raise TritonLaunchError(f"http, grpc and metrics ports must differ: {ports}")

            install = self.install
            backends = prepare_backend_dir(self._cache_dir, install)
            cmd = [
                str(install.binary),
                f"--model-repository={repo}",
                f"--backend-directory={backends}",
                f"--http-port={http_port}",
                f"--grpc-port={grpc_port}",
                f"--metrics-port={metrics_port}",
                "--allow-metrics=true",
                f"--log-verbose={int(log_verbose)}",
                f"--model-control-mode={model_control_mode}",
                f"--strict-readiness={'true' if strict_readiness else 'false'}",
                "--exit-on-error=true",
                f"--exit-timeout-secs={int(exit_timeout_secs)}",
            ]
            if address:
                cmd += [f"--http-address={address}", f"--grpc-address={address}", f"--metrics-address={address}"]
            for name in load_models:
                cmd.append(f"--load-model={name}")
            if allow_gpu_metrics is None:
                # Without an NVIDIA driver, GPU metrics only produce NVML/DCGM warnings.
                allow_gpu_metrics = os.path.exists("/dev/nvidiactl")
            cmd.append(f"--allow-gpu-metrics={'true' if allow_gpu_metrics else 'false'}")
            if shm_default_byte_size is not None:
                cmd.append(f"--backend-config=python,shm-default-byte-size={int(shm_default_byte_size)}")
            if shm_growth_byte_size is not None:
                cmd.append(f"--backend-config=python,shm-growth-byte-size={int(shm_growth_byte_size)}")
            cmd += [str(a) for a in extra_args]

            child_env = server_environment(install)
            if env:
                child_env.update({str(k): str(v) for k, v in env.items()})

            if self._log_path is None:
                log_dir = default_cache_dir() if self._cache_dir is None else self._cache_dir
                log_dir = log_dir / "logs"
                log_dir.mkdir(parents=True, exist_ok=True)
                fd, name = tempfile.mkstemp(prefix=f"tritonserver-{http_port}-", suffix=".log", dir=log_dir)
                os.close(fd)
                self._log_path = Path(name)
            else:
                self._log_path.parent.mkdir(parents=True, exist_ok=True)
            self._warn_if_small_shm()

            self._log_fh = open(self._log_path, "ab", buffering=0)
            self._log_fh.write(("$ " + " ".join(cmd) + "\n").encode())
            self.command = cmd
            try:
                self._proc = subprocess.Popen(
                    cmd,
                    stdin=subprocess.DEVNULL,
                    stdout=self._log_fh,
                    stderr=subprocess.STDOUT,
                    env=child_env,
                    start_new_session=True,
                    close_fds=True,
                )
            except OSError as exc:
                self._log_fh.close()
                self._log_fh = None
                raise TritonLaunchError(f"could not execute {install.binary}: {exc}") from exc
            self._pgid = self._proc.pid  # session leader: pgid == pid
            self._known_children = {}
            host = address if address and address not in ("0.0.0.0", "::", "[::]") else "127.0.0.1"
            self._endpoints = Endpoints(host, http_port, grpc_port, metrics_port)
            _LIVE_SERVERS.add(self)
            return self

    def _warn_if_small_shm(self) -> None:
        try:
            st = os.statvfs("/dev/shm")
        except OSError:
            return
        free = st.f_bavail * st.f_frsize
        if free < _MIN_SHM_FREE_BYTES and self._log_path is not None:
            with open(self._log_path, "ab") as fh:
                fh.write(
                    f"specdec: warning: only {free // (1024 * 1024)} MiB free in /dev/shm; the python backend "
                    "needs shared memory (docker: --shm-size=1g)\n".encode()
                )

    def wait_ready(self, timeout: float = 120.0, poll_interval: float = 0.1) -> "TritonServer":
        """Poll ``/v2/health/ready`` until 200.

        Raises :class:`ServerExitedError` (with the log tail) as soon as the process exits,
        :class:`ServerTimeoutError` (with the log tail) after ``timeout`` seconds.
        """
        if self._proc is None:
            raise TritonLaunchError("the server has not been started")
        url = f"{self.endpoints.http_url}/v2/health/ready"
        deadline = time.monotonic() + timeout
        while True:
            code = self._proc.poll()
            if code is not None:
                raise ServerExitedError(
                    f"tritonserver exited with code {code} before becoming ready; log {self._log_path}:\n{self.log_tail()}"
                )
            try:
                with urllib.request.urlopen(url, timeout=2) as resp:
                    if resp.status == 200:
                        self._remember_children()
                        return self
            except (urllib.error.URLError, OSError, ValueError):
                pass
            if time.monotonic() >= deadline:
                raise ServerTimeoutError(
                    f"tritonserver was not ready after {timeout:.0f}s; log {self._log_path}:\n{self.log_tail()}"
                )
            time.sleep(poll_interval)

    def _remember_children(self) -> None:
        if self._proc is not None:
            for pid in descendants(self._proc.pid):
                self._known_children.setdefault(pid, _proc_cmdline(pid))

    def survivors(self) -> List[int]:
        """Processes of this server (group members or remembered descendants) still alive."""
        pids = set()
        if self._pgid is not None:
            pids.update(group_members(self._pgid))
        # remembered descendants (in case one left the group); the command line guards against pid reuse
        pids.update(p for p, cmd in self._known_children.items() if _alive(p) and _proc_cmdline(p) == cmd)
        if self._proc is not None and self._proc.poll() is None:
            pids.add(self._proc.pid)
        return sorted(pids)

    def stop(self, timeout: float = 30.0) -> Optional[int]:
        """Stop the server: SIGTERM to the whole process group, wait up to ``timeout`` seconds,
        then SIGKILL whatever is left (python stubs included).  Returns tritonserver's exit code
        (``None`` if it was never started).  Idempotent.
        """
        with self._lock:
            proc = self._proc
            if proc is None:
                return None
            if proc.poll() is None:
                self._remember_children()
            self._signal_group(signal.SIGTERM)
            deadline = time.monotonic() + max(0.0, timeout)
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            # The stubs normally exit during model unload; give them the remaining time.
            while self.survivors() and time.monotonic() < deadline:
                time.sleep(0.05)
            if self.survivors():
                self._signal_group(signal.SIGKILL)
                for pid in self.survivors():
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except (ProcessLookupError, PermissionError):
                        pass
                kill_deadline = time.monotonic() + 5.0
                while self.survivors() and time.monotonic() < kill_deadline:
                    time.sleep(0.05)
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
            self._remove_stale_shm()
            if self._log_fh is not None:
                self._log_fh.close()
                self._log_fh = None
            _LIVE_SERVERS.discard(self)
            left = self.survivors()
            if left:
                raise TritonLaunchError(
                    "processes of the Triton server survived SIGKILL: "
                    + ", ".join(f"{p} ({_proc_cmdline(p)})" for p in left)
                )
            return proc.returncode

    def _remove_stale_shm(self) -> None:
        """Unlink the python backend's /dev/shm regions of this server's stubs.

        Triton removes them itself on a clean shutdown; after SIGKILL they would leak.  The
        region names (UUID-based, taken from the stubs' command lines) belong to this server only.
        """
        for cmd in self._known_children.values():
            for token in cmd.split():
                if token.startswith(_SHM_REGION_PREFIX) and "/" not in token:
                    try:
                        os.unlink(os.path.join("/dev/shm", token))
                    except OSError:
                        pass

    def _signal_group(self, sig: int) -> None:
        if self._pgid is None:
            return
        try:
            os.killpg(self._pgid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def __enter__(self) -> "TritonServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.is_running() else "stopped"
        return f"TritonServer(pid={self.pid}, {state}, endpoints={self._endpoints}, log={self._log_path})"


# ------------------------------------------------------------------------------------ CLI


def _build_parser(prog: str = "specdec serve") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="Run Triton Inference Server on the specdec model repository.")
    p.add_argument("--model-repository", type=Path, default=DEFAULT_MODEL_REPOSITORY, help="default: %(default)s")
    p.add_argument("--http-port", type=int, default=8000)
    p.add_argument("--grpc-port", type=int, default=8001)
    p.add_argument("--metrics-port", type=int, default=8002)
    p.add_argument("--log-verbose", type=int, default=0, help="tritonserver --log-verbose level")
    p.add_argument("--log-file", type=Path, default=None, help="server + model log (default: a file under the cache dir)")
    p.add_argument("--address", default=None, help="interface to bind (default: tritonserver's 0.0.0.0)")
    p.add_argument("--ready-timeout", type=float, default=600.0, help="seconds to wait for all models to load")
    p.add_argument("--stop-timeout", type=float, default=30.0)
    p.add_argument(
        "--shm-default-byte-size", type=int, default=None, help="python backend initial shared-memory region per model instance"
    )
    p.add_argument("extra", nargs="*", help="extra tritonserver arguments (after --)")
    return p


def serve_main(argv: Optional[Sequence[str]] = None) -> int:
    """``specdec serve``: start Triton, wait until ready, print the endpoints, block until
    SIGINT/SIGTERM (or the server dies), then stop it and its python stubs.  Returns an exit code.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--"]:  # `specdec serve -- --http-port ...` (argparse.REMAINDER keeps the "--")
        argv = argv[1:]
    args = _build_parser().parse_args(argv)
    stop_event = threading.Event()
    received: List[int] = []

    def on_signal(signum, _frame):
        received.append(signum)
        stop_event.set()

    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, on_signal)
    server = TritonServer(log_path=args.log_file)
    try:
        try:
            server.start(
                args.model_repository,
                args.http_port,
                args.grpc_port,
                args.metrics_port,
                log_verbose=args.log_verbose,
                extra_args=args.extra,
                address=args.address,
                shm_default_byte_size=args.shm_default_byte_size,
            )
        except TritonLaunchError as exc:
            print(f"specdec serve: {exc}", file=sys.stderr)
            return 2
        print(f"specdec serve: starting tritonserver (pid {server.pid}); log: {server.log_path}", flush=True)
        deadline = time.monotonic() + args.ready_timeout
        while not stop_event.is_set():
            try:
                server.wait_ready(timeout=min(1.0, max(0.0, deadline - time.monotonic())))
                break
            except ServerTimeoutError as exc:
                if time.monotonic() >= deadline:
                    print(f"specdec serve: {exc}", file=sys.stderr)
                    return 1
            except ServerExitedError as exc:
                print(f"specdec serve: {exc}", file=sys.stderr)
                return 1
        if stop_event.is_set():
            print("specdec serve: interrupted before the server was ready; stopping", flush=True)
            return 130
        ep = server.endpoints
        print("specdec serve: ready", flush=True)
        print(f"  HTTP    {ep.http_url}", flush=True)
        print(f"  gRPC    {ep.grpc}", flush=True)
        print(f"  metrics {ep.metrics_url}", flush=True)
        print("  (Ctrl-C to stop)", flush=True)
        while not stop_event.wait(0.5):
            if not server.is_running():
                print(
                    f"specdec serve: tritonserver exited with code {server.returncode}; log {server.log_path}:\n{server.log_tail()}",
                    file=sys.stderr,
                )
                return 1
        name = signal.Signals(received[0]).name if received else "signal"
        print(f"specdec serve: {name} received; stopping tritonserver", flush=True)
        return 0
    finally:
        try:
            code = server.stop(timeout=args.stop_timeout)
            if code is not None:
                print(f"specdec serve: tritonserver stopped (exit code {code})", flush=True)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


if __name__ == "__main__":  # python -m specdec.launcher [serve options]
    sys.exit(serve_main())
