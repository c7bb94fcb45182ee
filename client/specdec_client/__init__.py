"""Client for the speculative-decoding Triton ensemble (gRPC / HTTP, sync / asyncio)."""
from specdec_client.client import AsyncSpecDecClient, Chunk, Generation, GenerateRequest, SpecDecClient
from specdec_client.errors import ClientConnectionError, RequestTimeoutError, ServerError, SpecDecClientError

__all__ = [
    "AsyncSpecDecClient", "Chunk", "ClientConnectionError", "Generation", "GenerateRequest", "RequestTimeoutError",
    "ServerError", "SpecDecClient", "SpecDecClientError",
]
