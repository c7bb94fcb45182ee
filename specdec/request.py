"""What a generation request asks for, decided in one place: the draft-budget cut here,
the request parser (one for every entry point) below."""
from __future__ import annotations


def room_left(max_tokens: int, max_seq_len: int, prompt_len: int, generated: int) -> int:
    """Tokens a sequence may still emit: max_tokens and the context both bound it."""
    return min(max_tokens - generated, max_seq_len - prompt_len - generated)


def draft_budget(wanted: int, max_tokens: int, max_seq_len: int, prompt_len: int, generated: int) -> int:
    """Draft no more than could be emitted, leaving room for the bonus token."""
    return max(0, min(wanted, room_left(max_tokens, max_seq_len, prompt_len, generated) - 1))
