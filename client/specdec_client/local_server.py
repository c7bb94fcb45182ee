"""Start the project's Triton server on free ports for a benchmark or load test
(`--start-server`), and stop it afterwards."""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator

from specdec_client.errors import SpecDecClientError


@contextlib.contextmanager
def local_server(log_path: Path, settings_path: Path | None = None, model_repository: Path | None = None,
                 ready_timeout_s: float = 600.0) -> Iterator:
    """Yields the running server's triton_launcher.Endpoints."""
    try:
        from specdec.launcher import DEFAULT_MODEL_REPOSITORY, TritonServer, free_ports
    except ImportError as exc:  # the client installed on its own (pip install ./client)
        raise SpecDecClientError("--start-server needs the full project (pip install -e '.[serve]'), "
                                 "not the client alone") from exc

    http, grpc, metrics = free_ports(3)
    env = {"SPECDEC_SETTINGS": str(Path(settings_path).resolve())} if settings_path else None
    server = TritonServer(log_path=log_path)
    server.start(model_repository or DEFAULT_MODEL_REPOSITORY, http_port=http, grpc_port=grpc, metrics_port=metrics, env=env)
    try:
        server.wait_ready(timeout=ready_timeout_s)
        yield server.endpoints
    finally:
        server.stop()


def settings_in_use(settings_path: Path | None) -> Path:
    """The specdec.json a started server reads."""
    from specdec_client.envinfo import default_settings_path

    return Path(settings_path) if settings_path else default_settings_path()
