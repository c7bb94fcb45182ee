"""The launcher offered to the client as its local server (`specdec-client bench
--start-server`, `loadtest.run --start-server`) through the `specdec_client.local` entry
points, so the client, which may be installed alone, never imports the server."""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator

from specdec.config import SERVED_SETTINGS
from specdec.launcher.install import DEFAULT_MODEL_REPOSITORY
from specdec.launcher.processes import free_ports
from specdec.launcher.server import Endpoints, TritonServer


@contextlib.contextmanager
def local_server(log_path: Path, settings_path: Path | None = None, ready_timeout_s: float = 600.0) -> Iterator[Endpoints]:
    """Triton on the model repository, on free ports, until the block ends."""
    http, grpc, metrics = free_ports(3)
    env = {"SPECDEC_SETTINGS": str(Path(settings_path).resolve())} if settings_path else None
    server = TritonServer(log_path=log_path)
    server.start(DEFAULT_MODEL_REPOSITORY, http_port=http, grpc_port=grpc, metrics_port=metrics, env=env)
    try:
        server.wait_ready(timeout=ready_timeout_s)
        yield server.endpoints
    finally:
        server.stop()


def served_settings() -> Path:
    """The specdec.json a server started here reads by default."""
    return SERVED_SETTINGS
