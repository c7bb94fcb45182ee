"""ShareGPT for the tools (training data, in-process benchmarks): whole conversations by
role, and first-turn prompts filtered by token length. The file is found and read by the
client's loader (specdec_client.datasets: one ShareGPT reader for the project); the
selection here is the one the shipped drafters were trained and measured with."""
from __future__ import annotations

import random
from functools import lru_cache

from specdec_client.datasets import read_conversations, sharegpt_path

ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "bard": "assistant", "system": "system"}


@lru_cache(maxsize=1)
def sharegpt_conversations() -> tuple[tuple[tuple[str, str], ...], ...]:
    """Every complete conversation as ((role, text), ...) with roles user/assistant/system."""
    records, _ = read_conversations(sharegpt_path())
    out = []
    for record in records:
        turns = tuple(
            (ROLES[t["from"]], t["value"]) for t in record.get("conversations", []) if t.get("from") in ROLES and t.get("value")
        )
        if turns:
            out.append(turns)
    return tuple(out)


def sharegpt_prompts(
    n: int, seed: int = 0, tokenizer=None, min_tokens: int = 4, max_tokens: int = 512
) -> list[str]:
    """n first-turn user prompts, sampled with `seed`, filtered by token length (the
    tokenizer's, or a whitespace estimate without one)."""
    firsts = [conv[0][1] for conv in sharegpt_conversations() if conv[0][0] == "user"]
    rng = random.Random(seed)
    rng.shuffle(firsts)
    picked = []
    for text in firsts:
        length = len(tokenizer(text).input_ids) if tokenizer is not None else len(text.split())
        if min_tokens <= length <= max_tokens:
            picked.append(text)
            if len(picked) == n:
                break
    return picked
