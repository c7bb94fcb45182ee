"""Ports and process-tree helpers for running tritonserver as a child process group
(standard library only)."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Dict, List, Optional


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
