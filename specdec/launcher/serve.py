"""`specdec serve` (or `python -m specdec.launcher`): run Triton on the model repository
until SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import List, Optional, Sequence

from specdec.launcher.admin import ADMIN_KEY_ENV, ADMIN_KEY_HEADER, RESTRICTED_APIS

from specdec.launcher.install import DEFAULT_MODEL_REPOSITORY, ServerExitedError, ServerTimeoutError, TritonLaunchError, default_cache_dir
from specdec.launcher.server import TritonServer


def _build_parser(prog: str = "specdec serve") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="Run Triton Inference Server on the specdec model repository.")
    p.add_argument("--model-repository", type=Path, default=DEFAULT_MODEL_REPOSITORY, help="default: %(default)s")
    p.add_argument("--http-port", type=int, default=8000)
    p.add_argument("--grpc-port", type=int, default=8001)
    p.add_argument("--metrics-port", type=int, default=8002)
    p.add_argument("--log-verbose", type=int, default=0, help="tritonserver --log-verbose level")
    p.add_argument("--log-file", type=Path, default=None, help="server + model log (default: a file under the cache dir)")
    # Local only unless asked: the server has no authentication (containers pass 0.0.0.0 and
    # sit behind the NetworkPolicy).
    p.add_argument("--address", default="127.0.0.1", help="interface to bind (default: %(default)s; 0.0.0.0 = all)")
    p.add_argument("--ready-timeout", type=float, default=600.0, help="seconds to wait for all models to load")
    p.add_argument("--stop-timeout", type=float, default=30.0)
    p.add_argument(
        "--shm-default-byte-size", type=int, default=None, help="python backend initial shared-memory region per model instance"
    )
    p.add_argument(
        "--on-stub-death", choices=("restart", "exit"), default="restart",
        help="when a model's Python stub dies (Triton then fails that model's every request while it reports ready): "
             "restart tritonserver here, or exit 1 for the supervisor to restart (default: %(default)s)",
    )
    p.add_argument("--core-dir", type=Path, default=None,
                   help="run tritonserver in this directory with core dumps on, so a crashed stub leaves a core for gdb")
    p.add_argument("extra", nargs="*", help="extra tritonserver arguments (after --)")
    return p


def _admin_key_source(server: TritonServer) -> str:
    """Where the operator finds the admin key, without printing it: the variable they set,
    or a file only they can read holding the one generated for this server."""
    if os.environ.get(ADMIN_KEY_ENV):
        return f"${ADMIN_KEY_ENV}"
    path = default_cache_dir() / "admin-key"
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(server.admin_key or "")
    return f"the key in {path} (export {ADMIN_KEY_ENV}=$(cat {path}) for specdec-client)"


def _start_until_ready(server: TritonServer, args, stop_event: threading.Event) -> Optional[int]:
    """Start tritonserver and wait for it: None when ready, else the exit code to return."""
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
            core_dir=args.core_dir,
        )
    except TritonLaunchError as exc:
        print(f"specdec serve: {exc}", file=sys.stderr)
        return 2
    print(f"specdec serve: starting tritonserver (pid {server.pid}); log: {server.log_path}", flush=True)
    deadline = time.monotonic() + args.ready_timeout
    while not stop_event.is_set():
        try:
            server.wait_ready(timeout=min(1.0, max(0.0, deadline - time.monotonic())))
            print("specdec serve: ready", flush=True)
            return None
        except ServerTimeoutError as exc:
            if time.monotonic() >= deadline:
                print(f"specdec serve: {exc}", file=sys.stderr)
                return 1
        except ServerExitedError as exc:
            print(f"specdec serve: {exc}", file=sys.stderr)
            return 1
    print("specdec serve: interrupted before the server was ready; stopping", flush=True)
    return 130


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
        code = _start_until_ready(server, args, stop_event)
        if code is not None:
            return code
        ep = server.endpoints
        print(f"  HTTP    {ep.http_url}", flush=True)
        print(f"  gRPC    {ep.grpc}", flush=True)
        print(f"  metrics {ep.metrics_url}", flush=True)
        print(f"  admin APIs ({', '.join(RESTRICTED_APIS)}): header {ADMIN_KEY_HEADER}: {_admin_key_source(server)}", flush=True)
        print("  (Ctrl-C to stop)", flush=True)
        while not stop_event.wait(0.5):
            if not server.is_running():
                print(
                    f"specdec serve: tritonserver exited with code {server.returncode}; log {server.log_path}:\n{server.log_tail()}",
                    file=sys.stderr,
                )
                return 1
            dead = server.dead_stubs()
            if dead:
                print(f"specdec serve: a Python stub died ({'; '.join(dead)}); log {server.log_path}:\n{server.log_tail()}",
                      file=sys.stderr, flush=True)
                # Readiness turns false now, not after a client notices; the server is broken, so no long drain.
                server.stop(timeout=min(args.stop_timeout, 5.0))
                if args.on_stub_death == "exit":
                    return 1
                print("specdec serve: restarting tritonserver", flush=True)
                code = _start_until_ready(server, args, stop_event)
                if code is not None:
                    return code
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
