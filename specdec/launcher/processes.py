"""Ports and process-tree helpers for running tritonserver as a child process group
(process tables through psutil)."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import List, Optional

import psutil


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


_GONE = (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)


def _proc_cmdline(pid: int) -> str:
    try:
        return " ".join(psutil.Process(pid).cmdline())
    except psutil.Error:
        return ""


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() not in _GONE
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:  # someone else's: it exists
        return True


def group_members(pgid: int) -> List[int]:
    """Live (non-zombie) processes whose process group is ``pgid``."""
    out = []
    for proc in psutil.process_iter(["status"]):
        try:
            if proc.info["status"] not in _GONE and os.getpgid(proc.pid) == pgid:
                out.append(proc.pid)
        except (ProcessLookupError, PermissionError):
            continue
    return out


def descendants(root: int) -> List[int]:
    """Live descendants of ``root``."""
    try:
        children = psutil.Process(root).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    out = []
    for child in children:
        try:
            if child.status() not in _GONE:
                out.append(child.pid)
        except psutil.NoSuchProcess:
            continue
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
