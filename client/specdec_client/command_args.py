"""Command-line arguments shared by `specdec-client generate` and `specdec-client bench`."""
from __future__ import annotations

import argparse

DEFAULT_PORTS = {"grpc": 8001, "http": 8000}
EXIT_NOT_READY, EXIT_UNREACHABLE = 1, 2


def default_url(protocol: str) -> str:
    return f"localhost:{DEFAULT_PORTS[protocol]}"


def add_connection_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", help="host:port of the server (default localhost:8001 for grpc, localhost:8000 for http)")
    p.add_argument("--protocol", choices=("grpc", "http"), default="grpc")
    p.add_argument("--model", default="ensemble", help="model to call (ensemble, or speculative_loop directly)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")


def add_sampling_arguments(p: argparse.ArgumentParser, temperature: float | None) -> None:
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=temperature, help="0 = greedy")
    p.add_argument("--top-k", type=int)
    p.add_argument("--top-p", type=float)
    p.add_argument("--seed", type=int, default=0, help="random_seed of each request (bench: also seeds the Poisson arrivals)")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
