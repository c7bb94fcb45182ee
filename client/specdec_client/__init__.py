"""The client: gRPC / HTTP, sync / asyncio, streaming; its CLI, benchmark runner and reports. Installable alone (pip install ./client).
May import: specdec_wire."""
from specdec_client.client import AsyncSpecDecClient, Chunk, Generation, GenerateRequest, SpecDecClient
from specdec_client.errors import ClientConnectionError, RequestTimeoutError, ServerError, SpecDecClientError

__all__ = [
    "AsyncSpecDecClient", "Chunk", "ClientConnectionError", "Generation", "GenerateRequest", "RequestTimeoutError",
    "ServerError", "SpecDecClient", "SpecDecClientError",
]
