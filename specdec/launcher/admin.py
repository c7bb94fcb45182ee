"""Triton's administrative APIs behind the server's admin key (the restricted-API feature):
callers must send specdec_wire.ADMIN_KEY_HEADER with the key in $SPECDEC_ADMIN_KEY. Health,
metadata and inference stay open."""
from __future__ import annotations

from specdec_wire import ADMIN_KEY_ENV, ADMIN_KEY_HEADER

__all__ = ["ADMIN_KEY_ENV", "ADMIN_KEY_HEADER", "RESTRICTED_APIS", "restricted_api_args"]

RESTRICTED_APIS = ("model-repository", "logging", "trace", "shared-memory", "statistics")


def restricted_api_args(admin_key: str) -> list[str]:
    """tritonserver flags that put RESTRICTED_APIS behind ADMIN_KEY_HEADER, HTTP and gRPC."""
    spec = f"{','.join(RESTRICTED_APIS)}:{ADMIN_KEY_HEADER}={admin_key}"
    return [f"--http-restricted-api={spec}", f"--grpc-restricted-protocol={spec}"]
