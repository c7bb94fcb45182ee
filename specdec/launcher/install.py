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

import dataclasses
import importlib.metadata
import importlib.util
import os
import shutil
import sys
import sysconfig
import tempfile
from pathlib import Path
from typing import Dict, Iterable, Mapping, Optional

from specdec.errors import SpecDecError


REPO_ROOT = Path(__file__).resolve().parents[2]  # the checkout: specdec/launcher/install.py
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
# The python backend's shared-memory pool per model instance, and its growth step. Triton's
# defaults (1 MiB, grown 1 MiB at a time) make a busy instance grow its pool while requests
# are in flight, the path suspected in the one tritonserver SIGSEGV seen here (issue 22;
# python_backend's pool growth, cf. triton-inference-server/server#8882). 32 MiB holds the
# largest tensors we pass (a sampled tree's draft probabilities: 16 x 49152 x 4 B = 3 MiB per
# sequence) many times over; /dev/shm regions are sparse, so unused space costs nothing.
PYTHON_SHM_BYTES = 32 * 1024 * 1024


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
    # The checkout's packages for the python stubs: specdec at its root, the wire contract
    # (specdec_wire) beside the client in client/.
    prepend("PYTHONPATH", [REPO_ROOT, REPO_ROOT / "client"])
    env["PYTHONUNBUFFERED"] = "1"
    env.pop("PYTHONHOME", None)
    return env
