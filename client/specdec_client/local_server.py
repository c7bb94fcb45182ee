"""The full project's server, when it is installed: `--start-server` starts it on free ports,
and its prepared tokenizer and settings are the defaults. Found through the
`specdec_client.local` entry points (server, tokenizer_dir, settings), never imported by
name, so the client installed alone (pip install ./client) works without it."""
from __future__ import annotations

import contextlib
import importlib.metadata
import os
from pathlib import Path
from typing import Any, Iterator

from specdec_client.errors import SpecDecClientError

GROUP = "specdec_client.local"


def plugin(name: str) -> Any | None:
    """The object the installed server offers under `name`, or None without one."""
    for entry in importlib.metadata.entry_points(group=GROUP):
        if entry.name == name:
            return entry.load()
    return None


@contextlib.contextmanager
def local_server(log_path: Path, settings_path: Path | None = None) -> Iterator[Any]:
    """Yields the started server's endpoints (.grpc, .http, .metrics_url); a server that
    does not start is a SpecDecClientError (the launcher's own errors are not the client's)."""
    start = plugin("server")
    if start is None:
        raise SpecDecClientError("--start-server needs the full project (pip install -e '.[serve]'), not the client alone")
    with contextlib.ExitStack() as stack:
        try:
            endpoints = stack.enter_context(start(log_path, settings_path))
        except Exception as exc:  # noqa: BLE001 - whatever the launcher raised, said as the client's error
            raise SpecDecClientError(f"the server did not start: {exc}") from exc
        yield endpoints


def default_settings_path() -> Path:
    """$SPECDEC_SETTINGS (as the server reads it), else the installed server's specdec.json,
    else a checkout's (when run from one)."""
    env = os.environ.get("SPECDEC_SETTINGS")
    if env:
        return Path(env)
    served = plugin("settings")
    return Path(served()) if served is not None else Path("model_repository") / "specdec.json"


def settings_in_use(settings_path: Path | None) -> Path:
    """The specdec.json a started server reads."""
    return Path(settings_path) if settings_path else default_settings_path()


def default_tokenizer_dir() -> Path | None:
    """The installed server's prepared target (exact token counts), or None."""
    model_dir = plugin("tokenizer_dir")
    return None if model_dir is None else Path(model_dir())
