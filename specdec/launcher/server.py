"""TritonServer: start the server as its own process group, wait until ready, stop it and
every python-backend stub with it (standard library only)."""

from __future__ import annotations

import atexit
import dataclasses
import os
import resource
import secrets
import signal
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
import weakref
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence

from specdec.launcher.admin import ADMIN_KEY_ENV, restricted_api_args
from specdec.triton_models.keys import INTERNAL_KEY_ENV

from specdec.launcher.install import BACKEND_STUB_NAME as STUB_MARKER, DEFAULT_MODEL_REPOSITORY, PYTHON_SHM_BYTES, ModelRepositoryNotFoundError, ServerExitedError, ServerTimeoutError, TritonInstall, TritonLaunchError, _MIN_SHM_FREE_BYTES, _SHM_REGION_PREFIX, default_cache_dir, find_triton_install, prepare_backend_dir, server_environment
from specdec.launcher.processes import _alive, _proc_cmdline, _tail, descendants, group_members


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


def _enable_core_dumps() -> None:  # in the child, before exec: inherited by every stub
    resource.setrlimit(resource.RLIMIT_CORE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))


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
        self.admin_key: Optional[str] = None  # set by start()

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
        core_dir: Optional[os.PathLike] = None,
    ) -> "TritonServer":
        """Launch tritonserver (does not wait; see :meth:`wait_ready`).

        ``env`` entries are added on top of :func:`server_environment`.  ``address`` binds
        HTTP, gRPC and metrics to one interface (default: tritonserver's ``0.0.0.0``).
        ``extra_args`` are appended last and can override anything. ``core_dir``: the server
        and its Python stubs run there with core dumps on (the kernel's core_pattern permitting),
        so a crash leaves a core for gdb.
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
            # Sized so the pool never grows in normal use (issue 22's crash: see PYTHON_SHM_BYTES).
            shm_default = PYTHON_SHM_BYTES if shm_default_byte_size is None else int(shm_default_byte_size)
            shm_growth = PYTHON_SHM_BYTES if shm_growth_byte_size is None else int(shm_growth_byte_size)
            cmd.append(f"--backend-config=python,shm-default-byte-size={shm_default}")
            cmd.append(f"--backend-config=python,shm-growth-byte-size={shm_growth}")
            child_env = server_environment(install)
            if env:
                child_env.update({str(k): str(v) for k, v in env.items()})
            # The internal models accept only calls that carry this per-server secret.
            child_env.setdefault(INTERNAL_KEY_ENV, secrets.token_hex(32))
            # The administrative APIs (repository control, logging, trace, shared memory,
            # statistics) answer only callers that send the admin key: from the caller's
            # environment when set there, else generated for this server (self.admin_key).
            # (A restart after a stub death keeps the key the operator was given.)
            self.admin_key = child_env.get(ADMIN_KEY_ENV) or os.environ.get(ADMIN_KEY_ENV) or self.admin_key or secrets.token_hex(32)
            child_env[ADMIN_KEY_ENV] = self.admin_key
            cmd += restricted_api_args(self.admin_key)
            cmd += [str(a) for a in extra_args]

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
            shown = " ".join(cmd).replace(self.admin_key, "<admin key>")  # secrets are never logged
            self._log_fh.write(("$ " + shown + "\n").encode())
            self.command = cmd
            try:
                self._proc = subprocess.Popen(
                    cmd,
                    cwd=None if core_dir is None else str(core_dir),
                    preexec_fn=None if core_dir is None else _enable_core_dumps,
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

    def dead_stubs(self) -> List[str]:
        """The Python-backend stubs this server had when it became ready that are gone now
        (their command lines). Triton keeps serving after a stub dies, failing every request
        of that model ("Stub process ... is not healthy") while /v2/health/ready stays 200,
        so the launcher watches for this and restarts the server."""
        return [cmd for pid, cmd in self._known_children.items()
                if STUB_MARKER in cmd and not (_alive(pid) and _proc_cmdline(pid) == cmd)]

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
