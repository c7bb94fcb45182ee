"""What a generation request asks for, decided in one place: the draft-budget cut here,
the request parser (one for every entry point) below."""
from __future__ import annotations

from typing import Callable

import numpy as np

from . import protocol as P
from .config import SamplingParams


def room_left(max_tokens: int, max_seq_len: int, prompt_len: int, generated: int) -> int:
    """Tokens a sequence may still emit: max_tokens and the context both bound it."""
    return min(max_tokens - generated, max_seq_len - prompt_len - generated)


def draft_budget(wanted: int, max_tokens: int, max_seq_len: int, prompt_len: int, generated: int) -> int:
    """Draft no more than could be emitted, leaving room for the bonus token."""
    return max(0, min(wanted, room_left(max_tokens, max_seq_len, prompt_len, generated) - 1))


# ---- sampling settings on the wire between the models: encoded once, decoded once ----------
def encode_sampling(params: SamplingParams) -> dict[str, np.ndarray]:
    """What the verifier needs of a request's sampling settings (max_tokens bounds drafting)."""
    out = {
        P.MAX_TOKENS: np.int32([params.max_tokens]), P.TEMPERATURE: np.float32([params.temperature]),
        P.TOP_K: np.int32([params.top_k]), P.TOP_P: np.float32([params.top_p]),
    }
    if params.seed is not None:
        out[P.RANDOM_SEED] = np.uint64([params.seed])
    return out


def decode_sampling(read: Callable[[str], np.ndarray | None]) -> SamplingParams:
    """The inverse of encode_sampling; `read(name)` returns the tensor or None."""
    def one(name: str, default, cast):
        value = read(name)
        return default if value is None else cast(value.reshape(-1)[0])

    return SamplingParams(
        max_tokens=one(P.MAX_TOKENS, 1, int), temperature=one(P.TEMPERATURE, 0.0, float), top_k=one(P.TOP_K, 0, int),
        top_p=one(P.TOP_P, 1.0, float), seed=one(P.RANDOM_SEED, None, int),
    )
